"""A training run's checkpoints (TP=2) through the tools: `armor convert megatron-to-hf` and
`armor diagnose` (the CLI's `main`, in this process) read `checkpoints/step_N/model/`, checked against
the training state's own tensors (one Megatron distributed checkpoint, TP shards put together)."""

import json
from pathlib import Path

import torch
from launcher import armor
from safetensors.torch import load_file

from megatron_armor.cli import main
from state_trees import full_weight, saved_modules

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


def weight(step_dir: Path, name: str) -> torch.Tensor:
    """The whole Megatron parameter `name` of the actor in a training checkpoint."""
    return full_weight(saved_modules(step_dir)["actor"], name)


def test_convert_and_diagnose_training_checkpoints(synthetic_cache, tmp_path):
    run = tmp_path / "run"
    proc = armor("train", "--config", CONFIG, "--max-steps", "3", "--run-dir", str(run), "--task.cache_dir",
                 str(synthetic_cache), "--task.num_train_rows", "400", "--task.num_val_rows", "16", "--eval.every", "0",
                 "--eval.before_train", "false", "--checkpoint.every", "1", "--checkpoint.keep_last", "0",
                 "--logging.tensorboard", "false", "--logging.progress_bar", "false", "--optimizer.lr", "1e-3",
                 nproc=2, log_dir=tmp_path / "logs")  # the recipe's TP=2
    assert proc.returncode == 0, proc.output[-6000:]
    steps = run / "checkpoints"

    assert main(["convert", "megatron-to-hf", "--megatron-path", str(steps / "step_000003" / "model"),
                 "--out", str(tmp_path / "hf3")]) == 0
    hf = load_file(tmp_path / "hf3" / "model.safetensors")
    assert torch.equal(hf["model.norm.weight"], weight(steps / "step_000003", "decoder.final_layernorm.weight"))
    assert torch.equal(hf["lm_head.weight"], weight(steps / "step_000003", "output_layer.weight"))
    o_proj = weight(steps / "step_000003", "decoder.layers.1.self_attention.linear_proj.weight")
    assert torch.equal(hf["model.layers.1.self_attn.o_proj.weight"], o_proj)

    assert main(["diagnose", "--base", str(steps / "step_000001" / "model"), "--checkpoints",
                 str(steps / "step_000002" / "model"), str(steps / "step_000003" / "model"),
                 "--out-dir", str(tmp_path / "diag"), "--k-angles", "4", "--k-sim", "2", "--k-hill", "2",
                 "--mask-rank", "4"]) == 0
    report = json.loads((tmp_path / "diag" / "report.json").read_text())
    assert [c["step"] for c in report["checkpoints"]] == [2, 3]
    row_parallel = lambda step: weight(  # noqa: E731
        steps / f"step_{step:06d}", "decoder.layers.1.self_attention.linear_proj.weight")
    expected = (row_parallel(3) - row_parallel(1)).double().norm().item()
    final = report["matrices"]["model.layers.1.self_attn.o_proj.weight"]["checkpoints"][-1]
    assert abs(final["update_norm"] - expected) <= 1e-6 * expected and expected > 0
