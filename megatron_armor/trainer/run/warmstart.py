"""Supervised warm start of a small HF checkpoint on a task's worked solutions, with caching.

ARMOR continues training from a policy that already solves part of the task (its anchors must be
correct sometimes). For the synthetic demo that policy is made here: a short SFT on
`prompt + solution + EOS`, with the loss on the solution and EOS tokens only. For a run that trains on trajectories
of an environment (rollout.agentic), a fraction of the rows (`tool_fraction`) is shown instead as the environment's
demonstration of a solved episode (tool calls, tool results, answer), rendered by the chat template the rollouts use,
with the loss on the assistant turns only (`ToolDemonstrations`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from megatron_armor.agentic.environment import load_environment
from megatron_armor.agentic.render import ChatRenderer, TemplateError
from megatron_armor.config import AgenticConfig, WarmStartConfig
from megatron_armor.models.tokenizer import load_tokenizer
from megatron_armor.rewards.arithmetic import verify
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine

COMPLETE_MARKER = "WARM_START_COMPLETE"


@dataclass(frozen=True)
class Demonstrations:
    """Where tool demonstrations come from: the environment class (module:Class or file.py:Class) whose
    `demonstration(row)` they are, and the chat template's text they are rendered with (None: the tokenizer's)."""

    environment: str
    chat_template: str | None = None

    @classmethod
    def load(cls, agentic: AgenticConfig) -> Demonstrations | None:
        """What rollout.agentic names, loaded: its environment and its chat template's text (the file read), or None
        without an environment."""
        if agentic.environment is None:
            return None
        template = Path(agentic.chat_template).read_text() if agentic.chat_template else None
        return cls(agentic.environment, template)


@dataclass(frozen=True)
class WarmStartResult:
    path: str
    steps: int
    accuracy: float


@dataclass(frozen=True)
class Example:
    """One supervised sequence: `token_ids` [S] and `trained` [S], True where the token is a target."""

    token_ids: list[int]
    trained: list[bool]


def solution_example(tokenizer, row: dict) -> Example:
    """`prompt + solution + EOS`, the solution and EOS trained."""
    prompt = tokenizer.encode(row["prompt"], add_special_tokens=False)
    target = tokenizer.encode(row["solution"], add_special_tokens=False) + [tokenizer.eos_token_id]
    return Example(prompt + target, [False] * len(prompt) + [True] * len(target))


class ToolDemonstrations:
    """Rows as solved episodes of `environment` (its `demonstration(row) -> messages`), rendered with the tools it
    offers by `tokenizer`'s chat template, as the rollouts render them: the assistant turns trained (their content
    and the template's footer after it, the end-of-turn token included), the rest (problem, tool results,
    scaffolding) not. Each assistant turn's tokens are read between the render of the conversation before it (with the
    generation prompt) and the render through it, so the template must render a conversation as its earlier renders
    followed by new tokens (TemplateError otherwise)."""

    def __init__(self, tokenizer, environment: str) -> None:
        self.environment = load_environment(environment)()
        if not callable(getattr(self.environment, "demonstration", None)):
            raise ValueError(f"environment {environment!r} has no demonstration(row) method for the warm start")
        self.renderer = ChatRenderer(tokenizer, (), tools=self.environment.tools)

    def example(self, row: dict) -> Example:
        messages = self.environment.demonstration(row)
        token_ids = self.renderer.ids(messages, generation_prompt=False)
        trained = [False] * len(token_ids)
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.renderer.ids(messages[:k], generation_prompt=True)
            through = self.renderer.ids(messages[: k + 1], generation_prompt=False)
            if through[: len(before)] != before or token_ids[: len(through)] != through:
                raise TemplateError(f"the chat template does not render assistant turn {k} of {messages} as the "
                                    f"conversation before it followed by new tokens")
            trained[len(before) : len(through)] = [True] * (len(through) - len(before))
        return Example(token_ids, trained)


def sampled_accuracy(model, tokenizer, rows: list[dict], *, seed: int, max_new_tokens: int = 40) -> float:
    """Fraction of `rows` whose T=1 sample, answering the bare prompt (no tools), passes the arithmetic verifier."""
    engine = LocalEngine(model, pad_token_id=tokenizer.pad_token_id, prepack_weights=False)  # `model` is in training
    prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,), seed=seed)
    generations = engine.generate(prompts, sampling)
    texts = [tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in generations]
    return sum(verify(text, row)[1] for text, row in zip(texts, rows)) / len(rows)


def _padded(examples: list[Example], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, S] right-padded; labels [B, S]: the token where it is trained, else -100."""
    width = max(len(e.token_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, example in enumerate(examples):
        ids = torch.tensor(example.token_ids)
        input_ids[i, : len(ids)] = ids
        labels[i, : len(ids)] = torch.where(torch.tensor(example.trained), ids, -100)
    return input_ids, labels


def _sft_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The worked solutions of `rows`: input_ids [B, S] right-padded; labels [B, S] with -100 outside solution + EOS."""
    return _padded([solution_example(tokenizer, row) for row in rows], tokenizer.pad_token_id)


class _Examples:
    """The warm start's example of each training row, made once: its demonstration (a `tool_fraction` of the rows,
    drawn with `rng`) or its worked solution."""

    def __init__(self, tokenizer, rows: list[dict], tool_fraction: float, demonstrations: Demonstrations | None,
                 rng: random.Random) -> None:
        self.tokenizer, self.rows = tokenizer, rows
        self.demonstrations = None
        if tool_fraction > 0:
            if demonstrations is None:
                raise ValueError("task.warm_start.tool_fraction > 0 needs demonstrations (rollout.agentic.environment)")
            if demonstrations.chat_template is not None:
                self.tokenizer = tokenizer = copy.deepcopy(tokenizer)
                tokenizer.chat_template = demonstrations.chat_template
            self.demonstrations = ToolDemonstrations(tokenizer, demonstrations.environment)
        self.demonstrated = [rng.random() < tool_fraction for _ in rows]
        self._made: dict[int, Example] = {}

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        for i in indices:
            if i not in self._made:
                self._made[i] = (self.demonstrations.example(self.rows[i]) if self.demonstrated[i]
                                 else solution_example(self.tokenizer, self.rows[i]))
        return _padded([self._made[i] for i in indices], self.tokenizer.pad_token_id)


def warm_start(model_dir: str | Path, rows: list[dict], out_dir: str | Path, cfg: WarmStartConfig, *, seed: int,
               demonstrations: Demonstrations | None = None,
               progress: bool = True) -> WarmStartResult:
    """SFT `model_dir` on `rows` (dicts with prompt/solution/answer) as `cfg` (task.warm_start) says, seeded by
    `seed`, a `cfg.tool_fraction` of them shown as `demonstrations`, and save to `out_dir` atomically."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    held_out, train_rows = rows[: cfg.eval_rows], rows[cfg.eval_rows :] or rows
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    examples = _Examples(tokenizer, train_rows, cfg.tool_fraction, demonstrations, random.Random(seed + 1))
    accuracy, step = 0.0, 0
    bar = tqdm(range(cfg.steps), desc="warm start", disable=not progress, dynamic_ncols=True)
    for step in bar:
        model.train()
        input_ids, labels = examples.batch(rng.sample(range(len(train_rows)), min(cfg.batch_size, len(train_rows))))
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
                      seed: int, demonstrations: Demonstrations | None = None,
                      progress: bool = True) -> WarmStartResult:
    """`warm_start`, reusing a complete earlier result for the same model, rows, settings, seed and (when shown)
    demonstrations."""
    shown = asdict(demonstrations) if demonstrations is not None and cfg.tool_fraction > 0 else None
    settings = {**asdict(cfg), "seed": seed, "demonstrations": shown}
    key = hashlib.sha256(
        json.dumps([_directory_hash(Path(model_dir)), settings, rows], sort_keys=True).encode()
    ).hexdigest()[:16]
    out = Path(cache_root) / key
    marker = out / COMPLETE_MARKER
    if marker.is_file():
        return WarmStartResult(**json.loads(marker.read_text()))
    out.parent.mkdir(parents=True, exist_ok=True)
    return warm_start(model_dir, rows, out, cfg, seed=seed, demonstrations=demonstrations, progress=progress)
