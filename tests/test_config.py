"""Config loading: YAML + overrides, typed coercion, validation messages, and the CLI surface."""

import ast
import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from megatron_armor.agentic.trajectory import DRIFT_POLICIES
from megatron_armor.algorithms import build_algorithm, check_algorithm_config
from megatron_armor.cli import build_parser, overrides_from_args
from megatron_armor.config import (
    MOVED_FIELDS, AgenticConfig, AlgorithmConfig, ConfigError, KLConfig, OpdConfig, ParallelConfig, SamplingConfig,
    WeightSyncConfig, config_fields, load_config, save_config,
)

DEMO = Path(__file__).parents[1] / "examples" / "tiny" / "armor.yaml"


def test_demo_config_loads_with_typed_overrides():
    cfg = load_config(DEMO, ["optimizer.lr=1e-4", "algorithm.name=armor", "eval.max_prompts=null", "logging.plot=off"])
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.rollout.sampling.actor_n is None  # derived: 7
    assert build_algorithm(cfg).on_policy_samples(cfg.rollout.sampling) == 7
    assert cfg.optimizer.lr == 1e-4 and cfg.eval.max_prompts is None and cfg.logging.plot is False


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optimizer.lr=fast"], "optimizer.lr: expected float, got 'fast'"),
        (["train.max_steps=2.5"], "train.max_steps: expected int"),
        (["algorithm.name=ppo"], "algorithm.name: 'ppo' is not a registered algorithm; choose one of \\['grpo', "
                                 "'armor', 'grpo_kl', 'mipu', 'opd'"),
        (["optimizer.lrr=1"], "unknown config field 'optimizer.lrr'; did you mean 'optimizer.lr'"),
        (["trian.lr=1"], "unknown config section 'trian'; did you mean 'train'"),
        (["armor.alpha=0"], "armor.alpha must be in \\(0, 1\\], got 0.0"),
        (["rollout.sampling.actor_n=8"],
         "rollout.sampling.actor_n must be 7 for armor with rollout.sampling.n_samples 8, got 8 \\(leave it unset"),
        (["algorithm.name=grpo", "rollout.sampling.actor_n=7"],
         "rollout.sampling.actor_n must be 8 for grpo with rollout.sampling.n_samples 8, got 7"),
        (["train.mini_batch_size=3"], "train.mini_batch_size \\(3\\) must divide train.train_batch_size \\(8\\)"),
        (["rollout.sampling.top_p=1.5"], "rollout.sampling.top_p must be in \\(0, 1\\], got 1.5"),
        (["logging.plot=maybe"], "logging.plot: expected a boolean"),
        (["optimizer.lr"], "must look like section.field=value"),
        (["rollout.backend=sglang", "rollout.sglang.urls=http://a:1"],
         "rollout.sglang.ref_urls is required for armor .* or set rollout.anchors.engine shared"),
        (["rollout.anchors.engine=shared", "rollout.sglang.ref_urls=http://b:1"],
         "rollout.sglang.ref_urls \\(http://b:1\\) is unused with rollout.anchors.engine shared"),
        (["algorithm.name=grpo", "rollout.sampling.actor_n=8", "rollout.anchors.cache=true"],
         "rollout.anchors.engine \\(separate\\) and rollout.anchors.cache \\(True\\) apply to anchors; grpo samples none"),
        (["rollout.anchors.cache_max_prompts=0"], "rollout.anchors.cache_max_prompts must be >= 1, got 0"),
        (["rollout.backend=sglang", "rollout.sglang.urls=http://a:1", "rollout.anchors.engine=shared",
          "rollout.weight_sync.method=disk"], "rollout.weight_sync.method disk needs rollout.weight_sync.dir"),
        (["rollout.weight_sync.method=nccl"], "rollout.weight_sync.method: 'nccl' is not allowed; choose one of"),
        (["rollout.memory.release_servers=true"], "rollout.memory.release_servers .* needs rollout.backend sglang"),
        (["algorithm.clip_low=-0.5"], "algorithm.clip_low/clip_high must be >= 0, got -0.5/0.28"),
        (["algorithm.baseline_quantile=1.5"], "algorithm.baseline_quantile must be in \\[0, 1\\], got 1.5"),
        (["algorithm.advantage_baseline=median"], "algorithm.advantage_baseline: 'median' is not allowed"),
        (["algorithm.name=mipu", "rollout.sampling.actor_n=8", "algorithm.clip_low=0.0", "algorithm.dual_clip=null"],
         "algorithm.dual_clip must be > 1, got 1.0"),
        (["parallel.data_parallel_size=2", "parallel.expert_parallel_size=4"],
         "parallel.expert_tensor_parallel_size \\(unset: 2, the TP size\\) x parallel.expert_parallel_size \\(4\\) = 8 "
         "must divide parallel.tensor_parallel_size \\(2\\) x parallel.context_parallel_size \\(1\\) x "
         "parallel.data_parallel_size \\(2\\) = 4"),
        (["parallel.expert_parallel_size=4", "parallel.expert_tensor_parallel_size=1"],
         "parallel.expert_tensor_parallel_size \\(1\\) x parallel.expert_parallel_size \\(4\\) = 4 must divide "
         "parallel.tensor_parallel_size \\(2\\) x parallel.context_parallel_size \\(1\\) x "
         "parallel.data_parallel_size \\(1\\) = 2"),
        (["parallel.context_parallel_size=2", "parallel.expert_parallel_size=8",
          "parallel.expert_tensor_parallel_size=1"],
         "parallel.expert_tensor_parallel_size \\(1\\) x parallel.expert_parallel_size \\(8\\) = 8 must divide "
         "parallel.tensor_parallel_size \\(2\\) x parallel.context_parallel_size \\(2\\) x "
         "parallel.data_parallel_size \\(1\\) = 4"),
        (["parallel.expert_parallel_size=0"], "parallel.expert_parallel_size must be >= 1"),
        (["parallel.expert_tensor_parallel_size=0"], "parallel.expert_tensor_parallel_size must be >= 1, got 0"),
        (["model.moe_aux_loss_coeff=-0.1"], "model.moe_aux_loss_coeff must be >= 0, got -0.1"),
        (["model.moe_aux_loss_coeff=0.01", "model.moe_load_balancing=none"],
         "model.moe_aux_loss_coeff > 0 needs model.moe_load_balancing aux_loss or seq_aux_loss"),
        (["model.moe_load_balancing=sinkhorn"], "model.moe_load_balancing: 'sinkhorn' is not allowed"),
        (["rollout.agentic.on_failed=drop"], "rollout.agentic.on_failed: 'drop' is not allowed"),
        (["rollout.agentic.max_resamples=-1"], "rollout.agentic.max_resamples must be >= 0, got -1"),
        (["rollout.agentic.on_drift=realign"],
         "rollout.agentic.on_drift: 'realign' is not allowed; choose one of \\['keep', 'fork'\\]"),
    ],
)
def test_bad_values_name_the_field_value_and_what_is_allowed(overrides, message):
    """Through load_config and the chosen algorithm's own rules, as `armor train` checks a config."""
    with pytest.raises(ConfigError, match=message):
        check_algorithm_config(load_config(DEMO, overrides))


