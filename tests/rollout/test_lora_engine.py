"""LoRA on the rollout engines (model.lora.weight_sync adapter), one process: the in-process engine holding the base
and the adapter the trainer pushes samples the trainer's policy (its logprobs are the Megatron model's) and, with
the adapter off, the base's exactly (a MoE model's routed experts' adapters too); a push moves the adapters' bytes
alone; serve-local, loaded with the same adapter from tensors through the SGLang client (SGLang's endpoints and
`lora_path`), generates what the in-process engine does, with the adapter and without, and loaded by path from a
push directory (model.lora.push_dir: SGLang's /load_lora_adapter) samples the trainer's policy."""

import dataclasses
import functools

import pytest
import torch

from megatron_armor.config import LoRAConfig
from megatron_armor.convert.peft_export import all_stages_peft_tensors, peft_config
from megatron_armor.convert.weights import load_hf_weights
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.models.hf_config import load_model_shape, transformer_config
from megatron_armor.models.lora import apply_lora, lora_adapters
from megatron_armor.rollout.adapter_dir import AdapterDir
from megatron_armor.rollout.adapter_engine import AdapterEngine
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.engine_lora import AdapterError
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.prepacked_linear import PrepackedLinear, prepacking_available
from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig, ServerError, http_call
from megatron_armor.rollout.weight_sync import sync_weights

