"""What every config section is built from: the error type, documented fields, and the checks they share."""

from __future__ import annotations

import types
import typing
import dataclasses
from dataclasses import field
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration value that is missing, unknown, of the wrong type, or out of range."""


def doc(default: Any, help: str) -> Any:
    """A dataclass field with its `--help` text (`metadata["help"]`); a list default is copied per config."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def default_of(f: dataclasses.Field) -> Any:
    """The default value of a `doc` field (a fresh one for a list)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def section(cls: type) -> Any:
    """A nested section field: a fresh default `cls()` per config."""
    return field(default_factory=cls)


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless `ok`."""
    if not ok:
        raise ConfigError(message)


def check_choices(where: str, owner: Any) -> None:
    """Each `Literal`-typed field of the dataclass `owner` holds one of its values (or None where the type allows
    it), so a section built in code is held to what the loader's coercion checks; the error names
    `<where>.<field>` as the loader's does."""
    for name, annotation in typing.get_type_hints(type(owner)).items():
        allowed = _literal_values(annotation)
        value = getattr(owner, name)
        if allowed is not None:
            require(value in allowed, f"{where}.{name}: {value!r} is not allowed; choose one of "
                                      f"{[v for v in allowed if v is not None]}")


def _literal_values(annotation: Any) -> tuple | None:
    """The values a `Literal[...]` (or `Literal[...] | None`) annotation allows; None for other types."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        literals = [a for a in options if typing.get_origin(a) is Literal]
        if literals:
            return (*typing.get_args(literals[0]), *((None,) if type(None) in options else ()))
    return None


def require_at_least(where: str, owner: Any, names: tuple[str, ...], lower: int) -> None:
    """Each `owner.<name>` >= `lower`; the error names `<where>.<name>` and its value."""
    for name in names:
        value = getattr(owner, name)
        require(value >= lower, f"{where}.{name} must be >= {lower}, got {value}")
