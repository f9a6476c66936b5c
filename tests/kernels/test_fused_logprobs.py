"""fused_logprobs (Triton; interpreter on CPU) against the eager torch reference: forward and backward."""

import pytest
import torch
from kernel_cases import DEVICE, assert_grad_close, make_case, pad_vocab, randn, tolerances

from megatron_armor.kernels import fused_logprobs
from megatron_armor.kernels import fused as fused_module
from megatron_armor.kernels.reference import reference_logprobs
from megatron_armor.kernels.tiles import TileConfig

# Small tiles: several vocab splits and token tiles, ragged in N, V and H.
SMALL_TILES = TileConfig(block_n=16, block_v=64, block_h=16, num_warps=1, min_programs=8)


def _check_against_reference(n, v, h, dtype, temperature, seed=0, padding=0):
    """fused_logprobs on v vocabulary rows + `padding` padding rows vs the reference on the v rows alone."""
    case = make_case(n, v, h, dtype, seed)
    tol = tolerances(dtype)
    hidden = case.hidden.clone().requires_grad_()
    weight = pad_vocab(case.weight, padding).requires_grad_()
    logp, entropy = fused_logprobs(hidden, weight, case.labels, temperature=temperature,
                                   vocab_size=v if padding else None)
    ref_hidden = case.hidden.float().requires_grad_()
    ref_weight = case.weight.float().requires_grad_()
    ref_logp, ref_entropy = reference_logprobs(ref_hidden, ref_weight, case.labels, temperature)

    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == entropy.shape == (n,)
    torch.testing.assert_close(logp, ref_logp, atol=tol["forward"], rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=tol["forward"], rtol=0)
    assert (logp <= 0).all() and (logp[case.labels == -100] == 0).all()

    grad_logp, grad_entropy = randn(2, n, seed=seed + 1)
    (logp * grad_logp + entropy * grad_entropy).sum().backward()
    (ref_logp * grad_logp + ref_entropy * grad_entropy).sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == dtype
    assert_grad_close(hidden.grad, ref_hidden.grad, tol["grad"], "grad hidden")
    assert_grad_close(weight.grad[:v], ref_weight.grad, tol["grad"], "grad weight")
    assert (weight.grad[v:] == 0).all(), "padding rows got a gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "v", "h", "temperature"), [(1, 1000, 64, 1.0), (37, 1000, 64, 0.7), (37, 50257, 64, 1.3)])
