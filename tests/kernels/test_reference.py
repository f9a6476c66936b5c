"""The plain-torch reference itself: finite differences in float64, and chunked == eager."""

import torch
from kernel_cases import make_case

from megatron_armor.kernels.reference import chunked_logprobs, reference_armor_loss, reference_logprobs


def test_reference_gradients_match_finite_differences_float64():
    case = make_case(3, 7, 5, torch.float64, seed=1)
    labels = torch.tensor([2, -100, 6])
    inputs = (case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: reference_logprobs(h, w, labels, 0.7), inputs)
    rl = [t.double() for t in (case.old_logp, case.ref_logp, case.advantages)] + [torch.ones(3, dtype=torch.float64)]
    loss = lambda h, w: reference_armor_loss(h, w, labels, *rl, alpha=0.9375, clip_low=0.2, clip_high=0.28,  # noqa: E731
                                             dual_clip=10.0, temperature=0.7)[0]
    assert torch.autograd.gradcheck(loss, inputs)


def test_chunked_matches_eager_with_gradients():
    case = make_case(37, 300, 16, torch.float32, seed=2)
    results = []
    for fn in (reference_logprobs, lambda h, w, y, t: chunked_logprobs(h, w, y, t, chunk_size=10)):
        h, w = case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()
        logp, entropy = fn(h, w, case.labels, 0.7)
        (logp + 0.5 * entropy).sum().backward()
        results.append((logp, entropy, h.grad, w.grad))
    for eager, chunked in zip(*results):
        torch.testing.assert_close(chunked, eager, atol=1e-5, rtol=1e-5)
