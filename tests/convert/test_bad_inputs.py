"""Conversion refuses bad inputs with one clear message and leaves nothing half-written behind."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_armor.convert import workers
from megatron_armor.convert.cli import main
from megatron_armor.convert.hf_inputs import inspect_hf_checkpoint
from megatron_armor.convert.hf_shards import SafetensorsShardWriter, TensorSpec, name_shards
from megatron_armor.convert.megatron_checkpoint import (
    DIST_CHECKPOINT_DIR, INFO_FILE, is_megatron_checkpoint, save_model_checkpoint,
)
from megatron_armor.convert.output_dir import staging_dir
from megatron_armor.convert.streaming_save import StreamingSaveStrategy
from megatron_armor.convert.weights import TIED_HEAD, CheckpointError, HFCheckpointReader, check_hf_tensors
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.models.hf_config import load_model_shape, transformer_config


@pytest.fixture
def hf_copy(tiny_model_factory, tmp_path):
    """A writable copy of a tiny Qwen2 checkpoint, sharded into several files with an index."""
    source = tiny_model_factory("qwen2")
    copy = tmp_path / "hf"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(source / "model.safetensors")
    plan = [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    writer = SafetensorsShardWriter(copy, plan, max_shard_bytes=100_000)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    name_shards(copy, writer.close())
    return copy


def convert(hf_dir: Path, out: Path, *extra: str) -> int:
    return main(["hf-to-megatron", "--hf-path", str(hf_dir), "--out", str(out), "--tp", "2", "--pp", "2", *extra])


def shard_files(hf_dir: Path) -> list[Path]:
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    return sorted(hf_dir / f for f in set(index["weight_map"].values()))


def edit_config(hf_dir: Path, **fields) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **fields}))


def assert_refused(capsys, rc: int, out: Path, *phrases: str) -> None:
    message = capsys.readouterr().err
    assert rc == 2, message
    assert all(phrase in message for phrase in phrases), message
    assert not out.exists() and not staging_dir(out).exists()


def test_unknown_architecture_lists_supported(hf_copy, tmp_path, capsys):
    edit_config(hf_copy, model_type="gpt2")
    out = tmp_path / "out"
    assert_refused(capsys, convert(hf_copy, out), out, "'gpt2' is not supported",
                   "'deepseek_v3', 'glm4_moe', 'llama', 'mistral', 'mixtral', 'qwen2', 'qwen2_moe', 'qwen3', "
                   "'qwen3_moe'")


@pytest.mark.parametrize("edit, phrase", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"use_sliding_window": True}, "sliding-window attention"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types ['sliding_attention']"),
])
def test_options_the_model_would_not_build_are_refused(hf_copy, tmp_path, capsys, edit, phrase):
    edit_config(hf_copy, **edit)
    out = tmp_path / "out"
    assert_refused(capsys, convert(hf_copy, out), out, phrase)


def test_glm_layers_the_config_does_not_declare_and_an_unrenormalised_router_are_refused_by_name(
        tiny_model_factory, tmp_path, capsys):
    """Tensors of a GLM-4.5 layer after the last decoder layer that config.json does not declare a
    multi-token-prediction layer (num_nextn_predict_layers 0) are named as unexpected (with 1 they are carried:
    tests/convert/test_moe_round_trip.py); a sigmoid router without renormalisation is refused by its config field."""
    source = tiny_model_factory("glm4_moe")
    copy = tmp_path / "hf"
    shutil.copytree(source, copy)
    tensors = load_file(copy / "model.safetensors")
    save_file({**tensors, "model.layers.2.eh_proj.weight": torch.zeros(64, 128)}, copy / "model.safetensors",
              metadata={"format": "pt"})
    edit_config(copy, num_nextn_predict_layers=0)
    out = tmp_path / "out"
    assert_refused(capsys, convert(copy, out), out, "unexpected ['model.layers.2.eh_proj.weight']")
    edit_config(copy, norm_topk_prob=False)
    assert_refused(capsys, convert(copy, out), out, "glm4_moe with norm_topk_prob false is not supported")


def test_an_fp8_deepseek_v3_checkpoint_is_refused_by_its_quantization_config(tiny_model_factory, tmp_path, capsys):
    """DeepSeek-V3 / R1 as released: fp8 weight blocks with their scales, which config.json's quantization_config
    declares; refused by that field before any tensor is read (the recipe says to cast them to bf16 first)."""
    copy = tmp_path / "hf"
    shutil.copytree(tiny_model_factory("deepseek_v3"), copy)
    edit_config(copy, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    out = tmp_path / "out"
    assert_refused(capsys, convert(copy, out), out, "deepseek_v3 with quantization_config {'quant_method': 'fp8'")


def test_missing_shard(hf_copy, tmp_path, capsys):
    missing = shard_files(hf_copy)[1]
    missing.unlink()
    out = tmp_path / "out"
    assert_refused(capsys, convert(hf_copy, out), out, str(missing), "missing")


def test_corrupt_shard(hf_copy, tmp_path, capsys):
    corrupt = shard_files(hf_copy)[0]
    corrupt.write_bytes(corrupt.read_bytes()[:-100])  # truncated download
    out = tmp_path / "out"
    assert_refused(capsys, convert(hf_copy, out), out, str(corrupt), "corrupt safetensors")


def test_shape_mismatch_names_the_tensor(hf_copy, tmp_path, capsys):
    edit_config(hf_copy, intermediate_size=192)
    out = tmp_path / "out"
    assert_refused(capsys, convert(hf_copy, out), out, "gate_proj.weight", "[176, 64]", "[192, 64]")


def test_layout_that_does_not_divide_the_model(hf_copy, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["hf-to-megatron", "--hf-path", str(hf_copy), "--out", str(out), "--pp", "3"])
    assert_refused(capsys, rc, out, "num_hidden_layers=2 is not divisible by pipeline_parallel_size=3")


def fake_megatron_checkpoint(path: Path) -> None:
    (path / DIST_CHECKPOINT_DIR).mkdir(parents=True)
    (path / INFO_FILE).write_text("{}")


@pytest.mark.torchrun  # it replaces torchrun's launch itself
def test_existing_checkpoint_needs_overwrite(hf_copy, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    fake_megatron_checkpoint(out)
    assert convert(hf_copy, out) == 2
    assert "already holds a Megatron checkpoint; pass --overwrite" in capsys.readouterr().err
    assert (out / INFO_FILE).read_text() == "{}"
    # With --overwrite, a worker failure still leaves the old checkpoint untouched and no staging dir.
    worker_envs = []
    monkeypatch.setattr(workers.subprocess, "call", lambda command, env: worker_envs.append(env) or 1)
    assert convert(hf_copy, out, "--overwrite") == 1
    assert "failed in a worker process" in capsys.readouterr().err
    assert [env["CUDA_VISIBLE_DEVICES"] for env in worker_envs] == [""]  # conversion workers claim no GPU
    assert (out / INFO_FILE).read_text() == "{}" and not staging_dir(out).exists()


def test_non_checkpoint_directory_is_never_replaced(hf_copy, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert convert(hf_copy, out, "--overwrite") == 2
    assert "is not empty and is not a Megatron checkpoint" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"


def test_export_of_a_non_megatron_directory(hf_copy, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["megatron-to-hf", "--megatron-path", str(hf_copy), "--out", str(out)])
    assert_refused(capsys, rc, out, "not a Megatron checkpoint")


def test_tied_checkpoint_may_also_store_lm_head(tiny_model_factory, tmp_path):
    """Some exporters write the tied copy of the embedding as lm_head.weight: accepted and not read;
    an untied model still needs it, and any other extra tensor is still refused."""
    tied = tmp_path / "tied"
    shutil.copytree(tiny_model_factory("qwen3", tie_word_embeddings=True, vocab_size=100, head_dim=32), tied)
    tensors = load_file(tied / "model.safetensors")
    save_file({**tensors, TIED_HEAD: tensors["model.embed_tokens.weight"].clone()}, tied / "model.safetensors")
    assert TIED_HEAD not in check_hf_tensors(HFCheckpointReader(tied), inspect_hf_checkpoint(tied).shape)

    save_file({**tensors, TIED_HEAD: tensors["model.embed_tokens.weight"].clone(), "extra.weight": torch.zeros(2)},
              tied / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected \['extra.weight'\]"):
        inspect_hf_checkpoint(tied)
    edit_config(tied, tie_word_embeddings=False)
    save_file(tensors, tied / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing \['lm_head.weight'\]"):
        inspect_hf_checkpoint(tied)


def test_shard_writer_closes_its_file_when_the_export_fails(tmp_path):
    plan = [TensorSpec("a", (2,), torch.float32), TensorSpec("b", (2,), torch.float32)]
    with pytest.raises(ValueError, match="planned b"):
        with SafetensorsShardWriter(tmp_path, plan, max_shard_bytes=100) as writer:
            writer.add("a", torch.zeros(2))
            writer.add("c", torch.zeros(2))
    open_files = {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}
    assert not open_files & {str(p.resolve()) for p in tmp_path.glob("*.safetensors")}


def test_failed_save_leaves_no_checkpoint_marker(tiny_model_factory, tmp_path):
    """armor_checkpoint.json (what marks a Megatron checkpoint) is written only after every shard is saved."""
    hf_dir = tiny_model_factory("qwen2")
    shape = load_model_shape(hf_dir)

    def fail(name: str) -> torch.Tensor:
        raise OSError("disk full")

    initialize_distributed(1, 1, 1)
    try:
        with torch.device("meta"):
            model = build_gpt_model(shape, transformer_config(shape), trainable=False)
        with pytest.raises(BaseException, match="disk full"):  # torch DCP wraps it in a BaseException
            save_model_checkpoint(model, shape, tmp_path / "ckpt", side_files_from=hf_dir,
                                  strategy=StreamingSaveStrategy(model, fail))
    finally:
        destroy_distributed()
    assert (tmp_path / "ckpt" / DIST_CHECKPOINT_DIR).is_dir() and not is_megatron_checkpoint(tmp_path / "ckpt")
