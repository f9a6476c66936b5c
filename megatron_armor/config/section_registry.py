"""The config sections algorithms bring: each registered algorithm declares its settings classes
(`Algorithm.config_sections`, name -> dataclass), and every registered one is a top-level section of the run's config
(`ArmorConfig.algorithm_sections`), read from YAML and `--section.field` flags, listed by `--help`, checked like the
fixed sections. The built-in algorithms' sections are registered by `config.algorithm`, so loading a config and
`--help` need no algorithm imported; `register_algorithm` registers a plug-in's, and `register_plugin_sections`
those of a plug-in named by path before its config is read."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from megatron_armor.config.base import ConfigError
from megatron_armor.config.plugins import import_attribute

_SECTIONS: dict[str, type] = {}
_RESERVED: set[str] = set()  # the fixed sections' and ArmorConfig's own names (`reserve_names`)


def reserve_names(names: set[str]) -> None:
    """Names no algorithm section may take (ArmorConfig's fields and attributes)."""
    _RESERVED.update(names)


def register_sections(sections: Mapping[str, type]) -> None:
    """Make each dataclass of `sections` (name -> class) a config section, all or none: a ValueError (TypeError for
    a class that is not a dataclass built by its defaults) when a name is not an identifier, is reserved, or is
    another class's. The same class again under its name changes nothing."""
    for name, cls in sections.items():
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"config section {name!r}: {cls!r} is not a dataclass")
        if not name.isidentifier() or name in _RESERVED:
            taken = sorted(n for n in _RESERVED if not n.startswith("_"))
            raise ValueError(f"config section {name!r}: not a name a section can take (an identifier, not one of "
                             f"ArmorConfig's fields or attributes: {', '.join(taken)})")
        if _SECTIONS.get(name, cls) is not cls:
            raise ValueError(f"config section {name!r} is already {_SECTIONS[name].__qualname__}")
        cls()  # its defaults build (a field without one would fail every config)
    _SECTIONS.update(sections)


def unregister_section(name: str) -> None:
    """Forget config section `name` (KeyError if none is registered)."""
    del _SECTIONS[name]


def registered_sections() -> dict[str, type]:
    """Section name -> settings class, in registration order (the built-ins first)."""
    return dict(_SECTIONS)


def default_sections() -> dict[str, object]:
    """Every registered section at its defaults (what `ArmorConfig()` holds)."""
    return {name: cls() for name, cls in _SECTIONS.items()}


def register_plugin_sections(path: object) -> None:
    """The sections of a plug-in algorithm named by path (`package.module:ClassName` or `path/file.py:ClassName`):
    its class is imported and its `config_sections` registered, so a config naming it can set them. Other names
    (registered algorithms, None) need nothing; a path that does not resolve is a ConfigError."""
    if not isinstance(path, str) or ":" not in path:
        return
    try:
        cls = import_attribute(path, "algorithm.name plug-in", "package.module:ClassName")
    except ValueError as error:  # it names the plug-in and what is wrong
        raise ConfigError(str(error)) from error
    try:
        register_sections(getattr(cls, "config_sections", {}))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"algorithm.name plug-in {path!r}: {error}") from error
