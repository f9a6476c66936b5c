"""Config loading: YAML + overrides, typed coercion, validation messages, and the CLI surface."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_armor.cli import build_parser, overrides_from_args
from megatron_armor.config import ConfigError, config_fields, load_config

DEMO = Path(__file__).parents[1] / "examples" / "tiny" / "armor.yaml"


def test_demo_config_loads_with_typed_overrides():
    cfg = load_config(DEMO, ["train.lr=1e-4", "algorithm.name=armor", "eval.max_prompts=null", "logging.plot=off"])
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.rollout.actor_n == 7
    assert cfg.train.lr == 1e-4 and cfg.eval.max_prompts is None and cfg.logging.plot is False


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.lr=fast"], "train.lr: expected float, got 'fast'"),
        (["train.max_steps=2.5"], "train.max_steps: expected int"),
        (["algorithm.name=ppo"], "algorithm.name: 'ppo' is not allowed; choose one of \\['armor', 'grpo', 'grpo_kl', 'mipu', 'opd'\\]"),
        (["train.lrr=1"], "unknown config field 'train.lrr'; did you mean 'train.lr'"),
        (["trian.lr=1"], "unknown config section 'trian'; did you mean 'train'"),
        (["algorithm.alpha=0"], "algorithm.alpha must be in \\(0, 1\\], got 0.0"),
        (["rollout.actor_n=8"], "rollout.actor_n must be rollout.n_samples - 1 = 7 for armor"),
        (["train.mini_batch_size=3"], "train.mini_batch_size \\(3\\) must divide train.train_batch_size \\(8\\)"),
        (["rollout.top_p=1.5"], "rollout.top_p must be in \\(0, 1\\], got 1.5"),
        (["logging.plot=maybe"], "logging.plot: expected a boolean"),
        (["train.lr"], "must look like section.field=value"),
        (["rollout.backend=sglang", "rollout.sglang_urls=http://a:1"],
         "rollout.sglang_ref_urls is required for armor .* or set rollout.anchor_engine shared"),
        (["rollout.anchor_engine=shared", "rollout.sglang_ref_urls=http://b:1"],
         "rollout.sglang_ref_urls \\(http://b:1\\) is unused with rollout.anchor_engine shared"),
        (["algorithm.name=grpo", "rollout.actor_n=8", "rollout.cache_anchors=true"],
         "rollout.anchor_engine \\(separate\\) and rollout.cache_anchors \\(True\\) apply to armor's anchors; grpo"),
        (["rollout.anchor_cache_max_prompts=0"], "rollout.anchor_cache_max_prompts must be >= 1, got 0"),
        (["rollout.backend=sglang", "rollout.sglang_urls=http://a:1", "rollout.anchor_engine=shared",
          "rollout.weight_sync=disk"], "rollout.weight_sync disk needs rollout.weight_sync_dir"),
        (["rollout.weight_sync=nccl"], "rollout.weight_sync: 'nccl' is not allowed; choose one of"),
        (["rollout.release_memory=true"], "rollout.release_memory .* needs rollout.backend sglang"),
        (["algorithm.baseline_quantile=1.5"], "algorithm.baseline_quantile must be in \\[0, 1\\], got 1.5"),
        (["algorithm.advantage_baseline=median"], "algorithm.advantage_baseline: 'median' is not allowed"),
        (["algorithm.name=mipu", "rollout.actor_n=8", "algorithm.clip_low=0.0", "algorithm.dual_clip=null"],
         "algorithm.dual_clip must be > 1, got 1.0"),
    ],
)
def test_bad_values_name_the_field_value_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, overrides)


@pytest.mark.parametrize(
    "overrides, clip_high, dual_clip",
    [
        (["algorithm.name=armor"], 0.28, 10.0),  # armor.md §3
        (["algorithm.name=grpo", "rollout.actor_n=16"], 0.28, 10.0),
        (["algorithm.name=mipu", "rollout.actor_n=16"], 0.2, 1.4),  # mipu.md §2: symmetric eps, bound 1 + 2 eps
        (["algorithm.name=mipu", "rollout.actor_n=16", "algorithm.clip_low=0.1"], 0.1, 1.2),
        (["algorithm.name=mipu", "rollout.actor_n=16", "algorithm.clip_high=0.3", "algorithm.dual_clip=3"], 0.3, 3.0),
    ],
)
def test_clip_defaults_are_per_algorithm_unless_set(overrides, clip_high, dual_clip):
    cfg = load_config(None, ["task.synthetic=arithmetic", *overrides])  # no recipe: the dataclass defaults
    assert cfg.algorithm.effective_clip_high == pytest.approx(clip_high)
    assert cfg.algorithm.effective_dual_clip == pytest.approx(dual_clip)


def test_malformed_yaml_files(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  lr: [1e-4\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(broken)
    flat = tmp_path / "flat.yaml"
    flat.write_text("- train\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(flat)
    scalar_section = tmp_path / "scalar.yaml"
    scalar_section.write_text("train: 3\n")
    with pytest.raises(ConfigError, match="section 'train' must be a mapping"):
        load_config(scalar_section)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_user_task_requires_model_and_data():
    with pytest.raises(ConfigError, match="model.path is required"):
        load_config(None, [])
    with pytest.raises(ConfigError, match="data.train_path is required"):
        load_config(None, ["model.path=/models/x"])


def test_cli_exposes_every_field_and_maps_shorthands():
    parser = build_parser()
    help_text = parser._subparsers._group_actions[0].choices["train"].format_help()
    for dotted, _ in config_fields():
        assert f"--{dotted}" in help_text
    args = parser.parse_args(["train", "--config", str(DEMO), "--max-steps", "4", "--train.lr", "0.01"])
    assert sorted(overrides_from_args(args)) == ["train.lr=0.01", "train.max_steps=4"]
    ray = parser.parse_args(["ray-train", "--config", str(DEMO), "--tp", "2", "--num-servers", "3"])
    assert overrides_from_args(ray) == ["parallel.tensor_parallel_size=2"] and ray.num_servers == 3


def test_cli_reports_bad_config_with_exit_code_2():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_armor.cli", "train", "--config", str(DEMO), "--algorithm.alpha", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "error: algorithm.alpha must be in (0, 1], got 2.0" in proc.stderr
