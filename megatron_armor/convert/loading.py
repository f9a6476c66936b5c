"""Build a Megatron GPTModel for this process's TP/PP layout and load a checkpoint into it."""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_armor.convert.megatron_checkpoint import load_model_weights
from megatron_armor.distributed.device import training_device
from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.config import ModelConfig, RecomputeConfig
from megatron_armor.config.builders import builds
from megatron_armor.models.hf_config import ModelShape, MoERouting, transformer_config

# model.params_dtype / serve-teacher --params-dtype -> torch dtype
PARAMS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_gpt_model(
    path: str | Path, shape: ModelShape, *, params_dtype: torch.dtype = torch.float32, trainable: bool = False,
    recompute: RecomputeConfig = RecomputeConfig(), sequence_parallel: bool = False,
    moe: MoERouting = MoERouting(),
) -> GPTModel:
    """This rank's shard of the model at `path` (HF directory or Megatron checkpoint), on `training_device()`.

    The layout is `parallel_state`'s (initialised first); a layout that does not divide the model's
    heads, FFN width, vocabulary or layers raises `ModelConfigError`. `recompute` and `sequence_parallel`: as
    `transformer_config`'s, as is `moe` (MoE models; the expert-parallel and expert-TP sizes are `parallel_state`'s).
    """
    device = training_device()
    config = transformer_config(
        shape, tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(), params_dtype=params_dtype, device=device,
        recompute=recompute, sequence_parallel=sequence_parallel,
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        etp_size=parallel_state.get_expert_tensor_parallel_world_size(), moe=moe,
        cp_size=parallel_state.get_context_parallel_world_size(),
    )
    # As Megatron-LM's `get_model`: build (on the GPU, per the config), then `.cuda()` what Megatron
    # leaves on the CPU and cast to params_dtype what it builds in fp32 (the local spec's torch RMSNorm
    # weights; Megatron-LM's Float16Module casts the whole model), then load the checkpoint into it.
    model = build_gpt_model(shape, config, trainable=trainable).to(device=device, dtype=params_dtype)
    load_model_weights(model, path, shape)
    return model


@builds(ModelConfig)
def load_policy_model(
    model: ModelConfig, *, path: str | Path, shape: ModelShape, trainable: bool = False,
    recompute: RecomputeConfig = RecomputeConfig(), sequence_parallel: bool = False,
) -> GPTModel:
    """This rank's shard of a policy's model at `path` (model.path, ref_path, a teacher's) in model.params_dtype
    (`load_gpt_model`). The model that trains (`trainable`: the actor) routes MoE tokens with model.moe_load_balancing
    and moe_aux_loss_coeff; frozen ones score with the default routing (no auxiliary loss)."""
    moe = MoERouting(model.moe_load_balancing, model.moe_aux_loss_coeff) if trainable else MoERouting()
    return load_gpt_model(path, shape, params_dtype=PARAMS_DTYPES[model.params_dtype], trainable=trainable,
                          recompute=recompute, sequence_parallel=sequence_parallel, moe=moe)

