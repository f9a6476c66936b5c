"""`armor eval`: evaluate checkpoints on a dataset list with the code validation runs (trainer/step/validation.py).

Every rank loads each checkpoint into an in-process engine (`LocalEngines`), or rank 0 into SGLang servers all
ranks share (`SGLangEngines`), and generates its round-robin share of every dataset's requests; rank 0 writes the outputs (evaluation/writers.py).
A checkpoint of step N is sampled with the seed validation after step N used, (seed, N, "val"): with the run's
train.seed its numbers are those the run logged, at any number of ranks (either side's).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_armor.convert.hf_export import MegatronStageReader
from megatron_armor.data.datasets import check_tokenizer_fits_model
from megatron_armor.distributed.device import training_device
from megatron_armor.distributed.init import DistributedContext, destroy_distributed, initialize_distributed
from megatron_armor.evaluation.checkpoints import EvalCheckpoint, resolve_checkpoints
from megatron_armor.evaluation.settings import load_eval_datasets
from megatron_armor.evaluation.writers import (
    PLOTS_DIR, RESULTS_JSON, RESULTS_MD, SAMPLES_DIR, CheckpointResult, clear_outputs, markdown_table, write_results,
    write_samples,
)
from megatron_armor.models.hf_config import load_model_shape
from megatron_armor.models.tokenizer import load_tokenizer
from megatron_armor.rollout.base import RolloutEngine
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.sglang_engine import SGLangEngine
from megatron_armor.trainer.step.validation import EvalSet, evaluate_set

@dataclass(frozen=True)
class EvalRun:
    """What `armor eval` was asked: checkpoint names (evaluation/checkpoints.py), the dataset list's YAML file,
    the output directory and the seed (the run's train.seed reproduces its validation)."""

    checkpoints: list[str]
    datasets: str
    out: str
    seed: int = 0
    progress_bar: bool = True
    sglang_urls: str | None = None  # comma-separated SGLang servers to generate with (None: in-process engines)


def run_eval(run: EvalRun) -> list[CheckpointResult]:
    """Evaluate on this rank (collective over the launched ranks, all of them data parallel); every rank returns
    the results. Every input is checked (datasets, their rows, the checkpoints and their models) before any
    generation."""
    ctx = initialize_distributed(1, 1, None, seed=run.seed)
    try:
        return _evaluate(ctx, run)
    finally:
        destroy_distributed()


def _evaluate(ctx: DistributedContext, run: EvalRun) -> list[CheckpointResult]:
    datasets = load_eval_datasets(run.datasets)
    checkpoints = resolve_checkpoints(run.checkpoints)
    tokenizer = load_tokenizer(checkpoints[0].path)
    check_same_model(checkpoints, tokenizer)
    sets = [EvalSet.load(d, tokenizer, (tokenizer.eos_token_id,), in_process=not run.sglang_urls) for d in datasets]
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engines = (SGLangEngines(run.sglang_urls.split(","), is_main=ctx.is_main) if run.sglang_urls
               else LocalEngines(pad_token_id))
    out = Path(run.out)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        clear_outputs(out)
    progress = tqdm(total=len(checkpoints) * len(sets), desc="eval", disable=not (ctx.is_main and run.progress_bar),
                    dynamic_ncols=True)
    results = []
    for checkpoint in checkpoints:
        engine = engines.load(checkpoint)
        metrics = {}
        for eval_set in sets:
            progress.set_postfix(checkpoint=checkpoint.label, dataset=eval_set.dataset.name)
            result = evaluate_set(engine, eval_set, seed=(run.seed, checkpoint.step or 0, "val"))
            if ctx.is_main:
                write_samples(out, checkpoint.label, result.name, result.records)
            metrics[result.name] = result.metrics
            progress.update()
        results.append(CheckpointResult(checkpoint.label, checkpoint.step, str(checkpoint.path), metrics))
    progress.close()
    engines.close()
    if ctx.is_main:
        write_results(out, results, seed=run.seed)
        print(f"{markdown_table(results)}\nwrote {out}: {RESULTS_JSON}, {RESULTS_MD}, {SAMPLES_DIR}/"
              + (f", {PLOTS_DIR}/" if len(results) > 1 else ""))
    dist.barrier()
    return results


def check_same_model(checkpoints: list[EvalCheckpoint], tokenizer) -> None:
    """Every checkpoint has the first one's architecture (`ModelShape`), which the tokenizer fits."""
    first = load_model_shape(checkpoints[0].path)
    check_tokenizer_fits_model(tokenizer, first.vocab_size)
    for checkpoint in checkpoints[1:]:
        shape = load_model_shape(checkpoint.path)
        if shape != first:
            raise ValueError(f"{checkpoint.path} is not the model of {checkpoints[0].path} (its config.json differs: "
                             f"{shape} vs {first}); evaluate one model's checkpoints at a time")


def megatron_tensors(checkpoint: EvalCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named tensors of a Megatron checkpoint, read at TP=1 under this run's parallel state."""
    reader = MegatronStageReader(checkpoint.path, pp=1)
    for mapping in reader.mappings:
        yield from zip(mapping.hf_names, reader.read(mapping))


class LocalEngines:
    """An in-process engine per checkpoint on every rank, in float32, on the GPU when there is one."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id
        self.engine: LocalEngine | None = None

    def load(self, checkpoint: EvalCheckpoint) -> RolloutEngine:
        """An HF checkpoint loads directly; a Megatron checkpoint's tensors go into an engine built from its HF
        config, as training pushes the actor's."""
        self.close()
        if checkpoint.megatron:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint.path), dtype=torch.float32)
            self.engine = LocalEngine(model, pad_token_id=self.pad_token_id)
            self.engine.update_weights(megatron_tensors(checkpoint))
        else:
            self.engine = LocalEngine(checkpoint.path, pad_token_id=self.pad_token_id)
        self.engine.model.to(training_device())
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class SGLangEngines:
    """Running SGLang servers (or `armor serve-local`), shared by the ranks; rank 0 gives them each checkpoint:
    an HF directory they load from disk (a path they can read), a Megatron checkpoint's tensors pushed through
    shared memory (servers on this host; else export it with `armor convert megatron-to-hf` first)."""

    def __init__(self, urls: list[str], *, is_main: bool) -> None:
        rank = dist.get_rank()
        self.is_main = is_main
        self.engine = SGLangEngine(urls, push_urls=urls if is_main else [], first_server=rank)

    def load(self, checkpoint: EvalCheckpoint) -> RolloutEngine:
        dist.barrier()  # every rank's generations of the previous checkpoint are done
        if self.is_main:
            if checkpoint.megatron:
                self.engine.update_weights(megatron_tensors(checkpoint))
            else:
                self.engine.update_weights_from_disk(str(checkpoint.path.resolve()))
        dist.barrier()
        return self.engine

    def close(self) -> None:
        self.engine.close()
