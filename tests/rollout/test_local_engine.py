"""The in-process engine decodes with its KV cache under the argument name the model's forward takes, and draws a
prompt with a seed of its own (`SamplingParams.seeds`) independently of the call's other prompts."""

import dataclasses

import pytest
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


def test_a_prompt_with_its_own_seed_samples_the_same_wherever_it_stands(tiny_model_factory):
    """With per-prompt seeds, a prompt's completion is the one it draws alone with that seed as the call's seed
    (one CPU generator either way), whatever other prompts share the call and in which order."""
    engine = LocalEngine(tiny_model_factory("qwen2"))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)
    prompts, seeds = [[5, 9, 17, 3], [7, 7], [5, 9, 17, 3], [11, 2, 8]], (3, 41, 5, 8)
    batched = engine.generate(prompts, dataclasses.replace(sampling, seeds=seeds))
    alone = [engine.generate([p], dataclasses.replace(sampling, seed=s))[0] for p, s in zip(prompts, seeds)]
    reordered = engine.generate(prompts[::-1], dataclasses.replace(sampling, seeds=seeds[::-1]))[::-1]
    for got in (batched, reordered):
        assert [g.response_ids for g in got] == [g.response_ids for g in alone]
        torch.testing.assert_close([g.logprobs for g in got], [g.logprobs for g in alone], atol=1e-5, rtol=0)
    assert batched[0].response_ids != batched[2].response_ids  # one prompt, two seeds: two samples
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(seed=1, seeds=(1,))
