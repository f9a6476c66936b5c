"""Algorithm objects for tests, built as a run builds them: from a config of the synthetic task; and test
algorithms that inject faults (importable by worker processes as `algorithm_factory:ClassName`)."""

import torch
import torch.distributed as dist

from megatron_armor.algorithms import Algorithm, LossInputs, algorithm_class, build_algorithm
from megatron_armor.config import SamplingConfig, load_config


def make_algorithm(name: str, *overrides: str) -> Algorithm:
    """The registered algorithm `name` with `overrides` (`section.field=value`); algorithms without anchors get
    rollout.sampling.actor_n = n_samples (16), and the synthetic task's warm start is OPD's teacher."""
    anchored = algorithm_class(name).on_policy_samples(SamplingConfig(n_samples=16)) < 16  # a place is the anchor's
    group = [] if anchored else ["rollout.sampling.actor_n=16"]
    base = ["task.synthetic=arithmetic", "task.warm_start.steps=10", f"algorithm.name={name}", *group]
    return build_algorithm(load_config(None, [*base, *overrides]))


class NanAdvantagesOnChosenSteps(Algorithm):
    """REINFORCE (loss = -A_i * log pi_theta(y_it)) whose per-token advantages are NaN on the second half of the
    rank's rows (with two mini-batches: the second one), on the RL steps (0-based) in `bad_steps` and the global
    ranks in `bad_ranks` (None: every rank)."""

    name = "test_nan_advantages"
    bad_steps: frozenset[int] = frozenset()
    bad_ranks: frozenset[int] | None = None

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.scored_steps = 0  # token_advantages is asked once per RL step that trains

    def ppo_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.aggregate(-inputs.advantages * inputs.logprobs, inputs), {}

    def token_advantages(self, old_logprobs, teacher_logprobs, response_mask, sequence_advantages, generator):
        step, self.scored_steps = self.scored_steps, self.scored_steps + 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if step not in self.bad_steps or (self.bad_ranks is not None and rank not in self.bad_ranks):
            return None
        advantages = sequence_advantages[:, None].expand_as(response_mask).clone()  # [B, S] float32
        advantages[advantages.shape[0] // 2:] = float("nan")  # mini-batch 1 of 2 equal ones (or half of 1)
        return advantages


class NanOnRankOneAtStepTwo(NanAdvantagesOnChosenSteps):
    """NaN advantages in mini-batch 1 of RL step 2 (1-based) on global rank 1 only."""

    name = "test_nan_on_rank_one"
    bad_steps = frozenset({1})
    bad_ranks = frozenset({1})
