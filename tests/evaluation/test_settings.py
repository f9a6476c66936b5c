"""The dataset list: defaults, the k of pass@k, and the errors a bad list gets before anything loads."""

import pytest
import yaml

from megatron_armor.evaluation.settings import EvalDataset, EvalSettingsError, load_eval_datasets

VERIFY = "megatron_armor.rewards.arithmetic:verify"


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


@pytest.mark.parametrize("entry, message", [
    ({"name": "a", "path": "val.jsonl", "n": 2, "pass_k": [4]}, r"pass_k \[4\] larger than n = 2"),
    ({"name": "a", "path": "val.jsonl", "n": "4"}, "n must be int, got '4'"),
    ({"name": "a", "path": "val.jsonl", "n": True}, "n must be int, got True"),
    ({"name": "a", "path": "val.jsonl", "top_p": 0}, "0 < top_p <= 1"),
    ({"name": "a b", "path": "val.jsonl"}, "a name is letters"),
    ({"path": "val.jsonl"}, r"missing \['name'\]"),
    ({"name": "a", "path": "gone.jsonl"}, "gone.jsonl does not exist"),
    ({"name": "a", "path": "val.jsonl", "reward_fn": "megatron_armor.rewards.arithmetic:nothing"}, "nothing"),
])
def test_bad_entries(tmp_path, entry, message):
    with pytest.raises(EvalSettingsError, match=message):
        load_eval_datasets(write(tmp_path, [{"reward_fn": VERIFY, **entry}]))


def test_bad_lists(tmp_path):
    with pytest.raises(EvalSettingsError, match="names must be unique"):
        load_eval_datasets(write(tmp_path, [{"name": "a", "path": "val.jsonl"}] * 2))
    with pytest.raises(EvalSettingsError, match="non-empty YAML list"):
        load_eval_datasets(write(tmp_path, {"name": "a"}))
