"""Registered algorithms: lookup, what each built-in asks of the trainer, its loss against the plain loss
functions, and the config rules each owns."""

import math

import pytest
import torch

from megatron_armor.algorithms import (
    ACTOR, ANCHORS, REFERENCE, TEACHER, Algorithm, LossInputs, StepSources, algorithm_class, armor_policy_loss,
    build_algorithm, kl_penalty, register_algorithm,
    registered_algorithms, sampler_corrected_loss, unregister_algorithm,
)
from megatron_armor.algorithms.reduce import aggregate_loss
from megatron_armor.config import ConfigError, load_config

from algorithm_factory import make_algorithm

BASE = ["task.synthetic=arithmetic", "task.warm_start.steps=10"]  # the warm start: OPD's teacher
NON_ANCHOR = ["rollout.sampling.actor_n=16"]  # n_samples 16 by default


def _inputs(seed: int = 0) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    shape = (4, 7)
    mask = (torch.rand(shape, generator=g) > 0.3).float()
    old = -torch.rand(shape, generator=g) * 3
    return LossInputs(
        logprobs=(old + 0.3 * torch.randn(shape, generator=g)).requires_grad_(),
        old_logprobs=old, ref_logprobs=old + 0.2 * torch.randn(shape, generator=g),
        engine_logprobs=old + 0.5 * torch.randn(shape, generator=g),
        advantages=torch.randn(shape[0], 1, generator=g).expand(shape).clone(), response_mask=mask,
    )


def test_the_five_builtins_are_registered_and_a_typo_names_the_closest():
    assert {"armor", "grpo", "grpo_kl", "mipu", "opd"} <= set(registered_algorithms())
    with pytest.raises(ConfigError, match="'armr' is not a registered algorithm; choose one of .*did you mean 'armor'"):
        algorithm_class("armr")


def test_registering_twice_is_refused_and_unregistering_frees_the_name():
    class Twice(Algorithm):
        name = "test_twice"

    register_algorithm(Twice)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_algorithm(type("Other", (Algorithm,), {"name": "test_twice"}))
    finally:
        unregister_algorithm("test_twice")
    assert "test_twice" not in registered_algorithms()
    with pytest.raises(TypeError):
        register_algorithm(object)


@pytest.mark.parametrize("name, extra, scores, filters, aggregation, clip", [
    ("armor", (ANCHORS,), (REFERENCE,), True, "token_mean", (0.2, 0.28, 10.0)),  # armor.md §3
    ("grpo", (), (), True, "token_mean", (0.2, 0.28, 10.0)),
    ("grpo_kl", (), (REFERENCE,), True, "token_mean", (0.2, 0.28, 10.0)),
    ("mipu", (), (REFERENCE,), True, "seq_mean_token_mean", (0.2, 0.2, 1.4)),  # mipu.md §2
    ("opd", (), (TEACHER,), False, "token_mean", (0.2, 0.28, 10.0)),
])
def test_what_each_builtin_asks_of_the_trainer(name, extra, scores, filters, aggregation, clip):
    algorithm = make_algorithm(name)
    assert algorithm.sources == StepSources(sampler=ACTOR, extra_samples=extra, scores=scores)
    assert algorithm.filters_groups is filters and algorithm.loss_aggregation == aggregation
    assert (algorithm.clip.low, algorithm.clip.high, algorithm.clip.dual) == pytest.approx(clip)
    assert (algorithm.update_gate() is not None) == (name == "mipu")


def test_opd_with_teacher_rollouts_samples_from_the_teacher():
    overrides = ("opd.rollouts=teacher", "algorithm.clip_low=1.0", "algorithm.clip_high=1.0")
    assert make_algorithm("opd", *overrides).sources == StepSources(sampler=TEACHER, scores=(TEACHER,))


def test_step_sources_say_which_policies_a_step_uses():
    anchored, taught = StepSources(extra_samples=(ANCHORS,)), StepSources(sampler=TEACHER, scores=(TEACHER,))
    assert [anchored.uses(p) for p in (ACTOR, REFERENCE, TEACHER)] == [True, True, False]
    assert [taught.uses(p) for p in (ACTOR, REFERENCE, TEACHER)] == [False, False, True]