def test_context_parallel_ranks_count_in_the_world_size():
    """TP x PP x CP x DP processes: CP ranks hold chunks of the same sequences, not more data; packed micro-batches
    split under CP too."""
    cfg = load_config(DEMO, ["parallel.context_parallel_size=2", "parallel.data_parallel_size=2",
                             "micro_batching.pack=true"])
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.world_size, cfg.micro_batching.pack) == (2, 8, True)


def test_expert_layout_regroups_the_tp_x_cp_x_dp_ranks():
    """Expert TP x EP divides TP x CP x DP (Megatron's expert grid): at TP=2 x DP=1, EP=2 needs expert TP 1 (EP would
    have to divide CP x DP at the default expert TP = TP); at TP=2 x CP=2 x DP=1 it does at the default expert TP,
    and EP=4 at expert TP 1 spans all four ranks."""
    parallel = load_config(DEMO, ["parallel.expert_parallel_size=2", "parallel.expert_tensor_parallel_size=1"]).parallel
    assert (parallel.expert_parallel_size, parallel.expert_tensor_parallel_size, parallel.world_size) == (2, 1, 2)
    with pytest.raises(ConfigError, match="parallel.expert_tensor_parallel_size \\(unset: 2, the TP size\\)"):
        load_config(DEMO, ["parallel.expert_parallel_size=2"])
    for ep, etp in ((2, None), (4, 1)):
        overrides = ["parallel.context_parallel_size=2", f"parallel.expert_parallel_size={ep}"]
        overrides += [f"parallel.expert_tensor_parallel_size={etp}"] if etp else []
        parallel = load_config(DEMO, overrides).parallel
        assert (parallel.expert_parallel_size, parallel.world_size) == (ep, 4)


