"""Routing replay (scoring/routes.py, models/routing_replay.py) on a tiny Qwen3-MoE, a tiny Mixtral (softmax routers), a
tiny GLM-4.5 and a tiny DeepSeek-V3 (sigmoid routers with an expert bias) in one process: the local engine records its
routes, and the actor's forward replays them (R3) or its own earlier ones (R2); the routing metrics against counts taken
from the HF model. Multi-rank layouts (EP=2, PP=2): tests/trainer/test_parallel_layouts.py."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from megatron_armor.config import MicroBatchingConfig
from megatron_armor.convert.loading import load_gpt_model
from megatron_armor.data.types import Sample
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.hf_config import load_model_shape
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.scoring.batch import build_sequence_batch
from megatron_armor.scoring.logprobs import ScoringConfig, compute_logprobs, forward_backward
from megatron_armor.scoring.micro_batches import MicroBatching
from megatron_armor.scoring.routes import RoutingCounts, routing_pass

from algorithm_factory import make_algorithm

# Selection bias of the engine's routers [layer, expert]: its top-k is taken on logits + bias, its weights are the
# router's softmax at the chosen experts (as an expert-bias router's), so replaying its experts gives its logprobs.
# A sigmoid router's selection bias is its own expert bias (e_score_correction_bias), which this is added to.
ENGINE_BIAS = torch.tensor([[0.0, 0.9, 0.0, -0.9], [0.9, 0.0, -0.9, 0.0]])
# family -> its tiny checkpoint's options (GLM's: every layer MoE, as the others')
# (DeepSeek-V3's: one expert group, multi-latent attention, packed micro-batches through its padded value dims)
MODELS = {"qwen3_moe": {}, "mixtral": {}, "glm4_moe": {"moe": {"first_k_dense_replace": 0}},
          "deepseek_v3": {"moe": {"first_k_dense_replace": 0, "n_group": 1, "topk_group": 1}}}
SIGMOID_ROUTED = ("glm4_moe", "deepseek_v3")
LAYOUTS = {"rows": MicroBatching(MicroBatchingConfig(micro_batch_size=2)),
           "packed": MicroBatching(MicroBatchingConfig(micro_batch_size=3, pack=True))}


def selection_scores(arch: str, model, layer: int, logits: torch.Tensor) -> torch.Tensor:
    """The scores [T, E] the HF `model`'s router of `layer` takes its top-k of, from its logits: a softmax router's
    logits, a sigmoid router's sigmoid scores plus its expert bias."""
    if arch not in SIGMOID_ROUTED:
        return logits
    return logits.sigmoid() + model.model.layers[layer].mlp.gate.e_score_correction_bias


def bias_routing(model, bias: torch.Tensor) -> None:
    """Make every router of the HF `model` choose its top-k on its selection scores + bias[layer] (weights
    unchanged): a sigmoid router's expert bias moved by it, a softmax router's forward replaced."""
    for layer, block in enumerate(model.model.layers):
        gate = block.mlp.gate
        if hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias += bias[layer]
            continue

        def forward(hidden, gate=gate, bias=bias[layer]):
            logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            experts = torch.topk(logits + bias, gate.top_k, dim=-1).indices
            weights = torch.softmax(logits.float(), dim=-1).gather(1, experts)
            return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), experts

        gate.forward = forward


@pytest.fixture(scope="module", params=MODELS)
def setup(tiny_model_factory, request):
    """(checkpoint, biased engine, its samples' batch, the selection scores of its HF model's routers (the checkpoint's)
    for every sample [B][L] [T, E])."""
    checkpoint = tiny_model_factory(request.param, **MODELS[request.param])
    engine = LocalEngine(AutoModelForCausalLM.from_pretrained(checkpoint), record_routes=True)
    unbiased = AutoModelForCausalLM.from_pretrained(checkpoint)
    bias_routing(engine.model, ENGINE_BIAS)
    prompts = [[5, 17, 30, 2], [40, 8, 9], [5, 17, 30, 2], [11, 90]]  # rows 0 and 2 share a prefill
    generations = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
    samples = [Sample(i, g.prompt_ids, g.response_ids, g.logprobs, g.finish_reason, False,
                      routed_experts=g.routed_experts) for i, g in enumerate(generations)]
    logits = []  # teacher-forced, one sequence at a time: the selection scores of each router of the checkpoint
    with torch.no_grad():
        for g in generations:
            ids = torch.tensor([g.prompt_ids + g.response_ids])
            router_logits = engine.model(input_ids=ids, output_router_logits=True).router_logits
            logits.append([selection_scores(request.param, unbiased, layer, values)
                           for layer, values in enumerate(router_logits)])
    initialize_distributed(1, 1, 1)
    yield checkpoint, engine, samples, logits
    destroy_distributed()


