"""Worker: train.max_steps (2 or 3) MIPU steps through `build_training` with forced gate decisions: accept,
reject, accept.

argv: out_dir config_yaml overrides... Every rank reports each step's metrics, whether actor
weights, optimizer state and engine weights after the rejected step equal (bit for bit) those
after the accepted one, the clip settings of the loss it built, and for every rollout the step it is for, the
thread that generated it and whether the engine then held the weights after the accepted step (with rollout.mode
one_step_off: the weights the rejected step's rollback restores), and for every generation batch which step's
weights the engine held at its start. With rollout.memory.offload_trainer it also reports, for every generate call,
whether the actor's weights were parked during it.
"""

import copy
import dataclasses
import sys
import threading

import torch

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402
from state_trees import bit_identical  # noqa: E402

from megatron_armor.algorithms import TEACHER, build_algorithm  # noqa: E402
from megatron_armor.config import load_config  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed  # noqa: E402
from megatron_armor.trainer.run.build import build_training  # noqa: E402
from megatron_armor.trainer.run.task_setup import prepare_task  # noqa: E402

out_dir, config_path, *overrides = sys.argv[1:]
cfg = load_config(config_path, overrides)
ctx = initialize_distributed(cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size, seed=cfg.train.seed)
algorithm = build_algorithm(cfg)
trainer = build_training(ctx, cfg, algorithm, prepare_task(cfg, is_main=ctx.is_main, needs_teacher=algorithm.sources.uses(TEACHER))).trainer


def state():
    """(actor params, optimizer state, engine weights) of this rank, copied (collective)."""
    with trainer.colocation.trainer_phase():  # the optimizer state may be parked between steps
        return (
            [p.detach().clone() for p in trainer.models.actor.module.parameters()],
            copy.deepcopy(trainer.models.optimizer.state_dict()),
            {n: t.clone() for n, t in trainer.models.actor.engine.named_parameters_hf().items()},
        )


weights_parked_at_generate = []
generate = trainer.models.actor.engine.generate


def recording_generate(prompts, sampling):
    params = trainer.models.actor.module.parameters()
    weights_parked_at_generate.append(all(p.untyped_storage().nbytes() == 0 for p in params))
    return generate(prompts, sampling)


trainer.models.actor.engine.generate = recording_generate
collected = []  # (step, generating thread, the engine's weights) of every rollout
collect = trainer.rollouts.phase.collect


def recording_collect(step):
    weights = {n: t.clone() for n, t in trainer.models.actor.engine.named_parameters_hf().items()}
    rollout = collect(step)
    collected.append((step, threading.current_thread().name, weights))
    return rollout


trainer.rollouts.phase.collect = recording_collect
generated = []  # the engine's weights at the start of every generation batch (async: its generator's batches)
generation_batch = trainer.rollouts.phase.generation_batch


def recording_generation_batch(key, on_actor_done=None):
    weights = {n: t.clone() for n, t in trainer.models.actor.engine.named_parameters_hf().items()}
    batch = generation_batch(key, on_actor_done)
    generated.append(weights)
    return batch


trainer.rollouts.phase.generation_batch = recording_generation_batch


def force(c: float) -> None:
    """accept iff T_post >= -c: c = +1e9 always accepts, c = -1e9 always rejects."""
    trainer.gate.config = dataclasses.replace(trainer.gate.config, c_start=c, c_end=c)


metrics, states, optimizer_steps, versions = [], [state()], [], []
for step, c in enumerate([1e9, -1e9, 1e9][:cfg.train.max_steps]):
    force(c)
    metrics.append(trainer.step(step))
    states.append(state())
    optimizer_steps.append(trainer.optimizer_steps)
    versions.append(trainer.rollouts.version)
initial, after_accept, after_reject = states[:3]
write_result(out_dir, {
    "metrics": metrics,
    "accept_changed": [not bit_identical(x, y) for x, y in zip(initial, after_accept)],
    "reject_restored": [bit_identical(x, y) for x, y in zip(after_accept, after_reject)],
    "optimizer_steps": optimizer_steps,
    "versions": versions,
    "rollouts": [[step, thread, bit_identical(weights, after_accept[2])] for step, thread, weights in collected],
    "loss_clip": [trainer.plan.algorithm.clip.low, trainer.plan.algorithm.clip.high, trainer.plan.algorithm.clip.dual],
    "weights_parked_at_generate": weights_parked_at_generate,
    # per generation batch, the step count after which the engine held its weights (0: the initial ones), or None
    "batch_weights": [next((i for i, kept in enumerate(states) if bit_identical(weights, kept[2])), None)
                      for weights in generated],
})
destroy_distributed()
