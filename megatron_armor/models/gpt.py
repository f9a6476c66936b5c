"""Build Megatron-Core language models for actor and reference.

We build `GPTModel`. Megatron-Core 0.19 marks it deprecated in favour of `HybridModel` (a layer
pattern string mixing attention/MLP/Mamba layers), but GPTModel is still maintained for bug fixes,
is what the conversion ecosystem (mbridge, Megatron-Bridge) targets for Llama/Qwen checkpoints, and
its state-dict names are the ones our HF<->Megatron mapping uses. A dense Llama/Qwen decoder is
exactly a GPTModel, so nothing HybridModel adds is needed here; moving is a builder-only change.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    LayerNormImpl, TransformerBlockSubmodules, get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_armor.distributed.cpu_compat import megatron_device_scope
from megatron_armor.models.families import model_family
from megatron_armor.models.layer_specs import transformer_engine_usable
from megatron_armor.models.norm import SequenceParallelRMSNorm
from megatron_armor.models.shape import ModelShape

# Logit given to padded vocabulary rows: exp() underflows to exactly 0 and, unlike -inf, 0 * it is 0.
PADDED_VOCAB_LOGIT = -1e30


def decoder_spec(shape: ModelShape, config: TransformerConfig) -> ModuleSpec | TransformerBlockSubmodules:
    """The decoder of this pipeline stage: its family's layer spec (`ModelFamily.layer_spec`), or its layers and
    final norm (as Megatron builds the block from a layer spec) where they differ: a `SequenceParallelRMSNorm` final
    norm under sequence parallelism on the local spec, and in a MoE model each layer's spec (MoE, or dense for
    `shape.dense_layers`)."""
    family, first = model_family(shape.arch), get_transformer_layer_offset(config)
    sequence_parallel_norm = config.sequence_parallel and not transformer_engine_usable()
    if not sequence_parallel_norm and not shape.num_experts:
        return family.layer_spec(shape, first, sequence_parallel=config.sequence_parallel)
    specs = [family.layer_spec(shape, first + local, sequence_parallel=config.sequence_parallel)
             for local in range(get_num_layers_to_build(config))]
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
            rotary_percent=shape.rotary_percent,
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
