"""The optimized `LocalEngine` (last-position logits at the prefill, a preallocated KV cache, finished rows
dropped from the decode batch, linear layers on oneDNN-laid-out weights) generates what the plain decode loop it
replaced generates on an unmodified copy of the model (`F.linear` products): the same tokens, greedy and sampled
with a seed (whose draws it preserves), and the same logprobs up to `LOGPROB_ATOL`: oneDNN sums the products in
another order than MKL, and with several threads the attention over the preallocated cache's masked slots may
round the last bit differently."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine, _DecodeBatch
from megatron_armor.rollout.prepacked_linear import PrepackedLinear, prepacking_available


@torch.no_grad()
def reference_generate(model, prompts, sampling: SamplingParams, pad_token_id: int = 0):
    """The engine's decode loop before the optimizations: full-width logits at the prefill, a `DynamicCache`
    grown by concatenation, every row decoded until all stop, each row's token drawn by inverting its CDF at one
    uniform per row (counting the cumulative probabilities at or below u times the total).
    Returns [(response ids, logprobs)] per prompt."""
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    batch, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros(batch, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    positions, cache = (attention.cumsum(-1) - 1).clamp(min=0), DynamicCache()
    stop = torch.tensor(sampling.stop_token_ids or [-1])
    out = [([], []) for _ in prompts]
    finished, step_ids = torch.zeros(batch, dtype=torch.bool), input_ids
    for _ in range(sampling.max_new_tokens):
        logits = model(input_ids=step_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                       cache=cache).logits[:, -1]
        if sampling.temperature == 0:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            tokens = logprobs.argmax(dim=-1)
        else:
            logprobs = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)
            uniform = torch.rand(batch, generator=generator, dtype=torch.float64)
            cdf = logprobs.exp().double().cumsum(-1)
            tokens = (cdf <= (uniform * cdf[:, -1])[:, None]).sum(-1)
        token_logprobs = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        for row in (~finished).nonzero().flatten().tolist():
            out[row][0].append(int(tokens[row]))
            out[row][1].append(float(token_logprobs[row]))
        finished |= torch.isin(tokens, stop)
        if bool(finished.all()):
            break
        step_ids = tokens[:, None]
        attention = torch.cat([attention, attention.new_ones(batch, 1)], dim=1)
        positions = positions[:, -1:] + 1
    return out


def _model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _engine(model) -> LocalEngine:
    """The optimized engine on its own copy of `model` (it replaces its model's linear layers)."""
    engine = LocalEngine(copy.deepcopy(model))
    if prepacking_available():
        assert any(isinstance(m, PrepackedLinear) for m in engine.model.modules())
    return engine


LOGPROB_ATOL = 2e-6  # a few fp32 ulps at the magnitudes here; a real change of the computation moves them by far more

PROMPTS = [[5, 9, 17, 3], [40, 41], [7, 8, 9, 10, 11, 12, 13], [99], [3, 3, 3, 60, 61], [20, 30, 40],
           [11, 12], [50, 51, 52, 53, 54, 55, 56, 57, 58], [70], [80, 81, 82], [90, 91, 92, 93], [33, 34]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("rows", [12, 7])
def test_engine_equals_the_plain_decode_loop_with_rows_that_stop_early(prepackable_model, temperature, rows,
                                                                      monkeypatch):
    """Left-padded prompts of mixed lengths; stop tokens chosen among the tokens the rows draw, so some rows
    stop after a few tokens while others run to the limit (an even batch drops them mid-generation, an odd
    one keeps its size: its matmuls would round differently)."""
    prompts = PROMPTS[:rows]
    model = _model(prepackable_model)
    free = SamplingParams(temperature=temperature, max_new_tokens=24, seed=3)
    drawn = [ids for ids, _ in reference_generate(model, prompts, free)]
    stops = sorted({ids[2] for ids in drawn[:3]} | {drawn[3][10]})  # early stops, and one later
    sampling = SamplingParams(temperature=temperature, max_new_tokens=24, seed=3, stop_token_ids=stops)
    want = reference_generate(model, prompts, sampling)
    kept = []
    keep = _DecodeBatch._keep
    monkeypatch.setattr(_DecodeBatch, "_keep", lambda self, rows: (kept.append(len(rows)), keep(self, rows))[1])
    got = _engine(model).generate(prompts, sampling)
    assert (min(kept) < rows if rows % 2 == 0 else not kept), kept  # an even decode batch shrank
    lengths = [len(g.response_ids) for g in got]
    assert min(lengths) < 8 and max(lengths) == 24, lengths  # the batch shrinks while some rows run on
    for generation, (ids, logprobs) in zip(got, want):
        assert generation.response_ids == ids
        torch.testing.assert_close(torch.tensor(generation.logprobs), torch.tensor(logprobs), atol=LOGPROB_ATOL, rtol=0)
        assert generation.finish_reason == ("stop" if ids[-1] in stops else "length")


def test_sampled_generation_is_reproducible_and_equals_the_plain_loop_without_stops(prepackable_model):
    model = _model(prepackable_model)
    sampling = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=16, seed=11)
    engine = _engine(model)
    first, second = engine.generate(PROMPTS, sampling), engine.generate(PROMPTS, sampling)
    assert all(m._layout is not None for m in engine.model.modules() if isinstance(m, PrepackedLinear))
    assert [g.response_ids for g in first] == [g.response_ids for g in second]
    assert [g.logprobs for g in first] == [g.logprobs for g in second]
    want = reference_generate(model, PROMPTS, sampling)
    assert [g.response_ids for g in first] == [ids for ids, _ in want]
    for generation, (_, logprobs) in zip(first, want):
        torch.testing.assert_close(torch.tensor(generation.logprobs), torch.tensor(logprobs), atol=LOGPROB_ATOL, rtol=0)


def test_rows_that_share_a_prompt_are_prefilled_once_and_generate_what_the_plain_loop_does(prepackable_model,
                                                                                          monkeypatch):
    """RL's layout: n rows per prompt (prompts of mixed lengths, left-padded). The engine prefills each distinct prompt
    once (the prefill's batch is 3 rows, not 12) and copies its cache to the rows, which then sample apart: the
    same tokens and logprobs as the plain loop, which prefills all 12."""
    model = _model(prepackable_model)
    prompts = [PROMPTS[k] for k in (2, 0, 1) for _ in range(4)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
    prefill_rows = []
    model.register_forward_pre_hook(lambda module, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape),
                                    with_kwargs=True)  # the engine's copy of the model keeps the hook
    got = _engine(model).generate(prompts, sampling)
    assert prefill_rows[0] == (3, 7) and prefill_rows[1] == (12, 1)  # 3 distinct prompts, then every row decodes
    want = reference_generate(model, prompts, sampling)
    assert [g.response_ids for g in got] == [ids for ids, _ in want]
    assert len({tuple(g.response_ids) for g in got}) > 3  # rows of one prompt drew apart
    for generation, (_, logprobs) in zip(got, want):
        torch.testing.assert_close(torch.tensor(generation.logprobs), torch.tensor(logprobs), atol=LOGPROB_ATOL, rtol=0)