def test_grpo_kl_without_a_kl_coefficient_needs_no_reference():
    assert make_algorithm("grpo_kl", "kl.coef=0").sources.scores == ()


def test_losses_equal_the_plain_loss_functions():
    inputs = _inputs()
    clip = dict(clip_low=0.2, clip_high=0.28, dual_clip=10.0)
    args = (inputs.logprobs, inputs.old_logprobs, inputs.ref_logprobs, inputs.advantages, inputs.response_mask)

    armor = make_algorithm("armor", "armor.alpha=0.75").policy_loss(inputs)
    expected, stats = armor_policy_loss(*args, alpha=0.75, normalizer=1.0, **clip)
    assert torch.equal(armor.loss, expected) and armor.per_unit == {}
    assert armor.token_means["mixed_ratio_mean"] == stats["mixed_ratio_mean"] and "num_tokens" not in armor.token_means

    grpo_kl = make_algorithm("grpo_kl", "kl.coef=0.01", "kl.estimator=k2").policy_loss(inputs)
    ppo, _ = armor_policy_loss(*args, alpha=1.0, normalizer=1.0, **clip)
    kl = aggregate_loss(kl_penalty(inputs.logprobs, inputs.ref_logprobs, "k2"), inputs.response_mask, "token_mean", 1.0)
    assert torch.equal(grpo_kl.policy_loss, ppo.detach()) and torch.equal(grpo_kl.per_unit["kl_to_ref"], kl.detach())
    assert math.isclose(float(grpo_kl.loss.detach()), float((ppo + 0.01 * kl).detach()), rel_tol=1e-6)

    mipu = make_algorithm("mipu", "mipu.is_correction=mis", "mipu.w_max=1.5", "kl.coef=0").policy_loss(inputs)
    expected, _ = sampler_corrected_loss(
        inputs.logprobs, inputs.old_logprobs, inputs.engine_logprobs, inputs.advantages, inputs.response_mask,
        correction="mis", w_max=1.5, clip_low=0.2, clip_high=0.2, dual_clip=1.4, aggregation="seq_mean_token_mean",
        normalizer=1.0,
    )
    assert torch.equal(mipu.loss, expected)


