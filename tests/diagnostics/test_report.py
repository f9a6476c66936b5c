import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_armor.diagnostics import (
    DiagnoseConfig, diagnose, hill_tail_index, linear_weights, mask_overlap, principal_angles, spectral_drift,
    stable_rank, unchanged_fraction,
)
from megatron_armor.cli import build_parser

RANK_ONE = "model.layers.0.self_attn.q_proj.weight"
SETTINGS = DiagnoseConfig(k_angles=8, k_sim=1, k_hill=4, mask_rank=4)


def _rewrite(base_dir, out_dir, edit) -> None:
    """Copy an HF checkpoint, replacing each tensor by `edit(name, tensor)`."""
    shutil.copytree(base_dir, out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    edited = {n: edit(n, t).contiguous() for n, t in tensors.items()}
    save_file(edited, out_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def trajectory(tiny_model_factory, tmp_path_factory):
    """Base checkpoint and two later ones: a growing rank-1 update of one q_proj, 10% / 20% of entries elsewhere."""
    base = tiny_model_factory("qwen2")
    root = tmp_path_factory.mktemp("diagnose")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, generator=g), torch.randn(64, generator=g)

    def edit(fraction: float, scale: float):
        def apply(name: str, t: torch.Tensor) -> torch.Tensor:
            if name == RANK_ONE:
                return t + scale * torch.outer(a, b)
            flat = t.clone().view(-1)
            picked = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(len(name)))
            flat[picked[: int(fraction * flat.numel())]] *= 1.5
            return flat.view_as(t)
        return apply

    later = [root / "step_000020", root / "step_000010"]  # out of order on purpose
    _rewrite(base, later[0], edit(0.2, 0.02))
    _rewrite(base, later[1], edit(0.1, 0.01))
    return base, later, root


def test_report_matches_direct_computations(trajectory):
    base, later, root = trajectory
    report = diagnose(base, later, root / "out", SETTINGS)
    on_disk = json.loads((root / "out" / "report.json").read_text())
    assert on_disk == report
    assert {"by_layer_type.png", "trajectory.png"} <= {p.name for p in (root / "out").iterdir()}
    assert [c["step"] for c in report["checkpoints"]] == [10, 20]

    w0s, w1s = load_file(base / "model.safetensors"), load_file(later[1] / "model.safetensors")
    selected = linear_weights(w0s.keys())
    assert sorted(report["matrices"]) == sorted(w.name for w in selected) and len(selected) == 14

    name = "model.layers.1.mlp.down_proj.weight"
    w0, w1 = w0s[name], w1s[name]
    row = report["matrices"][name]["checkpoints"][0]
    assert report["matrices"][name]["shape"] == [64, 176] and report["matrices"][name]["layer_type"] == "down_proj"
    assert row["unchanged_fraction"] == pytest.approx(unchanged_fraction(w0, w1)) == pytest.approx(0.9, abs=1e-4)
    angles = principal_angles(w0, w1, SETTINGS.k_angles)
    assert row["angle_right_mean"] == pytest.approx(angles.right.mean().item())
    assert row["angle_left_max"] == pytest.approx(angles.left.max().item())
    assert row["spectral_drift"] == pytest.approx(spectral_drift(w0, w1))
    assert row["overlap_principal"] == pytest.approx(mask_overlap(w0, w1, "principal", rank=4))
    assert row["overlap_low_magnitude"] == pytest.approx(mask_overlap(w0, w1, "low_magnitude"))
    delta = w1.double() - w0.double()
    assert row["stable_rank"] == pytest.approx(stable_rank(delta))
    assert row["hill_index"] == pytest.approx(hill_tail_index(delta, 4))
    assert row["update_norm"] == pytest.approx(delta.norm().item())

    rank_one = report["matrices"][RANK_ONE]["checkpoints"]
    assert [r["stable_rank"] for r in rank_one] == pytest.approx([1.0, 1.0])
    assert [r["sim_k"] for r in rank_one] == pytest.approx([1.0, 1.0])  # same direction, growing scale
    assert rank_one[1]["update_norm"] == pytest.approx(2 * rank_one[0]["update_norm"], rel=1e-4)

    first = report["checkpoints"][0]
    rows = [m["checkpoints"][0] for m in report["matrices"].values()]
    weighted = sum(r["unchanged"] for r in rows) / sum(r["numel"] for r in rows)
    assert first["all"]["unchanged_fraction"] == pytest.approx(weighted)
    q_rows = [m["checkpoints"][0] for m in report["matrices"].values() if m["layer_type"] == "q_proj"]
    assert first["by_layer_type"]["q_proj"]["stable_rank"] == pytest.approx(sum(r["stable_rank"] for r in q_rows) / 2)
    assert list(first["by_layer_type"]) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_megatron_checkpoints_give_the_hf_report(trajectory, tmp_path):
    """Megatron checkpoints (TP=2, and a training-style `step_N/model`) are read in place, matrix by
    matrix, and give exactly the report of their HF originals."""
    from megatron_armor.convert.hf_to_megatron import convert_hf_to_megatron

    base, later, _ = trajectory
    megatron_base = convert_hf_to_megatron(base, tmp_path / "base", tp=2, pp=1)
    megatron_step = convert_hf_to_megatron(later[1], tmp_path / "step_000010" / "model", tp=1, pp=1)
    expected = diagnose(base, later, tmp_path / "from-hf", SETTINGS)
    report = diagnose(megatron_base, [megatron_step, later[0]], tmp_path / "from-megatron", SETTINGS)
    assert report["checkpoints"] == expected["checkpoints"] and report["matrices"] == expected["matrices"]