def test_matches_reference(n, v, h, dtype, temperature):
    _check_against_reference(n, v, h, dtype, temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_ragged_tiles_and_vocab_splits(monkeypatch, dtype):
    monkeypatch.setattr(fused_module, "default_tiles", lambda n, v, h: SMALL_TILES)
    _check_against_reference(37, 1000, 40, dtype, 0.7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_vocabulary_rows_take_no_part(monkeypatch, dtype):
    # 1000 real rows padded to 1024; with small tiles the last real row falls inside a tile of the last split.
    monkeypatch.setattr(fused_module, "default_tiles", lambda n, v, h: SMALL_TILES)
    _check_against_reference(37, 1000, 40, dtype, 0.7, padding=24)


@pytest.mark.parametrize("owner", ["ddp", "ddp-tied", "ddp-bf16-buffer", "no-ddp"])
def test_weight_gradient_into_megatron_main_grad(owner):
    """Megatron DDP's gradient_accumulation_fusion contract (tensor_parallel.layers): the weight gradient is
    added to the fp32 `main_grad`, `grad_added_to_main_grad` is set and autograd gets a dummy, zeros when
    the weight is tied to the embedding on this stage (`zero_out_wgrad`). A 16-bit buffer is left to DDP's
    hook (the gradient goes to autograd); without DDP's flag autograd gets None."""
    case = make_case(37, 1000, 64, torch.bfloat16)
    weight = pad_vocab(case.weight, 24).requires_grad_()
    weight.main_grad = randn(1024, 64, seed=1).to(torch.bfloat16 if owner == "ddp-bf16-buffer" else torch.float32)
    before = weight.main_grad.clone()  # what earlier micro-batches accumulated
    if owner != "no-ddp":
        weight.grad_added_to_main_grad = False
    weight.zero_out_wgrad = owner == "ddp-tied"
    logp, entropy = fused_logprobs(case.hidden, weight, case.labels, vocab_size=1000)
    (logp + 0.5 * entropy).sum().backward()
    ref_weight = case.weight.float().requires_grad_()
    ref_logp, ref_entropy = reference_logprobs(case.hidden.float(), ref_weight, case.labels)
    (ref_logp + 0.5 * ref_entropy).sum().backward()

    rel = tolerances(torch.bfloat16)["grad"]
    if owner == "ddp-bf16-buffer":
        assert torch.equal(weight.main_grad, before) and not weight.grad_added_to_main_grad
        assert_grad_close(weight.grad[:1000], ref_weight.grad, rel, "grad weight")
        return
    assert_grad_close(weight.main_grad[:1000] - before[:1000], ref_weight.grad, rel, "main_grad increment")
    assert torch.equal(weight.main_grad[1000:], before[1000:]), "padding rows of main_grad changed"
    if owner == "no-ddp":
        assert weight.grad is None
        return
    assert weight.grad_added_to_main_grad and weight.grad.shape == weight.shape and weight.grad.dtype == torch.bfloat16
    if owner == "ddp-tied":
        assert (weight.grad == 0).all()


def test_logprob_gradient_alone_and_near_one_hot_softmax_stays_nonpositive():
    # Labels at the argmax of a sharp softmax: logprobs within rounding of 0 must come out <= 0, never above.
    case = make_case(37, 1000, 64, torch.float32)
    hidden = (case.hidden * 40).requires_grad_()
    labels = (hidden.detach() @ case.weight.T).argmax(-1)
    logp, _ = fused_logprobs(hidden, case.weight, labels)
    ref_hidden = hidden.detach().clone().requires_grad_()
    ref_logp, _ = reference_logprobs(ref_hidden, case.weight, labels)
    assert (logp <= 0).all() and (logp > -1e-6).sum() >= 5
    torch.testing.assert_close(logp, ref_logp, atol=1e-4, rtol=0)
    logp.sum().backward()  # entropy unused: its gradient is None inside the backward
    ref_logp.sum().backward()
    assert_grad_close(hidden.grad, ref_hidden.grad, 1e-4, "grad hidden")


def test_gradient_filtering_changes_gradients_below_bf16_precision():
    # A head of 2048 likely tokens and a tail 16 nats lower (p < 2^-12): the filter skips the tail tiles.
    n, v, h, head = 37, 50257, 64, 2048
    case = make_case(n, v, h, torch.float32)
    hidden = torch.cat([case.hidden[:, :-1], torch.ones(n, 1, device=DEVICE)], 1).bfloat16()  # last column: bias input
    weight = case.weight.clone()
    weight[:, -1] = torch.where(torch.arange(v, device=DEVICE) < head, 0.0, -16.0)
    weight = weight.bfloat16()
    labels = case.labels.clamp(max=head - 1)
    grads = {}
    for eps in (None, 2.0**-12):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, entropy = fused_logprobs(x, w, labels, filter_eps=eps)
        (logp + 0.1 * entropy).sum().backward()
        grads[eps] = (x.grad.float(), w.grad.float())
    (hidden_full, weight_full), (hidden_filtered, weight_filtered) = grads.values()
    assert (weight_filtered[head:] == 0).all() and (weight_full[head:] != 0).any()  # tail tiles were skipped
    assert_grad_close(hidden_filtered, hidden_full, 2.0**-9, "filtered grad hidden")
    assert_grad_close(weight_filtered, weight_full, 2.0**-9, "filtered grad weight")


def test_rejects_bad_inputs():
    case = make_case(4, 50, 16, torch.float32)
    with pytest.raises(ValueError, match="labels must be"):
        fused_logprobs(case.hidden, case.weight, case.labels[:3])
    with pytest.raises(TypeError, match="share a dtype"):
        fused_logprobs(case.hidden, case.weight.bfloat16(), case.labels)
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs(case.hidden, case.weight, case.labels, temperature=0.0)
    with pytest.raises(ValueError, match=r"vocab_size must be in \[1, 50\]"):
        fused_logprobs(case.hidden, case.weight, case.labels, vocab_size=51)
