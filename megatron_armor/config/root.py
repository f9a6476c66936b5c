"""`ArmorConfig`: the run's configuration, composed of sections (some with sub-sections)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_armor.config.algorithm import AlgorithmConfig, KLConfig, MipuConfig, MixedRatioConfig, OpdConfig
from megatron_armor.config.base import section
from megatron_armor.config.monitor import MonitorConfig
from megatron_armor.config.rollout import RolloutConfig
from megatron_armor.config.sections import (
    CheckpointConfig, DataConfig, EvalConfig, LoggingConfig, ModelConfig, ParallelConfig, RewardConfig, TaskConfig,
    TrainConfig,
)


@dataclass
class ArmorConfig:
    """One run: each section (a dataclass, some with sub-sections) checks its own fields when built;
    `loading.validate` checks the rules between them."""

    model: ModelConfig = section(ModelConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    data: DataConfig = section(DataConfig)
    reward: RewardConfig = section(RewardConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    algorithm: AlgorithmConfig = section(AlgorithmConfig)
    armor: MixedRatioConfig = section(MixedRatioConfig)
    kl: KLConfig = section(KLConfig)
    mipu: MipuConfig = section(MipuConfig)
    opd: OpdConfig = section(OpdConfig)
    train: TrainConfig = section(TrainConfig)
    eval: EvalConfig = section(EvalConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    monitor: MonitorConfig = section(MonitorConfig)
    task: TaskConfig = section(TaskConfig)
    logging: LoggingConfig = section(LoggingConfig)


def section_class(f: dataclasses.Field) -> type | None:
    """The dataclass of a (sub-)section field, or None for a value field."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def config_fields(cls: type = ArmorConfig, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every value field (`section.field`, `section.sub.field`, ...) of `cls` and its Field, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        inner = section_class(f)
        out.extend(config_fields(inner, f"{dotted}.") if inner else [(dotted, f)])
    return out
