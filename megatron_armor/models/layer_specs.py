"""Decoder layer specs a model family chooses from (`ModelFamily.layer_spec`): Megatron-Core's GPT layer with
standard self-attention and a dense or routed SwiGLU MLP, on Transformer Engine where it runs, else on Megatron's
local layers made to run on the CPU."""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_armor.models.attention import SDPAttention
from megatron_armor.models.latent_attention import LocalMLASelfAttention
from megatron_armor.models.norm import SequenceParallelRMSNorm


def transformer_engine_usable() -> bool:
    """True when Transformer Engine is installed and a CUDA device exists (its layers need both)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None



def layer_spec(
    *, qk_layernorm: bool = False, use_transformer_engine: bool | None = None, sequence_parallel: bool = False,
    num_experts: int | None = None, multi_latent_attention: bool = False,
) -> ModuleSpec:
    """Decoder layer spec: Transformer Engine's fused layers on GPU when present, else Megatron's
    local layers with SDPA core attention (runs on CPU and GPU); with `sequence_parallel` their norms are
    `SequenceParallelRMSNorm` (Megatron's torch norm refuses sequence parallelism). With `num_experts` the MLP
    is Megatron's `MoELayer`: a `TopKRouter` and a `SequentialMLP` of this rank's experts (one SwiGLU MLP each,
    `experts.local_experts.{j}`; no grouped GEMM, which needs CUDA kernels), and with the config's
    `moe_shared_expert_intermediate_size` its `SharedExpertMLP` (Qwen2-MoE).

    `multi_latent_attention` (DeepSeek-V3): Megatron's `MLASelfAttention` instead (`qk_layernorm`: the RMSNorms of
    its query and key/value latents, `q_layernorm` / `kv_layernorm`, which Transformer Engine's spec fuses into the
    up projections), on the same core attention; on the local spec `models.latent_attention.LocalMLASelfAttention`,
    which sums its shared rotary key's gradient over TP.

    Context parallelism (the config's `context_parallel_size` > 1) needs a core attention that attends over the CP
    group: Transformer Engine's `TEDotProductAttention` in its spec (ring exchange of keys and values, the config's
    `cp_comm_type`), else `SDPAttention`'s all-gather of them; Megatron's local `DotProductAttention` refuses CP."""
    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_usable()
    if use_transformer_engine:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention)
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention)
    attention = spec.submodules.self_attention
    if multi_latent_attention:
        attention = dataclasses.replace(attention, module=LocalMLASelfAttention)
    attention_submodules = dataclasses.replace(attention.submodules, core_attention=SDPAttention)
    layer_norms = {}
    if sequence_parallel:
        norm = SequenceParallelRMSNorm
        qk_norms = ("q_layernorm", "kv_layernorm" if multi_latent_attention else "k_layernorm")
        attention_submodules = dataclasses.replace(
            attention_submodules, **(dict.fromkeys(qk_norms, norm) if qk_layernorm else {})
        )
        layer_norms = {"input_layernorm": norm, "pre_mlp_layernorm": norm}
    self_attention = dataclasses.replace(attention, submodules=attention_submodules)
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=self_attention, **layer_norms)
    )
