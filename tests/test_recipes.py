"""The multi-node recipes load as valid configs and carry the paper's hyperparameters (armor.md section 6)."""

import functools
import itertools
import re
import subprocess
from pathlib import Path

import pytest

from megatron_armor.algorithms import algorithm_class
from megatron_armor.cli import build_parser, overrides_from_args
from megatron_armor.config import load_config

EXAMPLES = Path(__file__).parents[1] / "examples"

COMMON = {
    "rollout.sampling.n_samples": 16, "rollout.anchors.ref_n": 4,
    "rollout.sampling.temperature": 1.0, "rollout.sampling.top_p": 1.0, "rollout.sampling.val_temperature": 1.0,
    "rollout.sampling.val_top_p": 0.7,
    "algorithm.name": "armor", "algorithm.clip_low": 0.2, "algorithm.clip_high": 0.28, "algorithm.dual_clip": 10.0,
    "algorithm.max_num_gen_batches": 10, "algorithm.filter_groups": True,
    "train.train_batch_size": 512, "train.mini_batch_size": 32, "optimizer.lr": 1e-6, "optimizer.warmup_steps": 10,
    "optimizer.weight_decay": 0.1, "optimizer.adam_beta1": 0.9, "optimizer.adam_beta2": 0.999, "optimizer.grad_clip": 1.0,
    "data.max_prompt_length": 2048, "reward.overlong_buffer": 4096, "reward.overlong_factor": 1.0,
    "eval.every": 5, "eval.before_train": True,
    "reward.train_fn": "megatron_armor.rewards.math_dapo:verify", "reward.val_fn": None,  # DAPO's verifier (section 5)
    "data.apply_chat_template": True, "data.answer_key": "reward_model.ground_truth",  # verl's parquet files as they are
}
RECIPES = {
    "qwen2.5-math-7b": {"armor.alpha": 0.9375, "algorithm.ref_reset_period": 0,
                        "rollout.sampling.max_new_tokens": 8192, "rollout.sampling.val_n": 80,
                        "train.gen_batch_size": 2048, "checkpoint.every": 20},
    "qwen3-8b-base": {"armor.alpha": 0.875, "algorithm.ref_reset_period": 1, "rollout.sampling.max_new_tokens": 20480,
                      "rollout.sampling.val_n": 32, "train.gen_batch_size": 1536, "checkpoint.every": 10},
}


def value_at(cfg, dotted: str):
    """The value of `section[.sub].field` in `cfg`."""
    return functools.reduce(getattr, dotted.split("."), cfg)


def on_policy_samples(cfg) -> int:
    """On-policy samples per prompt as the recipe's algorithm derives them (rollout.sampling.actor_n unset)."""
    assert cfg.rollout.sampling.actor_n is None
    return algorithm_class(cfg.algorithm.name).on_policy_samples(cfg.rollout.sampling)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_has_the_paper_hyperparameters(recipe):
    cfg = load_config(EXAMPLES / recipe / "armor.yaml")
    for dotted, expected in {**COMMON, **RECIPES[recipe]}.items():
        assert value_at(cfg, dotted) == expected, dotted
    assert on_policy_samples(cfg) == 15  # + 1 anchor per group
    assert cfg.parallel.world_size == 64 and cfg.train.mini_batch_size % cfg.parallel.data_parallel_size == 0


# mipu.md section 4; the batch reading (prompts, one optimizer step per RL step) is the recipe's stated choice.
MIPU = {
    "rollout.sampling.n_samples": 8, "rollout.sampling.temperature": 1.0,
    "rollout.sampling.top_p": 1.0, "rollout.sampling.val_temperature": 0.7, "rollout.sampling.val_top_p": 1.0,
    "rollout.sampling.val_n": 16, "rollout.sampling.max_new_tokens": 8192,
    "data.max_prompt_length": 512, "reward.overlong_buffer": 0, "optimizer.lr": 1e-6, "optimizer.warmup_steps": 0,
    "train.train_batch_size": 64, "train.mini_batch_size": 64, "algorithm.name": "mipu", "algorithm.clip_low": 0.2,
    "algorithm.clip_high": 0.2, "algorithm.dual_clip": 1.4, "kl.coef": 0.001, "mipu.w_max": 2.0,
    "mipu.is_correction": "tis", "mipu.gate": True, "algorithm.filter_groups": False,
    "data.answer_key": "reward_model.ground_truth",
}


