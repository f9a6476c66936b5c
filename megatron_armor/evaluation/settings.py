"""The evaluation dataset list: one YAML file that `armor eval --datasets` and the training config's
`eval.datasets` both read, validated before anything generates.

    - name: arithmetic                # metric prefix: val/arithmetic/avg@8 in training
      path: data/val.jsonl            # .jsonl or .parquet, as data.val_path
      prompt_key: prompt
      answer_key: answer
      reward_fn: megatron_armor.rewards.arithmetic:verify
      answer_fn: megatron_armor.rewards.arithmetic:extract_answer   # for maj@k; none: no maj@k
      n: 8
      pass_k: [1, 2, 4, 8]            # default: the powers of two below n, and n
      temperature: 1.0
      top_p: 1.0
      max_new_tokens: 1024
      apply_chat_template: false
      max_prompts: null               # the first N prompts only
      agentic: null                   # rollout.agentic's settings: each sample a trajectory of that environment

An agentic dataset (`agentic: {environment: package.module:Class, chat_template: ..., max_turns: ...}`, the keys and
defaults of the training config's rollout.agentic section) rolls every sample out as a trajectory of the environment,
scored by it (reward_fn is then not used); its environment and chat template are checked here too.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_armor.agentic.environment import Environment, load_environment
from megatron_armor.config import AgenticConfig, coerce
from megatron_armor.config.plugins import import_attribute

AnswerFn = Callable[[str], "str | None"]  # response text -> the answer a verifier reads from it (None: none given)
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class EvalSettingsError(ValueError):
    """A dataset list that cannot be evaluated: unreadable, an unknown or missing key, or a value out of range."""


@dataclass(frozen=True)
class EvalDataset:
    """One benchmark: where its prompts are, how they are scored, and how each prompt is sampled `n` times."""

    name: str
    path: str
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    reward_fn: str = "megatron_armor.rewards.math_dapo:verify"
    answer_fn: str | None = None
    n: int = 1
    pass_k: tuple[int, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    apply_chat_template: bool = False
    max_prompts: int | None = None
    max_prompt_length: int = 2048
    agentic: AgenticConfig | None = None  # rolled out as trajectories of agentic.environment (module docstring)

    def __post_init__(self) -> None:
        where = f"dataset {self.name!r}"
        if not _NAME.match(self.name):
            raise EvalSettingsError(f"{where}: a name is letters, digits, '_', '.' or '-' (it becomes a metric key)")
        if self.n < 1:
            raise EvalSettingsError(f"{where}: n must be >= 1, got {self.n}")
        too_large = [k for k in self.pass_k if k > self.n]
        if too_large:
            raise EvalSettingsError(f"{where}: pass_k {too_large} larger than n = {self.n} (k <= n samples per prompt)")
        if any(k < 1 for k in self.pass_k):
            raise EvalSettingsError(f"{where}: every pass_k must be >= 1, got {list(self.pass_k)}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise EvalSettingsError(f"{where}: need temperature >= 0, 0 < top_p <= 1 and max_new_tokens >= 1, got "
                                    f"{self.temperature}, {self.top_p}, {self.max_new_tokens}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise EvalSettingsError(f"{where}: max_prompts must be >= 1 or null, got {self.max_prompts}")

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of pass@k and maj@k, ascending: `pass_k`, or the powers of two below n and n itself."""
        if self.pass_k:
            return tuple(sorted(set(self.pass_k)))
        return tuple(sorted({2 ** i for i in range(self.n.bit_length()) if 2 ** i < self.n} | {self.n}))

    def reward(self) -> Callable[[str, dict], tuple[float, bool]]:
        """The reward function `reward_fn` names (imported now: a bad name fails before any generation)."""
        return _callable(self.reward_fn, "reward function", self.name)

    def answer_extractor(self) -> AnswerFn | None:
        """The answer extractor `answer_fn` names, or None (no maj@k)."""
        return None if self.answer_fn is None else _callable(self.answer_fn, "answer function", self.name)

    def environment(self) -> type[Environment] | None:
        """The environment class `agentic.environment` names (imported now), or None for single completions."""
        if self.agentic is None:
            return None
        try:
            return load_environment(self.agentic.environment)
        except ValueError as error:
            raise EvalSettingsError(f"dataset {self.name!r}: {error}") from error


