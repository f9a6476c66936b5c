"""Prompt datasets (JSONL / parquet rows with `prompt` and `answer`) and a resumable sampler.

A prompt is a string, or (with data.apply_chat_template) a list of chat messages as in verl's parquet files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_armor.config import DataConfig
from megatron_armor.config.builders import builds


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; the message names the file and row."""


@dataclass(frozen=True)
class PromptRow:
    """A tokenized prompt. index: row number in its dataset (or position in a batch);
    prompt_ids: [P] token ids; row: the raw row, so reward functions can read `answer` etc."""

    index: int
    prompt_ids: list[int]
    row: dict


def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise DatasetError(f"{path} line {number}: invalid JSON ({error.msg})") from error
        return rows
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as error:
            raise DatasetError(f"{path}: reading parquet needs pyarrow; run `pip install pyarrow`") from error
        return pq.read_table(path).to_pylist()
    raise DatasetError(f"{path}: unknown dataset format {path.suffix!r}; use .jsonl or .parquet")


def load_prompt_rows(
    path: str | Path, *, tokenizer, prompt_key: str = "prompt", answer_key: str = "answer",
    apply_chat_template: bool = False, max_prompt_length: int = 2048,
) -> list[PromptRow]:
    """Read and tokenize a prompt dataset; every row needs `prompt_key` and `answer_key`.

    The prompt is a string (wrapped in a user message when `apply_chat_template`) or a list of
    {"role", "content"} messages, rendered as they are by the chat template (which they require).
    Each distinct prompt is tokenized once and its rows share one id list (verl's DAPO-Math-17k file
    repeats 17k prompts to 1.79M rows): do not modify `prompt_ids` in place.
    """
    path = Path(path)
    rows = _read_rows(path)
    if not rows:
        raise DatasetError(f"{path}: dataset is empty")
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DatasetError(f"{path}: data.apply_chat_template is set but the tokenizer has no chat template")
    prompts = []
    tokenized: dict[Hashable, list[int]] = {}  # prompt text, or its messages -> ids
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DatasetError(f"{path} row {number}: expected a JSON object, got {type(row).__name__}")
        for key in (prompt_key, answer_key):
            if _field(row, key) is None:
                raise DatasetError(
                    f"{path} row {number}: missing required field {key!r}; every row needs {prompt_key!r} and {answer_key!r}"
                )
        prompt = _field(row, prompt_key)
        messages = _chat_messages(prompt)
        if messages is None and not isinstance(prompt, str):
            raise DatasetError(
                f"{path} row {number}: field {prompt_key!r} must be a string or a list of chat messages "
                f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}"
            )
        if messages is not None and not apply_chat_template:
            raise DatasetError(
                f"{path} row {number}: field {prompt_key!r} is a list of chat messages; set "
                f"data.apply_chat_template=true to render them with the tokenizer's chat template"
            )
        key = prompt if messages is None else tuple((m["role"], m["content"]) for m in messages)
        ids = tokenized.get(key)
        if ids is None:
            ids = tokenized[key] = _tokenize(tokenizer, prompt, messages, apply_chat_template)
        if not ids or len(ids) > max_prompt_length:
            raise DatasetError(
                f"{path} row {number}: prompt has {len(ids)} tokens; it must have 1..data.max_prompt_length "
                f"({max_prompt_length}) tokens"
            )
        if answer_key != "answer":
            row = {**row, "answer": _field(row, answer_key)}
        prompts.append(PromptRow(index=number - 1, prompt_ids=ids, row=row))
    return prompts


def _tokenize(tokenizer, prompt: str | list, messages: list[dict] | None, apply_chat_template: bool) -> list[int]:
    if not apply_chat_template:
        return tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.apply_chat_template(
        messages or [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)  # transformers 5: a BatchEncoding


def _field(row: dict, key: str) -> Any:
    """row[key], or for a dotted key the nested field (verl's "reward_model.ground_truth"); None if absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _chat_messages(prompt: Any) -> list[dict] | None:
    """A chat-style prompt (verl / DAPO-Math-17k parquet files: a list of {"role", "content"} messages)
    as a list of dicts; None for anything else."""
    if not isinstance(prompt, (list, tuple)):
        return None
    messages = list(prompt)
    if messages and all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                        and isinstance(m.get("content"), str) for m in messages):
        return [dict(m) for m in messages]
    return None


def check_tokenizer_fits_model(tokenizer, model_vocab_size: int) -> None:
    """Every token id the tokenizer can produce must have a row in the model's embedding."""
    if len(tokenizer) > model_vocab_size:
        raise DatasetError(
            f"tokenizer/model vocab mismatch: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size "
            f"is {model_vocab_size}; use the tokenizer saved with this checkpoint"
        )


def write_jsonl(rows: Iterable[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)


class PromptSampler:
    """Endless generation batches over `rows`, reshuffled each epoch, with a resumable position."""

    def __init__(self, rows: list[PromptRow], batch_size: int, *, seed: int, shuffle: bool = True) -> None:
        if batch_size > len(rows):
            raise DatasetError(f"generation batch size {batch_size} exceeds the dataset size {len(rows)}")
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.epoch, self.cursor = 0, 0

    def _order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[PromptRow]:
        """The next `batch_size` distinct rows; a batch never spans two epochs."""
        if self.cursor + self.batch_size > len(self.rows):
            self.epoch, self.cursor = self.epoch + 1, 0
        order = self._order()
        batch = [self.rows[i] for i in order[self.cursor : self.cursor + self.batch_size]]
        self.cursor += self.batch_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def at(self, state: dict[str, Any]) -> PromptSampler:
        """Another sampler over the same rows, at position `state` (it draws the batches this one draws from there)."""
        twin = PromptSampler(self.rows, self.batch_size, seed=self.seed, shuffle=self.shuffle)
        twin.load_state_dict(state)
        return twin

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]


@dataclass(frozen=True)
class Prompts:
    """A run's prompts: the training sampler and every validation row (none without validation prompts)."""

    train: PromptSampler
    validation: list[PromptRow]


@builds(DataConfig)
def load_prompts(
    data: DataConfig, *, tokenizer, train_path: str, val_path: str | None, batch_size: int, seed: int,
) -> Prompts:
    """The prompts of `train_path` and `val_path` (the data section's files, or those a task prepared), tokenized by
    `tokenizer` as the data section says (keys, chat template, max_prompt_length); the training ones in a sampler of
    generation batches of `batch_size` (train.gen_batch_size) seeded with `seed` (train.seed), reshuffled each epoch
    unless data.shuffle is off."""
    options = dict(prompt_key=data.prompt_key, answer_key=data.answer_key, tokenizer=tokenizer,
                   apply_chat_template=data.apply_chat_template, max_prompt_length=data.max_prompt_length)
    sampler = PromptSampler(load_prompt_rows(train_path, **options), batch_size, seed=seed, shuffle=data.shuffle)
    return Prompts(sampler, load_prompt_rows(val_path, **options) if val_path else [])

