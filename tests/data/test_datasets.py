"""Prompt datasets: row validation with file/row in the message, vocab checks, resumable sampling."""

import json

import pytest

from megatron_armor.data.datasets import (
    DatasetError, PromptSampler, check_tokenizer_fits_model, load_prompt_rows, write_jsonl,
)
from megatron_armor.models.tiny import make_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_char_tokenizer()


def test_rows_are_tokenized_and_keep_their_fields(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    write_jsonl([{"question": "1+2=", "target": "3", "source": "x"}], path)
    rows = load_prompt_rows(path, tokenizer=tokenizer, prompt_key="question", answer_key="target")
    assert tokenizer.decode(rows[0].prompt_ids) == "1+2="
    assert rows[0].row["answer"] == "3" and rows[0].row["source"] == "x"


def test_chat_template_wraps_the_prompt_in_the_tokenizers_template(tmp_path):
    """transformers 5 returns the template's ids in a BatchEncoding (a Mapping, not a dict)."""
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}[assistant]{% endif %}")
    path = tmp_path / "train.jsonl"
    write_jsonl([{"prompt": "1+2=", "answer": "3"}], path)
    (row,) = load_prompt_rows(path, tokenizer=tokenizer, apply_chat_template=True)
    assert row.prompt_ids == tokenizer.encode("[user]1+2=[assistant]", add_special_tokens=False)


def test_chat_style_prompt_column_is_rendered_as_its_messages(tmp_path):
    """verl-style parquet (e.g. DAPO-Math-17k): the prompt column is a list of {content, role} messages; the
    chat template renders those messages, not the list's Python repr inside one user message."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}[assistant]{% endif %}")
    path = tmp_path / "dapo.parquet"
    messages = [[{"content": "be brief", "role": "system"}, {"content": "1+2=", "role": "user"}],
                [{"content": "4-1=", "role": "user"}]]
    pq.write_table(pa.table({"prompt": messages, "answer": ["3", "3"]}), path)
    rows = load_prompt_rows(path, tokenizer=tokenizer, apply_chat_template=True, max_prompt_length=64)
    assert [tokenizer.decode(r.prompt_ids) for r in rows] == ["[system]be brief[user]1+2=[assistant]",
                                                              "[user]4-1=[assistant]"]
    with pytest.raises(DatasetError, match=r"dapo.parquet row 1: field 'prompt' is a list of chat messages; set "
                                           r"data.apply_chat_template=true"):
        load_prompt_rows(path, tokenizer=tokenizer, max_prompt_length=64)
    bad = tmp_path / "bad.jsonl"
    write_jsonl([{"prompt": ["1+2="], "answer": "3"}], bad)
    with pytest.raises(DatasetError, match=r"bad.jsonl row 1: field 'prompt' must be a string or a list of chat "
                                           r"messages .*got list"):
        load_prompt_rows(bad, tokenizer=tokenizer, apply_chat_template=True)


def test_each_distinct_prompt_is_tokenized_once(tmp_path, monkeypatch):
    """verl's DAPO-Math-17k repeats 17k prompts to 1.79M rows: repeats reuse the first tokenization."""
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    calls = []
    render = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda messages, **kw: calls.append(messages) or render(messages, **kw))
    chat = [{"role": "user", "content": "4-1="}]
    path = tmp_path / "repeated.jsonl"
    write_jsonl([{"prompt": p, "answer": "3"} for p in ["1+2=", chat, "1+2=", chat, "2+1=", "1+2="]], path)
    rows = load_prompt_rows(path, tokenizer=tokenizer, apply_chat_template=True, max_prompt_length=64)
    assert calls == [[{"role": "user", "content": "1+2="}], chat, [{"role": "user", "content": "2+1="}]]
    assert [tokenizer.decode(r.prompt_ids) for r in rows] == ["[user]1+2=", "[user]4-1=", "[user]1+2=", "[user]4-1=",
                                                              "[user]2+1=", "[user]1+2="]
    assert rows[0].prompt_ids is rows[2].prompt_ids is rows[5].prompt_ids
    assert [r.index for r in rows] == list(range(6))
    write_jsonl([{"prompt": "1+2=", "answer": "3"}, {"prompt": "x" * 70, "answer": "3"}, {"prompt": "x" * 70, "answer": "3"}], path)
    with pytest.raises(DatasetError, match="repeated.jsonl row 2: prompt has 76 tokens"):
        load_prompt_rows(path, tokenizer=tokenizer, apply_chat_template=True, max_prompt_length=64)


