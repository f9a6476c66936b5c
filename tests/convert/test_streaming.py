"""Conversion streams: import builds one parameter at a time; export reads one parameter at a time and
refuses checkpoints whose tensors disagree with their config.json."""

import json
import shutil

import pytest
import torch

from launcher import run_workers
from megatron_armor.convert.cli import main
from megatron_armor.convert.dist_checkpoint_reader import DistCheckpointReader
from megatron_armor.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_armor.convert.mapping import hf_shard_index, hf_to_megatron_shard, megatron_shards_to_hf, model_mappings
from megatron_armor.convert.megatron_checkpoint import DIST_CHECKPOINT_DIR
from megatron_armor.convert.output_dir import staging_dir
from megatron_armor.convert.weights import HFCheckpointReader
from megatron_armor.models.hf_config import load_model_shape


def test_import_builds_each_parameter_once_and_frees_it(tiny_model_factory, tmp_path):
    (result,) = run_workers("streaming_save.py", 1, tmp_path, str(tiny_model_factory("qwen2")))
    assert result["calls"] == result["params"]  # every parameter built exactly once (gate/up share one build)
    assert result["most_alive"] <= 1  # the writer's last tensor at most: never the model
    assert result["max_diff"] == 0.0


def test_region_reads_across_stored_chunks(tiny_model_factory, tmp_path):
    """A tp2 checkpoint stores each layer's qkv as two row chunks; rows straddling them read exactly."""
    hf_dir = tiny_model_factory("qwen2")
    megatron_dir = convert_hf_to_megatron(hf_dir, tmp_path / "m", tp=2, pp=1)
    shape, hf = load_model_shape(hf_dir), HFCheckpointReader(hf_dir)
    qkv = next(m for m in model_mappings(shape, first_layer=1, num_layers=1) if m.megatron_name.endswith("linear_qkv.weight"))
    expected = hf_to_megatron_shard(qkv, [hf.get(n) for n in qkv.hf_names], shape, tp_size=1)  # [rows, H]
    reader = DistCheckpointReader(megatron_dir / DIST_CHECKPOINT_DIR)
    rows, hidden = expected.shape
    middle = reader.read("decoder.layers.self_attention.linear_qkv.weight", (1, rows // 4, 0), (1, rows // 2, hidden))
    assert torch.equal(middle[0], expected[rows // 4: rows // 4 + rows // 2])


@pytest.mark.parametrize("arch, options", [
    ("qwen3", {"tie_word_embeddings": True, "vocab_size": 100, "head_dim": 32}),
    ("deepseek_v3", {}),  # multi-latent attention's column-parallel down and up projections
])
def test_tp_shards_are_built_from_their_slices_alone(tiny_model_factory, arch, options):
    """At TP=2 each rank reads disjoint rows / columns of the HF tensors (all of them between the ranks,
    none of the vocabulary padding), and the shards built from them export back to the HF tensors."""
    hf_dir = tiny_model_factory(arch, **options)
    shape, hf = load_model_shape(hf_dir), HFCheckpointReader(hf_dir)
    for mapping in model_mappings(shape):
        parts = [list(map(hf.get, mapping.hf_names, hf_shard_index(mapping, shape, rank, 2))) for rank in range(2)]
        shards = [hf_to_megatron_shard(mapping, rank_parts, shape, tp_size=2) for rank_parts in parts]
        for i, (name, exported) in enumerate(zip(mapping.hf_names, megatron_shards_to_hf(mapping, shards, shape))):
            assert torch.equal(exported, hf.get(name)), name
            read = sum(rank_parts[i].numel() for rank_parts in parts)
            assert read == exported.numel() * (2 if mapping.layout == "replicated" else 1), name


def test_one_shard_exports_as_views_of_it(tiny_model_factory):
    """Without TP, the HF tensors of a parameter are views of it (a weight push sends them without copying),
    except the split of a fused QKV over several KV groups, and equal the HF checkpoint's."""
    hf_dir = tiny_model_factory("qwen2")
    shape, hf = load_model_shape(hf_dir), HFCheckpointReader(hf_dir)
    assert shape.num_kv_heads > 1
    for mapping in model_mappings(shape):
        shard = hf_to_megatron_shard(mapping, [hf.get(n) for n in mapping.hf_names], shape, tp_size=1)
        for name, exported in zip(mapping.hf_names, megatron_shards_to_hf(mapping, [shard], shape)):
            assert torch.equal(exported, hf.get(name)), name
            shares = exported.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
            assert shares == (mapping.layout != "qkv"), f"{name} ({mapping.layout})"


def test_export_refuses_tensors_that_disagree_with_config(tiny_model_factory, tmp_path, capsys):
    """`armor convert megatron-to-hf` (tools/convert_megatron_to_hf.py calls the same main), in this process."""
    megatron_dir = convert_hf_to_megatron(tiny_model_factory("qwen2"), tmp_path / "m", tp=1, pp=1)
    config = json.loads((megatron_dir / "config.json").read_text())
    cases = {
        "fewer_layers": ({"num_hidden_layers": config["num_hidden_layers"] - 1}, "stored with shape"),
        "tied": ({"tie_word_embeddings": True}, "'output_layer.weight'"),
    }
    for name, (fields, phrase) in cases.items():
        edited = tmp_path / name
        shutil.copytree(megatron_dir, edited)
        (edited / "config.json").write_text(json.dumps({**config, **fields}))
        out = tmp_path / f"{name}-hf"
        assert main(["megatron-to-hf", "--megatron-path", str(edited), "--out", str(out)]) != 0
        stderr = capsys.readouterr().err
        assert phrase in stderr, stderr[-3000:]
        assert not out.exists() and not staging_dir(out).exists()
