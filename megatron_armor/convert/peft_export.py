"""A LoRA actor's adapters in Hugging Face PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained` loads onto the HF base model (the package itself never imports peft).

Each Megatron adapter becomes the adapters of the HF linear layers its layer fuses, through the parameter mapping of
the layer's weight (`convert.mapping`): a fused QKV's B `[q + 2kv, r]` is split as the weight is into q_proj's,
k_proj's and v_proj's B, each with the same A; a gated fc1's B `[2f, r]` into gate_proj's and up_proj's; proj and
fc2 map one to one (o_proj, down_proj). A routed expert's adapters (`model.lora.experts`) take the names of the
expert's HF layers in the checkpoint, `<layer>.mlp.experts.<e>.gate_proj` / `up_proj` / `down_proj` (Mixtral's
`block_sparse_moe.experts.<e>.w1` / `w3` / `w2`), which `peft` (with transformers 5's stacked experts) converts to
its adapters of the stacked expert tensors when it loads them. PEFT's scale is lora_alpha / r, as here.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_armor.config import LoRAConfig
from megatron_armor.convert.mapping import megatron_shards_to_hf
from megatron_armor.convert.weights import stage_mappings
from megatron_armor.models.hf_config import ModelShape
from megatron_armor.models.lora import ADAPTER_SUFFIX, LoRAAdapter
from megatron_armor.utils.peft_files import PEFT_PREFIX, write_peft_adapter

PEFT_DIR = "peft"  # a LoRA run's checkpoint's export: step_N/peft/ (checkpoint.save_peft)


def peft_tensors(model: GPTModel, shape: ModelShape) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapters under PEFT's names (`base_model.model.<HF layer>.lora_A.weight` `[r, in]`,
    `.lora_B.weight` `[out, r]`), whole (collective over the TP group); of the routed experts, those of this
    expert-parallel rank, under their global expert numbers."""
    mappings = {m.megatron_name: m for m in stage_mappings(model, shape)}
    out = {}
    for name, adapter in model.named_modules():
        if not isinstance(adapter, LoRAAdapter):
            continue
        mapping = mappings[f"{name.removesuffix(ADAPTER_SUFFIX)}.weight"]
        a, b = adapter.full_factors()
        for hf_name, hf_b in zip(mapping.hf_names, megatron_shards_to_hf(mapping, [b], shape), strict=True):
            layer = PEFT_PREFIX + hf_name.removesuffix(".weight")
            out[f"{layer}.lora_A.weight"] = a.clone()  # one copy per HF layer: safetensors stores no shared memory
            out[f"{layer}.lora_B.weight"] = hf_b.contiguous()
    return out


def peft_target_modules(tensors: dict[str, torch.Tensor] | list[str]) -> list[str]:
    """The HF layer kinds (last name components, e.g. q_proj) that the PEFT-named `tensors` (or their names) adapt."""
    return sorted({key.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for key in tensors
                   if key.endswith(".lora_A.weight")})


def peft_config(lora: LoRAConfig, tensors: dict[str, torch.Tensor], base_model: str) -> dict:
    """PEFT's `adapter_config.json` for `tensors` (from `peft_tensors`): the HF layer names they adapt, rank, alpha,
    dropout, and the base model they belong to (`LoRAConfig.peft_config`)."""
    return lora.peft_config(peft_target_modules(tensors), base_model)


def all_stages_peft_tensors(model: GPTModel, shape: ModelShape) -> dict[str, torch.Tensor]:
    """`peft_tensors` of every pipeline stage and every expert-parallel rank's experts, on the CPU, on every rank
    (collective over TP, EP and PP): the adapters whole, what the PEFT export writes and an adapter-only weight push
    sends. Where nothing had to be gathered they may be the live parameters themselves: copy them to keep them."""
    tensors = {key: value.cpu() for key, value in peft_tensors(model, shape).items()}
    for size, group in ((parallel_state.get_expert_model_parallel_world_size,
                         parallel_state.get_expert_model_parallel_group),
                        (parallel_state.get_pipeline_model_parallel_world_size,
                         parallel_state.get_pipeline_model_parallel_group)):
        if size() > 1:
            tensors = _union_over(tensors, group())
    return tensors


def _union_over(tensors: dict[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """The union of every rank of `group`'s `tensors` (a name two ranks hold is the same tensor on both)."""
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, tensors, group=group)
    return {key: value for part in parts for key, value in part.items()}


def save_peft_adapter(model: GPTModel, shape: ModelShape, lora: LoRAConfig, out_dir: str | Path,
                      base_model: str) -> Path | None:
    """Write the adapters of every pipeline stage in PEFT's format to `out_dir` (collective over TP and PP; global rank
    0 writes, once for all data-parallel replicas, and returns `out_dir`; the others None). `base_model` is recorded
    as the base they belong to (`base_model_name_or_path`)."""
    tensors = all_stages_peft_tensors(model, shape)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return write_peft_adapter(tensors, peft_config(lora, tensors, base_model), out_dir)
