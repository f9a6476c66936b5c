"""Subspace-constrained training through `armor train` (opd.md §3): after the capture step, every
update of a decoder matrix lies in the span of the recorded top-K right singular vectors. The trainer
runs offloaded (rollout.memory.offload_trainer), so W0 and the bases are parked between training phases and
the capture and every checkpoint read them back."""

from pathlib import Path

import torch
from launcher import armor

from state_trees import full_weight, saved_modules

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


def _checkpoint(run_dir: Path, step: int) -> dict:
    """The saved modules; "subspace": the constraint's state (one (PP, TP) position: TP=1)."""
    modules = saved_modules(run_dir / "checkpoints" / f"step_{step:06d}")
    return {**modules, "subspace": next(iter(modules["subspace"].values()))}


def _weight(actor: dict, name: str, shape: torch.Size) -> torch.Tensor:
    return full_weight(actor, name).reshape(shape)


def test_updates_after_capture_stay_in_the_recorded_span(synthetic_cache, tmp_path):
    run_dir = tmp_path / "run"
    proc = armor("train", "--config", CONFIG, "--tp", "1", "--max-steps", "3",
                 "--run-dir", str(run_dir), "--task.cache_dir", str(synthetic_cache), "--task.num_train_rows", "400",
                 "--task.num_val_rows", "16", "--eval.every", "0", "--eval.before_train", "false",
                 "--checkpoint.every", "1", "--checkpoint.keep_last", "0", "--logging.tensorboard", "false",
                 "--logging.progress_bar", "false", "--subspace.capture_step", "1", "--subspace.k", "2",
                 "--subspace.mode", "update", "--optimizer.lr", "1e-3",
                 "--optimizer.warmup_steps", "0",  # full-size steps, far above the float32 rounding of the projection
                 "--rollout.memory.offload_trainer", "true", nproc=1, log_dir=tmp_path / "logs")
    assert proc.returncode == 0, proc.output[-6000:]
    after_capture, final = _checkpoint(run_dir, 1), _checkpoint(run_dir, 3)
    bases = final["subspace"]["bases"]
    assert final["subspace"]["captured_step"] == 1 and final["subspace"]["projected_steps"] == 4  # 2 steps x 2
    assert len(bases) == 8  # qkv, proj, fc1, fc2 of 2 layers
    for name, v in bases.items():
        shape = final["subspace"]["initial"][name].shape
        now, then = _weight(final["actor"], name, shape), _weight(after_capture["actor"], name, shape)
        delta = (now - then).double()
        assert delta.norm() > 0, name  # the constrained steps still move the weights
        outside = delta - delta @ v.double() @ v.double().T
        assert outside.norm() <= 1e-5 * delta.norm(), name
        free = (then - after_capture["subspace"]["initial"][name]).double()
        assert (free - free @ v.double() @ v.double().T).norm() > 1e-3 * free.norm()  # rank > 2 before capture
