"""`armor eval` end to end on a tiny training run's checkpoints: its numbers equal what validation logged for the
same checkpoint and seed (one dataset list in both); the same sampled (n = 4, temperature 1), greedy and agentic
(trajectories of an environment, retry_env.py) JSONL rows and numbers at DP=1 and DP=2, and validation's (run over 2
ranks) at DP=1; the agentic dataset's metrics equal those computed from its JSONL rows; the table, the JSONL rows and
the PNGs written."""

import json
import re
from pathlib import Path
from statistics import mean

import pytest
import yaml
from launcher import armor

from megatron_armor.cli import main
from megatron_armor.data.datasets import write_jsonl
from megatron_armor.models.tiny import make_tiny_checkpoint
from megatron_armor.rewards.arithmetic import extract_answer, make_rows

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")
SEED = 1234  # the recipe's train.seed
ARITH = {"name": "arith", "path": "val.jsonl", "reward_fn": "megatron_armor.rewards.arithmetic:verify",
         "answer_fn": "megatron_armor.rewards.arithmetic:extract_answer", "n": 4, "pass_k": [1, 2, 4],
         "temperature": 1.0, "top_p": 0.7, "max_new_tokens": 40}
GREEDY = {"name": "greedy", "path": "val.jsonl", "reward_fn": "megatron_armor.rewards.arithmetic:verify",
          "n": 1, "temperature": 0.0, "max_new_tokens": 40, "max_prompts": 8}
AGENTIC = {"name": "retry", "path": "val.jsonl", "answer_fn": "megatron_armor.rewards.arithmetic:extract_answer",
           "n": 2, "temperature": 1.0, "top_p": 0.7, "max_new_tokens": 40, "max_prompts": 6,
           "agentic": {"environment": f"{Path(__file__).parent / 'retry_env.py'}:RetryArithmetic",
                       "chat_template": str(Path(__file__).parents[1] / "trainer" / "agentic_task" / "char_chat.jinja"),
                       "max_turns": 2, "max_total_tokens": 120}}


