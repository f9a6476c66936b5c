"""The local engine's weight-precision noise model: bf16 / simulated FP8 weights vs the fp32 trainer."""

import pytest
import torch

from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.precision import FP8_E4M3_MAX, quantize_weight


def test_fp8_rounds_rows_to_e4m3_with_a_per_row_scale():
    w = torch.tensor([[1.0, 0.3, -448.0], [0.01, 0.02, 0.03]])
    q = quantize_weight(w, "fp8")
    assert q.dtype == torch.float32 and q.shape == w.shape
    assert q[0, 2] == -448.0 and q[1, 2] == pytest.approx(0.03)  # each row's amax maps to +-448 exactly
    assert not torch.equal(q, w) and torch.allclose(q, w, rtol=0.07, atol=0)  # e4m3: 3 mantissa bits
    scale = w[1].abs().max() / FP8_E4M3_MAX
    assert torch.equal(q[1], (w[1] / scale).to(torch.float8_e4m3fn).float() * scale)
    assert torch.equal(quantize_weight(q, "fp8"), q)  # idempotent: re-syncing gives the same engine weights
    vector = torch.tensor([1.0 + 2**-10])
    assert torch.equal(quantize_weight(vector, "fp8"), vector.to(torch.bfloat16).float())
    assert quantize_weight(w, "fp32") is w


def _engine_logprobs(engine, prompt, response):
    """Teacher-forced logprobs of `response` under the engine's model. -> [R] float32."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_quantized_engines_differ_from_fp32_and_keep_quantizing_weight_updates(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    exact = LocalEngine(path)
    prompt = [5, 9, 17, 3]
    response = exact.generate([prompt], SamplingParams(max_new_tokens=12, seed=0))[0].response_ids
    reference = _engine_logprobs(exact, prompt, response)
    gaps = {}
    for precision in ("bf16", "fp8"):
        engine = LocalEngine(path, weight_precision=precision)
        gaps[precision] = float((_engine_logprobs(engine, prompt, response) - reference).abs().mean())
        trainer_weights = {n: p.detach() * 1.01 for n, p in exact.model.named_parameters()}
        engine.update_weights(trainer_weights.items())
        for name, param in engine.model.named_parameters():
            assert torch.equal(param, quantize_weight(trainer_weights[name], precision)), name
    assert 1e-6 < gaps["bf16"] < gaps["fp8"] < 0.5, gaps
    with pytest.raises(ValueError, match="unknown weight_precision 'int4'"):
        LocalEngine(path, weight_precision="int4")
