"""A new algorithm needs no change to the package: plain REINFORCE with a group-mean baseline, registered from
this module, runs two training steps through `armor train`'s code path (`run_training`)."""

import json
from pathlib import Path

import torch

from megatron_armor.algorithms import Algorithm, LossInputs, register_algorithm, unregister_algorithm
from megatron_armor.config import load_config
from megatron_armor.trainer.run.train import run_training

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


class GroupMeanReinforce(Algorithm):
    """REINFORCE: loss = -A_i * log pi_theta(y_it) summed over response tokens, A_i = R_i - mean of the group's
    rewards (the trainer's group advantages, normalised by the group's std as GRPO's). No ratio, no clip."""

    name = "test_reinforce"

    def ppo_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = self.aggregate(-inputs.advantages * inputs.logprobs, inputs)
        return loss, {"logprob_mean": (inputs.logprobs.detach() * inputs.response_mask).sum()
                      / inputs.response_mask.sum().clamp(min=1)}


def test_an_algorithm_registered_here_trains_two_steps(synthetic_cache, tmp_path):
    register_algorithm(GroupMeanReinforce)
    try:
        cfg = load_config(CONFIG, [
            "algorithm.name=test_reinforce", "rollout.sampling.actor_n=8", "parallel.tensor_parallel_size=1",
            f"task.cache_dir={synthetic_cache}", f"logging.run_dir={tmp_path / 'run'}", "train.max_steps=2",
            "task.num_train_rows=400", "task.num_val_rows=16", "eval.every=0", "eval.before_train=false",
            "checkpoint.every=2", "logging.tensorboard=false", "logging.plot=false", "logging.progress_bar=false",
        ])
        assert run_training(cfg) == 0
    finally:
        unregister_algorithm("test_reinforce")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["armor/anchors_used"] == 0 and row["armor/prompts_kept"] > 0  # no anchors: it asked for none
        assert row["optim/grad_norm"] > 0 and row["train/update_skipped"] == 0
        assert -20 < row["loss/logprob_mean"] < 0  # its own statistic, a token mean of log-probabilities
        assert "loss/clip_fraction" not in row and "mix_kl/kl_on_ref" not in row  # no PPO terms, no reference
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "COMPLETE").is_file()