def test_eval_matches_validation_and_data_parallel_sizes(synthetic_cache, tmp_path):
    write_jsonl(make_rows(12, seed=99), tmp_path / "val.jsonl")
    both = tmp_path / "datasets.yaml"
    both.write_text(yaml.safe_dump([ARITH, GREEDY, AGENTIC]))
    run = tmp_path / "run"
    proc = armor("train", "--config", CONFIG, "--max-steps", "2", "--run-dir", str(run), "--task.cache_dir",
                 str(synthetic_cache), "--task.num_train_rows", "400", "--task.num_val_rows", "16",
                 "--eval.every", "1", "--eval.before_train", "false", "--eval.datasets", str(both),
                 "--checkpoint.every", "1", "--checkpoint.keep_last", "0", "--logging.tensorboard", "false",
                 "--logging.progress_bar", "false", "--logging.plot", "false", "--optimizer.lr", "1e-3",
                 nproc=2, log_dir=tmp_path / "logs")  # the recipe's TP=2: validation dealt over 2 ranks
    assert proc.returncode == 0, proc.output[-6000:]
    logged = {row["step"]: row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert logged[1]["val/accuracy"] == logged[1]["val/arith/avg@4"]

    out = tmp_path / "eval"
    proc = armor("eval", "--checkpoints", str(run / "checkpoints" / "step_*"), "--datasets", str(both),
                 "--out", str(out), "--seed", str(SEED), "--no-progress-bar", nproc=2, log_dir=tmp_path / "logs-eval")
    assert proc.returncode == 0, proc.output[-6000:]
    results = json.loads((out / "results.json").read_text())
    assert [c["step"] for c in results["checkpoints"]] == [1, 2]
    for checkpoint in results["checkpoints"]:
        for dataset, metrics in checkpoint["datasets"].items():
            for metric, value in metrics.items():
                assert value == logged[checkpoint["step"]][f"val/{dataset}/{metric}"], (checkpoint["step"], metric)
    assert set(results["checkpoints"][0]["datasets"]["arith"]) >= {"avg@4", "avg@4_stderr", "pass@1", "pass@2",
                                                                   "pass@4", "maj@4", "truncated_fraction"}
    rows = [json.loads(line) for line in (out / "samples" / "step_000002" / "arith.jsonl").read_text().splitlines()]
    assert len(rows) == 12 * 4 and [(r["prompt_id"], r["sample"]) for r in rows[:5]] == [(0, 0), (0, 1), (0, 2),
                                                                                         (0, 3), (1, 0)]
    assert results["checkpoints"][1]["datasets"]["arith"]["avg@4"] == sum(r["correct"] for r in rows) / len(rows)
    assert "turns" not in rows[0]  # single completions: no trajectory fields
    check_agentic_metrics(results["checkpoints"][1]["datasets"]["retry"], out / "samples" / "step_000002" / "retry.jsonl")
    table = (out / "results.md").read_text().splitlines()
    assert table[0].startswith("| checkpoint | step | arith avg@4 |") and table[3].startswith("| step_000002 | 2 |")
    assert (out / "plots" / "avg@4.png").stat().st_size > 0 and (out / "plots" / "pass@2.png").is_file()

    single = tmp_path / "eval-dp1"  # one rank: each request's seed is its own, not its rank's
    assert main(["eval", "--checkpoints", str(run / "checkpoints" / "step_000002"), "--datasets", str(both),
                 "--out", str(single), "--seed", str(SEED), "--no-progress-bar"]) == 0
    dp1 = json.loads((single / "results.json").read_text())["checkpoints"][0]["datasets"]
    assert dp1 == results["checkpoints"][1]["datasets"]
    for dataset in ("arith", "greedy", "retry"):
        assert ((single / "samples" / "step_000002" / f"{dataset}.jsonl").read_text()
                == (out / "samples" / "step_000002" / f"{dataset}.jsonl").read_text()), dataset
    assert len({r["response"] for r in rows}) > 12  # sampled: a prompt's 4 responses are not all one
    assert not (single / "plots").exists()  # one checkpoint: no curves

    greedy_only = tmp_path / "greedy.yaml"
    greedy_only.write_text(yaml.safe_dump([GREEDY]))

    # evaluating part of the datasets again into the same directory keeps nothing of the first evaluation
    assert main(["eval", "--checkpoints", str(run / "checkpoints" / "step_000002"), "--datasets", str(greedy_only),
                 "--out", str(out), "--seed", "5", "--no-progress-bar"]) == 0
    assert not (out / "samples" / "step_000001").exists() and not (out / "plots").exists()
    assert list(json.loads((out / "results.json").read_text())["checkpoints"][0]["datasets"]) == ["greedy"]


def check_agentic_metrics(metrics: dict, samples: Path) -> None:
    """The agentic dataset's metrics against those computed here from its JSONL rows (6 prompts x 2 trajectories)."""
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 12 and {"status", "turns", "tool_calls", "tool_errors", "final_answer"} <= set(rows[0])
    assert {r["turns"] for r in rows} == {1, 2}  # some answered right at once, some were asked again
    calls = sum(r["tool_calls"] for r in rows)
    assert metrics["turns_mean"] == mean(r["turns"] for r in rows)
    assert metrics["tool_calls_mean"] == calls / 12
    assert metrics["tool_error_rate"] == sum(r["tool_errors"] for r in rows) / calls
    assert all(r["correct"] == (r["reward"] > 0) for r in rows)
    completed = [r for r in rows if r["status"] == "completed"]  # each turn's answer checked: right iff one was
    assert completed and all(r["tool_calls"] == r["turns"] and r["correct"] == (r["tool_errors"] < r["turns"])
                             for r in completed)
    assert all(r["answer"] == extract_answer(r["final_answer"]) for r in rows)
    pairs = [rows[i:i + 2] for i in range(0, 12, 2)]
    assert metrics["avg@2"] == mean(float(r["correct"]) for r in rows)
    assert metrics["pass@2"] == mean(float(a["correct"] or b["correct"]) for a, b in pairs)
    assert metrics["maj@2"] == mean(float(a["correct"] if a["answer"] is not None or b["answer"] is None
                                          else b["correct"]) for a, b in pairs)  # a tie: the first sample's answer


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Two tiny HF checkpoints of different shapes."""
    root = tmp_path_factory.mktemp("tiny-models")
    make_tiny_checkpoint(root / "a", seed=1)
    make_tiny_checkpoint(root / "b", seed=1, hidden_size=32)
    return root


@pytest.mark.parametrize("bad, checkpoints, message", [
    ({**GREEDY, "pass_k": [2]}, ["a"], "pass_k \\[2\\] larger than n = 1"),
    ({**GREEDY, "tempreature": 1.0}, ["a"], "unknown keys \\['tempreature'\\]"),
    ({**GREEDY, "answer_key": "solution_missing"}, ["a"], "row 1: missing required field 'solution_missing'"),
    ({**GREEDY, "agentic": {"environment": "no_such_module:Env"}}, ["a"], "cannot import module 'no_such_module'"),
    (GREEDY, ["a", "missing"], "missing does not exist"),
    (GREEDY, ["a", "b"], "is not the model of"),
])
def test_bad_input_fails_before_generation(tiny_models, tmp_path, capsys, bad, checkpoints, message):
    write_jsonl(make_rows(4, seed=3), tmp_path / "val.jsonl")
    (tmp_path / "datasets.yaml").write_text(yaml.safe_dump([bad]))
    code = main(["eval", "--checkpoints", *[str(tiny_models / c) for c in checkpoints], "--datasets",
                 str(tmp_path / "datasets.yaml"), "--out", str(tmp_path / "out"), "--no-progress-bar"])
    assert code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()  # nothing generated, nothing written
