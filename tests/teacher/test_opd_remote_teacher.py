"""OPD with the teacher at its own layout: a TP=1 student trains one step against a teacher server the
trainer starts at TP=2; same seed, so same rollouts, so the reverse KL matches the run with the
teacher inside the trainer's process. (The server at PP=2: tests/teacher/test_teacher_server.py.)"""

import json
from pathlib import Path

import pytest
from launcher import run_workers

from megatron_armor.algorithms import check_algorithm_config
from megatron_armor.config import ConfigError, load_config

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "opd.yaml")
# fp32 logprobs of TP/PP layouts differ in summation order only (~1e-6 per token)
REVERSE_KL_ATOL = 1e-5


def opd_step_metrics(cache, run_dir: Path, *overrides: str) -> dict:
    """Metrics of one OPD step of the tiny synthetic task with a TP=1 student (one process)."""
    run_workers(
        "train_run.py", 1, run_dir / "w", CONFIG, f"task.cache_dir={cache}", f"logging.run_dir={run_dir}",
        "parallel.tensor_parallel_size=1", "task.num_train_rows=400", "task.num_val_rows=16", "train.max_steps=1",
        "train.train_batch_size=2", "train.gen_batch_size=2", "train.mini_batch_size=2", "rollout.sampling.n_samples=4",
        "rollout.sampling.actor_n=4", "rollout.sampling.max_new_tokens=16", "eval.every=0",
        "eval.before_train=false", "checkpoint.save_model=false", "logging.tensorboard=false", "logging.plot=false",
        *overrides,
    )
    [row] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return row


def test_teacher_server_at_tp2_gives_the_in_process_reverse_kl(synthetic_cache, tmp_path_factory):
    in_process = opd_step_metrics(synthetic_cache, tmp_path_factory.mktemp("opd-in-process"))
    run_dir = tmp_path_factory.mktemp("opd-teacher-tp2")
    remote = opd_step_metrics(synthetic_cache, run_dir, "opd.teacher_tensor_parallel_size=2")
    assert remote["response/length_mean"] == in_process["response/length_mean"]  # the same rollouts
    assert in_process["opd/reverse_kl"] > 0.1  # an untrained student is far from the teacher
    assert remote["opd/reverse_kl"] == pytest.approx(in_process["opd/reverse_kl"], abs=REVERSE_KL_ATOL)
    assert remote["loss/policy_loss"] == pytest.approx(in_process["loss/policy_loss"], abs=1e-5)
    assert len(list(run_dir.glob("teacher-rank*.log"))) == 2  # the trainer started the two teacher ranks


def test_teacher_url_and_teacher_layout_are_exclusive():
    with pytest.raises(ConfigError, match="not both"):
        load_config(CONFIG, ["opd.teacher_url=http://127.0.0.1:1", "opd.teacher_tensor_parallel_size=2"])


def test_teacher_settings_belong_to_opd():
    with pytest.raises(ConfigError, match="grpo has none"):
        check_algorithm_config(load_config(CONFIG, ["algorithm.name=grpo", "opd.teacher_tensor_parallel_size=2"]))
