"""Supervised warm start of a small HF checkpoint on a task's worked solutions, with caching.

ARMOR continues training from a policy that already solves part of the task (its anchors must be
correct sometimes). For the synthetic demo that policy is made here: a short SFT on
`prompt + solution + EOS`, with the loss on the solution and EOS tokens only.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from megatron_armor.config import WarmStartConfig
from megatron_armor.models.tokenizer import load_tokenizer
from megatron_armor.rewards.arithmetic import verify
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine

COMPLETE_MARKER = "WARM_START_COMPLETE"


@dataclass(frozen=True)
class WarmStartResult:
    path: str
    steps: int
    accuracy: float


def sampled_accuracy(model, tokenizer, rows: list[dict], *, seed: int, max_new_tokens: int = 40) -> float:
    """Fraction of `rows` whose T=1 sample passes the arithmetic verifier."""
    engine = LocalEngine(model, pad_token_id=tokenizer.pad_token_id, prepack_weights=False)  # `model` is in training
    prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,), seed=seed)
    generations = engine.generate(prompts, sampling)
    texts = [tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in generations]
    return sum(verify(text, row)[1] for text, row in zip(texts, rows)) / len(rows)


def _sft_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, S] right-padded; labels [B, S] with -100 outside solution + EOS."""
    sequences, starts = [], []
    for row in rows:
        prompt = tokenizer.encode(row["prompt"], add_special_tokens=False)
        target = tokenizer.encode(row["solution"], add_special_tokens=False) + [tokenizer.eos_token_id]
        sequences.append(prompt + target)
        starts.append(len(prompt))
    width = max(map(len, sequences))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (seq, start) in enumerate(zip(sequences, starts)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, start : len(seq)] = torch.tensor(seq[start:])
    return input_ids, labels


def warm_start(model_dir: str | Path, rows: list[dict], out_dir: str | Path, cfg: WarmStartConfig, *, seed: int,
               progress: bool = True) -> WarmStartResult:
    """SFT `model_dir` on `rows` (dicts with prompt/solution/answer) as `cfg` (task.warm_start) says, seeded by
    `seed`, and save to `out_dir` atomically."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    held_out, train_rows = rows[: cfg.eval_rows], rows[cfg.eval_rows :] or rows
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    accuracy, step = 0.0, 0
    bar = tqdm(range(cfg.steps), desc="warm start", disable=not progress, dynamic_ncols=True)
    for step in bar:
        model.train()
        input_ids, labels = _sft_batch(tokenizer, rng.sample(train_rows, min(cfg.batch_size, len(train_rows))))
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % cfg.eval_every == 0:
            model.eval()
            accuracy = sampled_accuracy(model, tokenizer, held_out, seed=seed + step)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{accuracy:.2f}")
            if accuracy >= cfg.target_accuracy:
                break
    out, tmp = Path(out_dir), Path(str(out_dir) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    result = WarmStartResult(path=str(out), steps=step + 1, accuracy=accuracy)
    (tmp / COMPLETE_MARKER).write_text(json.dumps(asdict(result)))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return result


def _directory_hash(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def cached_warm_start(model_dir: str | Path, rows: list[dict], cache_root: str | Path, cfg: WarmStartConfig, *,
                      seed: int, progress: bool = True) -> WarmStartResult:
    """`warm_start`, reusing a complete earlier result for the same model, rows, settings and seed."""
    key = hashlib.sha256(
        json.dumps([_directory_hash(Path(model_dir)), {**asdict(cfg), "seed": seed}, rows], sort_keys=True).encode()
    ).hexdigest()[:16]
    out = Path(cache_root) / key
    marker = out / COMPLETE_MARKER
    if marker.is_file():
        return WarmStartResult(**json.loads(marker.read_text()))
    out.parent.mkdir(parents=True, exist_ok=True)
    return warm_start(model_dir, rows, out, cfg, seed=seed, progress=progress)
