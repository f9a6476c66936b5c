"""`model.lora`: low-rank adapters (LoRA, Hu et al. 2021) on the actor's linear layers, the base weights frozen.

The section is what `models.lora.apply_lora` builds the adapters from; no other class repeats its fields. Rank 0
(the default) is full fine-tuning: no adapter is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from megatron_armor.config.base import check_choices, doc, require

if TYPE_CHECKING:
    from megatron_armor.config.algorithm import AlgorithmConfig
    from megatron_armor.config.monitor import MonitorConfig
    from megatron_armor.config.rollout import RolloutConfig

# Megatron's names of the linear layers an adapter can sit on: attention's fused QKV (column-parallel) and output
# projection (row-parallel), the MLP's fused gate/up (column) and down (row) projections.
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class LoRAConfig:
    """Which linear layers get an adapter `W x + (alpha / rank) B A x` and its shape; A `[rank, in]` drawn
    kaiming-uniform, B `[out, rank]` zero, so the adapted model starts as the base."""

    rank: int = doc(0, "adapter rank r; 0: no adapters, every weight is trained")
    alpha: float = doc(16.0, "scale numerator: the adapter adds (alpha / rank) B A x")
    dropout: float = doc(0.0, "dropout probability on the adapter's input (training only)")
    target_modules: list[str] = doc(
        list(LORA_TARGETS), f"Megatron names of the adapted linear layers, any of {list(LORA_TARGETS)} (the MLP's fc1 "
        "is the fused gate/up projection)"
    )
    experts: bool = doc(
        False, "MoE models: the routed experts' linear_fc1 / linear_fc2 (those in target_modules) get adapters too "
        "(needs parallel.expert_tensor_parallel_size 1); shared experts are adapted as dense MLPs"
    )
    weight_sync: Literal["adapter", "merged"] = doc(
        "adapter", "what the rollout engines get after each update: adapter (the base is loaded once, then only the "
        "adapters' tensors are pushed, and the reference samples from the actor's engine with the adapter off: no "
        "reference engine or servers) | merged (the merged weights W + (alpha / rank) B A, for engines without LoRA; "
        "the reference then needs an engine of its own or rollout.anchors.engine shared)"
    )
    push_dir: str | None = doc(
        None, "weight_sync adapter: a directory on a filesystem every rollout server can read; each push then writes "
        "the adapter there in PEFT's format (a new version directory <actor>-rank<R>-v<N>, written under a temporary "
        "name and renamed; the older versions but the previous one removed) and the servers load it by path "
        "(SGLang's /load_lora_adapter), so they may run on other hosts. Unset: the tensors travel as shared-memory "
        "handles, to servers on the trainer's host only"
    )

    def __post_init__(self) -> None:
        check_choices("model.lora", self)
        require(self.rank >= 0, f"model.lora.rank must be >= 0 (0: no adapters), got {self.rank}")
        require(self.alpha > 0, f"model.lora.alpha must be > 0, got {self.alpha}")
        require(0 <= self.dropout < 1, f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        require(not unknown, f"model.lora.target_modules: {unknown} name no adaptable layer; choose from "
                             f"{list(LORA_TARGETS)}")
        require(not self.enabled or bool(self.target_modules),
                "model.lora.target_modules is empty: name at least one layer, or set model.lora.rank 0")
        require(self.push_dir is None or self.adapter_sync,
                "model.lora.push_dir is for adapter pushes (model.lora.rank > 0 and model.lora.weight_sync adapter); "
                "unset it")

    def check_with(self, ref_path: str | None, algorithm: AlgorithmConfig, monitor: MonitorConfig,
                   rollout: RolloutConfig, subspace_enabled: bool, keep_best: str | None) -> None:
        """With adapters the reference is the base (model.path) with them off, so nothing may make it another model:
        model.ref_path, the monitor's anchor_keep action (it makes the best checkpoint's weights the reference while
        the actor goes on: the model holds one set of adapters, the actor's) and monitor.reference_reset (it makes
        the current policy the reference at a new best; under LoRA that policy is the best checkpoint's already).
        A reference reset (algorithm.ref_reset_period) resets the adapters and their optimizer state to the best
        checkpoint's, as the monitor's anchor action does (trainer/guard/adapter_reset.py), so it needs
        checkpoint.`keep_best`. Trainer offload and subspace-constrained training (`subspace_enabled`:
        `SubspaceConfig.enabled`, passed as a value: that section imports this one's) read or move whole weights and
        do not know adapters yet. Under adapter sync the engines hold the base and the anchors come from the actor's
        (`check_adapter_sync_with`)."""
        if not self.enabled:
            return
        base = "the reference is model.path with the adapters off"
        refused = (  # (what, whether the run uses it, why, how to turn it off)
            ("model.ref_path", ref_path is not None, base, "unset it"),
            ("monitor.actions anchor_keep", monitor.keeps_weights_on_anchor,
             f"{base}, and the model holds one set of adapters, the actor's, so the best checkpoint's cannot become "
             "the reference beside them", "choose anchor (it resets the adapters to the best checkpoint's), warn or "
             "stop"),
            ("monitor.reference_reset", monitor.reference_reset,
             f"{base}, so the current policy cannot become it; at a new best the adapters are the best checkpoint's "
             "already, so resetting them to it changes nothing", "set it to false (algorithm.ref_reset_period resets "
             "the adapters to the best checkpoint's)"),
            ("algorithm.ref_reset_period without checkpoint.keep_best", algorithm.ref_reset_period > 0 and not keep_best,
             "a reference reset resets the adapters and their optimizer state to the best checkpoint's", "set "
             "checkpoint.keep_best (e.g. val/accuracy) or algorithm.ref_reset_period 0"),
            ("rollout.memory.offload_trainer", rollout.memory.offload_trainer, "trainer offload moves whole weights",
             "set it to false"),
            ("subspace.capture_step", subspace_enabled, "subspace training reads whole weights", "unset it"),
        )
        for name, used, why, fix in refused:
            require(not used, f"model.lora (rank {self.rank}) does not work with {name}: {why}; {fix}")
        if self.adapter_sync:
            self.check_adapter_sync_with(rollout)

    def check_adapter_sync_with(self, rollout: RolloutConfig) -> None:
        """model.lora.weight_sync adapter: the engines keep the base they loaded and the actor's adapter beside it,
        and the reference (ARMOR's anchors) samples from them with the adapter off, so reference servers would go
        unused; what the adapter push cannot carry (a base lost to a memory release, generations a push interrupts)
        needs the merged push."""
        refused = (  # (what, whether the run uses it, why)
            (f"rollout.sglang.ref_urls ({rollout.sglang.ref_urls})", bool(rollout.sglang.ref_urls),
             "the reference samples from the actor's servers with the adapter off, so reference servers go unused: "
             "drop it"),
            ("rollout.memory.release_servers", rollout.memory.release_servers, "a release loses the base the servers "
             "loaded, which only the first push sends"),
            ("rollout.partial_rollouts", rollout.partial_rollouts, "a weight push interrupts the engine's generations, "
             "the base's anchors among them"),
        )
        for name, used, why in refused:
            require(not used, f"model.lora.weight_sync adapter does not work with {name}: {why}; or set "
                              f"model.lora.weight_sync merged (engines get the merged weights)")

    @property
    def enabled(self) -> bool:
        """Adapters are built (rank > 0)."""
        return self.rank > 0

    @property
    def adapter_sync(self) -> bool:
        """Adapters are built and the engines get them alone (weight_sync adapter): the base stays in the engines,
        and the reference samples from the actor's engine with the adapter off."""
        return self.enabled and self.weight_sync == "adapter"

    @property
    def scale(self) -> float:
        """alpha / rank, the factor on the adapter's output."""
        return self.alpha / self.rank

    def peft_config(self, target_modules: list[str], base_model: str) -> dict:
        """Hugging Face PEFT's `adapter_config.json` of these adapters on the HF linear layers `target_modules` (last
        name components, e.g. q_proj), belonging to `base_model`: what `peft` and SGLang's LoRA loading read (PEFT's
        scale is lora_alpha / r, as here)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                "target_modules": sorted(target_modules), "bias": "none", "fan_in_fan_out": False,
                "use_rslora": False, "inference_mode": True}
