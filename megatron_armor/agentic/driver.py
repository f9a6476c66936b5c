"""Multi-turn rollouts: the rollout-function API, the environment loop built on it, and one asyncio task per
trajectory under a cap on those in flight.

A rollout function is `async def rollout(ctx: RolloutContext, row: dict) -> Trajectory`: it samples with
`ctx.generate(token_ids)`, builds its trajectory with a `TrajectoryBuilder` and scores it (users who write their own
loop start here; a config names one as rollout.agentic.rollout_fn, `load_rollout`). `environment_rollout(make_env)` is
the rollout function of an `Environment`: render the first messages, then per turn sample, let the environment answer,
append the template's delta, until the environment ends the episode or a limit (`RolloutContext.limits`) does. Whatever
a trajectory's environment, tools or rollout function raise, the trajectory ends `failed`, its error logged once with
its row, and the other trajectories go on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from megatron_armor.agentic.environment import Environment, MalformedMessages, Message, check_messages, load_environment
from megatron_armor.agentic.generate import GenerateResult, Generator
from megatron_armor.agentic.render import ChatRenderer
from megatron_armor.agentic.tools import WORKER_THREADS, ToolError, in_thread
from megatron_armor.agentic.trajectory import Status, Trajectory, TrajectoryBuilder, TrajectoryStats, TurnCheck
from megatron_armor.config import AgenticConfig
from megatron_armor.config.plugins import import_attribute
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.utils.seeding import stable_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutContext:
    """What a rollout function gets: `generate` on the policy's engine, the tokenizer (with its chat template), the
    turn's sampling settings (stop tokens: those that end an assistant turn) and the limits: the `rollout.agentic`
    section, whose max_turns, max_total_tokens, max_invalid_turns and on_drift the driver reads (a loop of one's own
    builds one by hand, e.g. `AgenticConfig(max_turns=6)`)."""

    generator: Generator
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingParams
    limits: AgenticConfig = field(default_factory=AgenticConfig)

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams | None = None) -> GenerateResult:
        return await self.generator.generate(token_ids, sampling or self.sampling)


RolloutFunction = Callable[[RolloutContext, dict], Awaitable[Trajectory]]


def load_rollout(settings: AgenticConfig) -> RolloutFunction:
    """The rollout function `settings` (a rollout.agentic section that `rolls_out`) names, imported now: that of
    its environment class (`environment_rollout`), or its rollout_fn, an async function of (ctx, row)."""
    if settings.environment is not None:
        return environment_rollout(load_environment(settings.environment))
    fn = import_attribute(settings.rollout_fn, "rollout function", "package.module:function")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout function {settings.rollout_fn!r} is {fn!r}, not an async function: write "
                         "`async def rollout(ctx: RolloutContext, row: dict) -> Trajectory`")
    return fn


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`: awaited on the loop when a coroutine function, else run in a worker thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await in_thread(fn, *args)


@dataclass
class _Episode:
    """The state of one environment trajectory while it runs."""

    row: dict
    stats: TrajectoryStats
    messages: list[Message]
    turn_rewards: list[float]
    builder: TrajectoryBuilder | None = None

    def trajectory(self, status: Status, reward: float, error: str | None = None) -> Trajectory:
        builder = self.builder
        return Trajectory(self.row, builder.trained_segments() if builder else [], status, reward, self.turn_rewards,
                          self.messages, self.stats, builder.final_render_matches if builder else None, error)


def environment_rollout(make_env: Callable[[], Environment]) -> RolloutFunction:
    """The rollout function of the environments `make_env` makes (one per trajectory; agentic/environment.py)."""

    async def rollout(ctx: RolloutContext, row: dict) -> Trajectory:
        env = make_env()
        episode = _Episode(row, TrajectoryStats(), [], [])
        try:
            renderer = ChatRenderer(ctx.tokenizer, ctx.sampling.stop_token_ids, env.tools)
            status, error = await _play(ctx, env, renderer, episode)
            episode.builder.finish(renderer.ids(episode.messages, generation_prompt=False))
            reward = float(await _call(env.score, episode.messages))
            return episode.trajectory(status, reward, error)
        except Exception as error:
            if isinstance(error, ToolError):
                episode.stats.tool_calls += error.calls
                episode.stats.tool_errors += 1
            return episode.trajectory(Status.FAILED, 0.0, _log_failure(row, error))
        finally:
            await _call(env.close)

    return rollout


async def _play(ctx: RolloutContext, env: Environment, renderer: ChatRenderer,
                episode: _Episode) -> tuple[Status, str | None]:
    """Run the episode's turns; how it ended (and why, when aborted)."""
    limits, stats, messages = ctx.limits, episode.stats, episode.messages
    messages += check_messages(await _call(env.reset, episode.row), f"{type(env).__name__}.reset")
    builder = episode.builder = TrajectoryBuilder(renderer.ids(messages, generation_prompt=True), limits.on_drift)
    invalid_in_a_row = 0
    while True:
        budget = limits.max_total_tokens - builder.total_tokens
        if budget <= 0:
            return Status.TRUNCATED, None
        start = time.perf_counter()
        sampled = await ctx.generate(builder.prompt, replace(ctx.sampling, max_new_tokens=min(
            ctx.sampling.max_new_tokens, budget)))
        stats.generation_s += time.perf_counter() - start
        builder.add_sampled(sampled.token_ids, sampled.logprobs, sampled.versions)
        stats.turns += 1
        messages.append(renderer.assistant_message(sampled.token_ids))
        if sampled.finish_reason != "stop":  # "length": a turn or the token budget ran out; "abort": interrupted
            return (Status.ABORTED, "the engine interrupted the turn") if sampled.finish_reason == "abort" else (
                Status.TRUNCATED, None)
        start = time.perf_counter()
        reply = await _call(env.step, messages)
        stats.tool_s += time.perf_counter() - start
        new = check_messages(reply.messages, f"{type(env).__name__}.step")
        stats.tool_calls += reply.tool_calls
        stats.tool_errors += reply.tool_errors
        if reply.reward is not None:
            episode.turn_rewards.append(float(reply.reward))
        if reply.done:
            return Status.COMPLETED, None
        invalid_in_a_row = invalid_in_a_row + 1 if reply.invalid else 0
        if invalid_in_a_row >= limits.max_invalid_turns:
            return Status.ABORTED, f"{invalid_in_a_row} invalid turns in a row"
        if stats.turns >= limits.max_turns:
            return Status.TRUNCATED, None
        messages += new
        check = builder.add_context(renderer.continuation(sampled.token_ids, new),
                                    renderer.ids(messages, generation_prompt=True))
        stats.drift_turns += check in (TurnCheck.DRIFT, TurnCheck.FORK)


