"""Hugging Face model config -> architecture shape -> Megatron `TransformerConfig`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_armor.config import RecomputeConfig, expert_tp_size
from megatron_armor.models.families import ModelConfigError, model_family
from megatron_armor.models.shape import ModelShape

def load_model_shape(model_dir: str | Path) -> ModelShape:
    """Read `config.json` of an HF checkpoint directory into a `ModelShape`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{model_dir}: no config.json; model.path must be a Hugging Face checkpoint directory")
    return model_shape_from_dict(json.loads(path.read_text()), source=str(path))


def model_shape_from_dict(hf: dict, *, source: str = "config") -> ModelShape:
    """Build a `ModelShape` from an HF config dict (transformers 4.x or 5.x layout): the fields every family shares
    here, the rest (biases, q/k norms, experts) by the family of its model_type (`models.families`)."""
    family = model_family(hf.get("model_type"), source=source)
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelConfigError(f"{source}: num_attention_heads {heads} not divisible by num_key_value_heads {kv_heads}")
    family_fields = family.shape_fields(hf, source)
    _refuse_unsupported_attention_and_activation(hf, source)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return ModelShape(
        arch=family.model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling_factor=family.rope_scaling_factor(rope, source),
        **family_fields,
    )


def _refuse_unsupported_attention_and_activation(hf: dict, source: str) -> None:
    """Options the Megatron model here does not build (SwiGLU with SiLU, full causal attention in every
    layer): refused rather than converted into a different model."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported; supported: 'silu' (SwiGLU)")
    windowed = sorted({kind for kind in hf.get("layer_types") or [] if kind != "full_attention"})
    if hf.get("use_sliding_window") or windowed:
        raise ModelConfigError(f"{source}: sliding-window attention (use_sliding_window / layer_types {windowed}) is "
                               f"not supported; supported: full attention in every layer")


def check_parallel_layout(
    shape: ModelShape, tp_size: int, pp_size: int, ep_size: int = 1, etp_size: int | None = None,
) -> None:
    """Raise a clear error if the model cannot be split over `tp_size` x `pp_size` ranks, its experts over `ep_size`
    ranks and each expert's matrices over `etp_size` (expert TP; None: `tp_size`). (Context parallelism splits the
    sequences, which any model takes.)"""
    etp_size = expert_tp_size(tp_size, etp_size)
    for name, value, split, size in (
        ("num_attention_heads", shape.num_attention_heads, "tensor_parallel_size", tp_size),
        ("num_key_value_heads", shape.num_kv_heads, "tensor_parallel_size", tp_size),
        ("intermediate_size", shape.ffn_hidden_size, "tensor_parallel_size", tp_size),
        ("padded vocab_size", shape.padded_vocab_size, "tensor_parallel_size", tp_size),
        ("moe_intermediate_size", shape.moe_ffn_hidden_size, "expert_tensor_parallel_size", etp_size),
        ("shared_expert_intermediate_size", shape.shared_expert_ffn_hidden_size, "tensor_parallel_size", tp_size),
        *_latent_widths(shape, tp_size),
    ):
        if value % size:
            raise ModelConfigError(f"{name}={value} is not divisible by {split}={size}")
    if shape.num_layers % pp_size:
        raise ModelConfigError(f"num_hidden_layers={shape.num_layers} is not divisible by pipeline_parallel_size={pp_size}")
    if ep_size > 1 and shape.num_experts % ep_size:
        raise ModelConfigError(f"num_experts={shape.num_experts} is not divisible by expert_parallel_size={ep_size}")


def _latent_widths(shape: ModelShape, tp_size: int) -> tuple[tuple[str, int, str, int], ...]:
    """Multi-latent attention's down projections, column-parallel on the local layer spec (Megatron gathers their
    outputs): the query latent and the key/value latent with the rotary key."""
    if shape.mla is None:
        return ()
    return (("q_lora_rank", shape.mla.q_lora_rank, "tensor_parallel_size", tp_size),
            ("kv_lora_rank + qk_rope_head_dim", shape.mla.kv_lora_rank + shape.mla.qk_rope_head_dim,
             "tensor_parallel_size", tp_size))


@dataclass(frozen=True)
class MoERouting:
    """The router's load balancing: `load_balancing` none | aux_loss (Switch/GShard auxiliary loss over the
    micro-batch) | seq_aux_loss (per sequence), scaled by `aux_loss_coeff` (0: no auxiliary loss, as RL recipes
    usually run; the routing itself is the same either way)."""

    load_balancing: str = "aux_loss"
    aux_loss_coeff: float = 0.0

    def megatron_fields(self, shape: ModelShape, ep_size: int, etp_size: int | None) -> dict:
        """TransformerConfig's MoE fields for `shape` (none for a dense model) that are not its family's (how its
        router scores and its shared expert: `ModelFamily.megatron_fields`), its experts over `ep_size` ranks and
        each over `etp_size` (None: TP; `initialize_model_parallel` must have the same sizes).
        Tokens reach experts on other EP ranks by Megatron's all-to-all dispatcher (`transformer_config` sets it:
        gloo has the uneven all-to-all on CPU, and the allgather dispatcher refuses the variable sequence lengths
        set under pipeline parallelism)."""
        if not shape.num_experts:
            return {}
        return {
            "num_moe_experts": shape.num_experts, "moe_router_topk": shape.moe_top_k,
            "moe_ffn_hidden_size": shape.moe_ffn_hidden_size, "moe_router_dtype": "fp32",
            "moe_router_load_balancing_type": self.load_balancing if self.aux_loss_coeff > 0 else "none",
            "moe_aux_loss_coeff": self.aux_loss_coeff, "moe_grouped_gemm": False,
            "moe_layer_freq": [int(shape.is_moe_layer(layer)) for layer in range(shape.num_layers)],
            "expert_model_parallel_size": ep_size, "expert_tensor_parallel_size": etp_size,
        }


def transformer_config(
    shape: ModelShape, *, tp_size: int = 1, pp_size: int = 1, params_dtype: torch.dtype = torch.float32,
    device: torch.device | None = None, recompute: RecomputeConfig = RecomputeConfig(),
    sequence_parallel: bool = False, ep_size: int = 1, etp_size: int | None = None, moe: MoERouting = MoERouting(),
    cp_size: int = 1) -> TransformerConfig:
    """The Megatron `TransformerConfig` equivalent to `shape` (dropout-free, no fusions that need CUDA).

    `recompute`: which activations the backward recomputes instead of keeping (the `recompute` section).
    `sequence_parallel` (TP > 1): hidden states outside attention and MLP are split along the sequence over the
    TP ranks, [S/tp, b, H]; the output layer all-gathers them (the fused head too, `scoring.logprobs`).
    `device`: where the model will live. For a CUDA device Megatron allocates and initialises the
    weights directly on the current GPU, as Megatron-LM trains (its default `use_cpu_initialization=False`;
    CPU initialisation plus a copy is slow for large models); otherwise (the default, and what
    building on the meta device in `convert` needs) on the CPU.
    `ep_size`, `etp_size`, `moe` (MoE models): experts over `ep_size` ranks, each split over `etp_size` ranks (expert
    TP; None: TP, Megatron's default here and in `initialize_model_parallel`, which must agree); load balancing
    (`MoERouting`). Training under TP needs `sequence_parallel` (Megatron's MoE layer refuses otherwise).
    `cp_size`: each sequence over that many context-parallel ranks (`parallel_state`'s CP group must agree).
    """
    check_parallel_layout(shape, tp_size, pp_size, ep_size, etp_size)
    return model_family(shape.arch).megatron_config_type(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size, context_parallel_size=cp_size,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=device is None or device.type != "cuda",
        # Loss functions return (sum of token losses, token count); gradients are divided by the
        # global token count once in `finalize_model_grads`, giving an exact token mean over the
        # mini-batch across micro-batches and data-parallel ranks.
        calculate_per_token_loss=True,
        # Micro-batches are trimmed to their own longest sequence (or packed), so their shapes differ: pipeline
        # stages send each activation's shape before it (one 3-int message per transfer).
        variable_seq_lengths=pp_size > 1,
        moe_token_dispatcher_type="alltoall",  # Megatron refuses variable lengths with its default (allgather)
                                               # dispatcher, even in a dense model, which dispatches no tokens
        **recompute.megatron_fields(),
        **moe.megatron_fields(shape, ep_size, etp_size),
        **model_family(shape.arch).megatron_fields(shape),
    )