@pytest.mark.parametrize(
    "overrides, clip_high, dual_clip",
    [
        (["algorithm.name=armor"], 0.28, 10.0),  # armor.md §3
        (["algorithm.name=grpo", "rollout.sampling.actor_n=16"], 0.28, 10.0),
        (["algorithm.name=mipu", "rollout.sampling.actor_n=16"], 0.2, 1.4),  # mipu.md §2: symmetric eps, 1 + 2 eps
        (["algorithm.name=mipu", "rollout.sampling.actor_n=16", "algorithm.clip_low=0.1"], 0.1, 1.2),
        (["algorithm.name=mipu", "rollout.sampling.actor_n=16", "algorithm.clip_high=0.3", "algorithm.dual_clip=3"],
         0.3, 3.0),
    ],
)
def test_clip_defaults_are_per_algorithm_unless_set(overrides, clip_high, dual_clip):
    clip = build_algorithm(load_config(None, ["task.synthetic=arithmetic", *overrides])).clip  # dataclass defaults
    assert clip.high == pytest.approx(clip_high)
    assert clip.dual == pytest.approx(dual_clip)


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
    args = parser.parse_args(["train", "--config", str(DEMO), "--max-steps", "4", "--optimizer.lr", "0.01"])
    assert sorted(overrides_from_args(args)) == ["optimizer.lr=0.01", "train.max_steps=4"]
    ray = parser.parse_args(["ray-train", "--config", str(DEMO), "--tp", "2", "--num-servers", "3"])
    assert overrides_from_args(ray) == ["parallel.tensor_parallel_size=2"] and ray.num_servers == 3


def test_cli_reports_bad_config_with_exit_code_2():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_armor.cli", "train", "--config", str(DEMO), "--armor.alpha", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "error: armor.alpha must be in (0, 1], got 2.0" in proc.stderr


def test_nested_sections_from_yaml_and_overrides(tmp_path):
    recipe = tmp_path / "nested.yaml"
    recipe.write_text("task:\n  synthetic: arithmetic\nrollout:\n  sampling:\n    temperature: 0.7\n    actor_n: 15\n"
                      "  anchors: {ref_n: 2}\n")
    cfg = load_config(recipe, ["rollout.sampling.top_p=0.9", "rollout.weight_sync={bucket_mb: 64}"])
    assert (cfg.rollout.sampling.temperature, cfg.rollout.sampling.top_p, cfg.rollout.anchors.ref_n) == (0.7, 0.9, 2)
    assert cfg.rollout.weight_sync.bucket_mb == 64 and cfg.rollout.sampling.n_samples == 16  # the rest: defaults
    saved = tmp_path / "saved.yaml"
    save_config(cfg, saved)
    assert load_config(saved) == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.samplig.temperature=1"], "unknown config field 'rollout.samplig'; did you mean 'rollout.sampling'"),
        (["rollout.sampling.temprature=1"],
         "unknown config field 'rollout.sampling.temprature'; did you mean 'rollout.sampling.temperature'"),
        (["rollout.sampling=3"], "section 'rollout.sampling' must be a mapping"),
        (["optimizer.lr.x=1"], "unknown config field 'optimizer.lr.x': optimizer.lr is a value, not a section"),
    ],
)
def test_unknown_nested_names(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, overrides)


