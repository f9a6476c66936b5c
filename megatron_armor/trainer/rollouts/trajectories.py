"""Multi-turn rollouts as the trainer's samples: a `SampleScorer` whose response to a prompt is a trajectory of the
run's environment or rollout function (rollout.agentic, docs/guides/agentic.md), sampled by the agentic layer
(megatron_armor/agentic/).

Every sample the rollout phase asks for goes through it: the policy's training responses and ARMOR's anchors (the
reference's engine, the same environment or function). A trajectory becomes one `Sample` per segment
(agentic/trajectory.py): one when its drift is kept token-exact (rollout.agentic.on_drift keep), one per fork with
on_drift fork (a template that strips earlier reasoning forks at every turn after one that reasoned). A segment's tokens
before its first sampled one are the sample's prompt, the rest its response, with `loss_mask` 1 exactly on the tokens
the policy sampled (its stop tokens included) and the engine's logprobs there (0.0 elsewhere); with partial rollouts
(the actor's engine a `PausableEngine`: a weight push interrupts a turn, which goes on under the new weights) also the
weight version of each response token (`Sample.token_versions`: a context token has that of the sampled token before
it). Every segment carries the trajectory's reward (its environment's score, or the one its rollout function gave); it
is correct (ARMOR's anchors, group filtering) when that is > 0. Its segments count as one trajectory in the group
statistics (`Sample.trajectory`, numbered by `generate_samples`; algorithms/groups.py). Its status decides what it
becomes (rollout.agentic.on_<status>): trained as it is, trained with reward 0, or rolled out again (as is a trajectory
that sampled nothing) at most `max_resamples` times, after which the last one is trained with reward 0 (one without
sampled tokens: a sample with the dataset prompt and an empty response, which trains nothing).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from transformers import PreTrainedTokenizerBase

from megatron_armor.agentic.driver import RolloutContext, RolloutFunction, load_rollout, run_rollouts
from megatron_armor.agentic.generate import EngineGenerator
from megatron_armor.agentic.metrics import AgentCounts
from megatron_armor.agentic.trajectory import Trajectory
from megatron_armor.config import AgenticConfig
from megatron_armor.config.builders import builds
from megatron_armor.data.datasets import PromptRow
from megatron_armor.data.types import Sample
from megatron_armor.rewards.audit import AuditVerifiers
from megatron_armor.rollout.base import RolloutEngine, SamplingParams
from megatron_armor.trainer.rollouts.samples import SampleScorer
from megatron_armor.utils.seeding import stable_seed


class TrajectoryScorer(SampleScorer):
    """`respond` rolls out one trajectory per prompt with `rollout` (module docstring), which scores them (an
    environment's `score`, or a rollout function's own reward), so the run's reward function and overlong penalty do
    not apply (audits still judge the decoded response).

    tokenizer: the policy's, with the chat template the conversations are rendered with; stop_token_ids: what ends
    an assistant turn; in_process: the engine runs in this process (its turns are batched by one worker thread), else
    it is a client of servers (a request per turn, `max_in_flight` at once)."""

    rolls_out_trajectories: ClassVar[bool] = True
    # A seed per request, and per turn from it (`TurnSeeds`; batched turns keep theirs): the step's samples are then
    # the same at any number of ranks and in any layout.
    seeds_each_request: ClassVar[bool] = True

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, rollout: RolloutFunction, settings: AgenticConfig, *,
        stop_token_ids: tuple[int, ...], in_process: bool, audits: AuditVerifiers = AuditVerifiers(),
    ) -> None:
        super().__init__(tokenizer, reward_fn=None, audits=audits)
        self.rollout, self.settings = rollout, settings
        self.stop_token_ids, self.in_process = stop_token_ids, in_process

    @classmethod
    def load(cls, settings: AgenticConfig, tokenizer: PreTrainedTokenizerBase, *, in_process: bool,
             audits: AuditVerifiers = AuditVerifiers()) -> TrajectoryScorer:
        """The scorer of rollout.agentic (its environment or rollout_fn set), what the section names loaded: the
        rollout function (`agentic.driver.load_rollout`), the tokenizer copied with the chat template file when one is
        named, the end-of-turn token (else EOS) as the stop token (the section itself is kept whole, not copied)."""
        if settings.chat_template is not None:
            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.chat_template = Path(settings.chat_template).read_text()
        end = settings.end_of_turn or tokenizer.eos_token
        stop = tokenizer.convert_tokens_to_ids(end)
        if stop is None or stop == tokenizer.unk_token_id and end != tokenizer.unk_token:
            raise ValueError(f"rollout.agentic.end_of_turn {end!r} is not a token of the tokenizer")
        return cls(tokenizer, load_rollout(settings), settings, stop_token_ids=(stop,),
                   in_process=in_process, audits=audits)

    def respond(self, engine: RolloutEngine, prompts: Sequence[PromptRow], sampling: SamplingParams, *,
                is_anchor: bool, agent: AgentCounts | None = None) -> list[list[Sample]]:
        """A trajectory of each of `prompts` (their rows go to the rollout function) sampled by `engine`, as its
        samples (one per segment), in order; every trajectory rolled out (resampled ones too) is counted into
        `agent`."""
        return [answer for answer, _ in self.respond_with_trajectories(engine, prompts, sampling, is_anchor=is_anchor,
                                                                       agent=agent)]

    def respond_with_trajectories(self, engine: RolloutEngine, prompts: Sequence[PromptRow], sampling: SamplingParams,
                                  *, is_anchor: bool, agent: AgentCounts | None = None,
                                  ) -> list[tuple[list[Sample], Trajectory]]:
        """`respond`'s answers, each beside the trajectory it is made of (the last one rolled out for its prompt).

        `sampling` has a seed per prompt (`sampling.seeds`: `generate_samples` gives them, `seeds_each_request`, and
        so does evaluation); prompt i's k-th rollout is seeded from (sampling.seeds[i], k) and its turns from that
        (`agentic.driver.TurnSeeds`), so it depends on neither what runs beside it nor on which rank."""
        if sampling.seeds is None or len(sampling.seeds) != len(prompts):
            raise ValueError(f"trajectories are seeded per request: {len(prompts)} prompts need as many "
                             f"sampling.seeds, got {sampling.seeds}")
        trajectories: list[Trajectory | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        turn_sampling = dataclasses.replace(sampling, seed=None, seeds=None)
        for attempt in range(self.settings.max_resamples + 1):
            if not pending:
                break
            seeds = [stable_seed(sampling.seeds[i], attempt) for i in pending]
            for i, trajectory in zip(pending, self._roll_out(engine, [prompts[i].row for i in pending], turn_sampling,
                                                             seeds)):
                trajectories[i] = trajectory
            if agent is not None:
                agent.add(trajectories[i] for i in pending)
            pending = [i for i in pending if self._action(trajectories[i]) == "resample"]
        return [(self._samples(prompt, trajectory, is_anchor=is_anchor, zero_reward=i in pending), trajectory)
                for i, (prompt, trajectory) in enumerate(zip(prompts, trajectories))]

    def _roll_out(self, engine: RolloutEngine, rows: list[dict], sampling: SamplingParams,
                  seeds: list[int]) -> list[Trajectory]:
        workers = dict(workers=1) if self.in_process else dict(workers=self.settings.max_in_flight, max_batch=1)
        generator = EngineGenerator(engine, **workers)
        turn = dataclasses.replace(sampling, stop_token_ids=self.stop_token_ids, seeds=None)  # `seeds`: per turn
        ctx = RolloutContext(generator, self.tokenizer, turn, self.settings)
        try:
            return asyncio.run(run_rollouts(ctx, self.rollout, rows, self.settings.max_in_flight, seeds))
        finally:
            generator.close()

    def _action(self, trajectory: Trajectory) -> str:
        """What `trajectory` becomes (rollout.agentic.on_<status>); one that sampled nothing is rolled out again."""
        return self.settings.action(trajectory.status.value) if trajectory.segments else "resample"

    def _samples(self, prompt: PromptRow, trajectory: Trajectory, *, is_anchor: bool,
                 zero_reward: bool) -> list[Sample]:
        """`trajectory` as the samples of `prompt`, one per segment (module docstring); `zero_reward`: its resamples
        ran out."""
        if zero_reward or self._action(trajectory) == "zero_reward":
            reward = 0.0
        else:
            reward = trajectory.reward
        if not trajectory.segments:
            return [Sample(prompt.index, list(prompt.prompt_ids), [], [], "length", is_anchor, reward=0.0,
                           correct=False, loss_mask=[])]
        samples = []
        for segment in trajectory.segments:
            start = segment.prompt_length
            response = segment.token_ids[start:]
            samples.append(Sample(
                prompt_index=prompt.index, prompt_ids=segment.token_ids[:start], response_ids=response,
                engine_logprobs=segment.logprobs[start:],
                finish_reason="stop" if response[-1] in self.stop_token_ids else "length", is_anchor=is_anchor,
                reward=float(reward), correct=reward > 0, loss_mask=segment.loss_mask[start:],
                token_versions=segment.response_versions(),
            ))
        return samples


builds(AgenticConfig)(TrajectoryScorer.load)
