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


def test_constraint_rejects_bad_inputs():
    w = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="only in params: \\['w'\\]"):
        SubspaceConstraint({"w": w}, {})
    with pytest.raises(ValueError, match="b: needs a 2-D parameter"):
        SubspaceConstraint({"b": torch.nn.Parameter(torch.zeros(4))}, {"b": torch.zeros(4)})
    with pytest.raises(ValueError, match="gradient"):
        SubspaceConstraint({"w": w}, {"w": w.detach()}, mode="adam")