def test_moved_fields_name_their_new_place(tmp_path):
    with pytest.raises(ConfigError, match="^algorithm.mipu_w_max moved to mipu.w_max$"):
        load_config(DEMO, ["algorithm.mipu_w_max=3"])
    with pytest.raises(ConfigError, match="^rollout.weight_sync moved to rollout.weight_sync.method$"):
        load_config(DEMO, ["rollout.weight_sync=disk"])  # the old field's name is now its section's
    with pytest.raises(ConfigError, match="^train.lr moved to optimizer.lr$"):
        load_config(DEMO, ["train.lr=1e-3"])
    with pytest.raises(ConfigError, match="^train.recompute moved to recompute.granularity$"):
        load_config(DEMO, ["train.recompute=full"])  # the old field's name is now a section's
    old = tmp_path / "old.yaml"
    old.write_text("task:\n  synthetic: arithmetic\nmodel:\n  teacher_path: /teacher\n")
    with pytest.raises(ConfigError, match="old.yaml: model.teacher_path moved to opd.teacher_path"):
        load_config(old)
    old.write_text("task:\n  synthetic: arithmetic\n  warm_start_steps: 400\n")  # into a sub-section of its own
    with pytest.raises(ConfigError, match="old.yaml: task.warm_start_steps moved to task.warm_start.steps"):
        load_config(old)
    old.write_text("task:\n  synthetic: arithmetic\ntrain:\n  micro_batch_size: 4\n")  # into a section of its own
    with pytest.raises(ConfigError, match="old.yaml: train.micro_batch_size moved to micro_batching.micro_batch_size"):
        load_config(old)
    with pytest.raises(ConfigError, match="^train.pack_sequences moved to micro_batching.pack$"):
        load_config(DEMO, ["train.pack_sequences=true"])
    assert not set(MOVED_FIELDS) & {dotted for dotted, _ in config_fields()}


def test_cli_reports_moved_flags_with_exit_code_2():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_armor.cli", "train", "--config", str(DEMO), "--rollout.actor_n", "7"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "error: rollout.actor_n moved to rollout.sampling.actor_n" in proc.stderr


def test_help_lists_nested_flags_with_defaults_and_hides_moved_ones():
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "--rollout.sampling.temperature VALUE sampling temperature of training rollouts (default: 1.0)" in help_text
    assert "--rollout.weight_sync.bucket_mb VALUE weight-update bucket size in MiB (backend sglang) (default: 512)" \
        in help_text
    assert "--rollout.actor_n " not in help_text and "--algorithm.mipu_w_max" not in help_text


def test_each_section_checks_its_own_fields_when_built():
    with pytest.raises(ConfigError, match="rollout.sampling.top_p must be in \\(0, 1\\], got 1.5"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ConfigError, match="mipu.gate_n must be >= 2 for group advantages, got 1"):
        load_config(DEMO, ["mipu.gate_n=1"])  # a rule of the mipu section: checked whatever the algorithm
    with pytest.raises(ConfigError, match="opd.teacher_url .* not both"):
        OpdConfig(teacher_url="http://t:1", teacher_tensor_parallel_size=2)


def test_config_package_imports_only_itself():
    package = Path(__file__).parents[1] / "megatron_armor" / "config"
    for module in package.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("megatron_armor") or name.startswith("megatron_armor.config"), (module, name)


