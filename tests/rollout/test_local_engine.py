"""The in-process engine decodes with its KV cache under the argument name the model's forward takes."""

import torch
from transformers import AutoModelForCausalLM

from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine


class PastKeyValuesForward(torch.nn.Module):
    """An HF causal LM whose forward takes the KV cache as `past_key_values`, as before transformers 5.24
    (and no **kwargs: a cache passed under another name is an error, not silently dropped)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = model, model.config

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=past_key_values, use_cache=use_cache)


def test_kv_cache_reaches_the_model_under_its_forward_argument_name(tiny_model_factory, teacher_logprobs):
    """Decoding without the cache would see only the newest token: its logprobs miss the full-sequence
    reference by tenths."""
    path = tiny_model_factory("qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = [5, 9, 17, 3]
    for engine in (LocalEngine(model), LocalEngine(PastKeyValuesForward(model))):
        (generation,) = engine.generate([prompt], SamplingParams(max_new_tokens=12, seed=0))
        assert len(generation.response_ids) > 4
        want = teacher_logprobs(path, prompt, generation.response_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs), want, atol=1e-5, rtol=0)
