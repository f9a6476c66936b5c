"""Worker: Qwen3-MoE / Qwen2-MoE / Mixtral / GLM-4.5 / DeepSeek-V3 on Megatron under TP x EP (x expert TP) layouts
against the HF model.

argv: out_dir layouts checkpoints model_dir..., layouts a comma-separated list of "tp<T>ep<E>[etp<X>]" run one after
another on the one process group (Megatron's parallel state rebuilt for each); each model is checked in turn under each
layout. checkpoints is a comma-separated list of "model_dir=megatron_dir", models converted to Megatron checkpoints at
another layout: each layout also loads them (Megatron's dist-checkpointing reshards them to the layout) and reports
whether their exports equal the HF checkpoints.
Under TP > 1 sequence parallelism is on (Megatron refuses MoE with TP in training without it). The experts are split
over the expert-TP group: of X ranks (`expert_tensor_parallel_size`), else of TP's (Megatron's default); with X other
than TP Megatron regroups the TP x DP ranks as expert TP x EP x expert DP. Every rank gets the same [3, 14] tokens for
the forward check; for the gradients data-parallel rank d takes rows d::dp of a fixed [4, 17] batch, the loss is the
sum of their token logprobs, and gradients are reduced as Megatron's DDP would: sequence-parallel parameters (norms,
routers: each TP rank saw a slice of the sequence) summed over TP, shared parameters over DP, experts over the
expert-DP group (the experts' gradients already hold the tokens the all-to-all dispatcher brought them from every EP
rank), so they equal the one-process gradients of the whole batch. Each rank saves the gathered HF-named gradients and
the logprobs [rows, 16] of its rows to `<out_dir>/<layout>/<model>/rank<r>.pt` and reports per layout and model its
forward's max difference to HF, whether the export equals the checkpoint, its local expert count, the number of ranks
each expert's matrices are split over (from their shape), its expert parameter count, the sizes of its other
parameters, and expert data-parallel size,
its data-parallel rank and size, and whether the exports that are views of a parameter are exactly those of
`parameters_exported_as_views`.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
sys.path.insert(0, __file__.rsplit("/workers/", 1)[0] + "/models")
from launcher import write_result  # noqa: E402
from test_moe import layout_sizes  # noqa: E402

from megatron_armor.convert.megatron_checkpoint import load_megatron_weights  # noqa: E402
from megatron_armor.convert.weights import (  # noqa: E402
    gather_hf_weights, load_hf_weights, parameters_exported_as_views,
)
from megatron_armor.distributed.init import destroy_distributed, destroy_model_parallel, initialize_distributed  # noqa: E402
from megatron_armor.models.gpt import build_gpt_model  # noqa: E402
from megatron_armor.models.hf_config import load_model_shape, transformer_config  # noqa: E402
from megatron_armor.models.tensors import checkpoint_tensors  # noqa: E402


def full_logits(model, ids: torch.Tensor, shape) -> torch.Tensor:
    """Logits [b, s, vocab] of `ids` [b, s] (the vocabulary shards gathered over TP; differentiable)."""
    logits = model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)
    return gather_from_tensor_model_parallel_region(logits)[..., : shape.vocab_size]


def forward_diff(model, hf, shape) -> float:
    """max |Megatron logits - HF logits| on the same [3, 14] tokens (every rank)."""
    ids = torch.randint(0, shape.vocab_size, (3, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (full_logits(model, ids, shape) - hf(ids).logits).abs().max().item()


def reduce_grads(model) -> None:
    """Sum the gradients as Megatron's DDP and `finalize_model_grads` would (see the module docstring)."""
    for name, param in model.named_parameters():
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
        expert = ".local_experts." in name
        dist.all_reduce(param.grad, group=parallel_state.get_expert_data_parallel_group() if expert
                        else parallel_state.get_data_parallel_group())


def rank_rows_grads(model, shape) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logprobs [rows, 16] of this DP rank's rows of a fixed [4, 17] batch, and the full-batch HF-named gradients."""
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    ids = torch.randint(0, shape.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))[dp_rank::dp]
    logits = full_logits(model, ids[:, :-1], shape)
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    model.zero_grad()
    logprobs.sum().backward()
    reduce_grads(model)
    grads = {name: grad.clone() for name, grad in gather_hf_weights(model, shape, use_grads=True)}
    return logprobs.detach(), grads


