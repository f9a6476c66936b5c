"""Evaluate datasets on a rollout engine: validation during training and `armor eval` both run this.

Each dataset's prompts are sampled n times, the requests dealt round-robin over the ranks (`RequestShare`), each
request seeded from the call's seed, the dataset's name, its prompt's index and its sample index, so the samples and
metrics are the same at any number of ranks. A request is answered as the dataset's scorer responds: one completion
scored by its reward function, or (an agentic dataset) a trajectory of its environment, rolled out and scored by the
trainer's `TrajectoryScorer`, its turns seeded from the request's seed. Each rank makes `SampleRecord`s of its share
(a trajectory's turns, tool calls and final answer included), the records are gathered, and the dataset's metrics
computed from them (evaluation/scores.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from megatron_armor.agentic.trajectory import Trajectory
from megatron_armor.config import ArmorConfig
from megatron_armor.data.datasets import PromptRow, load_prompt_rows
from megatron_armor.data.types import Sample
from megatron_armor.evaluation.scores import SampleRecord, TrajectoryRecord, dataset_metrics
from megatron_armor.evaluation.settings import AnswerFn, EvalDataset, validation_datasets
from megatron_armor.rollout.base import RolloutEngine, SamplingParams
from megatron_armor.trainer.rollouts.samples import RequestShare, SampleScorer
from megatron_armor.trainer.rollouts.trajectories import TrajectoryScorer
from megatron_armor.utils.seeding import stable_seed

# What validation logged before dataset lists, from the primary dataset (the first, or eval.primary): kept under these
# names (the collapse monitor and checkpoint.keep_best read val/accuracy).
_PRIMARY_KEYS = {"val/reward_mean": "reward_mean", "val/response_length": "response_length",
                       "val/aborted_fraction": "aborted_fraction"}


@dataclass(frozen=True)
class EvalSet:
    """A dataset ready to evaluate: its settings, tokenized prompts, scorer (a `TrajectoryScorer` for an agentic
    dataset), sampling and answer extractor."""

    dataset: EvalDataset
    rows: list[PromptRow]
    scorer: SampleScorer
    sampling: SamplingParams
    extract: AnswerFn | None = None

    @classmethod
    def load(cls, dataset: EvalDataset, tokenizer, stop_token_ids: tuple[int, ...], *, in_process: bool) -> EvalSet:
        """Read and tokenize `dataset`'s prompts (a row without the prompt or answer key is an error here, before
        anything generates) and import its functions, or its environment and chat template (`in_process`: the engine
        runs in this process, else it is a client of servers: how the trajectories' turns are sent to it)."""
        rows = load_prompt_rows(dataset.path, tokenizer=tokenizer, prompt_key=dataset.prompt_key,
                                answer_key=dataset.answer_key, apply_chat_template=dataset.apply_chat_template,
                                max_prompt_length=dataset.max_prompt_length)
        sampling = SamplingParams(temperature=dataset.temperature, top_p=dataset.top_p,
                                  max_new_tokens=dataset.max_new_tokens, stop_token_ids=stop_token_ids)
        scorer = (SampleScorer(tokenizer, dataset.reward()) if dataset.agentic is None
                  else TrajectoryScorer.load(dataset.agentic, tokenizer, in_process=in_process))
        return cls(dataset, rows[: dataset.max_prompts], scorer, sampling, dataset.answer_extractor())

    def record(self, sample_index: int, answer: Sequence[Sample], trajectory: Trajectory | None) -> SampleRecord:
        """The record of `answer`, sample `sample_index` of its prompt: one sample, or the segments of `trajectory`
        (when it is one; several when it forked: its reward theirs, its response the last one's, its length all of
        theirs)."""
        last = answer[-1]
        text = self.scorer.response_text(last.response_ids, last.finish_reason)
        summary = None if trajectory is None else TrajectoryRecord.of(trajectory)
        answered = text if summary is None else summary.final_answer
        return SampleRecord(
            prompt_id=last.prompt_index, sample=sample_index, response=text,
            answer=None if self.extract is None else self.extract(answered), reward=last.reward,
            correct=last.correct, length=sum(len(s.response_ids) for s in answer), finish_reason=last.finish_reason,
            trajectory=summary,
        )


@dataclass(frozen=True)
class DatasetResult:
    """One dataset evaluated: every response (prompt-major) and the dataset's metrics."""

    name: str
    records: list[SampleRecord]
    metrics: dict[str, float]


def evaluate_set(engine: RolloutEngine, eval_set: EvalSet, *, seed: tuple) -> DatasetResult:
    """Sample, score and measure `eval_set` on `engine` (collective when torch.distributed is initialised: every
    rank returns the whole result). Request (prompt p, sample k) is seeded from (`seed`, the dataset's name, p's
    index in the dataset, k), so the same `seed` gives the same samples at any number of ranks."""
    dataset, rows = eval_set.dataset, eval_set.rows
    share = RequestShare.deal(len(rows), dataset.n)
    base = stable_seed(*seed, dataset.name)
    sampling = dataclasses.replace(eval_set.sampling,
                                   seeds=tuple(stable_seed(base, rows[p].index, k) for p, k in share.mine))
    answers = eval_set.scorer.respond_with_trajectories(engine, [rows[p] for p, _ in share.mine], sampling,
                                                        is_anchor=False)
    records = [eval_set.record(k, answer, trajectory) for (_, k), (answer, trajectory) in zip(share.mine, answers)]
    if share.world > 1:
        every_rank: list[list[SampleRecord]] = [[] for _ in range(share.world)]
        dist.all_gather_object(every_rank, records)
        records = share.in_request_order([record for part in every_rank for record in part])
    return DatasetResult(dataset.name, records, dataset_metrics(records, dataset, seed=stable_seed(*seed)))


@dataclass(frozen=True)
class Validation:
    """The datasets validated during training. `per_dataset` (eval.datasets given): every dataset's metrics are
    logged as val/<name>/<metric>; in any case the primary dataset's avg@n is val/accuracy, beside its reward,
    response length and aborted fraction (what validation of data.val_path logs). `companions` (name, set): that
    set's avg@n is logged as val/accuracy_<name> too (a run on trajectories: the same prompts answered without tools).
    """

    sets: list[EvalSet]
    per_dataset: bool
    primary: int = 0  # the set whose avg@n is val/accuracy
    companions: tuple[tuple[str, int], ...] = ()

    @property
    def validates(self) -> bool:
        """Whether there is anything to validate on (the collapse monitor is on by default then)."""
        return bool(self.sets)

    @classmethod
    def load(cls, cfg: ArmorConfig, tokenizer, stop_token_ids: tuple[int, ...], val_rows: list[PromptRow],
                    val_scorer: SampleScorer, val_sampling: SamplingParams,
                    tool_scorer: SampleScorer | None = None) -> Validation:
        """eval.datasets' list (its agentic datasets rolled out on the run's engines: in-process or servers, as
        rollout.backend says), else data.val_path's prompts (`val_rows`, first eval.max_prompts of them) sampled
        rollout.sampling.val_n times with `val_sampling` and scored by `val_scorer`; none without either. With
        `tool_scorer` (the run's trajectories, rollout.agentic) those prompts are rolled out as its trajectories for
        val/accuracy, and answered bare (`val_scorer`) for val/accuracy_no_tools."""
        if cfg.eval.datasets is not None:
            datasets, primary = validation_datasets(cfg.eval.datasets, cfg.eval.primary)
            in_process = cfg.rollout.backend_settings.in_process
            return cls([EvalSet.load(d, tokenizer, stop_token_ids, in_process=in_process) for d in datasets],
                       per_dataset=True, primary=primary)
        if not val_rows:
            return cls([], per_dataset=False)
        data, sampling = cfg.data, cfg.rollout.sampling
        dataset = EvalDataset(
            name="val", path=cfg.data.val_path or "", prompt_key=data.prompt_key, answer_key=data.answer_key,
            reward_fn=cfg.reward.val_fn or cfg.reward.train_fn, n=sampling.val_n, temperature=val_sampling.temperature,
            top_p=val_sampling.top_p, max_new_tokens=val_sampling.max_new_tokens,
            apply_chat_template=data.apply_chat_template, max_prompt_length=data.max_prompt_length,
        )
        rows = val_rows[: cfg.eval.max_prompts]
        if tool_scorer is None:
            return cls([EvalSet(dataset, rows, val_scorer, val_sampling)], per_dataset=False)
        bare = EvalSet(dataclasses.replace(dataset, name="val_no_tools"), rows, val_scorer, val_sampling)
        return cls([EvalSet(dataset, rows, tool_scorer, val_sampling), bare], per_dataset=False,
                   companions=(("no_tools", 1),))

    def run(self, engine: RolloutEngine, *, seed: tuple) -> dict[str, float]:
        """The validation metrics ({} without datasets; collective)."""
        if not self.sets:
            return {}
        return validation_metrics([evaluate_set(engine, s, seed=seed) for s in self.sets],
                                  per_dataset=self.per_dataset, primary=self.primary, companions=self.companions)


def _avg_at_n(metrics: dict[str, float]) -> str:
    (accuracy,) = [key for key in metrics if key.startswith("avg@") and not key.endswith("_stderr")]
    return accuracy


def validation_metrics(results: Sequence[DatasetResult], *, per_dataset: bool, primary: int = 0,
                       companions: Sequence[tuple[str, int]] = ()) -> dict[str, float]:
    """val/accuracy (the avg@n of dataset `primary`), its standard error val/accuracy_stderr (the bootstrap's over
    prompts: the collapse monitor's val_drop_se measures drops in it) and that dataset's reward, length and aborted
    fraction; val/accuracy_<name> (the avg@n of dataset i) for each (name, i) of `companions`; with
    `per_dataset` also val/<name>/<metric> of every dataset."""
    chosen = results[primary].metrics
    accuracy = _avg_at_n(chosen)
    metrics = {"val/accuracy": chosen[accuracy], "val/accuracy_stderr": chosen[f"{accuracy}_stderr"],
               **{key: chosen[name] for key, name in _PRIMARY_KEYS.items()}}
    for name, i in companions:
        metrics[f"val/accuracy_{name}"] = results[i].metrics[_avg_at_n(results[i].metrics)]
    if per_dataset:
        metrics.update({f"val/{r.name}/{key}": value for r in results for key, value in r.metrics.items()})
    return metrics
