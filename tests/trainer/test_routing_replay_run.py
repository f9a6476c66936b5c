"""Routing replay end to end: `armor train` on a tiny Qwen3-MoE whose engine routes differently from the trainer
(its routers' top-k taken on biased logits, tests/workers/biased_engine_run.py). With `train.routing_replay rollout`
the trainer replays the engine's experts and its old logprobs are the engine's to the fp32 floor; without it the
trainer routes on its own and misses them by a hundred times more. `moe/routing_agreement` (the trainer's own choices
against the replayed ones) measures the bias: below 1; `moe/replay_applied` (the experts the forward used against
the replayed ones) shows the replay took effect: 1."""

from pathlib import Path

import pytest

from launcher import run_workers
from training_runs import run_metrics, run_overrides

REPO = Path(__file__).parents[2]
CONFIG = str(REPO / "examples" / "tiny" / "armor.yaml")
# A random model never solves the arithmetic task; this reward pays about one sample in ten (a leading digit).
REWARD = f"reward.train_fn={REPO / 'benchmarks' / 'train_check.py'}:first_char_is_digit"


@pytest.fixture(scope="module")
def steps(tiny_model_factory, synthetic_cache, tmp_path_factory):
    """replay mode -> the metrics of one ARMOR step with the biased engine."""
    model = tiny_model_factory("qwen3_moe")
    result = {}
    for replay in ("rollout", "none"):
        run_dir = tmp_path_factory.mktemp(f"replay-{replay}") / "run"
        run_workers("biased_engine_run.py", 1, run_dir.parent / "w", CONFIG, *run_overrides(synthetic_cache, run_dir, 1),
                    f"model.path={model}", "task.warm_start.steps=0", "parallel.tensor_parallel_size=1", REWARD,
                    f"train.routing_replay={replay}")
        result[replay] = run_metrics(run_dir)[1]
    return result


def test_replay_gives_the_engine_logprobs_and_measures_the_bias(steps):
    replayed, own = steps["rollout"], steps["none"]
    assert replayed["mismatch/logprob_abs_diff"] < 1e-5, replayed["mismatch/logprob_abs_diff"]
    assert own["mismatch/logprob_abs_diff"] > 100 * replayed["mismatch/logprob_abs_diff"]
    assert 0.5 < replayed["moe/routing_agreement"] < 1.0  # the bias moves some tokens' experts, not most
    assert replayed["moe/replay_applied"] == 1.0  # yet the forward sent every token to the engine's experts
    assert "moe/routing_agreement" not in own and "moe/replay_applied" not in own
