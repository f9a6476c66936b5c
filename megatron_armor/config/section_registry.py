"""The config sections algorithms bring: each registered algorithm declares its settings classes
(`Algorithm.settings`, name -> dataclass), and every registered one is a top-level section of the run's config
(`ArmorConfig.algorithm_sections`), read from YAML and `--section.field` flags, listed by `--help`, checked like the
fixed sections. The built-in algorithms' sections are registered here, so loading a config and `--help` need no
algorithm imported; `register_algorithm` registers a plug-in's."""

from __future__ import annotations

import dataclasses

_SECTIONS: dict[str, type] = {}


def register_section(name: str, cls: type) -> None:
    """Make dataclass `cls` the config section `name` (again for the same class: nothing happens); a ValueError for
    a non-dataclass or a name another class holds."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"config section {name!r}: {cls!r} is not a dataclass")
    if _SECTIONS.get(name, cls) is not cls:
        raise ValueError(f"config section {name!r} is already {_SECTIONS[name].__qualname__}")
    _SECTIONS[name] = cls


def unregister_section(name: str) -> None:
    """Forget config section `name` (KeyError if none is registered)."""
    del _SECTIONS[name]


def registered_sections() -> dict[str, type]:
    """Section name -> settings class, in registration order (the built-ins first)."""
    return dict(_SECTIONS)


def default_sections() -> dict[str, object]:
    """Every registered section at its defaults (what `ArmorConfig()` holds)."""
    return {name: cls() for name, cls in _SECTIONS.items()}