def test_mipu_recipe_has_the_paper_hyperparameters():
    cfg = load_config(EXAMPLES / "qwen3-1.7b" / "mipu.yaml")
    for dotted, expected in MIPU.items():
        assert value_at(cfg, dotted) == expected, dotted
    assert on_policy_samples(cfg) == 8  # the whole group
    optimizer_steps = cfg.train.train_batch_size // cfg.train.mini_batch_size
    micro_batches = (cfg.train.mini_batch_size * cfg.rollout.sampling.n_samples
                     // (cfg.parallel.data_parallel_size * cfg.micro_batching.micro_batch_size))
    assert (optimizer_steps, micro_batches) == (1, 32)  # the paper's gradient accumulation 32
    script = EXAMPLES / "qwen3-1.7b" / "run_torchrun.sh"
    assert "Hardware:" in script.read_text() and "--quantization fp8" in script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("script", ["run_torchrun.sh", "run_ray.sh"])
def test_launch_script_states_its_hardware_and_parses(recipe, script):
    path = EXAMPLES / recipe / script
    assert "Hardware:" in path.read_text() and f"examples/{recipe}/armor.yaml" in path.read_text()
    subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_pushes_weights_to_servers_on_other_nodes(recipe):
    """Both launch scripts put the SGLang servers on nodes of their own (torchrun: nodes 8-15; Ray: disaggregated
    placement); rollout.weight_sync.method tensor hands the servers shared-memory / CUDA-IPC handles, which only a
    process on the trainer's host can open, so the first weight push would fail: the recipe must broadcast
    (distributed)."""
    assert "--placement disaggregated" in (EXAMPLES / recipe / "run_ray.sh").read_text()
    assert "Nodes 0-7 (64 GPUs) train" in (EXAMPLES / recipe / "run_torchrun.sh").read_text()
    assert load_config(EXAMPLES / recipe / "armor.yaml").rollout.weight_sync.method == "distributed"


def test_lora_recipe_is_the_8b_recipe_with_adapters():
    """examples/qwen3-8b-base-lora: the 8B recipe's hyperparameters, layout and hardware with rank-64 adapters on every
    projection, the reference reset off (the reference is the base) and 10x the learning rate; its launcher names its
    config and parses."""
    cfg, full = (load_config(EXAMPLES / recipe / "armor.yaml") for recipe in ("qwen3-8b-base-lora", "qwen3-8b-base"))
    lora = {"optimizer.lr": 1e-5, "algorithm.ref_reset_period": 0}
    for dotted, expected in {**COMMON, **RECIPES["qwen3-8b-base"], **lora}.items():
        assert value_at(cfg, dotted) == expected, dotted
    assert (cfg.model.lora.rank, cfg.model.lora.scale, sorted(cfg.model.lora.target_modules)) == (
        64, 2.0, ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"])
    assert (cfg.model.path, cfg.parallel, cfg.train) == (full.model.path, full.parallel, full.train)
    assert cfg.checkpoint.save_peft and on_policy_samples(cfg) == 15
    script = EXAMPLES / "qwen3-8b-base-lora" / "run_torchrun.sh"
    text = script.read_text()
    assert "Hardware: 16 nodes x 8 H100" in text and "examples/qwen3-8b-base-lora/armor.yaml" in text
    assert "Nodes 0-7 (64 GPUs) train" in text and cfg.rollout.weight_sync.method == "distributed"
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_qwen3_follow_up_command_resumes_with_steps_left():
    """The header's follow-up run (run_8b_until_180.sh) resumes the step-180 checkpoint with resets off; train.max_steps
    counts from step 0, so the command must raise it past 180 or the resumed loop (steps 180..max_steps) is empty."""
    path = EXAMPLES / "qwen3-8b-base" / "armor.yaml"
    header = " ".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))
    (command,) = re.findall(r"`(--resume[^`]*)`", header)
    args = build_parser().parse_args(["train", "--config", str(path), *command.split()])
    cfg = load_config(args.config, overrides_from_args(args))
    assert args.resume and cfg.algorithm.ref_reset_period == 0 and cfg.train.gen_batch_size == 2048  # armor.md §6
    assert cfg.train.max_steps > 180 == load_config(path).train.max_steps


