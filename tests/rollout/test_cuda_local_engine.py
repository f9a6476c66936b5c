"""The in-process engine on a GPU, as the trainer places it there (its device, the trainer's parameter dtype);
skipped without CUDA (scripts/gpu_checks.sh engine runs it on the GPU machine)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_armor.config import LocalEngineConfig
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5, 9, 17, 3], [40, 41, 42], [7, 8, 9, 10, 11, 12, 13], [99]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_engine_samples_on_the_gpu_in_the_trainers_dtype(prepackable_model, dtype):
    path = prepackable_model
    device = torch.device("cuda", torch.cuda.current_device())
    engine = LocalEngineConfig().build(model=str(path), pad_token_id=0, device=device, dtype=dtype)
    assert {(p.device, p.dtype) for p in engine.model.parameters()} == {(device, dtype)}
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16))
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, seed=0))
    assert [g.response_ids for g in sampled] == [
        g.response_ids for g in engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, seed=0))]
    tolerance = 0.02 if dtype == torch.bfloat16 else 1e-4  # bf16 rounding; TF32-free fp32 kernels differ far less
    for generation in greedy + sampled:
        ids = torch.tensor([generation.prompt_ids + generation.response_ids], device=device)
        response = torch.tensor(generation.response_ids, device=device)[:, None]
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0, len(generation.prompt_ids) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(-1, response).squeeze(-1).cpu()
        assert len(generation.logprobs) == 16
        torch.testing.assert_close(torch.tensor(generation.logprobs), want, atol=tolerance, rtol=0)
