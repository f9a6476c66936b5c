"""Per-trajectory concurrency against a turn-synchronous loop: trajectories per second of multi-turn rollouts whose
every turn calls a tool of injected latency, on the in-process engine.

Each row asks for 1..--max-turns tool turns (drawn once, the same rows in every run). After each policy turn the
environment calls a `lookup` tool that sleeps an exponentially distributed time of mean --latency-ms (drawn per row
and turn, the same in every run), then answers with its result; after the row's turns it ends the episode. The policy
is a tiny random Qwen2 on the in-process LocalEngine (agentic/generate.py's EngineGenerator: the turns that wait
together go as one batch), sampling at most --max-new-tokens per turn, a turn ending at any of --stop-ids ids (a random
model rarely writes the template's end-of-turn token; a wide stop set gives turns of a few tokens and a few turns cut
at the limit, which end their trajectory).

Two runs per latency, over the same rows:
  per-trajectory   agentic/driver.py as it is: one task per trajectory, each generating again as soon as its own
                   tool returned;
  turn-synchronous every trajectory waits at each turn until all those still running have their tool results (a
                   barrier after the tool call), so each turn lasts as long as its slowest tool call: what a batch loop
                   of generate-all, call-all-tools, repeat does.
Printed per run: trajectories/s, the mean seconds per trajectory spent awaiting the engine and the environment
(agent/generation_s_mean, agent/tool_s_mean), mean turns, and per latency the ratio of the two throughputs.

Then two per-trajectory runs over the rows of the first latency with every turn seeded on its own (a seed per
trajectory, `driver.TurnSeeds`, as the trainer rolls out):
  seeded, batched  the turns waiting together go as one engine call with a seed per prompt (EngineGenerator);
  seeded, 1 a call one engine call per turn (max_batch 1: what the seeded turns cost before they batched);
and the ratio of their throughputs.

    python benchmarks/bench_agentic.py --trajectories 32 --latency-ms 50 500
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import tempfile
import time

from megatron_armor.agentic.chat_templates import make_chat_tokenizer
from megatron_armor.agentic.driver import RolloutContext, environment_rollout, run_rollouts
from megatron_armor.agentic.environment import EnvReply, Environment
from megatron_armor.agentic.generate import EngineGenerator
from megatron_armor.agentic.metrics import agent_metrics
from megatron_armor.config import AgenticConfig
from megatron_armor.models.tiny import make_tiny_checkpoint
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine


class Lockstep:
    """A barrier whose parties are the trajectories still running: `wait` returns once every running one waits."""

    def __init__(self, parties: int) -> None:
        self.parties, self.waiting = parties, 0
        self._released = asyncio.Event()

    async def wait(self) -> None:
        self.waiting += 1
        released = self._released
        self._release_if_all()
        await released.wait()

    def leave(self) -> None:
        self.parties -= 1
        self._release_if_all()

    def _release_if_all(self) -> None:
        if self.waiting and self.waiting >= self.parties:
            self._released.set()
            self._released, self.waiting = asyncio.Event(), 0


class LookupEnv(Environment):
    """Calls the slow `lookup` tool after every policy turn, for the row's number of turns (module docstring)."""

    lockstep: Lockstep | None = None  # set: turn-synchronous

    def reset(self, row):
        self.latencies = list(row["latencies"])
        return [{"role": "user", "content": f"Look up {row['key']}, one step at a time."}]

    async def step(self, messages):
        if not self.latencies:
            return EnvReply(done=True)
        await asyncio.sleep(self.latencies.pop(0))  # the tool's latency
        if self.lockstep is not None:
            await self.lockstep.wait()
        return EnvReply([{"role": "tool", "content": "found"}], tool_calls=1)

    def score(self, messages):
        return 0.0

    def close(self):
        if self.lockstep is not None:
            self.lockstep.leave()


def rows(n: int, max_turns: int, latency_s: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"key": f"k{i}", "latencies": [rng.expovariate(1 / latency_s) for _ in range(rng.randint(1, max_turns))]}
            for i in range(n)]


def run(ctx: RolloutContext, batch: list[dict], synchronous: bool,
        seeds: list[int] | None = None) -> tuple[float, dict[str, float]]:
    """(seconds, agent metrics) of rolling out `batch`, turn-synchronous or not, with `seeds` each turn seeded."""

    async def go():
        LookupEnv.lockstep = Lockstep(len(batch)) if synchronous else None
        return await run_rollouts(ctx, environment_rollout(LookupEnv), batch, max_in_flight=len(batch), seeds=seeds)

    start = time.perf_counter()
    trajectories = asyncio.run(go())
    return time.perf_counter() - start, agent_metrics(trajectories)


def report(latency_ms: float, mode: str, throughput: float, metrics: dict[str, float]) -> None:
    """One run's row of the table."""
    print(f"{latency_ms:>6.0f}ms {mode:>17} {throughput:>7.2f} {metrics['agent/generation_s_mean']:>6.2f} "
          f"{metrics['agent/tool_s_mean']:>6.2f} {metrics['agent/turns_mean']:>5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--max-turns", type=int, default=5)
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[50.0, 500.0])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--stop-ids", type=int, default=64, help="the last N token ids of the tokenizer end a turn")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokenizer = make_chat_tokenizer("chatml")
    with tempfile.TemporaryDirectory() as checkpoint:
        engine = LocalEngine(make_tiny_checkpoint(checkpoint, vocab_size=384))
    stops = tuple(range(len(tokenizer) - args.stop_ids, len(tokenizer))) + (tokenizer.convert_tokens_to_ids(
        "<|im_end|>"),)
    generator = EngineGenerator(engine, workers=1)
    ctx = RolloutContext(generator, tokenizer, SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=stops),
                         AgenticConfig(max_turns=args.max_turns + 1))
    print(f"{'latency':>8} {'mode':>17} {'traj/s':>7} {'gen s':>6} {'tool s':>6} {'turns':>5}")
    for latency_ms in args.latency_ms:
        batch = rows(args.trajectories, args.max_turns, latency_ms / 1000, args.seed)
        throughput = {}
        for mode, synchronous in (("per-trajectory", False), ("turn-synchronous", True)):
            seconds, metrics = run(ctx, batch, synchronous)
            throughput[mode] = len(batch) / seconds
            report(latency_ms, mode, throughput[mode], metrics)
        print(f"{latency_ms:>6.0f}ms per-trajectory / turn-synchronous: "
              f"{throughput['per-trajectory'] / throughput['turn-synchronous']:.2f}x")
    generator.close()
    latency_ms = args.latency_ms[0]
    batch = rows(args.trajectories, args.max_turns, latency_ms / 1000, args.seed)
    throughput = {}
    for mode, max_batch in (("seeded, batched", 256), ("seeded, 1 a call", 1)):
        generator = EngineGenerator(engine, workers=1, max_batch=max_batch)
        seconds, metrics = run(dataclasses.replace(ctx, generator=generator), batch, False, list(range(len(batch))))
        generator.close()
        throughput[mode] = len(batch) / seconds
        report(latency_ms, mode, throughput[mode], metrics)
    print(f"{latency_ms:>6.0f}ms seeded turns batched / one call per turn: "
          f"{throughput['seeded, batched'] / throughput['seeded, 1 a call']:.2f}x")


if __name__ == "__main__":
    main()