def test_a_context_longer_than_the_models_positions_is_named_at_start_up():
    """Qwen2.5-Math-7B's stock config has 4096 positions; the 7B recipe needs 2048 + 8192."""
    from megatron_armor.models.hf_config import model_shape_from_dict
    from megatron_armor.trainer.run.build import context_length_warning

    cfg = load_config(EXAMPLES / "qwen2.5-math-7b" / "armor.yaml", [])
    hf = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28,
          "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944}
    warning = context_length_warning(cfg, model_shape_from_dict({**hf, "max_position_embeddings": 4096}))
    assert warning is not None and "10240 positions" in warning and "max_position_embeddings 4096" in warning
    assert context_length_warning(cfg, model_shape_from_dict({**hf, "max_position_embeddings": 10240})) is None


# MoE recipe -> (its layout: expert parallel size, trainer GPUs; the hardware its launcher names)
MOE_RECIPES = {
    "qwen3-30b-a3b": ({"parallel.expert_parallel_size": 8}, 64, "Hardware: 16 nodes x 8 H100"),
    "glm-4.5-air": ({"parallel.expert_parallel_size": 4}, 64, "Hardware: 16 nodes x 8 H200"),
    "deepseek-v3": ({"parallel.expert_parallel_size": 256, "parallel.expert_tensor_parallel_size": 1}, 256,
                    "Hardware: 48 nodes x 8 H200"),
}


@pytest.mark.parametrize("recipe", MOE_RECIPES)
def test_moe_recipe_replays_the_servers_routing_and_states_its_hardware(recipe):
    """examples/qwen3-30b-a3b, glm-4.5-air, deepseek-v3: ARMOR's 8B hyperparameters with experts over EP and rollout
    routing replay; the launcher starts the servers that must return their routed experts, and the header says what
    ran on CPU and what has not run (`armor plan`: test_recipes_plan)."""
    layout, trainer_gpus, hardware = MOE_RECIPES[recipe]
    cfg = load_config(EXAMPLES / recipe / "armor.yaml")
    for dotted, expected in {**COMMON, **layout, "armor.alpha": 0.875, "train.routing_replay": "rollout",
                             "model.moe_aux_loss_coeff": 0.0, "recompute.granularity": "selective"}.items():
        assert value_at(cfg, dotted) == expected, dotted
    assert on_policy_samples(cfg) == 15  # + 1 anchor per group
    assert cfg.parallel.world_size == trainer_gpus and cfg.train.mini_batch_size % cfg.parallel.data_parallel_size == 0
    script = EXAMPLES / recipe / "run_torchrun.sh"
    assert hardware in script.read_text() and "--enable-return-routed-experts" in script.read_text()
    assert load_config(EXAMPLES / recipe / "armor.yaml").rollout.weight_sync.method == "distributed"
    if recipe != "qwen3-30b-a3b":  # the newer recipes' headers: what ran on CPU, and that nothing ran on GPUs
        header = (EXAMPLES / recipe / "armor.yaml").read_text()
        assert "What ran: nothing of this recipe has run on GPUs" in header and "On CPU, `armor plan`" in header
    subprocess.run(["bash", "-n", str(script)], check=True)


