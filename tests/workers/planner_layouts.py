"""Worker (2 ranks): the planner's bytes against a tiny Megatron model's tensors at TP=2, CP=2 and DP=2.

argv: out_dir checkpoint_dir mla_checkpoint_dir. Each rank writes {"activations": [[name, measured, estimated], ...]
(bytes saved for backward by a forward + logprobs at TP=2, sequence parallelism off and on, and at CP=2, recompute
none / selective / full, torch and fused head; the CP=2 rows also the estimate that counts only the rank's own keys and
values), "mla_cp2_activations": the CP=2 rows of the multi-latent attention model (torch head), "tp2_state": [planned, actual] (parameter and grad-buffer bytes of its TP shard),
"dp2": {"planned": StateBytes fields, "gradients": grad-buffer bytes, "optimizer": Adam moment bytes} of the
distributed optimizer at DP=2, "dp2_bf16": the same of a bf16 model, with its "weights" and fp32 "master_weights"
(this rank's slices) apart from its "moments"}.
"""
import os
import sys
from dataclasses import asdict

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused head runs in Triton's CPU interpreter here

import torch  # noqa: E402

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
sys.path.insert(0, __file__.rsplit("/workers/", 1)[0] + "/planning")
from launcher import write_result  # noqa: E402
from saved_bytes import estimated_saved_bytes, measured_saved_bytes  # noqa: E402
from test_memory import adam_state_bytes, master_weight_bytes  # noqa: E402


from megatron_armor.distributed.init import destroy_distributed, destroy_model_parallel, initialize_distributed  # noqa: E402
from megatron_armor.models.gpt import build_gpt_model  # noqa: E402
from megatron_armor.config import OptimizerConfig, RecomputeConfig  # noqa: E402
from megatron_armor.models.hf_config import load_model_shape, transformer_config  # noqa: E402
from megatron_armor.planning.memory import Layout, state_bytes  # noqa: E402
from megatron_armor.trainer.update.optimizer import optimizer_step, wrap_for_training  # noqa: E402

RECOMPUTE = {"none": RecomputeConfig(), "selective": RecomputeConfig("selective"),
             "full": RecomputeConfig("full", "uniform", 1)}


def tensor_parallel_activations(shape) -> list:
    """[name, measured, estimated] for every sequence-parallel, recompute and head setting at TP=2."""
    rows = []
    tokens = torch.randint(1, 96, (2, 40), generator=torch.Generator().manual_seed(1))  # the same on both ranks
    for sp in (False, True):
        for name, recompute in RECOMPUTE.items():
            config = transformer_config(shape, tp_size=2, sequence_parallel=sp, recompute=recompute)
            model = build_gpt_model(shape, config, trainable=True)
            for head in ("torch", "fused"):
                layout = Layout(tp=2, sequence_parallel=sp, dtype_bytes=4, recompute=recompute, head=head,
                                local_attention=True)
                rows.append([f"sp={sp},{name},{head}", measured_saved_bytes(model, tokens, head),
                             estimated_saved_bytes(shape, layout, tokens.numel())])
    return rows


def context_parallel_activations(shape, heads=("torch", "fused")) -> list:
    """[name, measured, estimated, estimated with the local keys and values only] at CP=2 (this rank's zig-zag chunks;
    the local spec's attention all-gathers keys and values) for every recompute setting and each of `heads`."""
    rows = []
    tokens = torch.randint(1, 96, (2, 40), generator=torch.Generator().manual_seed(1))  # 40: a multiple of 2 x CP
    for name, recompute in RECOMPUTE.items():
        model = build_gpt_model(shape, transformer_config(shape, recompute=recompute, cp_size=2), trainable=True)
        for head in heads:
            layout = Layout(cp=2, dtype_bytes=4, recompute=recompute, head=head, local_attention=True)
            local_kv = layout.with_(local_attention=False)  # saves as ring attention does (its K/V in flight apart)
            rows.append([f"cp=2,{name},{head}", measured_saved_bytes(model, tokens, head),
                         estimated_saved_bytes(shape, layout, tokens.numel()),
                         estimated_saved_bytes(shape, local_kv, tokens.numel())])
    return rows


def trained(shape, tp: int, distributed: bool, dtype: torch.dtype = torch.float32):
    """A model of this layout wrapped for training after one optimizer step (Adam's state exists)."""
    model = build_gpt_model(shape, transformer_config(shape, tp_size=tp, params_dtype=dtype), trainable=True).to(dtype)
    ddp, optimizer = wrap_for_training(OptimizerConfig(), model=model, distributed=distributed)
    tokens = torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(2))
    ddp(tokens, torch.arange(8).expand_as(tokens), None).float().sum().backward()
    optimizer_step(ddp, optimizer, lr=1e-3)
    return ddp, optimizer


def main(out_dir: str, checkpoint: str, mla_checkpoint: str) -> None:
    shape = load_model_shape(checkpoint)
    initialize_distributed(2, 1, seed=0)
    activations = tensor_parallel_activations(shape)
    ddp, _ = trained(shape, 2, distributed=False)
    planned = state_bytes(shape, Layout(tp=2, dtype_bytes=4))
    tp2_state = [[planned.weights, sum(p.nbytes for p in ddp.module.parameters())],
                 [planned.gradients, sum(b.grad_data.nbytes for b in ddp.buffers)]]
    destroy_model_parallel()
    initialize_distributed(1, 1, seed=0, context_parallel_size=2)
    activations += context_parallel_activations(shape)
    mla_activations = context_parallel_activations(load_model_shape(mla_checkpoint), heads=("torch",))
    destroy_model_parallel()
    initialize_distributed(1, 1, seed=0)  # dp 2
    ddp, optimizer = trained(shape, 1, distributed=True)
    planned = state_bytes(shape, Layout(dp=2, distributed_optimizer=True, dtype_bytes=4))
    dp2 = {"planned": asdict(planned), "gradients": sum(b.grad_data.nbytes for b in ddp.buffers),
           "optimizer": adam_state_bytes(optimizer)}
    ddp, optimizer = trained(shape, 1, distributed=True, dtype=torch.bfloat16)
    planned = state_bytes(shape, Layout(dp=2, distributed_optimizer=True, dtype_bytes=2))
    dp2_bf16 = {"planned": asdict(planned), "weights": sum(p.nbytes for p in ddp.module.parameters()),
                "gradients": sum(b.grad_data.nbytes for b in ddp.buffers), "moments": adam_state_bytes(optimizer),
                "master_weights": master_weight_bytes(optimizer)}
    write_result(out_dir, {"activations": activations, "mla_cp2_activations": mla_activations, "tp2_state": tp2_state, "dp2": dp2, "dp2_bf16": dp2_bf16})
    destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
