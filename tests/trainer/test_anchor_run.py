"""The collapse monitor's anchor action through `armor train`'s code path (`run_training`): a GRPO run whose planted
validation accuracies (0.5, 0.0, 1.0, 0.25, 1.0) make val_drop fire after steps 2 and 4 switches to ARMOR after
step 2 from the best checkpoint (step 1) and resets to the best again (step 3) after step 4; the checkpoints hold the
best's weights as actor and reference with a fresh optimizer, the lr warmup restarts, and a resume trains ARMOR
with the same reference. Under LoRA the action puts the best checkpoint's adapters and their optimizer state back, and
so does a reference reset (algorithm.ref_reset_period), the lr schedule going on.
"""

import json
import logging
from pathlib import Path

import pytest
import torch

from megatron_armor.config import ConfigError, load_config
from megatron_armor.trainer.run.train import run_training
from state_trees import bit_identical, saved_modules

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")
LR = 1e-3
VAL_N, VAL_PROMPTS = 4, 4
PLANTED = """from pathlib import Path

CALLS = Path(__file__).with_suffix(".calls")  # on disk: the reward function is loaded again on resume
SCHEDULE = {schedule}  # val/accuracy of validation 1, 2, ...


def planted(response, row):
    calls = CALLS.stat().st_size if CALLS.exists() else 0
    CALLS.write_text("x" * (calls + 1))
    validation, index = divmod(calls, {per_validation})
    correct = index < SCHEDULE[validation] * {per_validation}
    return float(correct), correct
"""


def _overrides(cache: Path, run_dir: Path, val_fn: str) -> list[str]:
    return [
        "algorithm.name=grpo", "rollout.sampling.n_samples=8", "rollout.sampling.actor_n=8",
        "parallel.tensor_parallel_size=1", f"task.cache_dir={cache}", f"logging.run_dir={run_dir}",
        "task.num_train_rows=400", "task.num_val_rows=16", "eval.every=1", f"eval.max_prompts={VAL_PROMPTS}",
        f"rollout.sampling.val_n={VAL_N}", "eval.before_train=false", "checkpoint.save_model=false",
        "checkpoint.every=1", "checkpoint.keep_last=0", "checkpoint.keep_best=val/accuracy", "train.max_steps=4",
        f"optimizer.lr={LR}", "optimizer.warmup_steps=2", "logging.tensorboard=false", "logging.plot=false",
        "logging.progress_bar=false", f"reward.val_fn={val_fn}",
        "monitor.enabled=true", "monitor.val_drop=0.3", "monitor.actions=[val_drop=anchor]",
    ]


def _planted(path: Path, schedule: list[float]) -> str:
    """A validation reward function at `path` whose validations score `schedule`'s accuracies in turn."""
    path.write_text(PLANTED.format(per_validation=VAL_N * VAL_PROMPTS, schedule=schedule))
    return f"{path}:planted"


