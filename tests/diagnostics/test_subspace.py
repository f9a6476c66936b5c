import pytest
import torch

from megatron_armor.diagnostics import SubspaceConstraint, project_gradient, record_subspace


def _split_basis(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An orthonormal [n, k] basis and an orthonormal [n, n-k] basis of its complement."""
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))
    return q[:, :k].float(), q[:, k:].float()


def test_record_subspace_recovers_the_update_row_space():
    inside, _ = _split_basis(12, 3)
    v = record_subspace(torch.randn(8, 3) @ inside.T, 3)
    assert v.shape == (12, 3) and v.dtype == torch.float32
    assert torch.allclose(v @ v.T @ inside, inside, atol=1e-5)


def test_projection_keeps_in_subspace_gradients_and_removes_orthogonal_ones():
    inside, outside = _split_basis(16, 4)
    g_in = torch.randn(10, 4) @ inside.T
    g_out = torch.randn(10, 12) @ outside.T
    assert torch.allclose(project_gradient(g_in, inside), g_in, atol=1e-5)
    assert project_gradient(g_out, inside).abs().max() < 1e-5
    assert project_gradient(g_in.bfloat16(), inside).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\(10, 16\).*\(12, 4\)"):
        project_gradient(g_in, outside[:12, :4])


def _setup(mode: str, k: int = 3):
    """A linear layer whose cumulative update lies in a known k-dim row space, plus its constraint."""
    layer = torch.nn.Linear(16, 10, bias=False)
    w0 = layer.weight.detach().clone()
    inside, outside = _split_basis(16, k)
    with torch.no_grad():
        layer.weight += torch.randn(10, k) @ inside.T
    constraint = SubspaceConstraint({"w": layer.weight}, {"w": w0}, k=k, mode=mode)
    return layer, constraint, inside, outside


def test_gradient_mode_projects_grad_or_main_grad_after_capture_only():
    layer, constraint, inside, outside = _setup("gradient")
    g = torch.randn(10, 16)
    layer.weight.grad = g.clone()
    constraint.pre_step()  # nothing captured yet: no-op
    assert torch.equal(layer.weight.grad, g)

    constraint.capture(step=5)
    constraint.pre_step()
    assert torch.allclose(layer.weight.grad, g @ inside @ inside.T, atol=1e-5)
    assert (layer.weight.grad @ outside).abs().max() < 1e-5

    layer.weight.grad = None
    layer.weight.main_grad = g.clone()  # Megatron DDP's buffer takes precedence
    constraint.pre_step()
    assert torch.allclose(layer.weight.main_grad, g @ inside @ inside.T, atol=1e-5)
    assert constraint.summary() == {"mode": "gradient", "k": 3, "captured_step": 5, "projected_steps": 2, "matrices": 1}


def test_update_mode_projects_the_optimizer_step():
    layer, constraint, inside, outside = _setup("update")
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    constraint.capture(step=2)
    layer.weight.grad = torch.randn(10, 16)
    before = layer.weight.detach().clone()
    constraint.pre_step()
    optimizer.step()
    raw_step = layer.weight.detach() - before
    constraint.post_step()
    step = layer.weight.detach() - before
    assert (step @ outside).abs().max() < 1e-6
    assert torch.allclose(step, raw_step @ inside @ inside.T, atol=1e-6)
    assert constraint.summary()["mode"] == "update" and constraint.summary()["projected_steps"] == 1


def test_update_mode_projects_the_fp32_master_weights_of_a_mixed_precision_optimizer():
    """As Megatron's Float16Optimizer: Adam steps `main_param` (fp32), then copies it onto the bf16
    parameter, as it does again after every later step; the projection must live in the master."""
    layer, constraint, inside, outside = _setup("update")
    main = layer.weight.detach().clone()
    with torch.no_grad():
        layer.weight.data = layer.weight.bfloat16()
    layer.weight.main_param = main
    optimizer = torch.optim.Adam([main], lr=1e-2)
    constraint.capture(step=2)
    before = main.clone()
    constraint.pre_step()
    main.grad = torch.randn(10, 16)
    optimizer.step()
    with torch.no_grad():
        layer.weight.copy_(main)  # the optimizer's master -> model copy
    constraint.post_step()
    assert ((main - before) @ outside).abs().max() < 1e-6
    assert torch.equal(layer.weight, main.bfloat16())  # the forward sees the projected step


def test_constraint_rejects_bad_inputs():
    w = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="only in params: \\['w'\\]"):
        SubspaceConstraint({"w": w}, {})
    with pytest.raises(ValueError, match="b: needs a 2-D parameter"):
        SubspaceConstraint({"b": torch.nn.Parameter(torch.zeros(4))}, {"b": torch.zeros(4)})
    with pytest.raises(ValueError, match="gradient"):
        SubspaceConstraint({"w": w}, {"w": w.detach()}, mode="adam")


# ----- tensor parallelism: the bases of the full matrices ---------------------------------------------------
TP_K = 3


def _decoder_matrices(hf: dict[str, torch.Tensor], num_layers: int = 2) -> dict[str, torch.Tensor]:
    """Megatron's 2-D decoder weights as full matrices from HF-named tensors. Fused qkv / fc1 are the HF
    blocks stacked, a row permutation of Megatron's layout, which leaves row-wise g V V^T unchanged."""
    out = {}
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        out[f"{layer}.qkv"] = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[f"{layer}.proj"] = hf[p + "self_attn.o_proj.weight"]
        out[f"{layer}.fc1"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        out[f"{layer}.fc2"] = hf[p + "mlp.down_proj.weight"]
    return out


def test_tensor_parallel_capture_and_projection_equal_the_full_matrices(tmp_path):
    """TP=2 (qkv / fc1 column-parallel, proj / fc2 row-parallel) projects a real gradient exactly as a
    TP=1 constraint on the gathered weights and gradient does; in-span gradients stay, orthogonal ones go,
    and a constraint restored from a TP=2 checkpoint projects the same."""
    from safetensors.torch import load_file

    from launcher import run_workers
    from megatron_armor.models.tiny import make_tiny_checkpoint

    w0_dir = make_tiny_checkpoint(tmp_path / "w0", seed=0)
    wt_dir = make_tiny_checkpoint(tmp_path / "wt", seed=1)
    ranks = run_workers("subspace_tp.py", 2, tmp_path / "out", str(w0_dir), str(wt_dir), str(TP_K))
    result = torch.load(tmp_path / "out" / "rank0.pt")
    # column-parallel shards keep V of the full input dim (hidden 64); row-parallel ones a block of it
    in_dims = {"linear_qkv": (0, 64), "linear_fc1": (0, 64), "linear_proj": (1, 64 // 2), "linear_fc2": (1, 176 // 2)}
    assert len(result["sharding"]) == 8  # qkv, proj, fc1, fc2 of 2 layers
    for name, dim in result["sharding"].items():
        expected_dim, rows = in_dims[name.split(".")[-2]]
        assert dim == expected_dim and ranks[0]["bases"][name] == ranks[1]["bases"][name] == [rows, TP_K], name

    weights_t = {n: torch.nn.Parameter(w) for n, w in _decoder_matrices(load_file(wt_dir / "model.safetensors")).items()}
    reference = SubspaceConstraint(weights_t, _decoder_matrices(load_file(w0_dir / "model.safetensors")), k=TP_K)
    reference.capture(step=1)
    raw = _decoder_matrices(result["raw"])
    for name, param in weights_t.items():
        param.grad = raw[name].clone()
    reference.pre_step()

    projected, twice = _decoder_matrices(result["projected"]), _decoder_matrices(result["twice"])
    orthogonal, resumed = _decoder_matrices(result["orthogonal"]), _decoder_matrices(result["resumed"])
    for name, param in weights_t.items():
        torch.testing.assert_close(projected[name], param.grad, atol=1e-5, rtol=0, msg=name)
        assert (raw[name] - projected[name]).norm() > 0.1 * raw[name].norm(), name  # the projection removed something
        torch.testing.assert_close(twice[name], projected[name], atol=1e-5, rtol=0, msg=name)
        assert orthogonal[name].abs().max() < 1e-5, name
        torch.testing.assert_close(resumed[name], projected[name], atol=1e-6, rtol=0, msg=name)
    for name in result["raw"].keys() - {n for n in result["raw"] if n.endswith("_proj.weight")}:
        assert torch.equal(result["projected"][name], result["raw"][name]), name  # embeddings, norms, biases: free
