"""Worker: MIPU loss gradients and metrics of a fixed batch under each loss aggregation and micro-batch size;
optionally an ARMOR case: its gradient, RL steps through update_policy and optimizer steps on given gradients.

argv: out_dir model_dir batch_path [armor_case_path]. The batch (a pickled `SequenceBatch` with old/ref
logprobs) is dealt to data-parallel ranks as rows rank, rank + dp, ... Every rank saves `rank<r>.pt`:
{"<aggregation>/<micro>": {"grads": full HF-named gradients, "metrics": update_policy's}} with
micro-batches of one sequence ("one") and of the whole local batch ("whole"), and "armor" (see `armor_run`).
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from algorithm_factory import make_algorithm  # noqa: E402
from launcher import write_result  # noqa: E402

from megatron_armor.convert.weights import (  # noqa: E402
    gather_all_stages_hf_weights, hf_parameter_source, load_hf_weights,
)
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed  # noqa: E402
from megatron_armor.config import MicroBatchingConfig, OptimizerConfig  # noqa: E402
from megatron_armor.models.gpt import build_gpt_model  # noqa: E402
from megatron_armor.models.hf_config import load_model_shape, transformer_config  # noqa: E402
from megatron_armor.scoring.logprobs import ScoringConfig, forward_backward  # noqa: E402
from megatron_armor.trainer.update.optimizer import (  # noqa: E402
    learning_rate, optimizer_step, wrap_for_training, zero_grads,
)
from megatron_armor.trainer.update.policy_update import PolicyLossCallback, update_policy  # noqa: E402
from megatron_armor.scoring.micro_batches import MicroBatching  # noqa: E402

out_dir, model_dir, batch_path = sys.argv[1:4]
ctx = initialize_distributed(1, 1, seed=0)
shape = load_model_shape(model_dir)
model = build_gpt_model(shape, transformer_config(shape), trainable=True)
load_hf_weights(model, model_dir, shape)
optim = OptimizerConfig(lr=0.0, warmup_steps=0)  # update_policy for its metrics only: the weights stay put
ddp, optimizer = wrap_for_training(optim, model=model)

batch = torch.load(batch_path, weights_only=False)
local = batch.select(torch.arange(ctx.dp_rank, batch.size, ctx.dp_size))
results = {}
SCORING = ScoringConfig(temperature=1.0, head="torch")
for aggregation in ("token_mean", "seq_mean_token_mean"):
    loss = make_algorithm("mipu", "algorithm.clip_low=0.2", "algorithm.clip_high=0.2", "algorithm.dual_clip=1.4",
                          "kl.coef=0.001", "mipu.is_correction=tis", "mipu.w_max=2.0",
                          f"algorithm.loss_aggregation={aggregation}")
    for micro, micro_batch_size in (("one", 1), ("whole", local.size)):
        batching = MicroBatching(MicroBatchingConfig(micro_batch_size))
        forward_backward(ddp, batching.split(local), PolicyLossCallback(loss), scoring=SCORING, forward_only=False)
        grads = {name: g.clone() for name, g in gather_all_stages_hf_weights(ddp.module, shape, use_grads=True)}
        zero_grads(ddp, optimizer)
        update = update_policy(ddp, optimizer, [local], micro_batching=batching, algorithm=loss,
                               scoring=SCORING, optim=optim, rl_step=0)
        results[f"{aggregation}/{micro}"] = {"grads": grads, "metrics": update.metrics}


def armor_run(case: dict) -> dict:
    """The ARMOR case (tests/algorithms/conftest.py `armor_case`), on fresh models from model_dir:
    "grads" (full HF-named) and "sums" (this rank's loss-callback sums) of the whole batch at the initial
    weights; "updates": per RL step of case["steps"] (rl_step, mini-batches as global rows), update_policy's
    metrics and the weights after it; "steps": per (rl_step, HF-named gradient) of case["injected"], the
    weights after `optimizer_step` at `learning_rate(rl_step)` with that gradient in the grad buffers."""
    settings = case["loss"]  # ARMOR's alpha and clip bounds
    loss = make_algorithm("armor", f"armor.alpha={settings['alpha']}", f"algorithm.clip_low={settings['clip_low']}",
                          f"algorithm.clip_high={settings['clip_high']}", f"algorithm.dual_clip={settings['dual_clip']}")
    optim, batch = OptimizerConfig(**case["optim"]), case["batch"]

    def local(rows):
        return batch.select(torch.tensor(list(rows)[ctx.dp_rank :: ctx.dp_size]))

    def fresh():
        m = build_gpt_model(shape, transformer_config(shape), trainable=True)
        load_hf_weights(m, model_dir, shape)
        return wrap_for_training(optim, model=m)

    def hf_weights(d):
        return {name: w.clone() for name, w in gather_all_stages_hf_weights(d.module, shape)}

    out = {}
    ddp, optimizer = fresh()
    pairs = MicroBatching(MicroBatchingConfig(2)).split(local(range(batch.size)))
    outputs = forward_backward(ddp, pairs, PolicyLossCallback(loss), scoring=SCORING, forward_only=False)
    out["grads"] = {name: g.clone() for name, g in gather_all_stages_hf_weights(ddp.module, shape, use_grads=True)}
    out["sums"] = {name: sum(float(o[name]) for o in outputs) for name in outputs[0]}
    zero_grads(ddp, optimizer)
    out["updates"] = []
    for rl_step, mini_batches in case["steps"]:
        update = update_policy(ddp, optimizer, [local(rows) for rows in mini_batches],
                               micro_batching=MicroBatching(MicroBatchingConfig(1)), algorithm=loss, scoring=SCORING,
                               optim=optim, rl_step=rl_step)
        out["updates"].append({"metrics": update.metrics, "weights": hf_weights(ddp)})

    ddp, optimizer = fresh()
    out["steps"] = []
    for k, (rl_step, grads) in enumerate(case["injected"]):
        grads_dir = Path(out_dir) / f"grads-rank{ctx.rank}-{k}"  # read back as a checkpoint: HF -> Megatron layout
        grads_dir.mkdir()
        save_file({name: g.contiguous() for name, g in grads.items()}, grads_dir / "model.safetensors")
        source = hf_parameter_source(ddp.module, grads_dir, shape)
        for name, param in ddp.module.named_parameters():
            param.main_grad.copy_(source(name))
        step = optimizer_step(ddp, optimizer, learning_rate(rl_step, optim))
        out["steps"].append({"grad_norm": step.grad_norm, "updated": step.updated, "weights": hf_weights(ddp)})
    return out


if len(sys.argv) > 4:
    results["armor"] = armor_run(torch.load(sys.argv[4], weights_only=False))
torch.save(results, Path(out_dir) / f"rank{ctx.rank}.pt")
write_result(out_dir, {"local_size": local.size})
destroy_distributed()