LORA = LoRAConfig(rank=4, alpha=8.0)
PROMPTS = [[5, 9, 17, 3], [40, 41], [7, 8, 9, 10, 11, 12, 13], [99]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SEEDED = SamplingParams(temperature=1.0, max_new_tokens=8, seeds=(11, 12, 13, 14))  # per prompt: any batching
TRAINER_ATOL = 1e-5  # engine (HF, oneDNN products) vs trainer (Megatron): the run test's mismatch bound
HF_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def megatron_world():
    initialize_distributed(1, 1, 1)
    yield
    destroy_distributed()


def _trained(checkpoint, lora: LoRAConfig) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """(Megatron actor of `checkpoint` with trained adapters: B nonzero, its PEFT tensors)."""
    shape = load_model_shape(checkpoint)
    model = build_gpt_model(shape, transformer_config(shape), trainable=True)
    load_hf_weights(model, checkpoint, shape)
    apply_lora(model, lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for adapter in lora_adapters(model):
            adapter.lora_b.copy_(torch.randn(adapter.lora_b.shape, generator=generator) * 0.05)
    return model, all_stages_peft_tensors(model, shape)


@pytest.fixture(scope="module")
def trained_actor(megatron_world, prepackable_model):
    """`_trained` on a checkpoint whose MLP the engine prepacks, so that the adapters' hooks sit on oneDNN layers
    too."""
    return _trained(prepackable_model, LORA)


def _actor_view(engine, model_dir, lora: LoRAConfig = LORA) -> AdapterEngine:
    return AdapterEngine(engine, "actor", functools.partial(peft_config, lora, base_model=str(model_dir)))


def _assert_samples_the_trainer_s_policy(actor, model, vocab: int) -> list[list[list[int]]]:
    """Greedy and seeded generations of `actor` have the Megatron `model`'s logprobs; returns their responses."""
    responses = []
    for sampling in (GREEDY, SEEDED):
        adapted = actor.generate(PROMPTS, sampling)
        for prompt, generation in zip(PROMPTS, adapted):
            want = _trainer_logprobs(model, vocab, prompt, generation.response_ids)
            torch.testing.assert_close(torch.tensor(generation.logprobs), want, atol=TRAINER_ATOL, rtol=0)
        responses.append([g.response_ids for g in adapted])
    return responses


@torch.no_grad()
def _trainer_logprobs(model, vocab: int, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[R] log_softmax of the Megatron model's logits at each response token (T = 1), one unpadded forward."""
    tokens = torch.tensor([prompt + response])
    logits = model(tokens, torch.arange(tokens.shape[1])[None], attention_mask=None)[0, :, :vocab].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_the_engine_with_the_pushed_adapter_samples_the_trainer_s_policy_and_without_it_the_base(
        trained_actor, prepackable_model):
    model, tensors = trained_actor
    engine = LocalEngine(prepackable_model)
    if prepacking_available():
        assert isinstance(engine.model.get_submodule("model.layers.0.mlp.up_proj"), PrepackedLinear)
    actor = _actor_view(engine, prepackable_model)
    with pytest.raises(AdapterError, match="no adapter 'actor' is loaded"):
        actor.generate(PROMPTS, GREEDY)
    report = sync_weights(actor, iter(tensors.items()))
    # independent count: A [r, in] and B [out, r] in float32 for every adapted HF linear layer
    layers = [engine.model.get_submodule(f"model.layers.{i}.{name}") for i in range(model.config.num_layers)
              for name in HF_LINEARS]
    assert report.tensors == 2 * len(layers)
    assert report.bytes == sum(LORA.rank * (layer.in_features + layer.out_features) * 4 for layer in layers)
    assert report.bytes < sum(p.nbytes for p in engine.model.parameters()) / 20  # the base never moves

    adapted = _assert_samples_the_trainer_s_policy(actor, model, engine.model.config.vocab_size)
    base = LocalEngine(prepackable_model)
    for sampling, responses in zip((GREEDY, SEEDED), adapted):
        off, want = engine.generate(PROMPTS, sampling), base.generate(PROMPTS, sampling)
        assert [(g.response_ids, g.logprobs) for g in off] == [(g.response_ids, g.logprobs) for g in want]
        assert responses != [g.response_ids for g in off]  # the adapter matters


def test_the_engine_with_pushed_expert_adapters_samples_the_trainer_s_policy(megatron_world, tiny_model_factory):
    """model.lora.experts: the push carries every routed expert's adapters under the checkpoint's per-expert names,
    and the engine (transformers 5's stacked experts) samples the trainer's policy with them and the base without."""
    checkpoint, lora = tiny_model_factory("qwen3_moe"), dataclasses.replace(LORA, experts=True)
    model, tensors = _trained(checkpoint, lora)
    engine = LocalEngine(checkpoint)
    actor = _actor_view(engine, checkpoint, lora)
    report = sync_weights(actor, iter(tensors.items()))
    experts = engine.model.config.num_experts
    assert report.tensors == 2 * model.config.num_layers * (4 + 3 * experts)  # q k v o, each expert's gate up down
    assert any(".mlp.experts.3.down_proj.lora_B" in name for name in tensors)
    adapted = _assert_samples_the_trainer_s_policy(actor, model, engine.model.config.vocab_size)
    off, want = engine.generate(PROMPTS, GREEDY), LocalEngine(checkpoint).generate(PROMPTS, GREEDY)
    assert [(g.response_ids, g.logprobs) for g in off] == [(g.response_ids, g.logprobs) for g in want]
    without_experts = {name: t for name, t in tensors.items() if ".mlp.experts." not in name}
    actor.update_weights(iter(without_experts.items()))  # the experts' adapters matter
    assert [g.response_ids for g in actor.generate(PROMPTS, GREEDY)] != adapted[0]


def test_bad_adapters_are_refused_before_anything_changes(trained_actor, tiny_model_factory):
    _, tensors = trained_actor
    engine = LocalEngine(tiny_model_factory("qwen2"))  # another shape than the adapter's
    config = peft_config(LORA, tensors, "base")
    with pytest.raises(AdapterError, match=r"o_proj.lora_A has shape \(4, 256\), the layer needs \(4, 64\)"):
        engine.load_lora_adapter("actor", config, tensors.items())
    with pytest.raises(AdapterError, match="is not a PEFT LoRA tensor name"):
        engine.load_lora_adapter("actor", config, [("model.layers.0.mlp.up_proj.weight", torch.zeros(1))])
    assert engine.adapters.loaded == {}


def test_serve_local_with_the_adapter_from_tensors_generates_what_the_in_process_engine_does(
        trained_actor, prepackable_model, serving, tmp_path):
    model, tensors = trained_actor
    local = LocalEngine(prepackable_model)
    local_actor = _actor_view(local, prepackable_model)
    local_actor.update_weights(iter(tensors.items()))
    with serving(prepackable_model) as server:
        client = SGLangEngine([f"http://127.0.0.1:{server.state.port}"],
                              SGLangEngineConfig(startup_timeout_s=60, poll_interval_s=0.1))
        remote_actor = _actor_view(client, prepackable_model)
        stale = {name: torch.zeros_like(t) for name, t in tensors.items()}
        remote_actor.update_weights(iter(stale.items()))
        remote_actor.update_weights(iter(tensors.items()))  # replaces it (SGLang refuses a name it holds: unloaded)
        assert list(server.state.engine.adapters.loaded) == ["actor"]
        for sampling in (GREEDY, SEEDED):
            for remote, here in ((remote_actor, local_actor), (client, local)):  # the adapter on, and off
                got, want = remote.generate(PROMPTS, sampling), here.generate(PROMPTS, sampling)
                assert [g.response_ids for g in got] == [g.response_ids for g in want]
                for g, w in zip(got, want):
                    torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-6, rtol=0)

        # model.lora.push_dir: each push is a new PEFT directory the server loads by path (SGLang's /load_lora_adapter)
        push_dir = tmp_path / "push"
        (push_dir / "actor-rank0-v000007").mkdir(parents=True)  # a run's earlier version: numbering goes on after it
        by_path = AdapterEngine(client, "actor", functools.partial(peft_config, LORA, base_model=str(prepackable_model)),
                                AdapterDir(push_dir, "actor-rank0"))
        by_path.update_weights(iter(stale.items()))
        by_path.update_weights(iter(tensors.items()))
        assert sorted(entry.name for entry in push_dir.iterdir()) == ["actor-rank0-v000008", "actor-rank0-v000009"]
        assert list(server.state.engine.adapters.loaded) == ["actor"]
        url = f"http://127.0.0.1:{server.state.port}"  # as SGLang, a name it holds is refused by both routes
        with pytest.raises(ServerError, match=r"/load_lora_adapter: adapter 'actor' is already loaded"):
            http_call(url, "/load_lora_adapter",
                      {"lora_name": "actor", "lora_path": str(push_dir / "actor-rank0-v000009")})
        with pytest.raises(ServerError, match=r"/load_lora_adapter: bad request"):
            http_call(url, "/load_lora_adapter", {"lora_name": "other"})
        _assert_samples_the_trainer_s_policy(by_path, model, local.model.config.vocab_size)
