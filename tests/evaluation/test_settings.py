"""The dataset list: defaults, the k of pass@k, and the errors a bad list gets before anything loads."""

from pathlib import Path

import pytest
import yaml

from megatron_armor.agentic.examples import CalculatorArithmetic
from megatron_armor.cli import main
from megatron_armor.config import AgenticConfig
from megatron_armor.evaluation.settings import EvalDataset, EvalSettingsError, load_eval_datasets, validation_datasets

VERIFY = "megatron_armor.rewards.arithmetic:verify"
ENV = "megatron_armor.agentic.examples:CalculatorArithmetic"
CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


def write(tmp_path, entries):
    (tmp_path / "val.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "list.yaml").write_text(yaml.safe_dump(entries))
    return tmp_path / "list.yaml"


def test_defaults_and_ks(tmp_path):
    (dataset,) = load_eval_datasets(write(tmp_path, [{"name": "a", "path": "val.jsonl", "reward_fn": VERIFY}]))
    assert dataset.path == str(tmp_path / "val.jsonl") and dataset.n == 1 and dataset.ks == (1,)
    assert EvalDataset("b", "p", n=8).ks == (1, 2, 4, 8)
    assert EvalDataset("b", "p", n=6).ks == (1, 2, 4, 6)
    assert EvalDataset("b", "p", n=6, pass_k=(3, 1, 3)).ks == (1, 3)


def test_an_agentic_entry_takes_rollout_agentics_settings(tmp_path):
    entry = {"name": "a", "path": "val.jsonl", "agentic": {"environment": ENV, "max_turns": 3, "on_failed": "resample"}}
    (dataset,) = load_eval_datasets(write(tmp_path, [entry]))
    assert dataset.agentic == AgenticConfig(environment=ENV, max_turns=3, on_failed="resample")
    assert dataset.environment() is CalculatorArithmetic
    assert load_eval_datasets(write(tmp_path, [{"name": "a", "path": "val.jsonl"}]))[0].environment() is None


@pytest.mark.parametrize("entry, message", [
    ({"name": "a", "path": "val.jsonl", "n": 2, "pass_k": [4]}, r"pass_k \[4\] larger than n = 2"),
    ({"name": "a", "path": "val.jsonl", "n": "4"}, "n must be int, got '4'"),
    ({"name": "a", "path": "val.jsonl", "n": True}, "n must be int, got True"),
    ({"name": "a", "path": "val.jsonl", "top_p": 0}, "0 < top_p <= 1"),
    ({"name": "a b", "path": "val.jsonl"}, "a name is letters"),
    ({"path": "val.jsonl"}, r"missing \['name'\]"),
    ({"name": "a", "path": "gone.jsonl"}, "gone.jsonl does not exist"),
    ({"name": "a", "path": "val.jsonl", "reward_fn": "megatron_armor.rewards.arithmetic:nothing"}, "nothing"),
    ({"name": "a", "path": "val.jsonl", "agentic": "calculator"}, "agentic must be a mapping"),
    ({"name": "a", "path": "val.jsonl", "agentic": {"environment": ENV, "max_turn": 2}}, r"agentic keys \['max_turn'\]"),
    ({"name": "a", "path": "val.jsonl", "agentic": {"max_turns": 2}}, "agentic needs an environment"),
    ({"name": "a", "path": "val.jsonl", "agentic": {"environment": ENV, "max_turns": 0}}, "max_turns must be >= 1"),
    ({"name": "a", "path": "val.jsonl", "agentic": {"environment": ENV, "chat_template": "gone.jinja"}},
     "agentic.chat_template gone.jinja does not exist"),
    ({"name": "a", "path": "val.jsonl", "agentic": {"environment": VERIFY}}, "not a subclass of"),
    ({"name": "a", "path": "val.jsonl", "agentic": {"environment": "no_such_module:Env"}},
     "dataset 'a': environment 'no_such_module:Env': cannot import module"),
])
def test_bad_entries(tmp_path, entry, message):
    with pytest.raises(EvalSettingsError, match=message):
        load_eval_datasets(write(tmp_path, [{"reward_fn": VERIFY, **entry}]))


def test_bad_lists(tmp_path):
    with pytest.raises(EvalSettingsError, match="names must be unique"):
        load_eval_datasets(write(tmp_path, [{"name": "a", "path": "val.jsonl"}] * 2))
    with pytest.raises(EvalSettingsError, match="non-empty YAML list"):
        load_eval_datasets(write(tmp_path, {"name": "a"}))


def test_validation_datasets_and_primary(tmp_path):
    path = write(tmp_path, [{"name": "a", "path": "val.jsonl"}, {"name": "b", "path": "val.jsonl"}])
    assert [d.name for d in validation_datasets(path, None)[0]] == ["a", "b"]
    assert validation_datasets(path, None)[1] == 0 and validation_datasets(path, "b")[1] == 1
    with pytest.raises(EvalSettingsError, match=r"eval.primary 'c' is not a dataset of .*\['a', 'b'\]"):
        validation_datasets(path, "c")


@pytest.mark.parametrize("flags, message", [
    (["--eval.datasets", "LIST", "--eval.primary", "nope"], "eval.primary 'nope' is not a dataset"),
    (["--eval.primary", "a"], "names a dataset of eval.datasets, which is not set"),
])
def test_armor_train_refuses_a_bad_validation_list_before_starting(tmp_path, capsys, flags, message):
    path = write(tmp_path, [{"name": "a", "path": "val.jsonl", "reward_fn": VERIFY}])
    flags = [str(path) if flag == "LIST" else flag for flag in flags]
    assert main(["train", "--config", CONFIG, *flags]) == 2
    assert message in capsys.readouterr().err
