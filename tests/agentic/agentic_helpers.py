"""Shared by the agentic tests: scripted policies (`Generator`s that play given turns: the policy is the test's input
here; tests/agentic/test_engines.py samples from real engines) and a tool environment with an `add` tool."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from megatron_armor.agentic.driver import RolloutContext, environment_rollout, run_rollouts
from megatron_armor.agentic.generate import GenerateResult
from megatron_armor.agentic.tool_env import ToolEnv
from megatron_armor.agentic.tools import Tool
from megatron_armor.config import AgenticConfig
from megatron_armor.rollout.base import SamplingParams

ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class AddEnv(ToolEnv):
    def __init__(self) -> None:
        super().__init__([Tool(add, ADD_SCHEMA)])

    def reset(self, row):
        return [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": row["prompt"]}]

    def score(self, messages):
        return float("answer" in messages[-1]["content"])


class ScriptedPolicy:
    """Answers the k-th `generate` call with the k-th scripted turn (ids, finish reason) and random logprobs, cut to
    the call's max_new_tokens; records (prompt, sampled ids, logprobs) of every call."""

    def __init__(self, turns: Sequence[tuple[list[int], str]], seed: int = 0) -> None:
        self.turns = list(turns)
        self.calls: list[tuple[list[int], list[int], list[float]]] = []
        self._rng = random.Random(seed)

    async def generate(self, token_ids, sampling):
        ids, finish = self.turns[len(self.calls)]
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[:sampling.max_new_tokens], "length"
        logprobs = [-self._rng.random() * 5 for _ in ids]
        self.calls.append((list(token_ids), list(ids), logprobs))
        await asyncio.sleep(0)
        return GenerateResult(list(ids), logprobs, finish)


def play(policy, tokenizer, stop_id: int, make_env=AddEnv, rows=({"prompt": "What is 2+3?"},), limits=AgenticConfig(),
         max_in_flight: int = 1):
    ctx = RolloutContext(policy, tokenizer, SamplingParams(max_new_tokens=256, stop_token_ids=(stop_id,)), limits)
    return asyncio.run(run_rollouts(ctx, environment_rollout(make_env), list(rows), max_in_flight))


class PolicyByPrompt:
    """Concurrent trajectories' scripted policy: a call whose prompt decodes to text containing `marker` gets the next
    of `scripts[marker]` (turn texts, each ended by the stop token; the last repeats), cut to max_new_tokens."""

    def __init__(self, tokenizer, stop_id: int, scripts: dict[str, list[str]]) -> None:
        self.tokenizer, self.stop_id = tokenizer, stop_id
        self.scripts = {marker: list(turns) for marker, turns in scripts.items()}
        self.calls = 0

    async def generate(self, token_ids, sampling):
        text = self.tokenizer.decode(list(token_ids))
        (marker,) = [m for m in self.scripts if m in text]
        turns = self.scripts[marker]
        reply = turns.pop(0) if len(turns) > 1 else turns[0]
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.stop_id]
        finish = "stop" if len(ids) <= sampling.max_new_tokens else "length"
        ids = ids[:sampling.max_new_tokens]
        self.calls += 1
        await asyncio.sleep(0)
        return GenerateResult(ids, [-1.0] * len(ids), finish)
