"""Worker: OPD's off-policy variant (opd.rollouts teacher) through `build_training`.

argv: out_dir config_yaml overrides... Every rank reports the checkpoints the run used, each training
sample's prompt and response tokens with the trainer's label-aligned old (student) and teacher logprobs
and per-token advantages on its response tokens, the batch metrics, and, around one full RL step,
whether the actor's and the teacher's engines' weights changed.
"""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402

from megatron_armor.algorithms import TEACHER, build_algorithm  # noqa: E402
from megatron_armor.config import load_config  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed  # noqa: E402
from megatron_armor.trainer.run.build import build_training  # noqa: E402
from megatron_armor.trainer.run.task_setup import prepare_task  # noqa: E402
from megatron_armor.trainer.update.training_batch import advantage_batch, batch_metrics, score_logprobs  # noqa: E402

out_dir, config_path, *overrides = sys.argv[1:]
cfg = load_config(config_path, overrides)
ctx = initialize_distributed(cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size, seed=cfg.train.seed)
algorithm = build_algorithm(cfg)
paths = prepare_task(cfg, is_main=ctx.is_main, needs_teacher=algorithm.sources.uses(TEACHER))
trainer = build_training(ctx, cfg, algorithm, paths).trainer


def engine_weights(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.named_parameters_hf().items()}


def unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


groups = trainer.rollouts.phase.collect(0).groups
advantaged = advantage_batch(groups, trainer.plan, dp_size=ctx.dp_size, dp_rank=ctx.dp_rank,
                             pad_token_id=trainer.models.pad_token_id)
prepared = score_logprobs(advantaged, trainer.models, trainer.plan, trainer.scoring,
                          optimizer_steps=trainer.optimizer_steps, dp_rank=ctx.dp_rank)
# one data-parallel rank: the batch rows are the samples in order
batch = prepared.batch
samples = []
for row, sample in enumerate(s for g in groups for s in g):
    on_response = batch.response_mask[row] > 0  # [S] the response tokens' label positions, in order
    samples.append({
        "prompt_ids": sample.prompt_ids,
        "response_ids": sample.response_ids,
        "old_logprobs": batch.old_logprobs[row][on_response].tolist(),
        "teacher_logprobs": batch.teacher_logprobs[row][on_response].tolist(),
        "token_advantages": batch.token_advantages[row][on_response].tolist(),
    })
metrics_of_batch = batch_metrics(prepared, trainer.plan.algorithm.sources)

actor_before = engine_weights(trainer.models.actor.engine)
teacher_before = engine_weights(trainer.models.teacher.engine)
step_metrics = trainer.step(1)
write_result(out_dir, {
    "student_path": paths.model_path,
    "teacher_path": paths.teacher_path,
    "samples": samples,
    "batch_metrics": metrics_of_batch,
    "step_metrics": step_metrics,
    "actor_engine_unchanged": unchanged(actor_before, engine_weights(trainer.models.actor.engine)),
    "teacher_engine_unchanged": unchanged(teacher_before, engine_weights(trainer.models.teacher.engine)),
})
destroy_distributed()
