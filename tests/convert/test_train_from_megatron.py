"""`armor train` from a converted Megatron checkpoint: saved at TP=2, trained at PP=2 (resharding),
with the local engines built from its config and filled by the trainer's weight push."""

import json
from pathlib import Path

from launcher import armor

from megatron_armor.config import load_config
from megatron_armor.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_armor.trainer.run.task_setup import prepare_task

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")
TASK = {"task.num_train_rows": "400", "task.num_val_rows": "16"}
UNTRAINED_ACCURACY = 0.05  # an untrained tiny model essentially never writes a correct "Answer: N"


def test_train_from_converted_checkpoint(synthetic_cache, tmp_path):
    overrides = [f"task.cache_dir={synthetic_cache}", *(f"{k}={v}" for k, v in TASK.items())]
    warm = prepare_task(load_config(CONFIG, overrides), is_main=True, needs_teacher=False).model_path
    megatron = convert_hf_to_megatron(warm, tmp_path / "mcore", tp=2, pp=1)
    run_dir = tmp_path / "run"
    proc = armor("train", "--config", CONFIG, "--tp", "1", "--pp", "2", "--max-steps", "1", "--run-dir", str(run_dir),
                 "--model.path", str(megatron), "--task.warm_start.steps", "0", "--task.cache_dir",
                 str(synthetic_cache), "--eval.max_prompts", "8", "--logging.tensorboard", "false",
                 "--logging.progress_bar", "false", *(arg for k, v in TASK.items() for arg in (f"--{k}", v)),
                 nproc=2, log_dir=tmp_path / "logs")
    assert proc.returncode == 0, proc.output[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The engines were built empty from config.json: these hold only if the converted weights reached them.
    assert rows[1]["mismatch/logprob_abs_diff"] < 1e-3
    assert rows[0]["val/accuracy"] > UNTRAINED_ACCURACY and rows[1]["armor/anchors_used"] == 8
