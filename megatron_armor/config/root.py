"""`ArmorConfig`: the run's configuration, composed of sections (some with sub-sections), the registered
algorithms' own sections among them (`config.section_registry`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megatron_armor.config.algorithm import AlgorithmConfig
from megatron_armor.config.base import section
from megatron_armor.config.micro_batching import MicroBatchingConfig
from megatron_armor.config.monitor import MonitorConfig
from megatron_armor.config.optimizer import OptimizerConfig
from megatron_armor.config.recompute import RecomputeConfig
from megatron_armor.config.rollout import RolloutConfig
from megatron_armor.config.section_registry import (
    default_sections, register_plugin_sections, registered_sections, reserve_names,
)
from megatron_armor.config.sections import (
    CheckpointConfig, DataConfig, EvalConfig, LoggingConfig, ModelConfig, ParallelConfig, RewardConfig, TaskConfig,
    TrainConfig,
)
from megatron_armor.config.subspace import SubspaceConfig

ALGORITHM_SECTIONS = "algorithm_sections"


@dataclass
class ArmorConfig:
    """One run, composed of one section per component (a dataclass, some with sub-sections): each checks its own
    fields when built, and `loading.validate` has each check the rules it shares with others (`check_with`). The
    registered algorithms' sections (armor, kl, mipu, opd and a plug-in's own) are held by name in `algorithm_sections` and read as attributes: `cfg.armor.alpha`."""

    model: ModelConfig = section(ModelConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    data: DataConfig = section(DataConfig)
    reward: RewardConfig = section(RewardConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    algorithm: AlgorithmConfig = section(AlgorithmConfig)
    algorithm_sections: dict[str, Any] = field(default_factory=default_sections)
    train: TrainConfig = section(TrainConfig)
    micro_batching: MicroBatchingConfig = section(MicroBatchingConfig)
    optimizer: OptimizerConfig = section(OptimizerConfig)
    recompute: RecomputeConfig = section(RecomputeConfig)
    subspace: SubspaceConfig = section(SubspaceConfig)
    eval: EvalConfig = section(EvalConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    monitor: MonitorConfig = section(MonitorConfig)
    task: TaskConfig = section(TaskConfig)
    logging: LoggingConfig = section(LoggingConfig)

    def __getattr__(self, name: str) -> Any:
        """A registered algorithm's section by its name (only called for names that are not fields)."""
        sections = self.__dict__.get(ALGORITHM_SECTIONS, {})
        if name in sections:
            return sections[name]
        raise AttributeError(f"ArmorConfig has no section {name!r} (algorithm sections: {sorted(sections)})")

    def as_sections(self) -> dict[str, dict]:
        """Every top-level section as a plain dict, by name, in config order, the algorithm sections this config
        holds after `algorithm` (what `save_config` writes)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name == ALGORITHM_SECTIONS:
                out.update({name: dataclasses.asdict(value) for name, value in self.algorithm_sections.items()})
            else:
                out[f.name] = dataclasses.asdict(getattr(self, f.name))
        return out

    def __reduce__(self) -> tuple:
        """Pickled as plain section dicts: a process that never imported a plug-in algorithm's module (a Ray
        trainer rank; a file plug-in's module has a made-up name) registers it first (`config_from_sections`)."""
        return config_from_sections, (self.as_sections(),)


def config_from_sections(sections: dict[str, dict]) -> ArmorConfig:
    """The `ArmorConfig` whose `as_sections()` is `sections`, a plug-in algorithm's sections registered first."""
    register_plugin_sections(sections["algorithm"]["name"])
    fixed = {f.name: _section_from_dict(section_class(f), sections[f.name])
             for f in dataclasses.fields(ArmorConfig) if f.name != ALGORITHM_SECTIONS}
    registered = registered_sections()
    held = {name: _section_from_dict(registered[name], values) for name, values in sections.items()
            if name not in fixed}
    return ArmorConfig(**fixed, algorithm_sections=held)


def _section_from_dict(cls: type, values: dict) -> Any:
    """Dataclass `cls` from its `dataclasses.asdict` form (sub-sections built first)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        inner = section_class(f)
        kwargs[f.name] = _section_from_dict(inner, values[f.name]) if inner else values[f.name]
    return cls(**kwargs)


class ConfigEntry(NamedTuple):
    """One entry of a config dataclass: a value `field`, or a (sub-)section of class `section` (a registered
    algorithm section has no field of its own)."""

    name: str
    field: dataclasses.Field | None
    section: type | None


def section_class(f: dataclasses.Field) -> type | None:
    """The dataclass of a (sub-)section field, or None for a value field."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def config_entries(cls: type) -> list[ConfigEntry]:
    """The entries of config dataclass `cls` in declaration order; `ArmorConfig.algorithm_sections` stands for
    every registered algorithm section, in registration order."""
    entries = []
    for f in dataclasses.fields(cls):
        if cls is ArmorConfig and f.name == ALGORITHM_SECTIONS:
            entries += [ConfigEntry(name, None, inner) for name, inner in registered_sections().items()]
        else:
            entries.append(ConfigEntry(f.name, f, section_class(f)))
    return entries


def config_fields(cls: type = ArmorConfig, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every value field (`section.field`, `section.sub.field`, ...) of `cls` and its Field, in declaration order."""
    out = []
    for entry in config_entries(cls):
        dotted = f"{prefix}{entry.name}"
        out.extend(config_fields(entry.section, f"{dotted}.") if entry.section else [(dotted, entry.field)])
    return out


def config_sections(cls: type = ArmorConfig, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted name, dataclass) of every section and sub-section of `cls`, in declaration order, each before its
    sub-sections."""
    out = []
    for entry in config_entries(cls):
        if entry.section is not None:
            out.append((f"{prefix}{entry.name}", entry.section))
            out.extend(config_sections(entry.section, f"{prefix}{entry.name}."))
    return out


reserve_names({f.name for f in dataclasses.fields(ArmorConfig)} | set(vars(ArmorConfig)))