def test_scaling_knobs_defaults_and_resolution():
    cfg = load_config(DEMO)
    assert (cfg.optimizer.use_distributed_optimizer, cfg.parallel.sequence_parallel) == (None, None)
    assert (cfg.recompute.granularity, cfg.recompute.method, cfg.recompute.num_layers) == ("none", "uniform", 1)
    synthetic = ["task.synthetic=arithmetic", "train.mini_batch_size=2", "train.train_batch_size=4"]

    def distributed(*overrides):
        run = load_config(None, [*synthetic, *overrides])
        return run.optimizer.distributed(run.parallel, run.subspace, run.rollout.memory)

    assert not distributed()  # DP 1
    assert distributed("parallel.data_parallel_size=2")
    assert not distributed("parallel.data_parallel_size=2", "optimizer.use_distributed_optimizer=false")
    assert not distributed("parallel.data_parallel_size=2", "subspace.capture_step=3")
    assert ParallelConfig(tensor_parallel_size=2).resolve_sequence_parallel(on_gpu=True)
    assert not ParallelConfig(tensor_parallel_size=2).resolve_sequence_parallel(on_gpu=False)
    assert ParallelConfig(tensor_parallel_size=2, sequence_parallel=True).resolve_sequence_parallel(on_gpu=False)
    assert not ParallelConfig(tensor_parallel_size=1).resolve_sequence_parallel(on_gpu=True)
    assert ParallelConfig(tensor_parallel_size=2).resolve_sequence_parallel(on_gpu=False, moe=True)
    assert not ParallelConfig(tensor_parallel_size=1).resolve_sequence_parallel(on_gpu=False, moe=True)
    with pytest.raises(ConfigError, match="MoE model at parallel.tensor_parallel_size 2 needs sequence parallelism"):
        ParallelConfig(tensor_parallel_size=2, sequence_parallel=False).resolve_sequence_parallel(on_gpu=True, moe=True)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.sequence_parallel=true", "parallel.tensor_parallel_size=1"],
     "parallel.sequence_parallel needs parallel.tensor_parallel_size > 1"),
    (["recompute.granularity=partial"], "recompute.granularity"),
    (["recompute.method=interleaved"], "recompute.method"),
    (["recompute.num_layers=0"], "recompute.num_layers must be >= 1, got 0"),
    (["optimizer.use_distributed_optimizer=true", "subspace.capture_step=3"],
     "optimizer.use_distributed_optimizer does not work with subspace.capture_step yet"),
    (["optimizer.use_distributed_optimizer=true", "rollout.memory.offload_trainer=true"],
     "optimizer.use_distributed_optimizer does not work with rollout.memory.offload_trainer yet"),
    (["subspace.capture_step=3", "parallel.data_parallel_size=2", "parallel.expert_parallel_size=2",
      "train.mini_batch_size=4"],
     r"subspace.capture_step does not work with parallel.expert_parallel_size \(2\) > 1 yet"),
    (["parallel.context_parallel_size=0"], "parallel.context_parallel_size must be >= 1, got 0"),
])
def test_scaling_knobs_refuse_bad_values(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, overrides)


@pytest.mark.parametrize("build, message", [
    (lambda: KLConfig(estimator="k9"), "kl.estimator: 'k9' is not allowed; choose one of \\['k1', 'k2', 'k3'\\]"),
    (lambda: AlgorithmConfig(loss_aggregation="sum"), "algorithm.loss_aggregation: 'sum' is not allowed"),
    (lambda: dataclasses.replace(WeightSyncConfig(), method="nccl"), "rollout.weight_sync.method: 'nccl' is not allowed"),
])
def test_a_section_built_in_code_checks_its_choices(build, message):
    """The loader's coercion refuses these from YAML and the CLI; a section built or replaced in code (as the Ray
    launcher does) refuses them too."""
    with pytest.raises(ConfigError, match=message):
        build()
    assert AlgorithmConfig(loss_aggregation=None).loss_aggregation is None  # Optional choices allow None


def test_list_fields_take_yaml_lists_or_comma_separated_strings_and_round_trip(tmp_path):
    cfg = load_config(DEMO, ["reward.audit_fns=megatron_armor.rewards.math_dapo:verify, checks/strict.py:exact"])
    assert cfg.reward.audit_fns == ["megatron_armor.rewards.math_dapo:verify", "checks/strict.py:exact"]
    assert load_config(DEMO, ["reward.audit_fns=[a:b]"]).reward.audit_fns == ["a:b"]
    assert load_config(DEMO).reward.audit_fns == [] and load_config(DEMO).monitor.enabled is None  # on if validating
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == cfg
    with pytest.raises(ConfigError, match=r"reward.audit_fns\[0\]: expected a string"):
        load_config(DEMO, ["reward.audit_fns=[[a]]"])


def test_monitor_section_loads_and_documents_its_actions():
    cfg = load_config(DEMO, ["monitor.enabled=true", "monitor.hack_rate=0.3", "monitor.actions=hack_rate=stop",
                             "monitor.val_drop=null"])
    assert cfg.monitor.enabled and cfg.monitor.hack_rate == 0.3 and cfg.monitor.action_of()["hack_rate"] == "stop"
    assert cfg.monitor.val_drop is None and cfg.monitor.action_of()["reward_gap"] == "warn"
    with pytest.raises(ConfigError, match="action 'rollback' is not allowed; choose one of \\['warn', 'stop', 'anchor', "
                                          "'anchor_keep'\\]"):
        load_config(DEMO, ["monitor.actions=[hack_rate=rollback]"])
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "--monitor.actions VALUE per-alarm actions as <kind>=<action>" in help_text
    assert "anchor: ARMOR's restart (armor.md §4), automatic: actor and reference go back to the best checkpoint" \
        in help_text
    assert "--reward.audit_fns VALUE audit verifiers" in help_text and "(default: [])" in help_text


