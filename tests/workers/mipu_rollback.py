"""Worker: two MIPU steps through `build_training` with a forced accept, then a forced reject.

argv: out_dir config_yaml overrides... Every rank reports both steps' metrics, whether actor
weights, optimizer state and engine weights after the rejected step equal (bit for bit) those
after the accepted one, and the clip settings of the loss it built. With rollout.memory.offload_trainer
it also reports, for every generate call, whether the actor's weights were parked during it.
"""

import copy
import dataclasses
import sys

import torch

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402
from state_trees import bit_identical  # noqa: E402

from megatron_armor.algorithms import build_algorithm  # noqa: E402
from megatron_armor.config import load_config  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed  # noqa: E402
from megatron_armor.trainer.build import build_training  # noqa: E402
from megatron_armor.trainer.task_setup import prepare_task  # noqa: E402

out_dir, config_path, *overrides = sys.argv[1:]
cfg = load_config(config_path, overrides)
ctx = initialize_distributed(cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size, seed=cfg.train.seed)
algorithm = build_algorithm(cfg)
trainer = build_training(ctx, cfg, algorithm, prepare_task(cfg, is_main=ctx.is_main, needs_teacher=algorithm.needs_teacher)).trainer


def state():
    """(actor params, optimizer state, engine weights) of this rank, copied (collective)."""
    with trainer.colocation.trainer_phase():  # the optimizer state may be parked between steps
        return (
            [p.detach().clone() for p in trainer.models.actor.module.parameters()],
            copy.deepcopy(trainer.models.optimizer.state_dict()),
            {n: t.clone() for n, t in trainer.models.actor_engine.named_parameters_hf().items()},
        )


weights_parked_at_generate = []
generate = trainer.models.actor_engine.generate


def recording_generate(prompts, sampling):
    params = trainer.models.actor.module.parameters()
    weights_parked_at_generate.append(all(p.untyped_storage().nbytes() == 0 for p in params))
    return generate(prompts, sampling)


trainer.models.actor_engine.generate = recording_generate


def force(c: float) -> None:
    """accept iff T_post >= -c: c = +1e9 always accepts, c = -1e9 always rejects."""
    trainer.gate.config = dataclasses.replace(trainer.gate.config, c_start=c, c_end=c)


initial = state()
force(1e9)
accepted = trainer.step(0)
after_accept, steps_after_accept = state(), trainer.optimizer_steps
force(-1e9)
rejected = trainer.step(1)
after_reject = state()
write_result(out_dir, {
    "accepted": accepted,
    "rejected": rejected,
    "accept_changed": [not bit_identical(x, y) for x, y in zip(initial, after_accept)],
    "reject_restored": [bit_identical(x, y) for x, y in zip(after_accept, after_reject)],
    "optimizer_steps": [steps_after_accept, trainer.optimizer_steps],
    "loss_clip": [trainer.plan.algorithm.clip.low, trainer.plan.algorithm.clip.high, trainer.plan.algorithm.clip.dual],
    "weights_parked_at_generate": weights_parked_at_generate,
})
destroy_distributed()
