"""A new algorithm needs no change to the package: plain REINFORCE with a group-mean baseline, registered from
this module with a config section of its own (one setting, read from YAML and from the command line), runs two
training steps through `armor train`'s code path (`run_training`)."""

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from megatron_armor.algorithms import Algorithm, LossInputs, register_algorithm, unregister_algorithm
from megatron_armor.cli import build_parser, main, overrides_from_args
from megatron_armor.config import ConfigError, load_config
from megatron_armor.config.base import doc, require
from megatron_armor.config.section_registry import registered_sections, unregister_section
from megatron_armor.trainer.run.train import run_training

CONFIG = Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml"


@dataclass
class ReinforceSettings:
    """test_reinforce's own config section."""

    advantage_scale: float = doc(1.0, "factor on the group advantages in test_reinforce's loss")

    def __post_init__(self) -> None:
        require(self.advantage_scale > 0, f"test_reinforce.advantage_scale must be > 0, got {self.advantage_scale}")


class GroupMeanReinforce(Algorithm):
    """REINFORCE: loss = -s * A_i * log pi_theta(y_it) summed over response tokens, A_i = R_i - mean of the group's
    rewards (the trainer's group advantages, normalised by the group's std as GRPO's), s its own setting
    test_reinforce.advantage_scale. No ratio, no clip."""

    name = "test_reinforce"
    config_sections = {"test_reinforce": ReinforceSettings}

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.advantage_scale = cfg.test_reinforce.advantage_scale

    def ppo_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = self.aggregate(-self.advantage_scale * inputs.advantages * inputs.logprobs, inputs)
        return loss, {"logprob_mean": (inputs.logprobs.detach() * inputs.response_mask).sum()
                      / inputs.response_mask.sum().clamp(min=1),
                      "advantage_scale": torch.tensor(self.advantage_scale)}


RUN = ["--tp", "1", "--max-steps", "2", "--task.num_train_rows", "400", "--task.num_val_rows", "16",
       "--eval.every", "0", "--eval.before_train", "false", "--checkpoint.every", "2", "--logging.tensorboard", "false",
       "--logging.plot", "false", "--logging.progress_bar", "false"]


@pytest.fixture
def reinforce_config(tmp_path) -> Path:
    """The demo's config run by test_reinforce, its own section's setting 2.0 in the YAML."""
    data = yaml.safe_load(CONFIG.read_text())
    data["algorithm"]["name"] = "test_reinforce"
    path = tmp_path / "reinforce.yaml"
    path.write_text(yaml.safe_dump({**data, "test_reinforce": {"advantage_scale": 2.0}}))
    return path


def test_a_plugin_named_by_path_brings_its_section_to_the_command_line_the_loader_and_pickles(reinforce_config,
                                                                                              capsys):
    """`armor train --algo module:Class` registers the plug-in's section before parsing (--help lists its setting),
    `load_config` does when the config names it by path, and so does unpickling a config (a Ray rank that never
    imported the plug-in); without it the section is unknown."""
    plugin = f"{__name__}:GroupMeanReinforce"
    assert "test_reinforce" not in registered_sections()
    try:
        with pytest.raises(SystemExit) as done:
            main(["train", "--algo", plugin, "--help"])
        assert done.value.code == 0 and "--test_reinforce.advantage_scale" in capsys.readouterr().out
        unregister_section("test_reinforce")
        cfg = load_config(reinforce_config, [f"algorithm.name={plugin}"])
        assert cfg.test_reinforce.advantage_scale == 2.0
        unregister_section("test_reinforce")
        assert pickle.loads(pickle.dumps(cfg)) == cfg
    finally:
        unregister_section("test_reinforce")
    with pytest.raises(ConfigError, match="unknown config section 'test_reinforce'"):
        load_config(reinforce_config)


def test_an_algorithm_registered_here_trains_two_steps_with_its_own_setting(reinforce_config, synthetic_cache,
                                                                             tmp_path):
    register_algorithm(GroupMeanReinforce)
    try:
        assert load_config(reinforce_config).test_reinforce.advantage_scale == 2.0  # from the YAML
        with pytest.raises(ConfigError, match="unknown config field 'test_reinforce.advantage_scal'; did you mean "
                                              "'test_reinforce.advantage_scale'"):
            load_config(reinforce_config, ["test_reinforce.advantage_scal=1"])
        with pytest.raises(ConfigError, match="test_reinforce.advantage_scale must be > 0, got -1.0"):
            load_config(reinforce_config, ["test_reinforce.advantage_scale=-1"])
        args = build_parser().parse_args(["train", "--config", str(reinforce_config), *RUN,
                                          "--test_reinforce.advantage_scale", "0.5", "--run-dir", str(tmp_path / "run"),
                                          "--task.cache_dir", str(synthetic_cache)])
        cfg = load_config(args.config, overrides_from_args(args))
        assert cfg.test_reinforce.advantage_scale == 0.5  # the command line over the YAML
        assert run_training(cfg) == 0
    finally:
        unregister_algorithm("test_reinforce")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["armor/anchors_used"] == 0 and row["filter/prompts_kept"] > 0  # no anchors: it asked for none
        assert row["optim/grad_norm"] > 0 and row["train/update_skipped"] == 0
        assert -20 < row["loss/logprob_mean"] < 0  # its own statistic, a token mean of log-probabilities
        assert row["loss/advantage_scale"] == 0.5  # its own setting, as the command line set it, in the loss
        assert "loss/clip_fraction" not in row and "mix_kl/kl_on_ref" not in row  # no PPO terms, no reference
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "COMPLETE").is_file()
