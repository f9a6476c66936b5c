"""Algorithms by name: built-ins register themselves on import, and so can a user's (`register_algorithm`), or
`algorithm.name` names a plug-in class by path (`package.module:ClassName`)."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from megatron_armor.algorithms.base import Algorithm
from megatron_armor.config import ConfigError
from megatron_armor.config.algorithm import BUILT_IN_SECTIONS
from megatron_armor.config.base import require
from megatron_armor.config.section_registry import register_sections, unregister_section
from megatron_armor.config.plugins import import_attribute

if TYPE_CHECKING:
    from megatron_armor.config import ArmorConfig

_ALGORITHMS: dict[str, type[Algorithm]] = {}
ANCHORED_ALGORITHM = "armor"  # what the collapse monitor's anchor action switches a run to


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make `cls` selectable as `algorithm.name: <cls.name>`, and its `config_sections` part of
    every config (`config.section_registry`). A second class under a registered name, or a section name another
    settings class holds, is a ValueError (unregister_algorithm first to replace one)."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)) or not getattr(cls, "name", None):
        raise TypeError(f"{cls!r} is not an Algorithm subclass with a `name`")
    if _ALGORITHMS.get(cls.name, cls) is not cls:
        raise ValueError(f"algorithm {cls.name!r} is already registered by {_ALGORITHMS[cls.name].__qualname__}")
    try:
        register_sections(cls.config_sections)
    except (TypeError, ValueError) as error:
        raise type(error)(f"algorithm {cls.name!r}: {error}") from error
    _ALGORITHMS[cls.name] = cls
    return cls


def unregister_algorithm(name: str) -> None:
    """Forget the algorithm registered as `name` (KeyError if none is), and those of its settings sections that no
    other registered algorithm reads and the config package does not define itself."""
    cls = _ALGORITHMS.pop(name)
    still_read = {section for other in _ALGORITHMS.values() for section in other.config_sections}
    for section in cls.config_sections:
        if section not in still_read and section not in BUILT_IN_SECTIONS:
            unregister_section(section)


def registered_algorithms() -> list[str]:
    """Registered names, in registration order (the built-ins first)."""
    return list(_ALGORITHMS)


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered as `name`, or, for a `package.module:ClassName` path, that class (imported and
    registered: a plug-in needs no change to this package); a ConfigError naming the registered ones otherwise."""
    if name in _ALGORITHMS:
        return _ALGORITHMS[name]
    if ":" in name:
        return _import_plugin(name)
    close = difflib.get_close_matches(name, list(_ALGORITHMS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"algorithm.name: {name!r} is not a registered algorithm; choose one of "
                      f"{registered_algorithms()}{hint}, or give a plug-in as 'package.module:ClassName'")


def _import_plugin(path: str) -> type[Algorithm]:
    try:
        cls = import_attribute(path, "algorithm.name plug-in", "package.module:ClassName")
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ConfigError(f"algorithm.name plug-in {path!r} is {cls!r}, not an Algorithm subclass")
    registered = _ALGORITHMS.get(getattr(cls, "name", None))
    if registered is cls:
        return cls
    try:
        return register_algorithm(cls)
    except (TypeError, ValueError) as error:  # no `name`, or another class's
        raise ConfigError(f"algorithm.name plug-in {path!r}: {error}") from error


def check_algorithm_config(cfg: ArmorConfig) -> type[Algorithm]:
    """The run's algorithm class, after its config rules passed (ConfigError otherwise), and, when an alarm's
    action is anchor, those of the run it may switch to (`Algorithm.anchored_config`)."""
    cls = algorithm_class(cfg.algorithm.name)
    cls.check_config(cfg)
    if cfg.monitor.anchors:
        anchored = cls.anchored_config(cfg)
        require(anchored is not None, f"monitor.actions: anchor switches a run to {ANCHORED_ALGORITHM}, which "
                                      f"continues grpo-style runs only; {cls.name} cannot switch (use warn or stop)")
        algorithm_class(anchored.algorithm.name).check_config(anchored)
    return cls


def build_anchored_algorithm(cfg: ArmorConfig) -> Algorithm:
    """The algorithm object the anchor action switches the run of `cfg` to: the one its algorithm's
    `anchored_config` names (ANCHORED_ALGORITHM for the built-ins), built from that config."""
    anchored = algorithm_class(cfg.algorithm.name).anchored_config(cfg)
    cls = algorithm_class(anchored.algorithm.name)
    cls.check_config(anchored)
    return cls(anchored)


def build_algorithm(cfg: ArmorConfig) -> Algorithm:
    """The run's algorithm object, built from its config sections (validated first)."""
    return check_algorithm_config(cfg)(cfg)