def test_cli_reports_a_missing_reward_file_with_exit_code_2():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_armor.cli", "train", "--config", str(DEMO), "--reward.audit_fns",
         "no/such/checks.py:strict"], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "error: reward.audit_fns[0]: reward function 'no/such/checks.py:strict': no file" in proc.stderr


def test_an_armor_config_runs_another_algorithm_by_its_name_alone():
    """rollout.sampling.actor_n is derived by the algorithm when unset: the demo's ARMOR config (groups of 7 +
    1 anchor) runs grpo or grpo_kl (groups of 8 on-policy samples) without another change."""
    for name, on_policy in (("armor", 7), ("grpo", 8), ("grpo_kl", 8)):
        cfg = load_config(DEMO, [f"algorithm.name={name}"])
        assert check_algorithm_config(cfg).on_policy_samples(cfg.rollout.sampling) == on_policy, name


def test_overlong_buffer_defaults_to_half_the_response_budget_up_to_dapo_s_4096():
    short = load_config(None, ["task.synthetic=arithmetic", "rollout.sampling.max_new_tokens=40"])
    assert short.reward.overlong_buffer is None and short.reward.overlong_buffer_for(40) == 20
    assert short.reward.overlong_buffer_for(20480) == 4096 and short.reward.overlong_buffer_for(8192) == 4096
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer \(64\) must be <= rollout.sampling.max_new_tokens "
                                          r"\(40\)"):
        load_config(None, ["task.synthetic=arithmetic", "rollout.sampling.max_new_tokens=40",
                           "reward.overlong_buffer=64"])


def test_a_plugin_path_that_does_not_import_is_refused_by_name_before_any_flag_is_parsed(capsys):
    from megatron_armor.cli import main

    assert main(["train", "--algo", "nosuch_module_here:Algo", "--help"]) == 2
    message = capsys.readouterr().err
    assert message.count("algorithm.name plug-in 'nosuch_module_here:Algo'") == 1 and "nosuch_module_here" in message
    with pytest.raises(ConfigError, match="cannot import module 'nosuch_module_here'"):
        load_config(DEMO, ["algorithm.name=nosuch_module_here:Algo"])


AGENTIC_DEMO = Path(__file__).parents[1] / "examples" / "tiny" / "agentic.yaml"


def test_on_drift_offers_the_trajectory_builders_policies():
    """rollout.agentic.on_drift's choices are the drift policies agentic/trajectory.py implements, keep first."""
    assert typing.get_args(typing.get_type_hints(AgenticConfig)["on_drift"]) == DRIFT_POLICIES
    assert AgenticConfig().on_drift == "keep"


def test_agentic_demo_config_loads_its_environment_template_and_harder_task():
    """examples/tiny/agentic.yaml: one process, the packaged calculator environment, its chat template on disk, 4 to 6
    operands, half the warm start demonstrated with tool calls."""
    from megatron_armor.agentic.environment import load_environment
    from megatron_armor.agentic.examples import CalculatorArithmetic

    cfg = load_config(AGENTIC_DEMO)
    agentic = cfg.rollout.agentic
    assert load_environment(agentic.environment) is CalculatorArithmetic and cfg.algorithm.name == "armor"
    assert (Path(__file__).parents[1] / agentic.chat_template).is_file() and cfg.parallel.world_size == 1
    assert (cfg.task.min_terms, cfg.task.max_terms, cfg.task.warm_start.tool_fraction) == (4, 6, 0.5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task.min_terms=1"], "2 <= min_terms <= max_terms, got 1, 3"),
        (["task.min_terms=5", "task.max_terms=4"], "2 <= min_terms <= max_terms, got 5, 4"),
        (["task.warm_start.tool_fraction=1.5"], "warm_start.tool_fraction must be in \\[0, 1\\], got 1.5"),
        (["task.warm_start.tool_fraction=0.5"], "warm_start.tool_fraction > 0 needs rollout.agentic.environment"),
    ],
)
def test_task_options_of_the_agentic_demo_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, overrides)


