"""What `armor eval` makes of checkpoint names (globs in step order, a run's step_N, BEST, bad names) and what it
writes (the Markdown table, fresh outputs)."""

import json

import pytest

from megatron_armor.convert.megatron_checkpoint import DIST_CHECKPOINT_DIR, INFO_FILE
from megatron_armor.evaluation.checkpoints import CheckpointSpecError, resolve_checkpoints
from megatron_armor.evaluation.writers import CheckpointResult, clear_outputs, markdown_table, write_results


def megatron_dir(path):
    (path / DIST_CHECKPOINT_DIR).mkdir(parents=True)
    (path / INFO_FILE).write_text("{}")
    return path


def test_checkpoint_names(tmp_path):
    steps = tmp_path / "run" / "checkpoints"
    for step in (9, 10, 100):
        megatron_dir(steps / f"step_{step:06d}" / "model")
    (steps / "step_000009" / "model").rename(steps / "step_000009" / "other")  # saved without the model
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    (steps / "BEST").write_text(json.dumps({"step": 10, "path": "step_000010", "metric": "val/accuracy", "value": 1}))

    found = resolve_checkpoints([str(steps / "step_*" / "model"), str(hf)])
    assert [(c.label, c.step, c.megatron) for c in found] == [("step_000010", 10, True), ("step_000100", 100, True),
                                                              ("hf", None, False)]
    assert found[0].path == steps / "step_000010" / "model"
    (run_step,) = resolve_checkpoints([str(steps / "step_000100")])
    assert (run_step.label, run_step.path) == ("step_000100", steps / "step_000100" / "model")
    (best,) = resolve_checkpoints([str(steps / "BEST")])
    assert (best.label, best.step) == ("step_000010", 10)

    with pytest.raises(CheckpointSpecError, match="without model/"):
        resolve_checkpoints([str(steps / "step_*")])
    with pytest.raises(CheckpointSpecError, match="no checkpoint matches"):
        resolve_checkpoints([str(tmp_path / "nothing_*")])
    with pytest.raises(CheckpointSpecError, match="neither an HF checkpoint"):
        resolve_checkpoints([str(tmp_path / "run")])
    with pytest.raises(CheckpointSpecError, match="named twice"):
        resolve_checkpoints([str(steps / "BEST"), str(steps / "step_000010")])


def test_table_and_fresh_outputs(tmp_path):
    results = [CheckpointResult("step_000001", 1, "a", {"math": {"avg@4": 0.25, "pass@4": 0.5}, "gsm": {"avg@4": 1.0}}),
               CheckpointResult("step_000002", 2, "b", {"math": {"avg@4": 0.125, "pass@4": 0.75}})]
    assert markdown_table(results).splitlines() == [
        "| checkpoint | step | math avg@4 | math pass@4 | gsm avg@4 |",
        "|---|---:|---:|---:|---:|",
        "| step_000001 | 1 | 0.2500 | 0.5000 | 1.0000 |",
        "| step_000002 | 2 | 0.1250 | 0.7500 |  |",
    ]
    write_results(tmp_path, results, seed=3)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["avg@4.png", "pass@4.png"]
    assert json.loads((tmp_path / "results.json").read_text())["checkpoints"][1]["datasets"]["math"]["pass@4"] == 0.75
    (tmp_path / "mine.txt").write_text("kept")
    clear_outputs(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]
