"""`ArmorConfig`: the run's configuration, composed of sections (some with sub-sections), the registered
algorithms' own sections among them (`config.section_registry`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megatron_armor.config.algorithm import AlgorithmConfig
from megatron_armor.config.base import section
from megatron_armor.config.monitor import MonitorConfig
from megatron_armor.config.rollout import RolloutConfig
from megatron_armor.config.section_registry import default_sections, registered_sections
from megatron_armor.config.sections import (
    CheckpointConfig, DataConfig, EvalConfig, LoggingConfig, ModelConfig, ParallelConfig, RewardConfig, TaskConfig,
    TrainConfig,
)

ALGORITHM_SECTIONS = "algorithm_sections"


@dataclass
class ArmorConfig:
    """One run: each section (a dataclass, some with sub-sections) checks its own fields when built;
    `loading.validate` checks the rules between them. The registered algorithms' sections (armor, kl, mipu, opd and
    a plug-in's own) are held by name in `algorithm_sections` and read as attributes: `cfg.armor.alpha`."""

    model: ModelConfig = section(ModelConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    data: DataConfig = section(DataConfig)
    reward: RewardConfig = section(RewardConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    algorithm: AlgorithmConfig = section(AlgorithmConfig)
    algorithm_sections: dict[str, Any] = field(default_factory=default_sections)
    train: TrainConfig = section(TrainConfig)
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
        """Every top-level section as a plain dict, by name, in config order (what `save_config` writes)."""
        return {entry.name: dataclasses.asdict(getattr(self, entry.name)) for entry in config_entries(ArmorConfig)}


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