CLAIM = re.compile(
    r"armor plan \((?P<gpus>\d+) GPUs of (?P<gb>\d+) GB\): responses up to (?P<without>\d+) tokens fit without context "
    r"parallelism \(dp (?P<dp>\d+)\)(?:, (?P<with>\d+) with parallel\.context_parallel_size (?P<cp>\d+) \(dp "
    r"(?P<cp_dp>\d+)\)|; no context-parallel layout of these GPUs splits the model and its experts)")
GPU_RECIPES = sorted(str(path.relative_to(EXAMPLES)) for path in EXAMPLES.glob("*/*.yaml")
                     if not path.parent.name == "tiny" and path.read_text().startswith("#"))


def header(path: Path) -> str:
    """A recipe's leading comment lines as one line of text."""
    lines = path.read_text().splitlines()
    return " ".join(line.lstrip("# ") for line in itertools.takewhile(lambda line: line.startswith("#"), lines))


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_header_states_the_response_lengths_that_fit_without_and_with_context_parallelism(recipe):
    """Each GPU recipe's header names the longest responses `armor plan` fits on its hardware without context
    parallelism and with it (rounded down to 4096 tokens: the planner's longest is within the next 4096), or that
    no CP layout of its GPUs splits its model and its experts."""
    from megatron_armor.planning.planner import Hardware, plan_run
    from megatron_armor.planning.report import NO_CP_LAYOUT, format_plan

    claim = CLAIM.search(header(EXAMPLES / recipe))
    assert claim, f"{recipe}: no 'armor plan (N GPUs of M GB): responses up to ...' line in its header"
    plan = plan_run(load_config(EXAMPLES / recipe), Hardware(int(claim["gpus"]), float(claim["gb"])))
    assert plan.memory.fits
    assert plan.without_cp == (1, int(claim["dp"]))
    assert int(claim["without"]) <= plan.longest_without_cp < int(claim["without"]) + 4096
    if claim["with"] is None:
        assert plan.with_cp is None and NO_CP_LAYOUT in format_plan(plan)
    else:
        assert plan.with_cp == (int(claim["cp"]), int(claim["cp_dp"]))
        assert int(claim["with"]) <= plan.longest_with_cp < int(claim["with"]) + 4096


def test_long_response_recipe_needs_context_parallelism_and_fits_with_it():
    """examples/qwen3-8b-base-long: the 8B recipe with 30720-token responses (prompt + response = the model's 32768
    positions) at selective recomputation: `armor plan` says the responses do not fit without CP and fit at CP 2,
    advises the CP raise on the layout without it, and its launcher names its config."""
    from megatron_armor.planning.planner import Hardware, plan_run

    path = EXAMPLES / "qwen3-8b-base-long" / "armor.yaml"
    cfg, base = load_config(path), load_config(EXAMPLES / "qwen3-8b-base" / "armor.yaml")
    for dotted, expected in {**COMMON, "armor.alpha": 0.875, "rollout.sampling.max_new_tokens": 30720,
                             "parallel.context_parallel_size": 2, "parallel.data_parallel_size": 8,
                             "recompute.granularity": "selective"}.items():
        assert value_at(cfg, dotted) == expected, dotted
    assert cfg.parallel.world_size == base.parallel.world_size == 64
    assert cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens == 32768  # Qwen3-8B-Base's positions
    plan = plan_run(cfg, Hardware(128, 80))
    assert plan.memory.fits and plan.longest_without_cp < 30720 <= plan.longest_with_cp
    without = plan_run(load_config(path, ["parallel.context_parallel_size=1", "parallel.data_parallel_size=16"]),
                       Hardware(128, 80))
    assert not without.memory.fits
    assert any(line.startswith("set parallel.context_parallel_size 2 (dp 8") and line.endswith("(fits)")
               for line in without.advice)
    script = EXAMPLES / "qwen3-8b-base-long" / "run_torchrun.sh"
    assert "Hardware: 16 nodes x 8 H100" in script.read_text() and "examples/qwen3-8b-base-long/armor.yaml" in script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