def _callable(path: str, kind: str, dataset: str) -> Callable:
    try:
        fn = import_attribute(path, kind, "package.module:function")
    except ValueError as error:
        raise EvalSettingsError(f"dataset {dataset!r}: {error}") from error
    if not callable(fn):
        raise EvalSettingsError(f"dataset {dataset!r}: {kind} {path!r} is not callable")
    return fn


def load_eval_datasets(path: str | Path) -> list[EvalDataset]:
    """The datasets of the YAML list at `path` (relative dataset paths are relative to the file), validated;
    their reward and answer functions import."""
    path = Path(path)
    try:
        entries = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise EvalSettingsError(f"{path}: cannot read the dataset list ({error})") from error
    if not isinstance(entries, list) or not entries:
        raise EvalSettingsError(f"{path}: expected a non-empty YAML list of datasets, got {type(entries).__name__}")
    datasets = [_dataset(entry, i, path) for i, entry in enumerate(entries)]
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        raise EvalSettingsError(f"{path}: dataset names must be unique, got {names}")
    for dataset in datasets:
        dataset.reward(), dataset.answer_extractor(), dataset.environment()
    return datasets


def validation_datasets(path: str | Path, primary: str | None) -> tuple[list[EvalDataset], int]:
    """The training config's eval.datasets list and the index of eval.primary in it (None: 0, the first)."""
    datasets = load_eval_datasets(path)
    names = [d.name for d in datasets]
    if primary is not None and primary not in names:
        raise EvalSettingsError(f"eval.primary {primary!r} is not a dataset of {path}: {names}")
    return datasets, names.index(primary) if primary is not None else 0


def _dataset(entry: Any, index: int, source: Path) -> EvalDataset:
    where = f"{source} entry {index}"
    if not isinstance(entry, dict):
        raise EvalSettingsError(f"{where}: expected a mapping of dataset settings, got {entry!r}")
    known = {f.name: f for f in dataclasses.fields(EvalDataset)}
    unknown = sorted(set(entry) - set(known))
    if unknown:
        raise EvalSettingsError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    missing = [name for name in ("name", "path") if name not in entry]
    if missing:
        raise EvalSettingsError(f"{where}: missing {missing}")
    values = dict(entry)  # pass_k a tuple, path relative to the list's file
    values["path"] = str((source.parent / str(values["path"])).resolve())
    values["pass_k"] = tuple(values.get("pass_k") or ())
    if values.get("agentic") is not None:
        values["agentic"] = _agentic(values["agentic"], where)
    hints = typing.get_type_hints(EvalDataset)
    for name, value in values.items():
        if name != "agentic" and not _has_type(value, hints[name]):
            raise EvalSettingsError(f"{where}: {name} must be {known[name].type}, got {value!r}")
    if not Path(values["path"]).is_file():
        raise EvalSettingsError(f"{where}: dataset file {values['path']} does not exist")
    return EvalDataset(**values)


def _agentic(value: Any, where: str) -> AgenticConfig:
    """An entry's `agentic` mapping as rollout.agentic's section (its keys, types and checks), its environment set and
    its chat template file there."""
    if not isinstance(value, dict):
        raise EvalSettingsError(f"{where}: agentic must be a mapping of rollout.agentic's settings, got {value!r}")
    hints = typing.get_type_hints(AgenticConfig)
    unknown = sorted(set(value) - {f.name for f in dataclasses.fields(AgenticConfig)})
    if unknown:
        raise EvalSettingsError(f"{where}: unknown agentic keys {unknown}; known: those of rollout.agentic "
                                f"(docs/config.md)")
    try:
        settings = AgenticConfig(**{name: coerce(v, hints[name], f"agentic.{name}") for name, v in value.items()})
    except ValueError as error:
        raise EvalSettingsError(f"{where}: {error}") from error
    if settings.environment is None:
        raise EvalSettingsError(f"{where}: agentic needs an environment (package.module:Class or "
                                f"path/to/file.py:Class; a rollout_fn is for training only)")
    if settings.chat_template is not None and not Path(settings.chat_template).is_file():
        raise EvalSettingsError(f"{where}: agentic.chat_template {settings.chat_template} does not exist (a relative "
                                f"path is taken from the working directory {Path.cwd()})")
    return settings


def _has_type(value: Any, annotation: Any) -> bool:
    """Whether a YAML `value` fits a field's `annotation` (an int is a float; a bool is no int)."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if value is None:
        return type(None) in options
    if typing.get_origin(annotation) is tuple:
        return isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if isinstance(value, bool):
        return bool in options
    return any(isinstance(value, (int, float) if o is float else o) for o in options if o in (int, float, str))
