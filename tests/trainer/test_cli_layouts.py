"""`armor train` under other layouts (PP=2 with ARMOR, DP=2 at TP=1 with the GRPO + KL baseline) end to end,
and refusal of impossible layouts."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest


from megatron_armor.models.hf_config import ModelConfigError, check_parallel_layout, load_model_shape
from megatron_armor.utils.net import free_port

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


def armor_train(*args: str, torchrun_nproc: int | None = None) -> subprocess.CompletedProcess:
    module = ["-m", "megatron_armor.cli", "train", "--config", CONFIG, *args]
    if torchrun_nproc:
        module = ["-m", "torch.distributed.run", f"--nproc-per-node={torchrun_nproc}", f"--master-port={free_port()}",
                  *module]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *module], capture_output=True, text=True, timeout=600, env=env)


def small_run(cache: Path, run_dir: Path) -> list[str]:
    return ["--max-steps", "1", "--run-dir", str(run_dir), "--task.cache_dir", str(cache), "--task.num_train_rows",
            "400", "--task.num_val_rows", "16", "--eval.max_prompts", "8", "--logging.tensorboard", "false",
            "--logging.progress_bar", "false"]


GRPO_KL = ["--algorithm.name", "grpo_kl", "--kl.estimator", "k3", "--rollout.sampling.actor_n", "8"]


@pytest.mark.parametrize("layout", [["--tp", "1", "--pp", "2"], ["--tp", "1", "--dp", "2", *GRPO_KL]],
                         ids=["pp2-armor", "dp2-grpo-kl"])
def test_training_step_under_layout(layout, synthetic_cache, tmp_path):
    proc = armor_train(*layout, *small_run(synthetic_cache, tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    step = rows[1]
    for key in ("train/reward_mean", "loss/policy_loss", "policy/entropy", "optim/grad_norm"):
        assert math.isfinite(step[key]), key
    if "grpo_kl" in layout:
        assert step["armor/anchors_used"] == 0 and step["filter/prompts_kept"] == 8
        assert math.isfinite(step["loss/kl_to_ref"]) and step["loss/kl_to_ref"] >= 0  # k3 >= 0
    else:
        assert step["armor/anchors_used"] == step["filter/prompts_kept"] == 8
    # The engine received every pipeline stage's weights: its logprobs equal the trainer's.
    assert step["mismatch/logprob_abs_diff"] < 1e-3
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "COMPLETE").is_file()


def test_refuses_layouts_that_do_not_fit(tmp_path, tiny_model_factory):
    proc = armor_train("--tp", "2", "--dp", "2", "--nproc", "2", "--run-dir", str(tmp_path / "a"))
    assert proc.returncode == 2 and "--nproc 2 does not match the layout tp x pp x cp x dp = 4" in proc.stderr
    proc = armor_train("--tp", "2", "--dp", "2", "--run-dir", str(tmp_path / "b"), torchrun_nproc=2)
    assert proc.returncode != 0
    assert "world size 2 does not match the layout tensor_parallel_size (2) x pipeline_parallel_size (1) x " \
           "context_parallel_size (1) x data_parallel_size (2) = 4" in proc.stderr
    assert not (tmp_path / "b").exists()
    shape = load_model_shape(tiny_model_factory("qwen2"))  # 4 heads, 2 KV heads, 2 layers
    with pytest.raises(ModelConfigError, match="num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        check_parallel_layout(shape, 4, 1)
    with pytest.raises(ModelConfigError, match="num_hidden_layers=2 is not divisible by pipeline_parallel_size=4"):
        check_parallel_layout(shape, 1, 4)