def _actor(checkpoint):
    return load_gpt_model(checkpoint, load_model_shape(checkpoint), trainable=True)


def _batch(samples, *, routes: bool = True):
    if not routes:
        samples = [Sample(s.prompt_index, s.prompt_ids, s.response_ids, s.engine_logprobs, s.finish_reason, False)
                   for s in samples]
    return build_sequence_batch(samples, [1.0, -1.0, 0.5, -0.5], pad_token_id=0)


def test_the_engine_records_the_experts_it_routed_each_fed_token_to(setup):
    """SGLang's layout, [prompt + response - 1, L, k] int32: every token the engine fed (prompt, then all response
    tokens but the last), routed as its teacher-forced forward routes it."""
    _, _, samples, logits = setup
    for sample, layer_logits in zip(samples, logits):
        fed = len(sample.prompt_ids) + len(sample.response_ids) - 1
        routes = sample.routed_experts
        assert routes.shape == (fed, 2, 2) and routes.dtype == torch.int32
        for layer, values in enumerate(layer_logits):
            expected = torch.topk(values[:fed] + ENGINE_BIAS[layer], 2).indices
            assert torch.equal(routes[:, layer].sort(-1).values, expected.sort(-1).values)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rollout_replay_gives_the_engine_logprobs(setup, layout):
    """The engine's routers chose differently (selection bias): the trainer's own routing misses its logprobs, its
    replayed routing (R3) gives them to fp32 tolerance; rows or packed micro-batches alike."""
    checkpoint, _, samples, _ = setup
    actor, scoring, batching = _actor(checkpoint), ScoringConfig(), LAYOUTS[layout]
    for routes in (False, True):
        batch = _batch(samples, routes=routes)
        scored = compute_logprobs(actor, batch, micro_batching=batching, scoring=scoring,
                                  routing=routing_pass(actor, batch))
        diff = float(((scored.logprobs - batch.engine_logprobs).abs() * batch.response_mask).max())
        assert diff < 1e-5 if routes else diff > 1e-3, (routes, diff)  # own routing: a hundred times further