def test_lora_refuses_what_would_make_the_reference_another_model():
    """Under model.lora the reference is model.path with the adapters off: a reference of its own, the monitor's
    reference reset and anchor_keep action, trainer offload and subspace training are refused at start-up, each with
    why and its fix; a reference reset (algorithm.ref_reset_period) resets the adapters to the best checkpoint's, so
    it needs checkpoint.keep_best (tests/trainer/test_anchor_run.py), as the anchor action does; the routed experts'
    adapters are exported and pushed like the others."""
    base = ["task.synthetic=arithmetic", "model.lora.rank=8"]
    assert load_config(None, base).model.lora.rank == 8
    assert load_config(None, [*base, "model.lora.experts=true"]).checkpoint.save_peft
    monitor = ["monitor.enabled=true", "checkpoint.keep_best=val/accuracy", "eval.every=1", "checkpoint.every=1"]
    assert load_config(None, [*base, *monitor, "monitor.actions=[val_drop=anchor]"]).monitor.anchors
    assert load_config(None, [*base, *monitor, "algorithm.ref_reset_period=2"]).algorithm.ref_reset_period == 2
    refused = {"model.ref_path=/ckpt": "model.ref_path: the reference is model.path.*unset it",
               "algorithm.ref_reset_period=2": "ref_reset_period without checkpoint.keep_best: a reference reset "
                                               "resets the adapters.*set checkpoint.keep_best",
               "monitor.reference_reset=true": "monitor.reference_reset: .*the adapters are the best checkpoint's "
                                               "already.*set it to false",
               "rollout.memory.offload_trainer=true": "rollout.memory.offload_trainer: .*set it to false"}
    for override, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*base, override])
    with pytest.raises(ConfigError, match="anchor_keep: .*one set of adapters.*choose anchor .*, warn or stop"):
        load_config(None, [*base, *monitor, "monitor.actions=[val_drop=anchor_keep]"])
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['q_proj'\] name no adaptable layer"):
        load_config(None, [*base, "model.lora.target_modules=[q_proj]"])


def test_lora_adapter_sync_needs_no_reference_servers_and_merged_sync_does():
    """model.lora.weight_sync adapter (the default): ARMOR's anchors come from the actor's servers with the adapter
    off, so reference servers are not needed and are refused if named, as is what the adapter push cannot carry;
    merged: the actor's servers hold the merged actor, so ARMOR needs reference servers (or the shared engine)."""
    servers = ["task.synthetic=arithmetic", "model.lora.rank=8", "rollout.backend=sglang",
               "rollout.sglang.urls=http://h:1"]
    cfg = load_config(None, servers)
    assert cfg.model.lora.weight_sync == "adapter" and cfg.model.lora.adapter_sync
    check_algorithm_config(cfg)  # ARMOR without rollout.sglang.ref_urls
    assert load_config(None, [*servers, "model.lora.experts=true"]).model.lora.adapter_sync  # experts' adapters too
    refused = {"rollout.sglang.ref_urls=http://h:2": r"rollout.sglang.ref_urls \(http://h:2\): the reference samples",
               "rollout.memory.release_servers=true": "rollout.memory.release_servers: a release loses the base",
               "rollout.partial_rollouts=true": "rollout.partial_rollouts: a weight push interrupts"}
    for override, message in refused.items():
        extra = {"rollout.partial_rollouts=true": ["rollout.mode=async"]}.get(override, [])
        with pytest.raises(ConfigError, match=f"weight_sync adapter does not work with {message}.*weight_sync merged"):
            load_config(None, [*servers, *extra, override])
    merged = [*servers, "model.lora.weight_sync=merged"]
    with pytest.raises(ConfigError, match=r"rollout.sglang.ref_urls is required for armor.*weight_sync adapter"):
        check_algorithm_config(load_config(None, merged))
    check_algorithm_config(load_config(None, [*merged, "rollout.sglang.ref_urls=http://h:2"]))
    assert load_config(None, [*servers, "model.lora.push_dir=/shared/adapters"]).model.lora.push_dir
    with pytest.raises(ConfigError, match=r"model.lora.push_dir is for adapter pushes .*weight_sync adapter"):
        load_config(None, [*merged, "model.lora.push_dir=/shared/adapters"])
    with pytest.raises(ConfigError, match=r"model.lora.weight_sync: 'both' is not allowed"):
        load_config(None, [*servers, "model.lora.weight_sync=both"])
