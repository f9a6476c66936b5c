"""`PrepackedLinear` (oneDNN products on a laid-out weight): float32-accurate against a float64 product, each row
rounded the same in a batch of any size, weight updates seen, the replaced model's Parameters, names, tied
weights and gradients unchanged, and an engine on it sampling what an engine on `F.linear` samples."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.prepacked_linear import (
    PrepackedLinear, drop_layouts, prepack_linears, prepacking_available,
)

pytestmark = pytest.mark.skipif(not prepacking_available(), reason="this torch build has no oneDNN linear")


def _float32_error_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The classical bound on the rounding error of a float32 sum of n terms, gamma_n * sum |term| (n = in features
    plus the bias, gamma_n = n u / (1 - n u), u = 2^-24), for every output [N, out]."""
    n, u = x.shape[-1] + (bias is not None), 2.0**-24
    terms = x.abs().double() @ weight.abs().double().t() + (0.0 if bias is None else bias.abs().double())
    return n * u / (1 - n * u) * terms


@pytest.mark.parametrize("bias", [False, True])
def test_products_are_float32_accurate_and_a_row_rounds_the_same_in_any_batch(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 768, bias=bias)
    packed = PrepackedLinear.sharing(linear)
    x = torch.randn(256, 512)
    with torch.no_grad():
        out = packed(x)
        assert packed._layout is not None  # the oneDNN path ran, not the F.linear fallback
        exact = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
        assert ((out.double() - exact).abs() <= _float32_error_bound(x, linear.weight, linear.bias)).all()
        torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
        for rows in (1, 2, 3, 5, 16):  # a decode batch that dropped rows rounds the rows it kept as before
            assert torch.equal(packed(x[:rows]), out[:rows]), rows
        assert torch.equal(packed(x.view(16, 16, 512)), out.view(16, 16, 768))
        assert torch.equal(packed(x.t().contiguous().t()), out)  # a non-contiguous input


def test_a_weight_changed_in_place_or_replaced_is_laid_out_again_and_a_dropped_layout_is_remade():
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 32, bias=False)
    packed = PrepackedLinear.sharing(linear)
    x = torch.randn(4, 64)
    with torch.no_grad():
        packed(x)
        new = torch.randn(32, 64)
        linear.weight.copy_(new)  # LocalEngine.update_weights' in-place copy
        torch.testing.assert_close(packed(x), x @ new.t(), rtol=1e-5, atol=1e-5)
        replaced = torch.randn(32, 64)
        linear.weight.data = replaced  # new storage, version counter untouched
        torch.testing.assert_close(packed(x), x @ replaced.t(), rtol=1e-5, atol=1e-5)
        written = torch.randn(32, 64)  # a write into the storage's bytes (StoragePark.restore) bypasses both:
        linear.weight.untyped_storage().copy_(written.clone().untyped_storage())
        drop_layouts(torch.nn.Sequential(packed))  # the layout is made again from the weight as it is now
        assert packed._layout is None
        torch.testing.assert_close(packed(x), x @ written.t(), rtol=1e-5, atol=1e-5)


def test_forwards_that_need_gradients_or_other_dtypes_take_f_linear_and_copies_leave_the_layout_behind():
    torch.manual_seed(2)
    linear = torch.nn.Linear(64, 32)
    packed = PrepackedLinear.sharing(linear)
    x = torch.randn(4, 64)
    linear.weight.requires_grad_(False)  # only the bias trains: still a backward through F.linear
    packed(x).sum().backward()
    torch.testing.assert_close(linear.bias.grad, torch.full((32,), 4.0))
    assert packed._layout is None
    with torch.no_grad():
        packed(x)
        assert packed._layout is not None
        bf16 = copy.deepcopy(packed).bfloat16()
        assert bf16._layout is None  # a copy makes its own layout (an opaque oneDNN tensor cannot be copied)
        assert bf16(x.bfloat16()).dtype == torch.bfloat16 and bf16._layout is None  # bf16 takes F.linear
        restored = pickle.loads(pickle.dumps(packed))
        torch.testing.assert_close(restored(x), packed(x), rtol=0, atol=0)


def test_prepacking_a_model_keeps_its_parameters_names_ties_and_gradients(tiny_model_factory):
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_factory("qwen2"), dtype=torch.float32)
    model = copy.deepcopy(plain)
    model.lm_head.weight = model.get_input_embeddings().weight  # tied, as Qwen2-0.5B's are
    before = dict(model.named_parameters(remove_duplicate=False))
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert prepack_linears(copy.deepcopy(plain)) == 0  # the tiny model's layers are all below the default size
    assert prepack_linears(model, min_weight_elements=0) == linears > 0
    assert sum(isinstance(m, PrepackedLinear) for m in model.modules()) == linears
    assert isinstance(model.lm_head, PrepackedLinear) and model.lm_head.weight is model.get_input_embeddings().weight
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert model.state_dict().keys() == plain.state_dict().keys()
    untied = copy.deepcopy(plain)
    prepack_linears(untied, min_weight_elements=0)
    ids = torch.tensor([[5, 9, 17, 3, 40, 41]])
    for m in (untied, plain):  # a forward that needs gradients takes F.linear: the same loss and gradients
        m(input_ids=ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in untied.named_parameters()}
    for name, parameter in plain.named_parameters():
        torch.testing.assert_close(grads[name], parameter.grad, rtol=0, atol=0)


def test_engine_on_prepacked_weights_samples_what_an_engine_on_f_linear_samples(prepackable_model):
    """The same tokens, greedy and seeded; logprobs within a few ulps of the unpacked engine's, each engine's within
    the same distance of a full-sequence forward of the unmodified model (the trainer's side of the comparison)."""
    plain = AutoModelForCausalLM.from_pretrained(prepackable_model, dtype=torch.float32).eval()
    prompts = [[5, 9, 17, 3], [40, 41], [7, 8, 9, 10, 11, 12, 13], [99, 100, 101], [3, 3, 3, 60, 61], [20, 30]]
    fast, slow = LocalEngine(copy.deepcopy(plain)), LocalEngine(copy.deepcopy(plain), prepack_weights=False)
    prepacked = {n: m for n, m in fast.model.named_modules() if isinstance(m, PrepackedLinear)}
    assert {n.rsplit(".", 1)[-1] for n in prepacked} == {"gate_proj", "up_proj", "down_proj", "lm_head"}  # >= 2^17
    assert not any(isinstance(m, PrepackedLinear) for m in slow.model.modules())
    assert all(not m.training for m in fast.model.modules())
    for sampling in (SamplingParams(temperature=0.0, max_new_tokens=12),
                     SamplingParams(temperature=1.0, max_new_tokens=12, seed=4)):
        got, want = fast.generate(prompts, sampling), slow.generate(prompts, sampling)
        assert all(m._layout is not None for m in prepacked.values())  # the products ran on the layouts
        assert [g.response_ids for g in got] == [g.response_ids for g in want]
        for g, w in zip(got, want):
            ids = torch.tensor([g.prompt_ids + g.response_ids])
            with torch.no_grad():
                full = torch.log_softmax(plain(input_ids=ids).logits[0] / max(sampling.temperature, 1.0), dim=-1)
            trainer = full[len(g.prompt_ids) - 1 : -1].gather(-1, torch.tensor(g.response_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=2e-6)
            torch.testing.assert_close(torch.tensor(g.logprobs), trainer, rtol=0, atol=2e-6)
            torch.testing.assert_close(torch.tensor(w.logprobs), trainer, rtol=0, atol=2e-6)
