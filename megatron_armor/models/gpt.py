"""Build Megatron-Core language models for actor and reference.

We build `GPTModel`. Megatron-Core 0.19 marks it deprecated in favour of `HybridModel` (a layer
pattern string mixing attention/MLP/Mamba layers), but GPTModel is still maintained for bug fixes,
is what the conversion ecosystem (mbridge, Megatron-Bridge) targets for Llama/Qwen checkpoints, and
its state-dict names are the ones our HF<->Megatron mapping uses. A dense Llama/Qwen decoder is
exactly a GPTModel, so nothing HybridModel adds is needed here; moving is a builder-only change.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    LayerNormImpl, TransformerBlockSubmodules, get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_armor.distributed.cpu_compat import megatron_device_scope
from megatron_armor.models.attention import SDPAttention
from megatron_armor.models.norm import SequenceParallelRMSNorm
from megatron_armor.models.hf_config import ModelShape


def transformer_engine_usable() -> bool:
    """True when Transformer Engine is installed and a CUDA device exists (its layers need both)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


# Logit given to padded vocabulary rows: exp() underflows to exactly 0 and, unlike -inf, 0 * it is 0.
PADDED_VOCAB_LOGIT = -1e30


def layer_spec(
    *, qk_layernorm: bool = False, use_transformer_engine: bool | None = None, sequence_parallel: bool = False,
    num_experts: int | None = None,
) -> ModuleSpec:
    """Decoder layer spec: Transformer Engine's fused layers on GPU when present, else Megatron's
    local layers with SDPA core attention (runs on CPU and GPU); with `sequence_parallel` their norms are
    `SequenceParallelRMSNorm` (Megatron's torch norm refuses sequence parallelism). With `num_experts` the MLP
    is Megatron's `MoELayer`: a `TopKRouter` and a `SequentialMLP` of this rank's experts (one SwiGLU MLP each,
    `experts.local_experts.{j}`; no grouped GEMM, which needs CUDA kernels), and with the config's
    `moe_shared_expert_intermediate_size` its `SharedExpertMLP` (Qwen2-MoE)."""
    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_usable()
    if use_transformer_engine:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm)
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=qk_layernorm)
    attention = spec.submodules.self_attention
    attention_submodules = dataclasses.replace(attention.submodules, core_attention=SDPAttention)
    layer_norms = {}
    if sequence_parallel:
        norm = SequenceParallelRMSNorm
        attention_submodules = dataclasses.replace(
            attention_submodules, **({"q_layernorm": norm, "k_layernorm": norm} if qk_layernorm else {})
        )
        layer_norms = {"input_layernorm": norm, "pre_mlp_layernorm": norm}
    self_attention = dataclasses.replace(attention, submodules=attention_submodules)
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=self_attention, **layer_norms)
    )


def decoder_spec(shape: ModelShape, config: TransformerConfig) -> ModuleSpec | TransformerBlockSubmodules:
    """The decoder of this pipeline stage: the layer spec, or its layers and final norm (as Megatron builds the
    block from a layer spec) where they differ: a `SequenceParallelRMSNorm` final norm under sequence parallelism
    on the local spec, and in a MoE model each layer's spec (MoE, or dense for `shape.dense_layers`)."""
    spec = layer_spec(qk_layernorm=shape.qk_norm, sequence_parallel=config.sequence_parallel)
    sequence_parallel_norm = config.sequence_parallel and not transformer_engine_usable()
    if not sequence_parallel_norm and not shape.num_experts:
        return spec
    specs = [spec] * get_num_layers_to_build(config)
    if shape.num_experts:
        moe = layer_spec(qk_layernorm=shape.qk_norm, sequence_parallel=config.sequence_parallel,
                         num_experts=shape.num_experts)
        first = get_transformer_layer_offset(config)
        specs = [moe if shape.is_moe_layer(first + local) else spec for local in range(len(specs))]
    return TransformerBlockSubmodules(layer_specs=specs,
                                      layer_norm=SequenceParallelRMSNorm if sequence_parallel_norm else LayerNormImpl)


def build_gpt_model(shape: ModelShape, config: TransformerConfig, *, trainable: bool = True) -> GPTModel:
    """This rank's stage of the model (pre/post-process set from the pipeline position).

    The vocabulary is `shape.padded_vocab_size`; logits of the padding rows are forced to
    `PADDED_VOCAB_LOGIT`, so softmaxes and logprobs equal those over the real vocabulary; the fused LM
    head skips those rows (`output_layer.unpadded_vocab_size`).
    Weights are randomly initialised where `config.use_cpu_initialization` puts them (the CPU or an
    enclosing `torch.device` context, else the current GPU); `convert.loading.load_gpt_model` places
    the model on the training device and loads real ones. A frozen (`trainable=False`) model has
    `requires_grad=False` everywhere and starts in eval mode.
    """
    with megatron_device_scope():  # tied embeddings under PP all-reduce the output-layer copy via .cuda()
        model = GPTModel(
            config=config,
            transformer_layer_spec=decoder_spec(shape, config),
            vocab_size=shape.padded_vocab_size,
            max_sequence_length=shape.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=shape.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(shape.rope_theta),
            rope_scaling=shape.rope_scaling_factor is not None,
            rope_scaling_factor=shape.rope_scaling_factor or 8.0,
        )
    if model.post_process:
        model.output_layer.unpadded_vocab_size = shape.vocab_size  # what the fused LM head scores
    if model.post_process and shape.padded_vocab_size != shape.vocab_size:
        model.output_layer.register_forward_hook(_mask_padded_vocab(shape.vocab_size))
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    return model


def _mask_padded_vocab(vocab_size: int):
    """Forward hook of the (vocab-parallel) output layer: padded vocabulary columns of this rank's
    logits shard `[S, B, V_pad/tp]` get `PADDED_VOCAB_LOGIT` (no gradient flows into them)."""

    def hook(module, inputs, output):
        logits, bias = output
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        first = tp_rank * logits.shape[-1]
        padded = torch.arange(first, first + logits.shape[-1], device=logits.device) >= vocab_size
        return logits.masked_fill(padded, PADDED_VOCAB_LOGIT), bias

    return hook