def _rows(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _weights(modules: dict, name: str) -> dict[str, torch.Tensor]:
    """The tensors of a saved module ("actor" | "ref"; the layers' extra-state objects left out)."""
    return {key: value for key, value in modules[name].items() if torch.is_tensor(value)}


def _fresh(optimizer: dict) -> bool:
    """A fresh optimizer's saved state: Adam step 0, zero moments."""
    moments = [value for key, value in optimizer.items() if key.startswith("optimizer.state.exp_avg")]
    return optimizer["adam_step"] == 0 and len(moments) > 0 and all(not m.any() for m in moments)


def test_anchor_switches_to_armor_from_the_best_checkpoint_resets_again_and_resumes(
        synthetic_cache, tmp_path, caplog):
    run_dir = tmp_path / "run"
    overrides = _overrides(synthetic_cache, run_dir, _planted(tmp_path / "planted.py", [0.5, 0.0, 1.0, 0.25, 1.0]))
    with caplog.at_level(logging.WARNING, logger="megatron_armor"):
        assert run_training(load_config(CONFIG, overrides)) == 0
    rows = _rows(run_dir)
    assert [rows[step]["val/accuracy"] for step in (1, 2, 3, 4)] == [0.5, 0.0, 1.0, 0.25]
    assert [rows[step]["monitor/alarm_val_drop"] for step in (1, 2, 3, 4)] == [0, 1, 0, 1]
    assert [rows[step]["monitor/anchored"] for step in (1, 2, 3, 4)] == [0, 1, 0, 1]
    assert [rows[step]["armor/anchors_used"] for step in (1, 2, 3, 4)] == [0, 0, 8, 8]  # ARMOR from step 3: anchors
    assert "mix_kl/main_ratio" not in rows[2] and rows[3]["mix_kl/main_ratio"] == 8 / 9
    assert [rows[step]["optim/lr"] for step in (1, 2, 3, 4)] == [LR / 2, LR, LR / 2, LR]  # warmup restarts at 3
    assert ("step 2: anchor on alarm val_drop: switched to armor; actor and reference from the best checkpoint "
            "step_000001 (step 1, val/accuracy 0.5)") in caplog.text
    assert "step 4: anchor on alarm val_drop: armor's reference reset; actor and reference from the best " \
           "checkpoint step_000003 (step 3, val/accuracy 1)" in caplog.text

    root = run_dir / "checkpoints"
    saved = {step: saved_modules(root / f"step_{step:06d}") for step in (1, 2, 3, 4)}
    assert "ref" not in saved[1]  # GRPO's reference is model.ref_path's until the switch
    best_1, best_3 = _weights(saved[1], "actor"), _weights(saved[3], "actor")
    assert bit_identical(_weights(saved[2], "actor"), best_1) and bit_identical(_weights(saved[2], "ref"), best_1)
    assert bit_identical(_weights(saved[3], "ref"), best_1)  # frozen between the alarms
    assert bit_identical(_weights(saved[4], "actor"), best_3) and bit_identical(_weights(saved[4], "ref"), best_3)
    assert _fresh(saved[2]["optimizer"]) and _fresh(saved[4]["optimizer"])
    assert saved[1]["optimizer"]["adam_step"] == saved[3]["optimizer"]["adam_step"] == 2  # 2 mini-batches a step
    record = json.loads((root / "step_000004" / "trainer_state.json").read_text())["extra"]["anchor"]
    assert record == {"mode": "armor", "anchors": 2, "step": 4, "reference_step": 3}
    assert json.loads((root / "BEST").read_text())["step"] == 3

    assert run_training(load_config(CONFIG, [*overrides, "train.max_steps=5"]), resume=True) == 0
    row = _rows(run_dir)[5]
    assert row["armor/anchors_used"] == 8 and row["optim/lr"] == LR / 2 and row["monitor/anchored"] == 0
    resumed = saved_modules(root / "step_000005")
    assert bit_identical(_weights(resumed, "ref"), best_3)
    assert not bit_identical(_weights(resumed, "actor"), best_3)  # trained on


def test_a_drop_right_after_the_start_restores_the_start(synthetic_cache, tmp_path, caplog):
    """The start (step-0 validation 1.0) is the best restore point: the drops after steps 1 and 2 restart from it,
    both times to the same weights, without a copy of it in checkpoints/ (BEST names model.path)."""
    run_dir = tmp_path / "run"
    overrides = [*_overrides(synthetic_cache, run_dir, _planted(tmp_path / "planted.py", [1.0, 0.25, 0.25])),
                 "eval.before_train=true", "train.max_steps=2"]
    with caplog.at_level(logging.WARNING, logger="megatron_armor"):
        assert run_training(load_config(CONFIG, overrides)) == 0
    rows = _rows(run_dir)
    assert rows[0]["checkpoint/best_step"] == 0 and rows[0]["checkpoint/best_value"] == 1.0
    assert [rows[step]["monitor/anchored"] for step in (1, 2)] == [1, 1]
    assert "the run's start (model.path), the best so far (step 0, val/accuracy 1)" in caplog.text
    root = run_dir / "checkpoints"
    best = json.loads((root / "BEST").read_text())
    assert best["step"] == 0 and Path(best["path"]).is_absolute() and (Path(best["path"]) / "config.json").is_file()
    assert sorted(path.name for path in root.glob("step_*")) == ["step_000001", "step_000002"]
    saved = {step: saved_modules(root / f"step_{step:06d}") for step in (1, 2)}
    start = _weights(saved[1], "actor")
    assert bit_identical(_weights(saved[1], "ref"), start)
    assert bit_identical(_weights(saved[2], "actor"), start) and bit_identical(_weights(saved[2], "ref"), start)
    assert _fresh(saved[2]["optimizer"])  # trained a step from the start in between, then restarted again


def test_anchor_keep_keeps_the_actor_and_makes_the_best_checkpoint_the_reference(synthetic_cache, tmp_path):
    """anchor_keep after step 2 (validation 0.25, best 1.0 at step 1; step 3 validates 1.0 again): the actor, its optimizer and the lr schedule
    go on bit for bit as in the same run with the alarm warning only; the reference becomes step 1's actor and the
    run trains ARMOR from step 3."""
    schedule = [0.5, 1.0, 0.25, 1.0]
    runs = {}
    for action in ("warn", "anchor_keep"):
        run_dir = tmp_path / action
        overrides = [*_overrides(synthetic_cache, run_dir, _planted(tmp_path / f"{action}.py", schedule)),
                     f"monitor.actions=[val_drop={action}]", "eval.before_train=true", "train.max_steps=3"]
        assert run_training(load_config(CONFIG, overrides)) == 0
        root = run_dir / "checkpoints"
        runs[action] = (_rows(run_dir), {step: saved_modules(root / f"step_{step:06d}") for step in (1, 2, 3)})
    (warned, warned_saved), (kept, kept_saved) = runs["warn"], runs["anchor_keep"]
    assert [kept[step]["monitor/anchored"] for step in (1, 2, 3)] == [0, 1, 0]
    assert bit_identical(_weights(kept_saved[2], "actor"), _weights(warned_saved[2], "actor"))
    assert kept_saved[2]["optimizer"]["adam_step"] == warned_saved[2]["optimizer"]["adam_step"] == 4  # not reset
    assert bit_identical(_weights(kept_saved[2], "ref"), _weights(kept_saved[1], "actor"))
    assert [kept[step]["optim/lr"] for step in (1, 2, 3)] == [warned[step]["optim/lr"] for step in (1, 2, 3)]
    assert kept[3]["armor/anchors_used"] > 0 and warned[3]["armor/anchors_used"] == 0  # ARMOR from step 3
    record = json.loads((tmp_path / "anchor_keep" / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert record["extra"]["anchor"] == {"mode": "armor", "anchors": 1, "step": None, "reference_step": 1}


def test_anchor_under_lora_restores_the_best_adapters_and_their_optimizer_state(synthetic_cache, tmp_path, caplog):
    """Under LoRA the reference is the base and never moves: the drop after step 2 puts step 1's adapters and their
    Adam state back (bit for bit, not a fresh optimizer), the reference stays the base (nothing of it is saved) and
    step 3 trains ARMOR against it, the lr warmup counted again from step 2."""
    run_dir = tmp_path / "run"
    overrides = [*_overrides(synthetic_cache, run_dir, _planted(tmp_path / "planted.py", [0.5, 0.0, 1.0])),
                 "model.lora.rank=8", "train.max_steps=3"]
    with caplog.at_level(logging.WARNING, logger="megatron_armor"):
        assert run_training(load_config(CONFIG, overrides)) == 0
    rows = _rows(run_dir)
    assert [rows[step]["monitor/anchored"] for step in (1, 2, 3)] == [0, 1, 0]
    assert [rows[step]["optim/lr"] for step in (1, 2, 3)] == [LR / 2, LR, LR / 2]
    # ARMOR against the base, which step 1's adapters moved the actor from (kl_on_ref is mean(ref - old) over the
    # anchors' tokens, a one-sample estimate whose sign is the sample's: non-zero is what shows the two differ)
    assert rows[3]["armor/anchors_used"] == 8 and rows[3]["mix_kl/kl_on_ref"] != 0
    assert ("step 2: anchor on alarm val_drop: switched to armor; the LoRA adapters and their optimizer state from "
            "the best checkpoint step_000001 (step 1, val/accuracy 0.5)") in caplog.text
    saved = {step: saved_modules(run_dir / "checkpoints" / f"step_{step:06d}") for step in (1, 2, 3)}
    assert all("ref" not in modules for modules in saved.values())
    assert all("_adapter." in key for key in saved[1]["actor"])
    assert bit_identical(saved[2]["actor"], saved[1]["actor"]) and not bit_identical(saved[3]["actor"], saved[1]["actor"])
    assert bit_identical(saved[2]["optimizer"], saved[1]["optimizer"]) and not _fresh(saved[2]["optimizer"])
    assert saved[3]["optimizer"]["adam_step"] == 4
    assert json.loads((run_dir / "checkpoints" / "BEST").read_text())["step"] == 3  # keep_best as without LoRA


def test_a_reference_reset_under_lora_restores_the_best_adapters_unless_the_step_is_the_best(
        synthetic_cache, tmp_path, caplog):
    """algorithm.ref_reset_period 1 under LoRA, no monitor: after step 1 the adapters stay (no best checkpoint yet),
    after step 2 (val/accuracy 0.0) they and their Adam state are step 1's (the best, 0.5) again, bit for bit, the lr
    schedule going on (no warmup again); after step 3 (1.0, a new best) they stay. The reference stays the base: no
    checkpoint holds one."""
    run_dir = tmp_path / "run"
    planted = _planted(tmp_path / "planted.py", [0.5, 0.0, 1.0])
    overrides = [*(o for o in _overrides(synthetic_cache, run_dir, planted) if not o.startswith("monitor.")),
                 "monitor.enabled=false", "model.lora.rank=8", "algorithm.ref_reset_period=1", "train.max_steps=3"]
    with caplog.at_level(logging.INFO, logger="megatron_armor"):
        assert run_training(load_config(CONFIG, overrides)) == 0
    rows = _rows(run_dir)
    assert [rows[step].get("armor/ref_reset", 0) for step in (1, 2, 3)] == [0, 1, 0]
    assert [rows[step]["optim/lr"] for step in (1, 2, 3)] == [LR / 2, LR, LR]
    assert "step 1: reference reset: the adapters stay (no best checkpoint yet)" in caplog.text
    assert ("step 2: reference reset under LoRA: the adapters and their optimizer state from the best checkpoint "
            "step_000001 (step 1, val/accuracy 0.5)") in caplog.text
    assert "step 3: reference reset: the adapters stay (val/accuracy 1 is the best so far)" in caplog.text
    saved = {step: saved_modules(run_dir / "checkpoints" / f"step_{step:06d}") for step in (1, 2, 3)}
    assert all("ref" not in modules for modules in saved.values())
    assert bit_identical(saved[2]["actor"], saved[1]["actor"]) and not _fresh(saved[2]["optimizer"])
    assert bit_identical(saved[2]["optimizer"], saved[1]["optimizer"])
    assert not bit_identical(saved[3]["actor"], saved[2]["actor"])  # trained on, not reset
    assert json.loads((run_dir / "checkpoints" / "BEST").read_text())["step"] == 3


def test_anchor_needs_a_best_checkpoint_and_an_algorithm_that_can_switch(tmp_path):
    from megatron_armor.algorithms import check_algorithm_config

    overrides = _overrides(tmp_path, tmp_path / "run", "megatron_armor.rewards.arithmetic:verify")
    with pytest.raises(ConfigError, match="set checkpoint.keep_best"):
        load_config(CONFIG, [*overrides, "checkpoint.keep_best=null"])
    mipu = load_config(CONFIG, [*overrides, "algorithm.name=mipu", "mipu.gate=false"])
    with pytest.raises(ConfigError, match="mipu cannot switch"):
        check_algorithm_config(mipu)
    check_algorithm_config(load_config(CONFIG, overrides))
    check_algorithm_config(load_config(CONFIG, [*overrides, "algorithm.name=armor", "rollout.sampling.actor_n=7"]))