def test_opd_token_advantages_follow_its_section():
    algorithm = make_algorithm("opd", "opd.beta=0.5", "opd.alpha=0.5")
    old, teacher = -torch.ones(2, 3), -2 * torch.ones(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    sequence = torch.tensor([2.0, -2.0])
    got = algorithm.token_advantages(old, teacher, mask, sequence, torch.Generator())
    expected = (0.5 * (-0.5 * (old - teacher)) + 0.5 * sequence[:, None]) * mask  # opd.md §1
    assert torch.allclose(got, expected)
    assert make_algorithm("grpo").token_advantages(old, teacher, mask, sequence, torch.Generator()) is None


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.name=armor", "rollout.sampling.actor_n=16"],
     "rollout.sampling.actor_n must be 15 for armor with rollout.sampling.n_samples 16, got 16"),
    (["algorithm.name=armor", "rollout.anchors.ref_n=0"], "rollout.anchors.ref_n must be >= 1 for armor"),
    (["algorithm.name=grpo", "rollout.sampling.actor_n=15"],
     "rollout.sampling.actor_n must be 16 for grpo with rollout.sampling.n_samples 16, got 15"),
    (["algorithm.name=grpo", *NON_ANCHOR, "rollout.anchors.cache=true"],
     "rollout.anchors.engine \\(separate\\) and rollout.anchors.cache \\(True\\) apply to anchors; grpo samples none"),
    (["algorithm.name=grpo", *NON_ANCHOR, "opd.token_fraction=0.5"],
     "opd.token_fraction \\(0.5\\) sparsifies the teacher's per-token advantages; grpo has none"),
    (["algorithm.name=mipu", *NON_ANCHOR, "opd.teacher_url=http://t:1"],
     "opd.teacher_url / teacher_\\*_parallel_size configure the OPD teacher; mipu has none"),
    (["algorithm.name=mipu", *NON_ANCHOR, "algorithm.clip_low=0.0"], "algorithm.dual_clip must be > 1, got 1.0"),
    (["algorithm.name=opd", *NON_ANCHOR, "task.warm_start.steps=0"], "opd.teacher_path is required for algorithm.name opd"),
    (["algorithm.name=opd", *NON_ANCHOR, "opd.rollouts=teacher", "opd.teacher_path=/t"],
     "opd.rollouts teacher trains on off-policy tokens with the PPO ratio clip off"),
    (["algorithm.name=opd", *NON_ANCHOR, "opd.rollouts=teacher", "opd.teacher_path=/t", "algorithm.clip_low=1.0",
      "algorithm.clip_high=1.0", "rollout.mode=async", "rollout.partial_rollouts=true"],
     "rollout.partial_rollouts pauses the actor's engine at weight pushes, but opd.rollouts teacher"),
])
def test_each_algorithm_owns_its_config_rules(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_algorithm(load_config(None, [*BASE, *overrides]))


def test_a_plugin_named_by_path_is_imported_and_registered(tmp_path, monkeypatch):
    (tmp_path / "my_algorithms.py").write_text(
        "from megatron_armor.algorithms import Algorithm\n\n"
        "class SignOnly(Algorithm):\n    name = 'test_sign_only'\n\n"
        "NOT_AN_ALGORITHM = 3\n\n"
        "class Grpo2(Algorithm):\n    name = 'grpo'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cls = algorithm_class("my_algorithms:SignOnly")
        assert cls.name == "test_sign_only" and algorithm_class("test_sign_only") is cls
        assert algorithm_class("my_algorithms:SignOnly") is cls  # a second lookup finds it registered
    finally:
        unregister_algorithm("test_sign_only")
    with pytest.raises(ConfigError, match="'my_algorithms:NOT_AN_ALGORITHM' is 3, not an Algorithm subclass"):
        algorithm_class("my_algorithms:NOT_AN_ALGORITHM")
    with pytest.raises(ConfigError, match="plug-in 'my_algorithms:Grpo2': algorithm 'grpo' is already registered"):
        algorithm_class("my_algorithms:Grpo2")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        algorithm_class("no_such_module:X")


def test_the_built_in_algorithms_declare_the_sections_the_config_package_registers():
    from megatron_armor.algorithms import algorithm_class, registered_algorithms
    from megatron_armor.config.algorithm import BUILT_IN_SECTIONS

    declared = {}
    for name in ("armor", "grpo", "grpo_kl", "mipu", "opd"):
        assert name in registered_algorithms()
        declared.update(algorithm_class(name).config_sections)
    assert declared.keys() <= BUILT_IN_SECTIONS.keys() and all(BUILT_IN_SECTIONS[k] is v for k, v in declared.items())
    assert set(BUILT_IN_SECTIONS) == {"armor", "kl", "mipu", "opd"}


def test_an_algorithm_s_sections_register_all_or_none_and_never_under_a_fixed_name():
    from dataclasses import dataclass

    from megatron_armor.algorithms import Algorithm, register_algorithm, registered_algorithms
    from megatron_armor.config.section_registry import registered_sections

    @dataclass
    class Extra:
        x: int = 1

    for sections, error in (({"extra": Extra, "model": Extra}, "'model': not a name a section can take"),
                            ({"extra": Extra, "as_sections": Extra}, "'as_sections': not a name"),
                            ({"extra": Extra, "armor": Extra}, "'armor' is already MixedRatioConfig"),
                            ({"extra": Extra, "bad name": Extra}, "'bad name': not a name")):
        cls = type("Bad", (Algorithm,), {"name": "test_bad_sections", "config_sections": sections})
        with pytest.raises(ValueError, match=f"algorithm 'test_bad_sections': config section {error}"):
            register_algorithm(cls)
        assert "extra" not in registered_sections() and "test_bad_sections" not in registered_algorithms()
