"""Worker: Qwen3-MoE on Megatron (experts over all ranks: EP = world size) against the HF model.

argv: out_dir model_dir... (each model checked in turn; results keyed by model_dir). Every rank gets the same
tokens for the forward check; for the gradients rank r takes rows r::world of a fixed batch, the
loss is the sum of their token logprobs, and the gradients of shared (non-expert) parameters are summed over the
data-parallel group as Megatron's DDP would (the experts' gradients already hold every rank's tokens, which the
all-to-all dispatcher routed to them), so they equal the EP=1 gradients of the whole batch. Each rank saves the
gathered HF-named gradients and the logprobs of its rows to `<out_dir>/<model>/rank<r>.pt`.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402

from megatron_armor.convert.weights import gather_hf_weights, load_hf_weights  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed  # noqa: E402
from megatron_armor.models.gpt import build_gpt_model  # noqa: E402
from megatron_armor.models.hf_config import load_model_shape, transformer_config  # noqa: E402

out_dir, *model_dirs = sys.argv[1:]
world = int(os.environ["WORLD_SIZE"])
ctx = initialize_distributed(1, 1, seed=0, expert_parallel_size=world)


def forward_diff(model, hf, shape) -> float:
    """max |Megatron logits - HF logits| on the same [3, 13] tokens (every rank)."""
    ids = torch.randint(0, shape.vocab_size, (3, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids, torch.arange(13).expand(3, -1), None)[..., : shape.vocab_size]
        return (logits - hf(ids).logits).abs().max().item()


def rank_rows_grads(model, shape) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logprobs [rows, 15] of this rank's rows of a fixed [4, 16] batch, and the full-batch HF-named gradients."""
    ids = torch.randint(0, shape.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))[ctx.rank :: world]
    positions = torch.arange(15).expand(ids.shape[0], -1)
    logits = model(ids[:, :-1], positions, None)[..., : shape.vocab_size]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    model.zero_grad()
    logprobs.sum().backward()
    for name, param in model.named_parameters():
        if ".local_experts." not in name:
            dist.all_reduce(param.grad, group=parallel_state.get_data_parallel_group())
    grads = {name: grad.clone() for name, grad in gather_hf_weights(model, shape, use_grads=True)}
    return logprobs.detach(), grads


def check(model_dir: str) -> dict:
    shape = load_model_shape(model_dir)
    model = build_gpt_model(shape, transformer_config(shape, ep_size=world), trainable=True)
    load_hf_weights(model, model_dir, shape)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stored = load_file(str(Path(model_dir) / "model.safetensors"))  # HF names: one tensor per expert projection
    exported = dict(gather_hf_weights(model, shape))
    logprobs, grads = rank_rows_grads(model, shape)
    target = Path(out_dir) / Path(model_dir).name
    target.mkdir(exist_ok=True)
    torch.save({"logprobs": logprobs, "grads": grads}, target / f"rank{ctx.rank}.pt")
    return {
        "forward_diff": forward_diff(model, hf, shape),
        "export_keys_match": set(exported) == set(stored),
        "export_equal": all(torch.equal(exported[k], stored[k]) for k in stored),
        "local_experts": len(model.decoder.layers[-1].mlp.experts.local_experts),
    }


write_result(out_dir, {model_dir: check(model_dir) for model_dir in model_dirs})
destroy_distributed()
