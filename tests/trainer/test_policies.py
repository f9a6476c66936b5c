"""`Policy` and `PolicyHandles` (trainer/step_inputs/policies.py): which weights an engine shared by two policies holds
at the start, lookup by the names algorithms use, and a policy's checkpoint prefix on its own keys."""

import pytest
import torch

from megatron_armor.algorithms import ACTOR, REFERENCE, TEACHER
from megatron_armor.trainer.step_inputs.policies import Policy, PolicyHandles


def _handles(actor_engine, ref_engine, teacher: Policy | None = None) -> PolicyHandles:
    return PolicyHandles(actor=Policy(ACTOR, torch.nn.Linear(2, 2), actor_engine),
                         ref=Policy(REFERENCE, torch.nn.Linear(2, 2), ref_engine, checkpoint_prefix="ref."),
                         optimizer=None, shape=None, pad_token_id=0, teacher=teacher)


def test_a_shared_engine_starts_with_the_actors_weights_and_separate_engines_with_their_own():
    shared, other = object(), object()  # PolicyHandles tells engines apart by identity only
    handles = _handles(shared, shared)
    assert handles.shared_engine and handles.engines() == [shared]
    assert (handles.actor.holds_weights, handles.ref.holds_weights) == (True, False)
    assert handles.sharing_engine(handles.ref) == [handles.actor, handles.ref]
    separate = _handles(shared, other, teacher=Policy(TEACHER, None))  # a scoring-server teacher: no engine
    assert not separate.shared_engine and separate.engines() == [shared, other]
    assert all(policy.holds_weights for policy in separate.policies())
    assert separate.sharing_engine(separate.teacher) == [separate.teacher]


def test_policies_are_found_by_the_names_algorithms_use():
    handles = _handles(None, None, teacher=Policy(TEACHER, None))
    assert [handles.policy(name) for name in (ACTOR, REFERENCE, TEACHER)] == handles.policies()
    with pytest.raises(KeyError, match="no 'teacher' policy"):
        _handles(None, None).policy(TEACHER)


def test_a_policy_loads_its_checkpoint_keys_without_its_prefix():
    ref = _handles(None, None).ref
    weights = {"ref.weight": torch.arange(4.0).reshape(2, 2), "ref.bias": torch.tensor([5.0, 6.0])}
    ref.load_state_dict(weights)
    assert torch.equal(ref.model.weight, weights["ref.weight"]) and torch.equal(ref.model.bias, weights["ref.bias"])
    assert ref.state_dict().keys() == {"weight", "bias"}  # the plain state dict carries no prefix