def test_cli_runs_diagnose_and_reports_bad_checkpoints(trajectory, tmp_path, capsys):
    base, later, _ = trajectory
    parser = build_parser()  # the real `armor` command line
    args = parser.parse_args(["diagnose", "--base", str(base), "--checkpoints", *map(str, later),
                              "--out-dir", str(tmp_path / "cli"), "--layer-types", "q_proj", "o_proj", "--k-sim", "1"])
    assert args.handler(args) == 0
    report = json.loads((tmp_path / "cli" / "report.json").read_text())
    assert len(report["matrices"]) == 4 and report["settings"]["layer_types"] == ["q_proj", "o_proj"]

    for bad, message in ((["--checkpoints", str(tmp_path / "missing")], "missing"),
                         (["--checkpoints", str(later[0]), "--k-hill", "1"], "k_hill must be >= 2")):
        args = parser.parse_args(["diagnose", "--base", str(base), "--out-dir", str(tmp_path / "bad"), *bad])
        assert args.handler(args) == 2
        assert message in capsys.readouterr().err


def test_shape_mismatch_names_the_matrix(trajectory, tmp_path):
    base, _, _ = trajectory
    _rewrite(base, tmp_path / "step_5", lambda n, t: t[:, :-1] if n == RANK_ONE else t)
    with pytest.raises(ValueError, match=rf"step_5: '{RANK_ONE}' has shape \(64, 63\), the base has \(64, 64\)"):
        diagnose(base, [tmp_path / "step_5"], tmp_path / "out", SETTINGS)


def test_settings_reject_values_the_formulas_cannot_use():
    with pytest.raises(ValueError, match="k_hill must be >= 2"):
        DiagnoseConfig(k_hill=1)
    with pytest.raises(ValueError, match="unknown \\['qkv_proj'\\]"):
        DiagnoseConfig(layer_types=("qkv_proj",))


def test_cli_parser_does_not_import_torch():
    code = ("import argparse, sys; from megatron_armor.diagnostics.cli import add_diagnose_subcommand; "
            "add_diagnose_subcommand(argparse.ArgumentParser().add_subparsers()); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
