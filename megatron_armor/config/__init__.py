"""Typed run configuration: `ArmorConfig`, a dataclass of sections (some with sub-sections), from YAML +
`section.field=value` overrides.

    base.py             ConfigError, documented fields, shared checks
    sections.py         model, parallel, data, reward, train, eval, checkpoint, task, logging
    optimizer.py        optimizer (Adam, grad clip, warmup, the distributed optimizer)
    recompute.py        recompute (activation recomputation)
    micro_batching.py   micro_batching (how a mini-batch is cut into forward/backward micro-batches)
    lora.py             model.lora (low-rank adapters on the actor)
    subspace.py         subspace (subspace-constrained training)
    rollout.py          rollout and its sub-sections: sampling, anchors, agentic, sglang, weight_sync, memory
    algorithm.py        algorithm, and the built-in algorithms' own sections armor, kl, mipu, opd
    section_registry.py the algorithms' own sections (built-ins and plug-ins), by name
    plugins.py          objects named by path (reward functions, plug-in algorithms)
    monitor.py          monitor (the collapse monitor's alarms)
    root.py             ArmorConfig (the fixed sections + the registered algorithm sections), config_fields
    moved_names.py      fields that moved (old name -> new place)
    loading.py          load_config, coerce, validate, save_config, config_hash
    reference.py        docs/config.md from the fields' docs and defaults
                        (python -m megatron_armor.config.reference > docs/config.md)

Each section checks its own fields when it is built, and the rules it shares with other sections in its
`check_with` (`loading.validate`); the chosen algorithm's own rules are checked by its object
(megatron_armor.algorithms). Defaults follow the ARMOR 7B recipe (armor.md section 6) where one applies.
"""

from megatron_armor.config.algorithm import AlgorithmConfig, KLConfig, MipuConfig, MixedRatioConfig, OpdConfig
from megatron_armor.config.base import ConfigError
from megatron_armor.config.lora import LORA_TARGETS, LoRAConfig
from megatron_armor.config.loading import coerce, config_hash, load_config, save_config, validate
from megatron_armor.config.micro_batching import MicroBatchingConfig
from megatron_armor.config.monitor import MonitorConfig
from megatron_armor.config.moved_names import MOVED_FIELDS
from megatron_armor.config.optimizer import OptimizerConfig
from megatron_armor.config.recompute import RecomputeConfig
from megatron_armor.config.rollout import (
    AgenticConfig, AnchorsConfig, LocalEngineConfig, MemoryHandoffConfig, RolloutConfig, SamplingConfig,
    SGLangClientConfig, WeightSyncConfig,
)
from megatron_armor.config.root import ArmorConfig, config_fields
from megatron_armor.config.subspace import SubspaceConfig
from megatron_armor.config.sections import (
    CheckpointConfig, DataConfig, EvalConfig, LoggingConfig, ModelConfig, ParallelConfig, RewardConfig, TaskConfig,
    TrainConfig, WarmStartConfig, check_expert_layout, expert_tp_size,
)

__all__ = [
    "AgenticConfig", "AlgorithmConfig", "AnchorsConfig", "ArmorConfig", "CheckpointConfig", "ConfigError",
    "DataConfig", "EvalConfig", "KLConfig", "LORA_TARGETS", "LoRAConfig", "LocalEngineConfig", "LoggingConfig",
    "MOVED_FIELDS", "MemoryHandoffConfig", "MicroBatchingConfig", "MipuConfig", "MixedRatioConfig", "MonitorConfig",
    "ModelConfig", "OpdConfig", "OptimizerConfig", "ParallelConfig", "RecomputeConfig", "RewardConfig",
    "RolloutConfig", "SGLangClientConfig", "SamplingConfig", "SubspaceConfig", "TaskConfig", "TrainConfig",
    "WarmStartConfig", "WeightSyncConfig", "check_expert_layout", "coerce", "config_fields", "config_hash",
    "expert_tp_size", "load_config", "save_config", "validate",
]
