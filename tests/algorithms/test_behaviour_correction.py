"""Decoupled PPO (algorithm.behaviour_correction): each token's policy term times the truncated (tis) or masked (mis)
importance weight pi_old / mu, for ARMOR's mixed ratio and GRPO, checked against a float64 hand computation."""

import math

import pytest
import torch
from algorithm_factory import make_algorithm

from megatron_armor.algorithms import LossInputs
from megatron_armor.config import ConfigError, load_config
from megatron_armor.algorithms import build_algorithm


def _inputs(seed: int = 0, is_anchor: list[bool] | None = None) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    shape = (4, 6)
    old = -torch.rand(shape, generator=g) * 3
    return LossInputs(
        logprobs=(old + 0.3 * torch.randn(shape, generator=g)).requires_grad_(),
        old_logprobs=old,
        ref_logprobs=old + 0.5 * torch.randn(shape, generator=g),
        engine_logprobs=old + torch.randn(shape, generator=g),  # behaviour policy: up to ~e^2 away
        advantages=torch.randn(4, generator=g)[:, None].expand(shape).contiguous(),
        response_mask=(torch.rand(shape, generator=g) > 0.2).float(),
        is_anchor=None if is_anchor is None else torch.tensor(is_anchor),
    )


def _expected(x: LossInputs, *, alpha: float, correction: str, w_max: float = 2.0) -> tuple[float, float, float]:
    """(token-sum loss, mean weight, fraction of tokens with w > w_max) in float64, term by term."""
    total, weights, truncated = 0.0, [], 0
    for b in range(x.logprobs.shape[0]):
        for t in range(x.logprobs.shape[1]):
            if x.response_mask[b, t] == 0:
                continue
            lp, old, ref, eng = (float(v[b, t]) for v in (x.logprobs.detach(), x.old_logprobs, x.ref_logprobs,
                                                           x.engine_logprobs))
            a = float(x.advantages[b, t])
            mix = (lambda l: math.log(alpha * math.exp(l) + (1 - alpha) * math.exp(ref))) if alpha < 1 else (lambda l: l)
            r = math.exp(mix(lp) - mix(old))
            loss = max(-a * r, -a * min(max(r, 0.8), 1.28))
            if a < 0:
                loss = min(loss, -a * 10.0)
            anchor = x.is_anchor is not None and bool(x.is_anchor[b])
            w = 1.0 if anchor else math.exp(old - eng)  # the reference sampled an anchor: never stale
            truncated += w > w_max
            w = {"tis": min(w, w_max), "mis": float(w <= w_max), "none": 1.0}[correction]
            weights.append(w)
            total += w * loss
    return total, sum(weights) / len(weights), truncated / len(weights)


@pytest.mark.parametrize("name,alpha,is_anchor", [
    ("armor", 0.875, [False, True, False, False]),  # an anchor row: weight 1 whatever its engine logprobs
    ("grpo", 1.0, None),
    ("grpo_kl", 1.0, None),
    ("opd", 1.0, None),  # opd.rollouts student: GRPO's loss on token advantages (here the sequences' broadcast)
])
@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_each_token_is_weighted_by_the_corrected_behaviour_ratio(name, alpha, is_anchor, correction):
    algorithm = make_algorithm(name, f"algorithm.behaviour_correction={correction}", "armor.alpha=0.875", "kl.coef=0.1")
    inputs = _inputs(is_anchor=is_anchor)
    terms = algorithm.policy_loss(inputs)
    loss, mean_weight, truncated = _expected(inputs, alpha=alpha, correction=correction)
    if name == "grpo_kl":  # plus the unweighted KL penalty, checked on its own in test_kl.py
        loss += 0.1 * terms.per_unit["kl_to_ref"].item()
    assert terms.loss.item() == pytest.approx(loss, rel=1e-5)
    assert terms.token_means["async/importance_weight_mean"].item() == pytest.approx(mean_weight, rel=1e-5)
    assert terms.token_means["async/clipped_fraction"].item() == pytest.approx(truncated, rel=1e-6)
    assert 0 < truncated < 1  # the case has tokens on both sides of w_max
    terms.loss.backward()
    assert inputs.logprobs.grad.abs().sum() > 0


def test_defaults_follow_the_rollout_mode_and_mipu_keeps_its_own():
    assert make_algorithm("grpo").behaviour_correction == "none"  # sync: the weights equal the engine's
    assert make_algorithm("armor", "rollout.mode=one_step_off").behaviour_correction == "tis"
    off = make_algorithm("grpo", "rollout.mode=one_step_off", "algorithm.behaviour_correction=none")
    assert off.behaviour_correction == "none"
    inputs = _inputs()
    assert "async/importance_weight_mean" not in off.policy_loss(inputs).token_means
    assert off.policy_loss(inputs).loss.item() == pytest.approx(_expected(inputs, alpha=1.0, correction="none")[0],
                                                               rel=1e-5)
    teacher = ["opd.rollouts=teacher", "algorithm.clip_low=1.0", "algorithm.clip_high=1.0", "rollout.mode=one_step_off"]
    assert make_algorithm("opd", *teacher).behaviour_correction == "none"  # the teacher's tokens: no pi_old / mu
    with pytest.raises(ConfigError, match="opd.rollouts teacher trains on the teacher's tokens unweighted"):
        make_algorithm("opd", *teacher, "algorithm.behaviour_correction=tis")
    with pytest.raises(ConfigError, match="mipu weights tokens by pi_old / mu itself"):
        build_algorithm(load_config(None, ["task.synthetic=arithmetic", "algorithm.name=mipu",
                                           "rollout.sampling.actor_n=16", "algorithm.behaviour_correction=tis"]))


def test_one_step_off_refuses_colocated_placement():
    with pytest.raises(ConfigError, match="rollout.mode one_step_off overlaps generation with training, but "
                                          "rollout.memory.offload_trainer gives the GPU to one of them at a time"):
        load_config(None, ["rollout.mode=one_step_off", "rollout.memory.offload_trainer=true"])


def test_mipu_s_gate_runs_in_every_rollout_mode_with_step_1_s_own_sampler_weight():
    """No mode generates on the actor's engine while the gate pushes or rolls back weights (tests/trainer/
    test_mipu_run.py runs a forced reject in each), so the gate is built in each; Step 1 keeps its own pi_old / mu
    weight instead of the decoupled objective's."""
    for mode in ("sync", "one_step_off", "async"):
        cfg = load_config(None, ["task.synthetic=arithmetic", "algorithm.name=mipu", "rollout.sampling.actor_n=16",
                                 f"rollout.mode={mode}"])
        mipu = build_algorithm(cfg)
        assert mipu.update_gate() is not None and mipu.behaviour_correction == "none", mode
