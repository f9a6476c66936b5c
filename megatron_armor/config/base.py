"""What every config section is built from: the error type, documented fields, and the checks they share."""

from __future__ import annotations

from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration value that is missing, unknown, of the wrong type, or out of range."""


def doc(default: Any, help: str) -> Any:
    """A dataclass field with its `--help` text (`metadata["help"]`)."""
    return field(default=default, metadata={"help": help})


def section(cls: type) -> Any:
    """A nested section field: a fresh default `cls()` per config."""
    return field(default_factory=cls)


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless `ok`."""
    if not ok:
        raise ConfigError(message)


def require_at_least(where: str, owner: Any, names: tuple[str, ...], lower: int) -> None:
    """Each `owner.<name>` >= `lower`; the error names `<where>.<name>` and its value."""
    for name in names:
        value = getattr(owner, name)
        require(value >= lower, f"{where}.{name} must be >= {lower}, got {value}")