def test_a_dotted_answer_key_reads_a_nested_field(tmp_path, tokenizer):
    """verl's parquet files keep the answer in reward_model.ground_truth."""
    path = tmp_path / "train.jsonl"
    write_jsonl([{"prompt": "1+2=", "reward_model": {"ground_truth": "3", "style": "rule"}}], path)
    (row,) = load_prompt_rows(path, tokenizer=tokenizer, answer_key="reward_model.ground_truth")
    assert row.row["answer"] == "3"
    write_jsonl([{"prompt": "1+2=", "reward_model": {"style": "rule"}}], path)
    with pytest.raises(DatasetError, match=r"row 1: missing required field 'reward_model\.ground_truth'"):
        load_prompt_rows(path, tokenizer=tokenizer, answer_key="reward_model.ground_truth")


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "1+1="}\n', r"train.jsonl row 1: missing required field 'answer'"),
        ('{"prompt": "1+1=", "answer": "2"}\n{"answer": "3"}\n', r"row 2: missing required field 'prompt'"),
        ('{"prompt": "1+1=", "answer": "2"}\nnot json\n', r"train.jsonl line 2: invalid JSON"),
        ("\n", r"dataset is empty"),
        ('["1+1=", "2"]\n', r"row 1: expected a JSON object, got list"),
        ('{"prompt": "' + "1+" * 20 + '1=", "answer": "21"}\n', r"prompt has 42 tokens; it must have 1..data.max_prompt_length \(16\)"),
    ],
)
def test_bad_rows_name_file_row_and_fix(tmp_path, tokenizer, content, message):
    path = tmp_path / "train.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_prompt_rows(path, tokenizer=tokenizer, max_prompt_length=16)


def test_missing_file_and_unknown_format(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match="dataset file not found"):
        load_prompt_rows(tmp_path / "nope.jsonl", tokenizer=tokenizer)
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unknown dataset format '.csv'; use .jsonl or .parquet"):
        load_prompt_rows(csv, tokenizer=tokenizer)


def test_parquet_rows(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "val.parquet"
    pq.write_table(pa.table({"prompt": ["2*3=", "4-1="], "answer": ["6", "3"]}), path)
    rows = load_prompt_rows(path, tokenizer=tokenizer)
    assert [r.row["answer"] for r in rows] == ["6", "3"]


def test_tokenizer_model_vocab_mismatch(tokenizer):
    check_tokenizer_fits_model(tokenizer, 128)
    with pytest.raises(DatasetError, match=r"tokenizer has 98 tokens but the model's vocab_size is 64"):
        check_tokenizer_fits_model(tokenizer, 64)


def test_sampler_epochs_and_resume_give_the_same_stream(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    write_jsonl([{"prompt": f"{i}+0=", "answer": str(i)} for i in range(10)], path)
    rows = load_prompt_rows(path, tokenizer=tokenizer)
    sampler = PromptSampler(rows, 4, seed=3)
    first = [[r.index for r in sampler.next_batch()] for _ in range(2)]
    assert len(set(first[0] + first[1])) == 8  # no repeats within an epoch
    state = json.loads(json.dumps(sampler.state_dict()))
    expected = [[r.index for r in sampler.next_batch()] for _ in range(3)]
    resumed = PromptSampler(rows, 4, seed=3)
    resumed.load_state_dict(state)
    assert [[r.index for r in resumed.next_batch()] for _ in range(3)] == expected
    with pytest.raises(DatasetError, match="generation batch size 11 exceeds the dataset size 10"):
        PromptSampler(rows, 11, seed=0)
