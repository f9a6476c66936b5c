"""`armor eval --sglang-urls`: a server (the CPU engine behind SGLang's HTTP API) loads each checkpoint, an HF one
from disk and a Megatron one's tensors pushed by rank 0, and its greedy answers are the in-process engine's."""

import json

import yaml

from megatron_armor.cli import main
from megatron_armor.data.datasets import write_jsonl
from megatron_armor.rewards.arithmetic import make_rows


def test_eval_through_a_server_matches_the_in_process_engine(tiny_model_factory, second_tiny_model, serving,
                                                             tmp_path):
    first = tiny_model_factory("qwen2")
    megatron = tmp_path / "second-megatron"
    assert main(["convert", "hf-to-megatron", "--hf-path", str(second_tiny_model), "--out", str(megatron)]) == 0
    write_jsonl(make_rows(6, seed=2), tmp_path / "val.jsonl")
    (tmp_path / "datasets.yaml").write_text(yaml.safe_dump([{
        "name": "greedy", "path": "val.jsonl", "reward_fn": "megatron_armor.rewards.arithmetic:verify", "n": 2,
        "temperature": 0.0, "max_new_tokens": 12}]))
    common = ["eval", "--checkpoints", str(first), str(megatron), "--datasets", str(tmp_path / "datasets.yaml"),
              "--no-progress-bar"]
    assert main([*common, "--out", str(tmp_path / "local")]) == 0
    with serving(second_tiny_model) as server:  # it starts with other weights: each checkpoint must be loaded
        url = f"http://127.0.0.1:{server.state.port}"
        assert main([*common, "--out", str(tmp_path / "server"), "--sglang-urls", url]) == 0

    def samples(out, label):
        return [json.loads(line) for line in (out / "samples" / label / "greedy.jsonl").read_text().splitlines()]

    for label in (first.name, megatron.name):
        assert samples(tmp_path / "server", label) == samples(tmp_path / "local", label)
    assert [r["response"] for r in samples(tmp_path / "local", first.name)] != [
        r["response"] for r in samples(tmp_path / "local", megatron.name)]  # two models, two sets of answers
