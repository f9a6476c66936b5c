"""Worker: converted Megatron checkpoints, loaded at TP=1, TP=2 and PP=2, against the HF forward.

argv: out_dir HF_DIR=MEGATRON_DIR ...   (run on 2 ranks; TP=1 runs as two data-parallel replicas)
Each rank writes {"<megatron_dir>|tp<t>pp<p>": max |logit diff| over its vocab shard, or None off the last stage,
"mismatch_error": the error of loading the first checkpoint into a model with a wider MLP}.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoModelForCausalLM

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402

from megatron_armor.convert.megatron_checkpoint import load_model_weights  # noqa: E402
from megatron_armor.convert.weights import CheckpointError  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, destroy_model_parallel, initialize_distributed  # noqa: E402
from megatron_armor.models.gpt import build_gpt_model  # noqa: E402
from megatron_armor.models.hf_config import load_model_shape, transformer_config  # noqa: E402

LAYOUTS = ((1, 1), (2, 1), (1, 2))
BATCH, SEQ = 2, 11


def stage_forward(model, ids: torch.Tensor, hidden_size: int) -> torch.Tensor | None:
    """Run one pipeline stage by hand (activations sent stage to stage); logits [B, S, V/tp] on the last."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    if not model.pre_process:
        hidden = torch.empty(ids.shape[1], ids.shape[0], hidden_size)  # [S, B, H]
        dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    with torch.no_grad():
        out = model(ids, positions, None)
    if not model.post_process:
        dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    return out


def main() -> None:
    out_dir, pairs = sys.argv[1], [arg.split("=", 1) for arg in sys.argv[2:]]
    ids = torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    references = {}
    for hf_dir, _ in pairs:
        with torch.no_grad():
            references[hf_dir] = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids).logits
    result = {}
    for tp, pp in LAYOUTS:
        ctx = initialize_distributed(tp, pp, seed=0)
        for hf_dir, megatron_dir in pairs:
            shape = load_model_shape(megatron_dir)
            model = build_gpt_model(shape, transformer_config(shape, tp_size=tp, pp_size=pp), trainable=False)
            load_model_weights(model, megatron_dir, shape)
            logits = stage_forward(model, ids, shape.hidden_size)
            diff = None
            if logits is not None:
                shard = shape.padded_vocab_size // tp
                first, real = ctx.tp_rank * shard, max(0, min(shard, shape.vocab_size - ctx.tp_rank * shard))
                diff = (logits[..., :real] - references[hf_dir][..., first : first + real]).abs().max().item()
            result[f"{megatron_dir}|tp{tp}pp{pp}"] = diff
        destroy_model_parallel()
    initialize_distributed(1, 1, seed=0)
    megatron_dir = pairs[0][1]
    shape = load_model_shape(megatron_dir)
    wider = dataclasses.replace(shape, ffn_hidden_size=shape.ffn_hidden_size + 16)
    try:
        load_model_weights(build_gpt_model(wider, transformer_config(wider), trainable=False), megatron_dir, wider)
    except CheckpointError as error:
        result["mismatch_error"] = str(error)
    write_result(out_dir, result)
    destroy_distributed()


if __name__ == "__main__":
    main()
