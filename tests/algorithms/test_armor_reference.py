"""The ARMOR training step through Megatron against a reference outside the package (conftest.py `armor_case`):
the loss and its gradient against float64 autograd of armor.md §2-3 through the HF model, and the optimizer
(Adam, weight decay, global grad-norm clip, warmup by RL step) against torch.optim.AdamW + clip_grad_norm_.
The Megatron side runs on two data-parallel ranks in the shared worker run (conftest.py `loss_workers`)."""

import pytest
import torch

from hf_reference import assert_same_grads, grpo_advantages, warmup_lr

# Megatron's fp32 weights against the float64 reference. With the reference gradients fed in, only rounding
# differs: weights of size <= 1 round to 1.2e-7 in fp32, once per step (observed: 2.4e-7 after three steps).
STEP_ATOL = 1e-6
# Through update_policy Megatron's own gradients enter Adam (within ~4e-8 of the reference). Adam's step
# lr * m / (sqrt(v) + eps) has slope up to lr / eps in g, so where a gradient is within a few eps of zero
# that error moves a weight by a visible part of a step (observed: 7e-6 on 2 of ~1e5 weights, where the
# first mini-batch's gradient is 2e-8). So: every weight within 10% of the smallest step (lr / 4 = 1e-3),
# and all but 1 in 10^4 of them within STEP_ATOL.
UPDATE_ATOL, UPDATE_OUTLIERS = 1e-4, 1e-4
METRIC_REL = 1e-5


def _local_means(results, names=("loss/policy_loss", "loss/clip_fraction", "loss/mixed_ratio_mean")):
    """Token means over both data-parallel ranks of the loss-callback sums (policy loss: partial sums)."""
    tokens = sum(r["armor"]["sums"]["num_tokens"] for r in results)
    return {name: sum(r["armor"]["sums"][name] for r in results) / tokens for name in names}, tokens


def test_case_exercises_clipping_anchors_and_the_grad_clip(armor_case):
    """Guards that keep the comparisons below meaningful."""
    samples = armor_case.samples
    assert [s.is_anchor for s in samples].count(True) == 2 and all(s.correct for s in samples if s.is_anchor)
    # the package's advantages in the batch equal the hand-written per-group loop
    expected = grpo_advantages([s.reward for s in samples], [s.prompt_index for s in samples])
    assert armor_case.batch.advantages.tolist() == pytest.approx(expected, rel=1e-6)
    # some but not all tokens clip at theta_0 and on every RL step; the dual clip cannot bind with
    # these near-uniform tiny models (rho > 10 would need pi_theta > 3 pi_ref where pi_old << pi_ref)
    sums = armor_case.sums
    assert 0 < sums["clipped"] < sums["tokens"] and sums["dual_clipped"] == 0
    for update in armor_case.updates:
        assert 0 < update["clipped"] < update["tokens"]
    # the global grad-norm clip binds on every optimizer step
    assert all(step["grad_norm"] > 2 * armor_case.optim["grad_clip"] for step in armor_case.steps)


def test_loss_and_gradient_match_float64_reference(armor_case, loss_workers):
    """Both ranks hold the whole batch's gradient (4 sequences each, micro-batches of 2), equal to float64
    autograd through the HF model of the token-mean ARMOR loss; the loss statistics summed over the ranks
    equal the reference's, clip fraction by exact count."""
    assert any(g.abs().max() > 0 for g in armor_case.grads.values())
    for results in loss_workers:
        assert_same_grads(results["armor"]["grads"], armor_case.grads)
    means, tokens = _local_means(loss_workers)
    sums = armor_case.sums
    assert tokens == sums["tokens"]
    assert means["loss/policy_loss"] == pytest.approx(sums["loss/policy_loss"] / tokens, rel=METRIC_REL)
    assert means["loss/clip_fraction"] == pytest.approx(sums["clipped"] / tokens, abs=1e-6)
    assert means["loss/mixed_ratio_mean"] == pytest.approx(sums["rho"] / tokens, rel=METRIC_REL)


def test_update_policy_matches_adamw_reference(armor_case, loss_workers):
    """RL step 0 (two mini-batches, both at lr / 4) then RL step 1 (one, at lr / 2) through update_policy:
    metrics and weights equal the reference run of AdamW + clip_grad_norm_ on the HF model's gradients."""
    for results in loss_workers:
        for got, expected in zip(results["armor"]["updates"], armor_case.updates, strict=True):
            metrics = got["metrics"]
            for name in ("loss/policy_loss", "loss/mixed_ratio_mean"):
                assert metrics[name] == pytest.approx(expected["metrics"][name], rel=METRIC_REL), name
            assert metrics["loss/clip_fraction"] == pytest.approx(expected["metrics"]["loss/clip_fraction"], abs=1e-6)
            assert metrics["optim/grad_norm"] == pytest.approx(expected["metrics"]["optim/grad_norm"], rel=METRIC_REL)
            assert metrics["optim/lr"] == pytest.approx(expected["metrics"]["optim/lr"], rel=1e-12)
            outliers, total = 0, 0
            for name, weight in got["weights"].items():
                reference = expected["weights"][name].float()
                torch.testing.assert_close(weight, reference, atol=UPDATE_ATOL, rtol=0, msg=name)
                outliers += int(((weight - reference).abs() > STEP_ATOL).sum())
                total += weight.numel()
            assert outliers <= UPDATE_OUTLIERS * total, (outliers, total)


def test_optimizer_step_matches_torch_adamw(armor_case, loss_workers):
    """The reference gradients put in Megatron's grad buffers, optimizer_step at learning_rate(rl_step):
    three steps give torch.optim.AdamW (weight decay 0.1 on every parameter, armor.md §6) after
    clip_grad_norm_(0.25). An optimizer without the clip, or exempting 1-D tensors from decay, lands
    far outside the tolerance, so both are pinned down."""
    exempt_1d = [name for name, w in armor_case.init.items() if w.dim() == 1]
    assert any(name.endswith("layernorm.weight") for name in exempt_1d) and any(n.endswith(".bias") for n in exempt_1d)
    for results in loss_workers:
        for got, expected in zip(results["armor"]["steps"], armor_case.steps, strict=True):
            assert got["updated"] and got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
            for name, weight in got["weights"].items():
                torch.testing.assert_close(weight, expected["weights"][name].float(), atol=STEP_ATOL, rtol=0, msg=name)
        final = results["armor"]["steps"][-1]["weights"]
        last = armor_case.steps[-1]
        no_clip = max((final[n] - last["no_clip"][n].float()).abs().max().item() for n in final)
        exempt = max((final[n] - last["megatron_1d_exempt"][n].float()).abs().max().item() for n in exempt_1d)
        assert no_clip > 50 * STEP_ATOL and exempt > 50 * STEP_ATOL, (no_clip, exempt)


def test_learning_rate_warms_up_over_rl_steps():
    """armor.md §6: linear warmup counted in RL steps, then constant; RL step k runs at lr * (k + 1) / warmup."""
    from megatron_armor.config import OptimizerConfig
    from megatron_armor.trainer.update.optimizer import learning_rate

    settings = OptimizerConfig(lr=4e-3, warmup_steps=4)
    assert [learning_rate(k, settings) for k in range(6)] == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3, 4e-3, 4e-3],
                                                                           rel=1e-12)
    assert [warmup_lr(4e-3, 4, k) for k in range(6)] == [learning_rate(k, settings) for k in range(6)]
    assert learning_rate(0, OptimizerConfig(lr=4e-3, warmup_steps=1)) == 4e-3
