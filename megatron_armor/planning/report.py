"""`RunPlan` -> the text `armor plan` prints (GiB = 2^30 bytes, per GPU)."""

from __future__ import annotations

from megatron_armor.planning.activations import cp_rank_tokens
from megatron_armor.planning.planner import GIB, RunPlan

# the longest-response line where `context_layouts` finds no CP layout
NO_CP_LAYOUT = "no context-parallel layout of these GPUs splits the model and its experts"


def _gib(value: int) -> str:
    return f"{value / GIB:9.2f} GiB"


def memory_lines(plan: RunPlan) -> list[str]:
    """One line per part of the per-GPU memory, the peak and the verdict."""
    memory, inputs = plan.memory, plan.memory.inputs
    layout, state = inputs.layout, memory.state
    recompute = layout.recompute
    sharding = f"distributed over dp{' x cp' if layout.cp > 1 else ''}" if layout.distributed_optimizer else "replicated"
    rows = [
        ("weights", state.weights, f"{state.params / 1e6:.1f} M params on this GPU, {layout.dtype_bytes} bytes each"
         + (f"; {state.trainable / 1e6:.2f} M of them LoRA adapters (rank {layout.lora.rank})"
            if layout.lora.enabled else "")),
        ("gradients", state.gradients, "fp32 DDP grad buffer" + (" (the adapters')" if layout.lora.enabled else "")),
        ("optimizer state", state.optimizer,
         f"Adam {sharding}; replicated "
         f"{state.optimizer_replicated / GIB:.2f} GiB, distributed {state.optimizer_distributed / GIB:.2f} GiB"),
        *((f"{name} model", size, "frozen weights") for name, size in memory.frozen.items()),
        ("activations", memory.activations.peak,
         f"recompute {recompute.granularity}"
         + (f" ({recompute.method}, {recompute.num_layers})" if recompute.granularity == "full" else "")
         + f", {inputs.micro_batch_tokens} tokens/micro-batch"
         + (f" ({cp_rank_tokens(layout, inputs.micro_batch_tokens)} per CP rank)" if layout.cp > 1 else "")
         + f", sequence parallel {layout.sequence_parallel}; saved {memory.activations.saved / GIB:.2f} GiB + "
           f"recompute {memory.activations.recompute / GIB:.2f} GiB"
         + (f" + CP K/V exchange {memory.activations.exchange / GIB:.2f} GiB" if layout.cp > 1 else "")),
        (f"LM head ({layout.head})", memory.logits.peak,
         f"torch head {memory.logits_torch.peak / GIB:.2f} GiB, fused head {memory.logits_fused.peak / GIB:.2f} GiB"),
        ("reserve", inputs.reserve_bytes, "CUDA context, communication buffers, fragmentation"),
    ]
    lines = [f"  {name:<18}{_gib(size)}   {note}" for name, size, note in rows]
    lines.append(f"  {'training peak':<18}{_gib(memory.training_peak)}   of {inputs.gpu_bytes / GIB:.2f} GiB per GPU")
    if (full := plan.full_finetune) is not None:
        saved = full.training_peak - memory.training_peak
        lines.append(f"  {'LoRA saves':<18}{_gib(saved)}   full fine-tuning's peak {full.training_peak / GIB:.2f} GiB "
                     f"(gradients {full.state.gradients / GIB:.2f}, optimizer state {full.state.optimizer / GIB:.2f}, "
                     f"reference {full.frozen['reference'] / GIB:.2f} GiB)")
    where = "colocated, beside the trainer's resident state" if inputs.colocated else "on a GPU of its own"
    lines.append(f"  {'KV cache left':<18}{_gib(memory.kv_cache)}   for a TP-{inputs.server_tp} SGLang server {where} "
                 f"(mem fraction {inputs.server_mem_fraction}, less its bf16 weights)")
    return lines


def longest_response_line(plan: RunPlan) -> str:
    """The longest responses that fit without and with context parallelism (the knob for long responses)."""
    line = (f"longest responses that fit (rollout.sampling.max_new_tokens): {plan.longest_without_cp} tokens without "
            f"context parallelism (dp {plan.without_cp[1]})")
    if plan.with_cp is None:
        return line + f"; {NO_CP_LAYOUT}"
    cp, dp = plan.with_cp
    return line + f", {plan.longest_with_cp} with parallel.context_parallel_size {cp} (dp {dp})"


def format_plan(plan: RunPlan) -> str:
    """The whole report: model, layout, per-GPU bytes, verdict and advice, FLOPs of one RL step."""
    inputs, layout = plan.memory.inputs, plan.memory.inputs.layout
    shape, flops = inputs.shape, plan.flops
    lines = [
        f"model: {shape.arch}, {shape.num_layers} layers, hidden {shape.hidden_size}, heads {shape.num_attention_heads}"
        f" (kv {shape.num_kv_heads}), ffn {shape.ffn_hidden_size}, vocab {shape.vocab_size} ({plan.shape_source})",
        f"layout: tp {layout.tp} x pp {layout.pp} x " + (f"cp {layout.cp} x " if layout.cp > 1 else "")
        + f"dp {layout.dp} = {plan.trainer_gpus} trainer GPUs of {plan.gpus}; "
        + (f"experts over ep {layout.ep} x etp {layout.expert_tp} (expert dp {layout.expert_dp}); "
           if shape.num_experts else "")
        + f"{inputs.micro_batches} micro-batches per optimizer step per rank",
        "per GPU (estimate):", *memory_lines(plan),
        "fits" if plan.memory.fits else "does NOT fit; knobs to turn:",
        *(f"  - {line}" for line in plan.advice),
        f"training FLOPs of one RL step ({plan.sequences} sequences at the maximum {plan.max_len} tokens, an upper "
        f"bound): {flops.total:.3e} (update {flops.update:.3e}, old logprobs {flops.old_logprobs:.3e}, reference "
        f"{flops.reference:.3e}, teacher {flops.teacher:.3e}); per trainer GPU {flops.total / plan.trainer_gpus:.3e}",
    ]
    lines.append(longest_response_line(plan))
    if plan.trainer_gpus > plan.gpus:
        lines.append(f"error: the layout needs {plan.trainer_gpus} GPUs, only {plan.gpus} given")
    return "\n".join(lines)
