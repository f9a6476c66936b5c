"""Loading a config: defaults <- YAML file <- `section.field=value` overrides, each value coerced to its
field's type; then every section is built from its merged values (so it checks its own fields) and the
rules between sections run."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_armor.config.base import ConfigError
from megatron_armor.config.moved_names import MOVED_FIELDS
from megatron_armor.config.root import ALGORITHM_SECTIONS, ArmorConfig, config_entries, section_class
from megatron_armor.config.section_registry import register_plugin_sections

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a YAML/CLI value to `annotation` (int, float, bool, str, Optional, list of those: a YAML list or a
    comma-separated string; a Literal's value is the section's to check)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if isinstance(value, str) and any(typing.get_origin(a) is Literal and value in typing.get_args(a) for a in options):
            return value  # a choice named like null (e.g. "none") is the choice
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if type(None) in options:
                return None
        inner = [a for a in options if a is not type(None)]
        return coerce(value, inner[0], where)
    if origin is Literal:
        return value  # the section's own `check_choices` refuses a value it does not allow
    if origin is list:
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{where}: expected a list (YAML [a, b] or a comma-separated string), got {value!r}")
        (inner,) = typing.get_args(annotation)
        return [coerce(item, inner, f"{where}[{i}]") for i, item in enumerate(items)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected a boolean (true/false), got {value!r}")
    if annotation in (int, float):
        if isinstance(value, bool) or (annotation is int and isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
        try:
            return annotation(float(value)) if annotation is int and isinstance(value, float) else annotation(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}") from None
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported type {annotation}")


def _unknown(name: str, known: list[str], kind: str) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {known}"
    return ConfigError(f"unknown config {kind} {name!r}{hint}")


def _assign(values: dict[str, Any], dotted: str, value: Any) -> None:
    """Record `dotted` = `value`, coerced to the field's type, in `values` ({dotted name: value} of value
    fields). A mapping assigned to a (sub-)section sets its fields."""
    if dotted in MOVED_FIELDS and not isinstance(value, dict):
        raise ConfigError(f"{dotted} moved to {MOVED_FIELDS[dotted]}")
    cls, prefix = ArmorConfig, ""
    parts = dotted.split(".")
    for depth, name in enumerate(parts):
        entries = {entry.name: entry.section for entry in config_entries(cls)}
        path = f"{prefix}{name}"
        if name not in entries:
            raise _unknown(path, [f"{prefix}{n}" for n in entries], "field" if depth else "section")
        inner = entries[name]
        if inner is None:
            if depth != len(parts) - 1:
                raise ConfigError(f"unknown config field {dotted!r}: {path} is a value, not a section")
            values[path] = coerce(value, typing.get_type_hints(cls)[name], path)
            return
        cls, prefix = inner, f"{path}."
    if not isinstance(value, dict):
        raise ConfigError(f"section {dotted!r} must be a mapping")
    for name, inner_value in value.items():
        _assign(values, f"{dotted}.{name}", inner_value)


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """`cls` with the given `values` (sub-sections built first); each section validates itself as it is built."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        dotted, inner = f"{prefix}{f.name}", section_class(f)
        if cls is ArmorConfig and f.name == ALGORITHM_SECTIONS:
            kwargs[f.name] = {entry.name: _build(entry.section, values, f"{entry.name}.")
                              for entry in config_entries(cls) if entry.field is None}
        elif inner is not None:
            kwargs[f.name] = _build(inner, values, f"{dotted}.")
        elif dotted in values:
            kwargs[f.name] = values[dotted]
    return cls(**kwargs)


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> ArmorConfig:
    """Defaults <- YAML file (nested mappings of sections) <- `section[.sub].field=value` overrides, then
    each section's own checks and `validate`. The sections are the fixed ones and the registered algorithms' own
    (`section_registry`); a plug-in algorithm named by path brings its own first."""
    data = _read_yaml(path) if path is not None else {}
    register_plugin_sections(_algorithm_name(data, _override_pairs(overrides)))
    values: dict[str, Any] = {}
    for section, section_values in data.items():
        try:
            _assign(values, str(section), section_values)
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from None
    for key, value in _override_pairs(overrides):
        _assign(values, key, value)
    cfg = _build(ArmorConfig, values)
    validate(cfg)
    return cfg


def _read_yaml(path: str | Path) -> dict:
    """The mapping of sections in YAML file `path`."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: invalid YAML ({error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def _override_pairs(overrides: typing.Sequence[str]) -> list[tuple[str, Any]]:
    """(dotted name, YAML-parsed value) of each `section.field=value` override."""
    pairs = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        pairs.append((key.strip(), yaml.safe_load(value) if value.strip() else value))
    return pairs


def _algorithm_name(data: dict, pairs: list[tuple[str, Any]]) -> Any:
    """algorithm.name as the overrides (the last one) or else the YAML mapping `data` give it; None if neither."""
    named = [value for key, value in pairs if key == "algorithm.name"]
    algorithm = data.get("algorithm")
    return named[-1] if named else algorithm.get("name") if isinstance(algorithm, dict) else None


def configured_algorithm(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> Any:
    """algorithm.name of the config `load_config(path, overrides)` would load (None: the default's)."""
    return _algorithm_name(_read_yaml(path) if path is not None else {}, _override_pairs(overrides))


def validate(cfg: ArmorConfig) -> None:
    """The rules between sections (each section checked its own fields when it was built); each error names the
    fields, their values and what is allowed. The rules of the chosen algorithm are its own: they are checked
    when it is built (`megatron_armor.algorithms.check_algorithm_config`). Each rule lives with the section whose
    field it checks (`check_with`), which is handed the sections it reads."""
    cfg.reward.check_with(cfg.rollout.sampling.max_new_tokens)
    cfg.train.check_with(cfg.parallel, cfg.recompute)
    cfg.subspace.check_with(cfg.model, cfg.parallel)
    cfg.optimizer.check_with(cfg.subspace, cfg.rollout.memory)
    cfg.checkpoint.check_with(cfg.eval)
    cfg.monitor.check_with(cfg.checkpoint.keep_best)
    cfg.rollout.check_with(cfg.train.routing_replay)
    cfg.task.check_with(cfg.model, cfg.data, cfg.rollout.agentic.environment)
    cfg.model.lora.check_with(cfg.model.ref_path, cfg.algorithm, cfg.monitor, cfg.rollout, cfg.subspace.enabled,
                              cfg.checkpoint.keep_best)


def save_config(cfg: ArmorConfig, path: str | Path) -> None:
    """Write `cfg` as YAML that `load_config` reads back."""
    Path(path).write_text(yaml.safe_dump(cfg.as_sections(), sort_keys=False))


def config_hash(value: Any) -> str:
    """Stable short sha256 of a config section (dataclass) or plain JSON-able value."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]