def _log_failure(row: dict, error: Exception) -> str:
    """Log a failed trajectory once (a traceback unless the error is a known kind with a full message); its error."""
    message = f"{type(error).__name__}: {error}"
    known = isinstance(error, (ToolError, MalformedMessages))
    trace = "" if known else "\n" + "".join(traceback.format_exception(error)).rstrip()
    logger.error("agentic: trajectory failed on row %.300r: %s%s", row, message, trace)
    return message


class TurnSeeds:
    """A `Generator` that samples its k-th call (k = 1, 2, ...) with seed `stable_seed(seed, k)`: a trajectory's
    turns then depend on its own seed only, not on which other trajectories' turns share an engine batch."""

    def __init__(self, generator: Generator, seed: int) -> None:
        self.generator, self.seed, self.calls = generator, seed, 0

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> GenerateResult:
        self.calls += 1
        return await self.generator.generate(token_ids, replace(sampling, seed=stable_seed(self.seed, self.calls)))


async def run_rollouts(ctx: RolloutContext, rollout: RolloutFunction, rows: Sequence[dict],
                       max_in_flight: int = 64, seeds: Sequence[int] | None = None) -> list[Trajectory]:
    """One task per row running `rollout`, at most `max_in_flight` at once; trajectories in the order of `rows`.
    With `seeds` (one per row) row i's trajectory samples its turns seeded from `seeds[i]` (`TurnSeeds`), so it is
    reproducible whatever runs beside it (turns batched together keep their own seeds: `EngineGenerator`).
    A rollout function that raises (or returns no `Trajectory`) gives a `failed` trajectory without segments.
    Synchronous environment methods and plain-function tools run meanwhile on a pool of `max_in_flight` threads
    (`tools.WORKER_THREADS`), so every trajectory in flight may wait on one; the pool is shut down on return without
    waiting for a call past its time-out."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if seeds is not None and len(seeds) != len(rows):
        raise ValueError(f"{len(seeds)} seeds for {len(rows)} rows")
    admission = asyncio.Semaphore(max_in_flight)
    threads = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="agentic-worker")
    token = WORKER_THREADS.set(threads)  # the tasks below copy this context

    async def one(row: dict, seed: int | None) -> Trajectory:
        async with admission:
            try:
                trajectory = await rollout(
                    ctx if seed is None else replace(ctx, generator=TurnSeeds(ctx.generator, seed)), row)
                if not isinstance(trajectory, Trajectory):
                    raise TypeError(f"the rollout function returned {type(trajectory).__name__}, not a Trajectory")
                return trajectory
            except Exception as error:
                return Trajectory(row, [], Status.FAILED, 0.0, [], [], TrajectoryStats(),
                                  error=_log_failure(row, error))

    try:
        row_seeds = [None] * len(rows) if seeds is None else seeds
        return list(await asyncio.gather(*(one(row, seed) for row, seed in zip(rows, row_seeds))))
    finally:
        WORKER_THREADS.reset(token)
        threads.shutdown(wait=False)
