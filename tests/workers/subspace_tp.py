"""Worker: subspace-constrained gradients of a tensor-parallel GPTModel (tp = world size).

argv: out_dir w0_dir wt_dir k. W0 (HF checkpoint w0_dir) is recorded, the weights move to W_t
(wt_dir), V_K of W_t - W0 is captured, and a real policy-loss gradient is projected. Rank 0 saves
`rank0.pt` with full HF-named gradients (TP-gathered):
  raw:        the gradient before projection
  projected:  after one projection (g V V^T)
  twice:      after projecting `projected` again (in-span gradients are unchanged)
  orthogonal: the projection of raw - projected (removed)
  resumed:    raw projected by a constraint restored from a checkpoint (trainer/checkpointing/checkpoint.py)
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from algorithm_factory import make_algorithm  # noqa: E402
from launcher import write_result  # noqa: E402

from megatron_armor.convert.weights import gather_all_stages_hf_weights, load_hf_weights  # noqa: E402
from megatron_armor.data.types import Sample  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed  # noqa: E402
from megatron_armor.models.gpt import build_gpt_model  # noqa: E402
from megatron_armor.models.hf_config import load_model_shape, transformer_config  # noqa: E402
from megatron_armor.scoring.batch import build_sequence_batch  # noqa: E402
from megatron_armor.scoring.logprobs import ScoringConfig, compute_logprobs, forward_backward  # noqa: E402
from megatron_armor.trainer.checkpointing.checkpoint import load_checkpoint  # noqa: E402
from megatron_armor.trainer.checkpointing.checkpoint_save import save_checkpoint  # noqa: E402
from megatron_armor.trainer.checkpointing.sharded_state import sharded_modules  # noqa: E402
from megatron_armor.config import MicroBatchingConfig, OptimizerConfig  # noqa: E402
from megatron_armor.trainer.step_inputs.policies import Policy  # noqa: E402
from megatron_armor.trainer.update.optimizer import subspace_constraint, wrap_for_training  # noqa: E402
from megatron_armor.trainer.update.policy_update import PolicyLossCallback  # noqa: E402
from megatron_armor.scoring.micro_batches import MicroBatching  # noqa: E402

out_dir, w0_dir, wt_dir, k = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ctx = initialize_distributed(int(os.environ["WORLD_SIZE"]), 1, seed=0)
shape = load_model_shape(w0_dir)
model = build_gpt_model(shape, transformer_config(shape, tp_size=ctx.tp_size), trainable=True)
load_hf_weights(model, w0_dir, shape)
ddp, optimizer = wrap_for_training(OptimizerConfig(), model=model)
constraint = subspace_constraint(ddp.module, k, "gradient")
load_hf_weights(ddp.module, wt_dir, shape)
constraint.capture(step=1)

g = torch.Generator().manual_seed(5)
samples = [Sample(i, torch.randint(1, 120, (3 + i,), generator=g).tolist(),
                  torch.randint(1, 120, (6 + 2 * i,), generator=g).tolist(), [0.0] * (6 + 2 * i), "stop", False)
           for i in range(3)]
batch = build_sequence_batch(samples, [1.0, -0.5, 0.25], pad_token_id=0)
scoring = ScoringConfig(temperature=1.0, head="torch")
batch.old_logprobs = compute_logprobs(ddp, batch, micro_batching=MicroBatching(MicroBatchingConfig(3)),
                                      scoring=scoring).logprobs
forward_backward(ddp, MicroBatching(MicroBatchingConfig(batch.size)).split(batch), PolicyLossCallback(make_algorithm("grpo")),
                 scoring=scoring, forward_only=False)
grads = {name: p.main_grad for name, p in constraint.params.items()}  # this rank's shards, projected in place
raw_local = {name: g.clone() for name, g in grads.items()}


def gathered() -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in gather_all_stages_hf_weights(ddp.module, shape, use_grads=True)}


def project_from(local: dict[str, torch.Tensor], projector) -> dict[str, torch.Tensor]:
    for name, grad in grads.items():
        grad.copy_(local[name])
    projector.pre_step()
    return gathered()


result = {"raw": gathered(), "projected": project_from(raw_local, constraint)}
projected_local = {name: g.clone() for name, g in grads.items()}
result["twice"] = project_from(projected_local, constraint)
result["orthogonal"] = project_from({n: raw_local[n] - projected_local[n] for n in grads}, constraint)

run_dir = Path(out_dir) / "run"
path = save_checkpoint(run_dir, 1, {"modules": sharded_modules({"actor": Policy("actor", ddp), "subspace": constraint}, is_loading=False)})
restored = subspace_constraint(ddp.module, k, "gradient")  # its W0 is W_t and nothing is captured ...
request = sharded_modules({"actor": Policy("actor", ddp), "subspace": restored}, is_loading=True)
_, state = load_checkpoint(path, {"modules": request}, seed=0)  # ... until the checkpoint restores W0 and the bases
restored.load_state_dict(state["modules"]["subspace"])
result["resumed"] = project_from(raw_local, restored)
result["sharding"] = {name: s.dim for name, s in constraint.sharding.items()}
if ctx.rank == 0:
    torch.save(result, Path(out_dir) / "rank0.pt")
write_result(out_dir, {"bases": {name: list(v.shape) for name, v in restored.bases.items()}})
destroy_distributed()
