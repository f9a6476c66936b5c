"""HF -> Megatron (saved at TP=2 x PP=2, TP=2 or PP=2) -> HF round trips (exported by one process, or
one per pipeline stage), and logits of the converted checkpoints loaded at TP=1, TP=2 and PP=2 (so
resharded) against the HF forward, for each supported architecture."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from launcher import run_workers
from megatron_armor.convert.cli import main
from megatron_armor.convert.hf_shards import INDEX_FILE
from megatron_armor.convert.hf_inputs import side_files
from megatron_armor.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_armor.convert.megatron_checkpoint import is_megatron_checkpoint, read_checkpoint_info
from megatron_armor.convert.output_dir import staging_dir
from megatron_armor.convert.weights import HFCheckpointReader

TOOLS = Path(__file__).parents[2] / "tools"
VARIANTS = {
    "qwen2": ("qwen2", {}),  # qkv bias, untied
    # q/k norms, head_dim != hidden / heads, tied embeddings, vocab 100 padded to 128.
    "qwen3-tied-padded": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True, "vocab_size": 100}),
    "llama3-rope-scaling": ("llama", {"rope_scaling_factor": 8.0, "max_position_embeddings": 16384}),
    "mistral": ("mistral", {}),
}
# Layout each is saved at (tp, pp): every split of the weights, in fewer processes than 2 x 2 each.
SAVE_LAYOUT = {"qwen2": (2, 2), "qwen3-tied-padded": (2, 1), "llama3-rope-scaling": (1, 2), "mistral": (2, 1)}
BF16 = "qwen3-bf16"  # round trip only, saved at TP=1 x PP=1: Megatron holds norm weights in fp32
# Export shard limit: tiny for qwen2 (several safetensors files + index), default for the others.
MAX_SHARD_GB = {"qwen2": "0.0001"}
# Export processes (one pipeline stage each): qwen2 (saved at PP=2, several files per stage) and the
# tied bf16 model (saved at PP=1, so loaded resharded; the last stage's output-layer copy is not exported).
EXPORT_PP = {"qwen2": "2", BF16: "2"}


def bf16_copy(hf_dir: Path, out: Path) -> Path:
    shutil.copytree(hf_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(hf_dir / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2))
    return out


@pytest.fixture(scope="module")
def converted(tiny_model_factory, tmp_path_factory):
    """variant -> (HF dir, Megatron checkpoint dir saved at SAVE_LAYOUT (bf16: TP=1 x PP=1)), each converted once."""
    made = {}
    for variant, (arch, options) in VARIANTS.items():
        hf_dir = tiny_model_factory(arch, **options)
        tp, pp = SAVE_LAYOUT[variant]
        made[variant] = hf_dir, convert_hf_to_megatron(hf_dir, tmp_path_factory.mktemp(variant) / "megatron", tp=tp, pp=pp)
    hf_dir = bf16_copy(tiny_model_factory("qwen3", **VARIANTS["qwen3-tied-padded"][1]), tmp_path_factory.mktemp(BF16) / "hf")
    made[BF16] = hf_dir, convert_hf_to_megatron(hf_dir, hf_dir.parent / "megatron", tp=1, pp=1)
    return made


@pytest.mark.parametrize("variant", [*VARIANTS, BF16])
def test_round_trip_is_bitwise(variant, converted, tmp_path):
    hf_dir, megatron_dir = converted[variant]
    info = read_checkpoint_info(megatron_dir)
    assert is_megatron_checkpoint(megatron_dir)
    assert (info.tensor_parallel_size, info.pipeline_parallel_size) == SAVE_LAYOUT.get(variant, (1, 1))
    out = tmp_path / "hf"
    args = ["--megatron-path", str(megatron_dir), "--out", str(out), "--max-shard-size", MAX_SHARD_GB.get(variant, "2"),
            "--pp", EXPORT_PP.get(variant, "1")]
    if variant == "qwen2":  # the tool, as users run it
        done = subprocess.run([sys.executable, str(TOOLS / "convert_megatron_to_hf.py"), *args], capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr[-4000:]
    else:  # the same main in this process (pp 1 exports here, pp 2 launches its stage processes)
        assert main(["megatron-to-hf", *args]) == 0

    original, exported = HFCheckpointReader(hf_dir), HFCheckpointReader(out)
    assert exported.names() == original.names()
    for name in original.names():
        a, b = original.get(name), exported.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == sorted(set(exported.weight_map.values()))  # stage files renamed, none left over
    if variant in MAX_SHARD_GB or variant in EXPORT_PP:
        assert len(files) > 1  # several files, read back through the index
        index = json.loads((out / INDEX_FILE).read_text())
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in map(exported.get, exported.names()))
    if variant in EXPORT_PP:  # transformers reads the stage-written files through the index
        loaded, reference = (AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (out, hf_dir))
        assert loaded.keys() == reference.keys() and all(torch.equal(loaded[k], reference[k]) for k in reference)
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    assert [p.name for p in side_files(out)] == [p.name for p in side_files(hf_dir)]
    assert all(p.read_bytes() == (hf_dir / p.name).read_bytes() for p in side_files(out))


def test_converted_logits_match_hf_at_tp1_tp2_pp2(converted, tmp_path):
    pairs = [f"{converted[v][0]}={converted[v][1]}" for v in VARIANTS]
    results = run_workers("convert_parity.py", 2, tmp_path, *pairs)
    merged: dict[str, float] = {}
    for result in results:
        mismatch = result.pop("mismatch_error")  # a model that does not fit the checkpoint: a clear error
        assert "does not match the model" in mismatch and "linear_fc1.weight" in mismatch, mismatch
        for key, diff in result.items():
            if diff is not None:
                merged[key] = max(diff, merged.get(key, 0.0))
    assert len(merged) == 3 * len(VARIANTS), sorted(merged)  # every layout of every variant compared
    assert max(merged.values()) < 1e-4, merged


def test_export_pp_that_does_not_divide_the_layers_is_refused(converted, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["megatron-to-hf", "--megatron-path", str(converted["qwen2"][1]), "--out", str(out), "--pp", "3"]) == 2
    assert "num_hidden_layers=2 is not divisible by pipeline_parallel_size=3" in capsys.readouterr().err
    assert not out.exists() and not staging_dir(out).exists()
