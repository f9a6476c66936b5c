"""`PausableEngine`: generations that a weight push interrupts and that go on under the new weights
(rollout.partial_rollouts).

`pause` interrupts the wrapped engine (`RolloutEngine.interrupt`: SGLang aborts the requests, the in-process engine
stops decoding) and returns once none of its calls runs, so the trainer can push weights; `generate` calls wait
until `resume(version)`. A generation the pause cut short is continued then: its prompt plus the tokens it has go
back to the engine as the prompt, with the tokens left of max_new_tokens, as slime's and AReaL's partial rollouts
do. Every token keeps the logprob the engine reported when it drew it and the weight version the engine held
(`Generation.versions`), so a response may mix versions: the behaviour policy of each token is known, which is all
the decoupled objective's importance weight needs (algorithm.behaviour_correction).

Without a pause, `generate` makes exactly the wrapped engine's call: same generations, same seeds.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from megatron_armor.rollout.base import EngineView, Generation, RolloutEngine, SamplingParams
from megatron_armor.utils.seeding import stable_seed


class PausableEngine(EngineView):
    """`engine` (the actor's) with `pause` / `resume` around weight pushes; its generations carry per-token
    versions: `version` is the weight version the engine holds (the trainer's count of kept updates)."""

    INTERRUPT_EVERY_S = 0.2  # `pause` repeats the interrupt this often (s) while a call still runs

    def __init__(self, engine: RolloutEngine, version: int = 0) -> None:
        super().__init__(engine)
        self.version = version
        self._cond = threading.Condition()
        self._paused = False
        self._calls = 0  # the wrapped engine's `generate` calls running

    def pause(self) -> None:
        """Interrupt the generations in flight and return once the engine runs none: its weights may change. Until
        `resume`, this wrapper's `generate` calls wait before they reach the engine, which itself serves others
        normally (validation, through the wrapped engine). The interrupt is repeated every `INTERRUPT_EVERY_S`
        while a call runs: an SGLang server ignores the abort of a request that has not reached it yet."""
        with self._cond:
            self._paused = True
        try:
            while True:
                self.engine.interrupt()  # not under the lock: a call that returns takes it to say so
                with self._cond:
                    if self._cond.wait_for(lambda: self._calls == 0, timeout=self.INTERRUPT_EVERY_S):
                        return
        finally:
            self.engine.end_interrupt()

    def resume(self, version: int) -> None:
        """The engine holds weight version `version`: let generations go on (an interrupted one continues)."""
        with self._cond:
            self.version = version
            self._paused = False
            self._cond.notify_all()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        """The engine's generations of `prompts`, each continued after every pause that cut it short until it stops
        or reaches `sampling.max_new_tokens`; `versions[j]` is the weight version that drew token j.

        The generations a pause cut short continue in one engine call per round, to the largest number of tokens
        any of them has left; each keeps only what its own budget allows (the rest is drawn and dropped: a batch's
        decode steps are its latency, its rows cost little more)."""
        out = [Generation(list(p), [], [], "abort", versions=[]) for p in prompts]
        pending, round_ = list(range(len(prompts))), 0
        while pending:
            budget = sampling.max_new_tokens - min(len(out[i].response_ids) for i in pending)
            call = sampling if round_ == 0 else dataclasses.replace(
                sampling, max_new_tokens=budget,
                seed=None if sampling.seed is None else stable_seed(sampling.seed, round_),
                seeds=None if sampling.seeds is None else tuple(stable_seed(sampling.seeds[i], round_) for i in pending))
            with self._cond:
                self._cond.wait_for(lambda: not self._paused)
                self._calls += 1
                version = self.version
            try:
                generations = self.engine.generate([out[i].prompt_ids + out[i].response_ids for i in pending], call)
            finally:
                with self._cond:
                    self._calls -= 1
                    self._cond.notify_all()
            for i, generation in zip(pending, generations, strict=True):
                out[i] = _extended(out[i], generation, version, sampling)
            pending = [i for i in pending if out[i].finish_reason == "abort"]
            round_ += 1
        return out


def _extended(head: Generation, tail: Generation, version: int, sampling: SamplingParams) -> Generation:
    """`head` (its prompt without the response so far) followed by `tail`, a continuation `version` drew, cut to
    `sampling.max_new_tokens` in all. An interrupted one that reached the limit or a stop token is finished."""
    if tail.routed_experts is not None:
        raise ValueError("partial rollouts do not carry routed experts across a continuation (rollout.partial_rollouts "
                         "refuses train.routing_replay rollout)")
    room = sampling.max_new_tokens - len(head.response_ids)
    ids, logprobs = tail.response_ids[:room], tail.logprobs[:room]
    finish = tail.finish_reason if len(tail.response_ids) <= room else "length"
    if finish == "abort" and ids and ids[-1] in sampling.stop_token_ids:
        finish = "stop"  # the interrupt raced the stop token
    elif finish == "abort" and len(ids) == room:
        finish = "length"
    return Generation(
        prompt_ids=head.prompt_ids, response_ids=head.response_ids + ids, logprobs=head.logprobs + logprobs,
        finish_reason=finish, versions=[*head.versions, *[version] * len(ids)],
    )