def views_match(model, shape, exported: dict[str, torch.Tensor]) -> bool:
    """Whether the exports sharing a parameter's (or persistent buffer's: GLM's expert bias) storage are exactly those
    of `parameters_exported_as_views`."""
    views = {p.untyped_storage().data_ptr() for p in parameters_exported_as_views(model, shape)}
    params = {p.untyped_storage().data_ptr() for p in checkpoint_tensors(model).values()}
    return {t.untyped_storage().data_ptr() for t in exported.values()} & params == views


def check(model_dir: str, tp: int, ep: int, etp: int, target: Path) -> dict:
    shape = load_model_shape(model_dir)
    config = transformer_config(shape, tp_size=tp, sequence_parallel=tp > 1, ep_size=ep, etp_size=etp)
    model = build_gpt_model(shape, config, trainable=True)
    load_hf_weights(model, model_dir, shape)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stored = load_file(str(Path(model_dir) / "model.safetensors"))  # HF names: one tensor per expert projection
    exported = dict(gather_hf_weights(model, shape))
    logprobs, grads = rank_rows_grads(model, shape)
    experts = model.decoder.layers[-1].mlp.experts.local_experts
    target.mkdir(parents=True, exist_ok=True)
    torch.save({"logprobs": logprobs, "grads": grads}, target / f"rank{dist.get_rank()}.pt")
    return {
        "forward_diff": forward_diff(model, hf, shape),
        "export_keys_match": set(exported) == set(stored),
        "export_equal": all(torch.equal(exported[k], stored[k]) for k in stored),
        "views_match": views_match(model, shape, exported),
        "local_experts": len(experts),
        "expert_split": 2 * shape.moe_ffn_hidden_size // experts[0].linear_fc1.weight.shape[0],
        "expert_numels": sum(p.numel() for name, p in model.named_parameters() if ".local_experts." in name),
        "dense_numels": sorted(p.numel() for name, p in model.named_parameters() if ".local_experts." not in name),
        "expert_dp": parallel_state.get_expert_data_parallel_world_size(),
        "dp": [parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()],
    }


def resharded_equal(megatron_dir: str, model_dir: str, tp: int, ep: int, etp: int) -> bool:
    """Whether the Megatron checkpoint of `model_dir` (saved at another layout), loaded at this one, exports the HF
    checkpoint's tensors bit for bit."""
    shape = load_model_shape(model_dir)
    config = transformer_config(shape, tp_size=tp, sequence_parallel=tp > 1, ep_size=ep, etp_size=etp)
    model = build_gpt_model(shape, config, trainable=False)
    load_megatron_weights(model, megatron_dir)
    stored = load_file(str(Path(model_dir) / "model.safetensors"))
    exported = dict(gather_hf_weights(model, shape))
    return exported.keys() == stored.keys() and all(torch.equal(exported[k], stored[k]) for k in stored)


def run_layout(layout: str, megatron_dirs: dict[str, str], model_dirs: list[str]) -> dict:
    """Every model's results under `layout` ("tp<T>ep<E>[etp<X>]"), and whether the Megatron checkpoints
    `megatron_dirs` (HF model directory -> its checkpoint saved at another layout) load at it."""
    tp, ep, etp = layout_sizes(layout)
    initialize_distributed(tp, 1, seed=0, expert_parallel_size=ep, expert_tensor_parallel_size=etp)
    results = {model_dir: check(model_dir, tp, ep, etp, Path(out_dir) / layout / Path(model_dir).name)
               for model_dir in model_dirs}
    results["resharded_equal"] = {model_dir: resharded_equal(megatron_dir, model_dir, tp, ep, etp)
                                  for model_dir, megatron_dir in megatron_dirs.items()}
    destroy_model_parallel()  # the next layout builds its own groups on the same process group
    return results


out_dir, layouts, checkpoints, *model_dirs = sys.argv[1:]
megatron_dirs = dict(pair.split("=", 1) for pair in checkpoints.split(","))
write_result(out_dir, {layout: run_layout(layout, megatron_dirs, model_dirs) for layout in layouts.split(",")})
destroy_distributed()
