"""examples/tiny/agentic.yaml through `armor train`'s code path (`run_training`, one process), at tiny sizes: the warm
start shows the calculator's demonstrations, so the policy's trajectories call the tool from the first RL step and
those trajectories are what it trains on; validation logs and prints the accuracy with the tool (the
prompts rolled out as trajectories) beside that of the same model answering without it.

The run is GRPO without group filtering rather than the example's ARMOR: a 100-step warm start (what fits the test's
time) writes well-formed tool calls but rarely the right expression, so ARMOR would find no correct anchor to keep a
group with. tests/trainer/test_agentic_run.py covers ARMOR on trajectories."""

from pathlib import Path

from training_runs import run_metrics

from megatron_armor.config import load_config
from megatron_armor.trainer.run.train import run_training

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "agentic.yaml")


def test_agentic_example_trains_trajectories_that_call_the_calculator(synthetic_cache, tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = [
        f"task.cache_dir={synthetic_cache}", f"logging.run_dir={run_dir}", "train.max_steps=2",
        "task.num_train_rows=400", "task.num_val_rows=8", "task.warm_start.steps=100", "task.warm_start.tool_fraction=1.0",
        "eval.every=2", "eval.before_train=false", "eval.max_prompts=8", "rollout.sampling.val_n=1", "checkpoint.every=100",
        "checkpoint.save_model=false", "logging.tensorboard=false", "logging.plot=false", "logging.progress_bar=false",
        "algorithm.name=grpo", "algorithm.filter_groups=false", "rollout.sampling.n_samples=4",
        "rollout.sampling.actor_n=4", "train.train_batch_size=2", "train.gen_batch_size=2", "train.mini_batch_size=2",
    ]
    assert run_training(load_config(CONFIG, overrides)) == 0
    rows = run_metrics(run_dir)
    for step in (1, 2):
        row = rows[step]
        assert row["agent/tool_calls_mean"] > 0 and row["agent/turns_mean"] > 1  # tool results came back, and
        assert row["agent/status_completed"] > 0 and row["agent/trainable_token_fraction"] < 1  # were not trained
        assert row["train/update_skipped"] == 0.0 and row["mismatch/logprob_abs_diff"] < 1e-5
    # validation: the prompts rolled out as trajectories (with the tool) and answered bare (without), both printed
    for key in ("val/accuracy", "val/accuracy_no_tools"):
        assert 0.0 <= rows[2][key] <= 1.0
    printed = f"step 2: val/accuracy = {rows[2]['val/accuracy']:.3f}, val/accuracy_no_tools = "
    assert printed + f"{rows[2]['val/accuracy_no_tools']:.3f}\n" in capsys.readouterr().out
