"""Worker: MIPU loss gradients and metrics of a fixed batch under each loss aggregation and micro-batch size.

argv: out_dir model_dir batch_path. The batch (a pickled `SequenceBatch` with old/ref logprobs) is
dealt to data-parallel ranks as rows rank, rank + dp, ... Every rank saves `rank<r>.pt`:
{"<aggregation>/<micro>": {"grads": full HF-named gradients, "metrics": update_policy's}} with
micro-batches of one sequence ("one") and of the whole local batch ("whole").
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402

from megatron_armor.convert.weights import gather_all_stages_hf_weights, load_hf_weights  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed  # noqa: E402
from megatron_armor.models.gpt import build_gpt_model  # noqa: E402
from megatron_armor.models.hf_config import load_model_shape, transformer_config  # noqa: E402
from megatron_armor.trainer.logprobs import forward_backward  # noqa: E402
from megatron_armor.trainer.optimizer import OptimizerSettings, wrap_for_training, zero_grads  # noqa: E402
from megatron_armor.trainer.policy_update import (  # noqa: E402
    LossSettings, SamplerCorrection, policy_loss_fn, update_policy,
)

out_dir, model_dir, batch_path = sys.argv[1:4]
ctx = initialize_distributed(1, 1, seed=0)
shape = load_model_shape(model_dir)
model = build_gpt_model(shape, transformer_config(shape), trainable=True)
load_hf_weights(model, model_dir, shape)
optim = OptimizerSettings(lr=0.0, warmup_steps=0)  # update_policy for its metrics only: the weights stay put
ddp, optimizer = wrap_for_training(model, optim)

batch = torch.load(batch_path, weights_only=False)
local = batch.select(torch.arange(ctx.dp_rank, batch.size, ctx.dp_size))
results = {}
for aggregation in ("token_mean", "seq_mean_token_mean"):
    loss = LossSettings(clip_low=0.2, clip_high=0.2, dual_clip=1.4, kl_coef=0.001, sampler=SamplerCorrection("tis", 2.0),
                        aggregation=aggregation)
    for micro, micro_batch_size in (("one", 1), ("whole", local.size)):
        forward_backward(ddp, list(local.micro_batches(micro_batch_size)), policy_loss_fn(loss), scoring=loss.scoring(),
                         forward_only=False)
        grads = {name: g.clone() for name, g in gather_all_stages_hf_weights(ddp.module, shape, use_grads=True)}
        zero_grads(ddp, optimizer)
        update = update_policy(ddp, optimizer, [local], micro_batch_size=micro_batch_size, loss=loss, optim=optim,
                               rl_step=0)
        results[f"{aggregation}/{micro}"] = {"grads": grads, "metrics": update.metrics}
torch.save(results, Path(out_dir) / f"rank{ctx.rank}.pt")
write_result(out_dir, {"local_size": local.size})
destroy_distributed()