def test_routing_metrics_match_counts_from_the_hf_model(setup):
    """moe/routing_agreement: the share of (token, layer) routes where the trainer's router's own top-k is the
    engine's, counted here from the engine's HF router logits; 1 without the bias. moe/expert_load_cv from the
    routes the forward took (the engine's, the trainer's own at each sequence's last token)."""
    checkpoint, _, samples, logits = setup
    actor = _actor(checkpoint)
    batch = _batch(samples)
    routing = routing_pass(actor, batch)
    compute_logprobs(actor, batch, micro_batching=LAYOUTS["rows"], scoring=ScoringConfig(), routing=routing)
    agreed = compared = 0
    load = torch.zeros(2, 4)
    for sample, layer_logits in zip(samples, logits):
        fed = len(sample.prompt_ids) + len(sample.response_ids) - 1
        for layer, values in enumerate(layer_logits):
            own = torch.topk(values, 2).indices.sort(-1).values  # [T, k]
            engine = torch.topk(values[:fed] + ENGINE_BIAS[layer], 2).indices.sort(-1).values
            agreed += int((own[:fed] == engine).all(-1).sum())
            compared += fed
            load[layer] += torch.bincount(torch.cat([engine, own[fed:]]).reshape(-1), minlength=4)
    expected_cv = float((load.std(1, unbiased=False) / load.mean(1)).mean())
    metrics = routing.metrics()
    assert 0 < agreed / compared < 1
    assert metrics["moe/routing_agreement"] == pytest.approx(agreed / compared, abs=1e-9)
    assert metrics["moe/expert_load_cv"] == pytest.approx(expected_cv, rel=1e-6)
    assert metrics["moe/replay_applied"] == 1.0  # every token went to the engine's experts, though its own differ

    unbiased = LocalEngine(AutoModelForCausalLM.from_pretrained(checkpoint), record_routes=True)
    same = unbiased.generate([s.prompt_ids for s in samples], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
    batch = _batch([Sample(i, g.prompt_ids, g.response_ids, g.logprobs, g.finish_reason, False,
                           routed_experts=g.routed_experts) for i, g in enumerate(same)])
    routing = routing_pass(actor, batch)
    compute_logprobs(actor, batch, micro_batching=LAYOUTS["rows"], scoring=ScoringConfig(), routing=routing)
    assert routing.metrics()["moe/routing_agreement"] == 1.0


def test_routing_counts_tell_a_replay_that_took_effect_from_one_that_did_not():
    """RoutingCounts on hand-made routes of 1 row x 3 positions x 2 layers x top-2 (the last position padding): of the
    4 real token-layer routes with a target, the router's own choice matches 2 (as sets) and the forward applied 3."""
    target = torch.tensor([[[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[0, 1], [0, 1]]]])
    chosen = torch.tensor([[[[1, 0], [2, 1]], [[1, 2], [0, 2]], [[0, 1], [0, 1]]]])  # agrees at (0, 0), (1, 0)
    applied = torch.tensor([[[[1, 0], [3, 2]], [[2, 1], [0, 2]], [[2, 3], [2, 3]]]])  # misses (1, 1) only
    counts = RoutingCounts(torch.zeros(2, 4, dtype=torch.int64))
    counts.add(chosen, applied, target, real=torch.tensor([[True, True, False]]))
    assert (counts.agreed, counts.applied, counts.compared) == (2, 3, 4)
    assert counts.load.sum() == 4 * 2 and counts.load[1, 3] == 1  # the applied experts of the real positions


def test_recompute_replays_the_old_pass_routing_and_gradients_reach_the_routers(setup):
    """R2: the routers' choices of the old-logprob pass, replayed after the routers' weights moved, route every token
    as before (the same expert loads), though the moved routers now choose otherwise; the loss's gradient still
    reaches every router's weight through the replayed experts' probabilities."""
    checkpoint, _, samples, _ = setup
    actor, batching = _actor(checkpoint), LAYOUTS["packed"]
    batch = _batch(samples, routes=False)
    old = routing_pass(actor, batch)
    batch.old_logprobs = compute_logprobs(actor, batch, micro_batching=batching, scoring=ScoringConfig(),
                                          routing=old).logprobs
    routers = {name: p for name, p in actor.named_parameters() if name.endswith("mlp.router.weight")}
    with torch.no_grad():
        for weight in routers.values():
            weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(7)))
    moved = routing_pass(actor, batch)
    compute_logprobs(actor, batch, micro_batching=batching, scoring=ScoringConfig(), routing=moved)
    assert not torch.equal(moved.counts.load, old.counts.load)  # the moved routers route otherwise

    batch.routed_experts = old.chosen
    replayed = routing_pass(actor, batch)
    actor.zero_grad()
    forward_backward(actor, batching.split(batch), _loss(), scoring=ScoringConfig(), forward_only=False,
                     routing=replayed)
    assert torch.equal(replayed.counts.load, old.counts.load)
    metrics = replayed.metrics()
    assert metrics["moe/routing_agreement"] < 1 and metrics["moe/replay_applied"] == 1.0
    assert len(routers) == 2 and all(float(w.grad.abs().sum()) > 0 for w in routers.values())


def _loss():
    from megatron_armor.trainer.update.policy_update import PolicyLossCallback

    return PolicyLossCallback(make_algorithm("grpo"))
