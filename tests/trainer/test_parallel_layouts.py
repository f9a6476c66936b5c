"""TP=2 (also with sequence parallelism), PP=2, DP=2 (also with the distributed optimizer) and TP=2 x PP=2 give
the TP=1 PP=1 logprobs, gradients and ARMOR step (gloo, CPU), and so do a MoE model's EP=2, PP=2, TP=2 (sequence
parallel) and EP=2 x TP=2 steps, with routing replay among them, and its TP=2 steps with every expert whole (expert
TP 1, over EP=1 or EP=2), and token-budget and packed micro-batches (one
process, PP=2 with micro-batches of different shapes, TP=2 with sequence parallelism and the fused head);
so does the fused Triton LM head (interpreter) at TP=2, also with sequence parallelism and on a padded vocabulary,
and a tied-embedding Qwen3 model at PP=2; so does a Qwen2-MoE step (a gated shared expert) at TP=2 (sequence
parallel) beside EP=2, and Mixtral's and GLM-4.5's (sigmoid router, expert bias) at PP=2; so do context-parallel
steps, entropy included, at CP=2 (also with the fused head, with packed micro-batches, and with the distributed
optimizer and full recomputation), CP=2 x TP=2 (sequence parallel) and CP=2 x PP=2, and a MoE model's CP=2 steps
(auxiliary loss, routing metrics, routing replay; CP=2 x EP=2 with selective recomputation); so does a whole ARMOR
step on multi-turn trajectories (rolled out, then trained; tokens inside the response that are not trained;
trajectories forked on drift into several samples) at TP=2 and DP=2."""

import collections
from pathlib import Path

import pytest
import torch

from launcher import concurrently, run_workers
from state_trees import adam_moments, saved_modules

LOGPROB_ATOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7  # fp32; reductions run in a different order per layout
# Adam's first step moves a weight by about lr * g / (|g| + eps): for gradients near eps (~1e-8) the
# summation-order differences above shift it by up to a few 1e-6 at lr = 1e-3; 1e-5 is 1% of a step.
WEIGHT_ATOL = 1e-5
# bf16 (8 significant bits): one rounding's relative error is at most U = 2^-8; its spacing at w is at most 2^-7 |w|.
U = 2.0 ** -8
LR = 1e-3  # the worker's learning rate
MOMENT_RTOL, MOMENT_ATOL = 1e-3, 1e-7  # Adam moments after two mini-batches (the second's grads at weights WEIGHT_ATOL apart)


def _actor_and_ref(root, eos_logit_scale=None, **options):
    from megatron_armor.models.tiny import make_tiny_checkpoint

    paths = [make_tiny_checkpoint(root / role, seed=seed, **options) for role, seed in (("actor", 0), ("ref", 1))]
    for path in paths if eos_logit_scale else ():
        _scale_eos_logit(path, eos_logit_scale)
    return paths


def _scale_eos_logit(path, factor):
    """Multiply the LM head's EOS row by `factor`: an untrained model's EOS logit then swings far above and below the
    others, so it ends a turn within a few tokens (multi-turn trajectories of a random model)."""
    from safetensors.torch import load_file, save_file

    from megatron_armor.models.tiny import make_char_tokenizer

    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][make_char_tokenizer().eos_token_id] *= factor
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


# checkpoint kind -> make_tiny_checkpoint options of its actor and reference
MODELS = {
    "dense": {},
    # Qwen3 with tied embeddings (the last stage keeps an output-layer copy whose grads Megatron all-reduces with
    # the embedding's), q/k norms and a vocabulary padded from 100 to 128.
    "tied": {"arch": "qwen3", "tie_word_embeddings": True, "vocab_size": 100, "head_dim": 32},
    "moe": {"arch": "qwen3_moe"},  # 4 experts, top-2 (tests/trainer/test_moe_layouts.py)
    "qwen2-moe": {"arch": "qwen2_moe"},  # 4 experts, top-2 unnormalised, a gated shared expert, QKV biases
    "mixtral": {"arch": "mixtral"},  # 4 experts of width intermediate_size, top-2 renormalised, block_sparse_moe names
    # layer 0 dense, sigmoid top-2 with a fixed expert bias (a buffer), routed scaling, an ungated shared expert
    "glm4-moe": {"arch": "glm4_moe"},
    # DeepSeek-V3: multi-latent attention with YaRN RoPE, layer 0 dense, grouped sigmoid top-2 with an expert bias
    "deepseek-v3": {"arch": "deepseek_v3"},
    "eos-prone": {"eos_logit_scale": 60.0},  # the dense model ending its turns early: multi-turn rollouts
}

# job name -> (checkpoint kind, tp, pp, head, worker options...); the jobs of one process count share one launch.
JOBS = {
    1: {"base": ("dense", 1, 1, "torch"), "tied-base": ("tied", 1, 1, "torch"),
        "budget-packed": ("dense", 1, 1, "torch", "budget=40", "packed"),
        "moe-base": ("moe", 1, 1, "torch"), "moe-aux": ("moe", 1, 1, "torch", "aux=0.1"),
        "moe-r3": ("moe", 1, 1, "torch", "replay=rollout"), "moe-r2": ("moe", 1, 1, "torch", "replay=recompute"),
        "qwen2-moe-base": ("qwen2-moe", 1, 1, "torch"), "mixtral-base": ("mixtral", 1, 1, "torch"),
        "wide-clip-base": ("dense", 1, 1, "torch", "clip=0.2"), "bf16-base": ("dense", 1, 1, "torch", "bf16", "clip=0.2"),
        "glm4-moe-base": ("glm4-moe", 1, 1, "torch"), "deepseek-v3-base": ("deepseek-v3", 1, 1, "torch"),
        "masked-base": ("dense", 1, 1, "torch", "masked"), "agentic-base": ("eos-prone", 1, 1, "torch", "agentic"),
        "lora-base": ("dense", 1, 1, "torch", "lora", "checkpoint"), "lora-moe-base": ("moe", 1, 1, "torch", "lora")},
    2: {"tp2": ("dense", 2, 1, "torch"), "pp2": ("dense", 1, 2, "torch"), "dp2": ("dense", 1, 1, "torch"),
        "dp2-distopt": ("dense", 1, 1, "torch", "distopt"),
        "tp2-fused-head": ("dense", 2, 1, "fused"),
        "tp2-sp": ("dense", 2, 1, "torch", "sp"), "tp2-sp-fused-head": ("dense", 2, 1, "fused", "sp"),
        "pp2-budget": ("dense", 1, 2, "torch", "budget=40"),
        "pp2-budget-packed": ("dense", 1, 2, "torch", "budget=40", "packed"),
        "tp2-sp-packed-fused-head": ("dense", 2, 1, "fused", "sp", "packed"),
        "tied-pp2": ("tied", 1, 2, "torch"),
        "tied-tp2-fused-head": ("tied", 2, 1, "fused"),
        "moe-ep2": ("moe", 1, 1, "torch", "ep=2"), "moe-pp2": ("moe", 1, 2, "torch"),
        "moe-ep2-r3": ("moe", 1, 1, "torch", "ep=2", "replay=rollout"),
        "moe-pp2-r2": ("moe", 1, 2, "torch", "replay=recompute"),
        "moe-tp2-sp-r3": ("moe", 2, 1, "torch", "sp", "replay=rollout"),
        "moe-tp2-sp-etp1": ("moe", 2, 1, "torch", "sp", "etp=1"),
        "moe-tp2-sp-ep2-etp1": ("moe", 2, 1, "torch", "sp", "ep=2", "etp=1"),
        "qwen2-moe-tp2-sp-ep2-etp1": ("qwen2-moe", 2, 1, "torch", "sp", "ep=2", "etp=1"),
        "mixtral-pp2": ("mixtral", 1, 2, "torch"), "glm4-moe-pp2": ("glm4-moe", 1, 2, "torch"),
        "deepseek-v3-pp2": ("deepseek-v3", 1, 2, "torch"),
        "bf16-tp2": ("dense", 2, 1, "torch", "bf16", "clip=0.2"), "bf16-pp2": ("dense", 1, 2, "torch", "bf16", "clip=0.2"),
        "bf16-dp2-distopt": ("dense", 1, 1, "torch", "bf16", "distopt", "clip=0.2"),
        "cp2": ("dense", 1, 1, "torch", "cp=2"), "cp2-fused-head": ("dense", 1, 1, "fused", "cp=2"),
        "cp2-budget-packed": ("dense", 1, 1, "torch", "cp=2", "budget=40", "packed"),
        "moe-cp2": ("moe", 1, 1, "torch", "cp=2"), "moe-cp2-aux": ("moe", 1, 1, "torch", "cp=2", "aux=0.1"),
        "moe-cp2-r3": ("moe", 1, 1, "torch", "cp=2", "replay=rollout"),
        "moe-cp2-budget-packed-r3": ("moe", 1, 1, "torch", "cp=2", "budget=40", "packed", "replay=rollout"),
        "cp2-distopt-recompute": ("dense", 1, 1, "torch", "cp=2", "distopt", "recompute=full"),
        "moe-cp2-ep2-selective": ("moe", 1, 1, "torch", "cp=2", "ep=2", "recompute=selective"),
        "agentic-tp2": ("eos-prone", 2, 1, "torch", "agentic"), "agentic-dp2": ("eos-prone", 1, 1, "torch", "agentic"),
        "lora-tp2": ("dense", 2, 1, "torch", "lora", "checkpoint"), "lora-tp2-sp": ("dense", 2, 1, "torch", "sp", "lora"),
        "lora-pp2": ("dense", 1, 2, "torch", "lora"), "lora-dp2-distopt": ("dense", 1, 1, "torch", "distopt", "lora", "checkpoint"),
        "lora-moe-ep2": ("moe", 1, 1, "torch", "ep=2", "lora"),
        "lora-tp2-sp-budget-packed": ("dense", 2, 1, "torch", "sp", "budget=40", "packed", "lora")},
    4: {"tp2xpp2": ("dense", 2, 2, "torch"),
        "cp2xtp2-sp": ("dense", 2, 1, "torch", "sp", "cp=2"), "cp2xpp2": ("dense", 1, 2, "torch", "cp=2"),
        "moe-ep2-tp2-sp-r3": ("moe", 2, 1, "torch", "sp", "ep=2", "replay=rollout"),
        "moe-ep2-pp2": ("moe", 1, 2, "torch", "ep=2")},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """job name -> every rank's result, from one launch per process count (one and two ranks at once)."""
    checkpoints = {kind: _actor_and_ref(tmp_path_factory.mktemp(kind), **options) for kind, options in MODELS.items()}
    outs = {nproc: tmp_path_factory.mktemp(f"n{nproc}") for nproc in JOBS}

    def launch(nproc: int) -> None:
        specs = [",".join(map(str, (name, *checkpoints[kind], *layout))) for name, (kind, *layout) in JOBS[nproc].items()]
        run_workers("layout_parity.py", nproc, outs[nproc], *specs)

    concurrently(lambda: launch(1), lambda: launch(2))  # one rank beside two: the box's 2 cores
    launch(4)
    return {name: [torch.load(outs[nproc] / name / f"rank{r}.pt") for r in range(nproc)]
            for nproc, jobs in JOBS.items() for name in jobs}


@pytest.mark.parametrize("name", ["tp2", "pp2", "dp2", "dp2-distopt", "tp2xpp2", "tp2-fused-head", "tp2-sp",
                                  "tp2-sp-fused-head", "budget-packed", "pp2-budget", "pp2-budget-packed",
                                  "tp2-sp-packed-fused-head"])
def test_layout_matches_single_rank(runs, name):
    ranks = runs[name]
    _, tp, pp, head, *_ = next(jobs[name] for jobs in JOBS.values() if name in jobs)
    assert ranks[0]["layout"] == (tp, pp, len(ranks) // (tp * pp))
    assert_same_step(ranks, runs["base"][0])
    assert_head_gradient_path(ranks, head)


def test_only_the_sampled_tokens_of_a_trajectory_are_scored_and_trained(runs):
    """Responses holding tokens the policy did not sample (loss_mask 0: a tool result between two turns): only the
    sampled tokens are scored, and the step differs from the same batch trained on every response token."""
    masked, whole = runs["masked-base"][0], runs["base"][0]
    assert masked["logprobs"].keys() == whole["logprobs"].keys()  # each sequence, up to its last (sampled) token
    for key, (old, ref) in masked["logprobs"].items():
        kept = [0] + list(range(3, len(whole["logprobs"][key][0])))  # the response's tokens 1 and 2 are not scored
        torch.testing.assert_close(old, whole["logprobs"][key][0][kept], atol=LOGPROB_ATOL, rtol=0)
        torch.testing.assert_close(ref, whole["logprobs"][key][1][kept], atol=LOGPROB_ATOL, rtol=0)
    assert masked["metrics"]["loss/policy_loss"] != pytest.approx(whole["metrics"]["loss/policy_loss"], rel=1e-3)


def test_multi_turn_armor_step_at_tp2_and_dp2_equals_one_process(runs):
    """The whole step on multi-turn trajectories, forked on drift under a template that strips earlier answers: the
    rollout (two-turn trajectories of the actor and the reference's anchors, the requests dealt over the ranks, each
    seeded on its own) gives every rank the one-process run's samples (tokens, masks, rewards and trajectory numbers
    exactly; engine logprobs to the fp32 floor: the in-process engine batches the turns in flight, which differ by
    layout), and the ARMOR update on them (a trajectory's segments dealt together, sharing its advantage) equals the
    one-process one."""
    base = runs["agentic-base"][0]
    samples = [s for group in base["samples"] for s in group]
    assert len(base["samples"]) == 4 and all(group[-1][5] and group[-1][4] > 0 for group in base["samples"])
    assert all(mask[0] == mask[-1] == 1 for _, _, mask, *_ in samples)  # from the first to the last sampled token
    segments = collections.Counter((g, s[5], s[6]) for g, group in enumerate(base["samples"]) for s in group)
    assert max(segments.values()) == 2  # forked two-turn trajectories (a first answer cut by the template) ...
    # ... and unforked ones (a first answer of at most one character: the tool message between their turns; or one
    # turn cut at its token limit); a forked trajectory's segments hold sampled tokens and context before them only
    with_tool_message = [segments[g, s[5], s[6]] for g, group in enumerate(base["samples"]) for s in group if 0 in s[2]]
    assert with_tool_message and set(with_tool_message) == {1}
    assert {s[4] for s in samples if not s[5]} == {-1.0, 1.0}
    # The EOS-prone head's logits swing by +-10: gradients ~15x the fixed batch's (max ~1.6), and the layouts'
    # summation-order differences with them (~2e-6 at TP=2): gradients are held to 1e-5 of the largest one, the
    # weights after two Adam steps to 2% of a step, where the gradient is not at Adam's eps (10x it: 1e-7).
    grad_atol = 1e-5 * max(g.abs().max().item() for g in base["grads"].values())
    for name in ("agentic-tp2", "agentic-dp2"):
        for rank in runs[name]:
            assert [[(s[:3], s[4:]) for s in g] for g in rank["samples"]] == [[(s[:3], s[4:]) for s in g]
                                                                             for g in base["samples"]]
            for got, want in zip((s for g in rank["samples"] for s in g), samples):
                assert got[3] == pytest.approx(want[3], abs=LOGPROB_ATOL, rel=0)
        assert_same_step(runs[name], base, grad_atol=grad_atol, weight_atol=2 * WEIGHT_ATOL, settled_grad=1e-7)


@pytest.mark.parametrize("name", ["dp2-distopt", "cp2-distopt-recompute"])
def test_distributed_optimizer_halves_the_state_per_rank(runs, name):
    """At DP=2, or at CP=2 (Megatron shards the state over the DP x CP ranks, which all hold the same weights), each
    rank keeps the Adam state of half the parameters (Megatron pads the flat buffer to a multiple of the DP x CP
    size, so a slice may be a little over half); its state_dict() round-trips exactly."""
    whole = runs["base"][0]["optimizer_state_bytes"]
    shards = [result["optimizer_state_bytes"] for result in runs[name]]
    assert [result["optimizer_state_bytes"] for result in runs["dp2"]] == [whole, whole]  # replicated without it
    assert all(0.45 * whole <= shard <= 0.51 * whole for shard in shards), (whole, shards)
    assert all(result["state_round_trip_exact"] for result in runs[name])


def test_tied_embeddings_under_pipeline_parallelism(runs):
    assert "lm_head.weight" not in runs["tied-base"][0]["grads"]  # tied: exported once, as the embedding
    assert_same_step(runs["tied-pp2"], runs["tied-base"][0])


def test_fused_head_on_padded_tied_vocabulary(runs):
    """Vocabulary 100 padded to 128: at TP=2 the second shard holds rows 64-127, 28 of them padding. The
    output weight is the embedding (Megatron's zero_out_wgrad case); the torch-head TP=1 step is the reference."""
    assert_same_step(runs["tied-tp2-fused-head"], runs["tied-base"][0])
    assert_head_gradient_path(runs["tied-tp2-fused-head"], "fused")


def test_moe_routing_replay_under_ep2_pp2_and_tp2_matches_single_rank(runs):
    """Routing replay (train.routing_replay) of a MoE ARMOR step: replaying an engine's routes (R3, here random ones)
    with the experts over EP=2, at TP=2 with sequence parallelism (each TP rank's routers see a slice of the
    sequence: they get that slice's routes, and their choices are gathered back), and at EP=2 x TP=2 (experts split
    over the expert-TP group too), and the old-logprob pass's own
    routing in the update (R2) with the layers over PP=2 (each stage records and replays its own layers), equal
    their one-process steps, routing metrics included; R3 changes the logprobs, and its routers' own choices mostly
    disagree with the random routes."""
    r3, r2, base = runs["moe-r3"][0], runs["moe-r2"][0], runs["moe-base"][0]
    assert_same_step(runs["moe-ep2-r3"], r3)
    assert_same_step(runs["moe-tp2-sp-r3"], r3)
    assert runs["moe-ep2-tp2-sp-r3"][0]["layout"] == (2, 1, 2)
    assert_same_step(runs["moe-ep2-tp2-sp-r3"], r3)
    assert_same_step(runs["moe-pp2-r2"], r2)
    some_key = next(iter(base["logprobs"]))
    assert not torch.allclose(r3["logprobs"][some_key][0], base["logprobs"][some_key][0], atol=1e-3)
    assert 0 < r3["routing_metrics"]["moe/routing_agreement"] < 0.5 and "moe/routing_agreement" not in r2["routing_metrics"]
    assert r3["routing_metrics"]["moe/replay_applied"] == 1.0  # and at every layout below: the replay took effect
    for name in ("moe-ep2-r3", "moe-tp2-sp-r3", "moe-ep2-tp2-sp-r3", "moe-pp2-r2"):
        reference = r3 if name.endswith("r3") else r2
        for result in runs[name]:
            assert result["routing_metrics"] == pytest.approx(reference["routing_metrics"], rel=1e-9), name
    assert r2["routing_metrics"]["moe/expert_load_cv"] > 0


@pytest.mark.parametrize("name", ["cp2", "cp2-fused-head", "cp2xtp2-sp", "cp2xpp2", "cp2-budget-packed",
                                  "cp2-distopt-recompute"])
def test_context_parallel_matches_single_rank(runs, name):
    """Every CP rank holds its zig-zag chunks of each sequence (no data-parallel replica: DP 1) and logs the whole
    step: logprobs, entropy, gradients, metrics and updated weights equal the one-process step's, with the torch
    head or the fused one (which scores each rank's chunks and adds its weight gradient into main_grad), with
    token-budget packed micro-batches (THD: each packed sequence re-padded and split zig-zag on its own), and with the
    distributed optimizer (its state sharded over the CP ranks) and full recomputation (every layer's forward, its
    all-gather of keys and values over the CP group included, run again in the backward)."""
    ranks, baseline = runs[name], runs["base"][0]
    _, tp, pp, head, *_ = next(jobs[name] for jobs in JOBS.values() if name in jobs)
    assert [result["layout"] for result in ranks] == [(tp, pp, 1)] * len(ranks)
    assert baseline["checkpointed"] == 0  # Megatron's activation checkpoint: only where the job recomputes
    assert all((result["checkpointed"] > 0) == ("recompute" in name) for result in ranks)
    assert_same_step(ranks, baseline)
    assert_head_gradient_path(ranks, head)
    for result in ranks:
        assert result["entropy"].keys() == baseline["entropy"].keys()
        for key, entropy in result["entropy"].items():
            torch.testing.assert_close(entropy, baseline["entropy"][key], atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("name,reference", [("moe-cp2", "moe-base"), ("moe-cp2-aux", "moe-aux"),
                                            ("moe-cp2-r3", "moe-r3"), ("moe-cp2-budget-packed-r3", "moe-r3"),
                                            ("moe-cp2-ep2-selective", "moe-base")])
def test_moe_under_context_parallelism_matches_single_rank(runs, name, reference):
    """A MoE step at CP=2: each CP rank routes its chunks' tokens; the auxiliary loss (Megatron reduces its token
    counts over TP x CP), the routing metrics (the routers' choices gathered over the CP ranks) and routing replay
    (R3: each rank replays its chunks' routes, also of packed micro-batches) equal the one-process step's; so does
    a step with the experts over EP=2 across the two CP ranks (Megatron's expert layout regroups TP x CP x DP: each
    rank holds half the experts and dispatches its chunks' tokens to both) with the core attention recomputed in the
    backward (selective recomputation)."""
    baseline = runs[reference][0]
    assert_same_step(runs[name], baseline)
    assert all((result["checkpointed"] > 0) == ("selective" in name) for result in runs[name])
    for result in runs[name]:
        assert result["routing_metrics"] == pytest.approx(baseline["routing_metrics"], rel=1e-9), name
        if "aux" in name:
            assert result["metrics"]["moe/aux_loss"] == pytest.approx(baseline["metrics"]["moe/aux_loss"], rel=1e-6)


def test_bf16_pipeline_and_distributed_optimizer_steps_equal_one_process(runs):
    """bf16 parameters, fp32 main grads and master weights (Megatron's mixed-precision optimizer; at DP=2 its
    distributed optimizer, master weights sharded). PP=2 splits the layers without changing any operation, and DP=2
    sums the same two micro-batches' fp32 grads in an order that does not matter for two terms: logprobs and grads
    are bitwise the one process's. Megatron's grad norm (summed over stages or DP shards) moves in its last fp32 bit,
    and so does the clip factor (the norm is above grad_clip 1.0): each fp32 master weight moves by under
    1e-7 * 2 steps * LR, its bf16 weight by at most one spacing (2^-7 |w|) where that crosses a rounding boundary."""
    baseline = runs["bf16-base"][0]
    assert baseline["metrics"]["optim/grad_norm"] > 1.0  # clipped: the clip factor is part of the step
    for name in ("bf16-pp2", "bf16-dp2-distopt"):
        for result in runs[name]:
            for key, (old, ref) in result["logprobs"].items():
                assert torch.equal(old, baseline["logprobs"][key][0]) and torch.equal(ref, baseline["logprobs"][key][1])
            for grad_name, grad in result["grads"].items():
                assert torch.equal(grad, baseline["grads"][grad_name]), (name, grad_name)
            for weight_name, weight in result["weights"].items():
                assert weight.dtype == torch.bfloat16
                torch.testing.assert_close(weight, baseline["weights"][weight_name], rtol=2 * U, atol=1e-9, msg=weight_name)
            for key in ("loss/policy_loss", "loss/mixed_ratio_mean", "optim/grad_norm"):
                assert result["metrics"][key] == pytest.approx(baseline["metrics"][key], rel=1e-6), (name, key)


def test_bf16_tensor_parallel_step_equals_one_process_within_bf16(runs):
    """At TP=2 each row-parallel output is a sum of two bf16 partial products, each rounded to bf16 before the
    all-reduce: one extra rounding (relative U) per row-parallel layer, forward and backward. The step equals the
    one-process bf16 step within `assert_bf16_tracks`' bounds."""
    assert runs["bf16-tp2"][0]["layout"] == (2, 1, 1)
    for result in runs["bf16-tp2"]:
        assert_bf16_tracks(result, runs["bf16-base"][0])


def test_bf16_step_tracks_the_fp32_step(runs):
    """The bf16 step against the same step in fp32 (same batch, clip and learning rate): bf16 rounds the weights
    (relative U / 2) and every layer's activations and their gradients (relative U each), all within
    `assert_bf16_tracks`' bounds."""
    assert_bf16_tracks(runs["bf16-base"][0], runs["wide-clip-base"][0])


def assert_bf16_tracks(result, baseline):
    """`result` (a bf16 step) equals `baseline` within bf16's error, derived for this 2-layer model:
    - logprobs within 2U: the logits (|logit| < 1 here: every logprob lies within 0.6 of -log(128)) carry the final
      hidden state's relative error, a few U after two layers' roundings that the final norm re-normalises; a logprob
      z_t - logsumexp(z) doubles it. Seen: 0.75 U.
    - each gradient within 16U of its tensor's largest entry: a weight's gradient is a bf16 product of activations
      and back-propagated errors (each ~2U per layer crossed, 2 layers forward and back); cancelling sums such as a
      bias's gradient lose relative accuracy, hence the largest entry as the scale. Seen: 5.6U.
    - loss, grad norm and mean ratio within 2U (relative; the ratio's error is its logprobs' difference, < 2U).
    - the weights after two Adam steps: each within 4 LR + 2^-7 |w| (Adam moves a weight by at most about LR per
      step, so a gradient whose sign differs under rounding noise moves it by up to 2 LR per step, and the bf16
      weight rounds by up to one spacing); the whole update (the weights' change from the checkpoint rounded to bf16)
      points the same way: cosine > 0.99 (a sign flip needs |g| below the 16U noise floor: few entries). Seen: 0.996.
    """
    assert {w.dtype for w in result["weights"].values()} == {torch.bfloat16}
    for key, (old, ref) in result["logprobs"].items():
        torch.testing.assert_close(old, baseline["logprobs"][key][0].to(old.dtype), atol=2 * U, rtol=0)
        torch.testing.assert_close(ref, baseline["logprobs"][key][1].to(ref.dtype), atol=2 * U, rtol=0)
    for name, grad in result["grads"].items():
        expected = baseline["grads"][name].float()
        torch.testing.assert_close(grad.float(), expected, atol=16 * U * expected.abs().max().item(), rtol=0, msg=name)
    for key in ("loss/policy_loss", "loss/mixed_ratio_mean", "optim/grad_norm"):
        assert result["metrics"][key] == pytest.approx(baseline["metrics"][key], rel=2 * U), key
    got, expected, start = [], [], baseline["initial_weights"]
    for name, weight in result["weights"].items():
        reference = baseline["weights"][name].float()
        torch.testing.assert_close(weight.float(), reference, atol=4 * LR, rtol=2 * U, msg=name)
        initial = start[name].to(torch.bfloat16).float()
        got.append((weight.float() - initial).flatten())
        expected.append((reference - initial).flatten())
    assert torch.nn.functional.cosine_similarity(torch.cat(got), torch.cat(expected), dim=0) > 0.99


def assert_same_step(ranks, baseline, *, grad_atol=GRAD_ATOL, weight_atol=WEIGHT_ATOL, settled_grad=None):
    """Every rank's logprobs (merged over DP shards), gradients, loss metrics and updated weights equal
    the single-process run's; with `settled_grad`, the weights whose first-mini-batch gradient is at most that in
    the single-process run are left out (Adam's first step is g / (|g| + eps): a gradient near its eps, 1e-8, turns the
    layouts' summation-order noise in it into a difference of a good part of a step)."""
    seen = {}
    for result in ranks:
        seen.update(result["logprobs"])
    assert seen.keys() == baseline["logprobs"].keys()  # the DP shards together cover the whole batch
    for key, (old, ref) in seen.items():
        torch.testing.assert_close(old, baseline["logprobs"][key][0], atol=LOGPROB_ATOL, rtol=0)
        torch.testing.assert_close(ref, baseline["logprobs"][key][1], atol=LOGPROB_ATOL, rtol=0)
    for result in ranks:
        assert result["grads"].keys() == baseline["grads"].keys()
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, baseline["grads"][name], rtol=GRAD_RTOL, atol=grad_atol, msg=name)
        for name in ("loss/policy_loss", "loss/clip_fraction", "loss/mixed_ratio_mean", "optim/grad_norm"):
            assert result["metrics"][name] == pytest.approx(baseline["metrics"][name], rel=1e-5, abs=1e-7), name
        for name, weight in result["weights"].items():
            settled = slice(None) if settled_grad is None else baseline["grads"][name].abs() > settled_grad
            torch.testing.assert_close(weight[settled], baseline["weights"][name][settled], atol=weight_atol, rtol=0,
                                       msg=name)
        assert result["geometry"].keys() == baseline["geometry"].keys() and baseline["geometry"]
        for name, value in result["geometry"].items():  # whole-matrix norms and counts, reduced over the shards
            close = (pytest.approx(baseline["geometry"][name], abs=2e-3) if name.endswith("changed_fraction")
                     else pytest.approx(baseline["geometry"][name], rel=1e-3))
            assert value == close, name


def assert_head_gradient_path(ranks, head):
    """The fused head adds the output weight's gradient straight into Megatron's main_grad (its
    `grad_added_to_main_grad` flag is up after the backward); the torch head leaves that to DDP's hook."""
    flags = [result["head_in_main_grad"] for result in ranks if result["head_in_main_grad"] is not None]
    assert flags and all(flag == (head == "fused") for flag in flags), flags


@pytest.mark.parametrize("name, baseline", [("lora-tp2", "lora-base"), ("lora-tp2-sp", "lora-base"),
                                            ("lora-pp2", "lora-base"), ("lora-dp2-distopt", "lora-base"),
                                            ("lora-moe-ep2", "lora-moe-base"),
                                            ("lora-tp2-sp-budget-packed", "lora-base")])
def test_lora_layout_matches_single_rank(runs, name, baseline):
    """A LoRA ARMOR step (the reference: the actor's model with its adapters off) at TP=2 (with and without sequence
    parallelism; with it also on token-budget packed micro-batches), PP=2, DP=2 with the distributed optimizer, and a
    MoE model's with experts adapted over EP=2, equals
    the one-process step: logprobs, the adapters' gradients (whole, TP-gathered), the merged weights after two
    optimizer steps and the adapters themselves, whole and PEFT-named as a push sends them (a MoE model's every
    expert's, on every rank); the base weights never move, and the adapters off still score the base after the
    step."""
    ranks, base = runs[name], runs[baseline][0]
    assert_same_step(ranks, base)
    assert base["grads"] and all(name.endswith((".lora_a", ".lora_b")) for name in base["grads"])
    assert any(g.abs().max() > 0 for name, g in base["grads"].items() if name.endswith(".lora_b"))
    if "moe" in name:
        assert any(".local_experts.3." in key for key in base["adapters"])  # every expert, gathered over EP
        assert any(".mlp.experts.3.up_proj.lora_B" in key for key in base["peft"])
    for result in ranks:
        assert result["adapters"].keys() == base["adapters"].keys()
        for key, tensor in result["adapters"].items():
            torch.testing.assert_close(tensor, base["adapters"][key], atol=WEIGHT_ATOL, rtol=0, msg=key)
        assert result["peft"].keys() == base["peft"].keys()
        for key, tensor in result["peft"].items():
            torch.testing.assert_close(tensor, base["peft"][key], atol=WEIGHT_ATOL, rtol=0, msg=key)
        before, after = result["ref_logprobs_before_and_after"]
        assert torch.equal(before, after)
    changed = [key for key, w in base["weights"].items() if not torch.equal(w, base["initial_weights"][key])]
    assert changed and all(key.endswith("proj.weight") for key in changed), changed  # only the adapted (merged) ones


@pytest.mark.parametrize("name, layout", [("lora-tp2", {"tp": 2, "pp": 1, "dp": 1}),
                                          ("lora-dp2-distopt", {"tp": 1, "pp": 1, "dp": 2})])
def test_lora_checkpoint_reshards_to_one_process(runs, name, layout):
    """A LoRA checkpoint saved after the step at TP=2 (plain optimizer) or DP=2 (distributed optimizer) holds the
    adapters and their Adam state, not the base, and loads at one process (plain optimizer): the adapters are the
    saved ones exactly, their Adam moments and step the one-process run's (whose step equals the TP=2 / DP=2 one:
    test_lora_layout_matches_single_rank)."""
    from megatron_armor.config import LoRAConfig, OptimizerConfig
    from megatron_armor.convert.weights import load_hf_weights
    from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
    from megatron_armor.models.gpt import build_gpt_model
    from megatron_armor.models.hf_config import load_model_shape, transformer_config
    from megatron_armor.models.lora import apply_lora, full_adapters
    from megatron_armor.trainer.checkpointing.checkpoint import load_modules, read_record
    from megatron_armor.trainer.checkpointing.sharded_state import (
        adam_step, restore_module, restore_order, sharded_modules,
    )
    from megatron_armor.trainer.step_inputs.policies import Policy
    from megatron_armor.trainer.update.optimizer import wrap_for_training

    saved, base_dir = (Path(runs[name][0]["checkpoint"][key]) for key in ("path", "base"))
    one_process = runs["lora-base"][0]
    record = read_record(saved)
    assert {key: record["layout"][key] for key in layout} == layout and record["modules"] == ["actor", "optimizer"]
    stored = saved_modules(saved)
    assert stored["actor"] and all("_adapter." in key for key in stored["actor"])  # no base weight
    initialize_distributed(1, 1, 1)
    try:
        shape = load_model_shape(base_dir)
        model = build_gpt_model(shape, transformer_config(shape), trainable=True)
        load_hf_weights(model, base_dir, shape)
        apply_lora(model, LoRAConfig(rank=4, alpha=8.0), seed=1)  # other draws of A: every adapter tensor is loaded
        ddp, optimizer = wrap_for_training(OptimizerConfig(lr=LR, warmup_steps=0), model=model, distributed=False)
        modules = {"actor": Policy("actor", ddp, adapters_only=True), "optimizer": optimizer}
        loaded = load_modules(saved, sharded_modules(modules, is_loading=True))
        for module in restore_order(list(loaded)):
            restore_module(module, modules[module], loaded[module])
        adapters, moments, steps = full_adapters(ddp), adam_moments(model, optimizer), adam_step(optimizer)
    finally:
        destroy_distributed()
    assert adapters.keys() == runs[name][0]["adapters"].keys()
    assert all(torch.equal(tensor, runs[name][0]["adapters"][key]) for key, tensor in adapters.items())
    assert steps == 2 and moments.keys() == one_process["adam_moments"].keys()
    for key, (exp_avg, exp_avg_sq) in moments.items():
        expected_avg, expected_sq = one_process["adam_moments"][key]
        assert expected_avg.abs().max() > 0, key
        torch.testing.assert_close(exp_avg, expected_avg, rtol=MOMENT_RTOL, atol=MOMENT_ATOL, msg=key)
        torch.testing.assert_close(exp_avg_sq, expected_sq, rtol=MOMENT_RTOL, atol=MOMENT_ATOL ** 2, msg=key)


def test_baseline_step_is_not_trivial(runs):
    baseline = runs["base"][0]
    # The worker's 0.003 clip binds on part of the second mini-batch; the first, scored at ratio 1, never clips.
    assert 0 < baseline["metrics"]["loss/clip_fraction"] < 1 and baseline["metrics"]["optim/grad_norm"] > 0
    assert any(g.abs().max() > 0 for g in baseline["grads"].values())
    # The second mini-batch is scored after the first optimizer step, so the mean ratio leaves 1.
    assert abs(baseline["metrics"]["loss/mixed_ratio_mean"] - 1.0) > 1e-5


def test_moe_ep2_and_pp2_steps_match_single_rank(runs):
    """A Qwen3-MoE ARMOR step with its experts over EP=2 (DP=2, Megatron DDP and optimizer), its layers over
    PP=2, or both (EP=2 x PP=2 on 4 ranks), equals the one-process step (experts' gradients gathered over the EP group); with a load-balancing
    coefficient the auxiliary loss is logged (`moe/aux_loss`) and moves the routers and the layers below them."""
    base, aux = runs["moe-base"][0], runs["moe-aux"][0]
    assert any(".mlp.experts.3.down_proj" in name for name in base["grads"])
    assert runs["moe-ep2"][0]["layout"] == (1, 1, 2)
    assert_same_step(runs["moe-ep2"], base)
    assert_same_step(runs["moe-pp2"], base)
    assert runs["moe-ep2-pp2"][0]["layout"] == (1, 2, 2)
    assert_same_step(runs["moe-ep2-pp2"], base)
    assert "moe/aux_loss" not in base["metrics"] and 0.5 < aux["metrics"]["moe/aux_loss"] < 2.5, aux["metrics"]
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.self_attn.o_proj.weight"):
        assert not torch.equal(aux["grads"][name], base["grads"][name]), name


def test_mixtral_pp2_step_matches_single_rank(runs):
    """A Mixtral ARMOR step over PP=2 equals the one-process step (its TP=2 and EP=2 logprobs and gradients:
    tests/models/test_moe.py); the gradients come back under its checkpoint's names."""
    base = runs["mixtral-base"][0]
    assert any(".block_sparse_moe.experts.3.w2." in name for name in base["grads"])
    assert_same_step(runs["mixtral-pp2"], base)


@pytest.mark.parametrize("kind", ["glm4-moe", "deepseek-v3"])
def test_sigmoid_routed_pp2_step_matches_single_rank(runs, tmp_path, kind):
    """A GLM-4.5 or DeepSeek-V3 (multi-latent attention) ARMOR step over PP=2 (the dense layer 0 on the first stage,
    the MoE layer on the second) equals the one-process step (their TP=2 and EP=2 logprobs and gradients:
    tests/models/test_moe.py); the routers' expert bias is exported with the weights, has no gradient and does not
    move (the actor's checkpoint is remade to compare)."""
    from safetensors.torch import load_file

    base = runs[f"{kind}-base"][0]
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert bias not in base["grads"] and any(".mlp.shared_experts.down_proj." in name for name in base["grads"])
    actor = _actor_and_ref(tmp_path, **MODELS[kind])[0]
    assert torch.equal(base["weights"][bias], load_file(actor / "model.safetensors")[bias])
    assert_same_step(runs[f"{kind}-pp2"], base)


def test_moe_expert_tp1_steps_match_single_rank(runs):
    """At TP=2 with every expert whole on its rank (parallel.expert_tensor_parallel_size 1), over EP=1 (the two TP
    ranks are expert data-parallel replicas: Megatron DDP sums the experts' gradients over them, as the
    TransformerConfig's expert TP tells it) or over EP=2 (the two TP ranks split the experts), a MoE step equals the
    one-process step: logprobs, gradients, Megatron's grad norm, weights and the update geometry reduced over the
    expert groups."""
    for name in ("moe-tp2-sp-etp1", "moe-tp2-sp-ep2-etp1"):
        assert runs[name][0]["layout"] == (2, 1, 1), name
        assert_same_step(runs[name], runs["moe-base"][0])


def test_qwen2_moe_shared_expert_step_matches_single_rank(runs):
    """Qwen2-MoE's gated shared expert split over TP=2 with sequence parallelism (its gate vector replicated, its
    gradient summed over the sequence slices of the TP ranks) beside the routed experts over EP=2 (whole, expert
    TP 1): the ARMOR step equals the one-process step."""
    base = runs["qwen2-moe-base"][0]
    for part in ("mlp.shared_expert_gate.weight", "mlp.shared_expert.down_proj.weight", "self_attn.q_proj.bias"):
        assert any(name.endswith(part) and grad.abs().max() > 0 for name, grad in base["grads"].items()), part
    assert runs["qwen2-moe-tp2-sp-ep2-etp1"][0]["layout"] == (2, 1, 1)
    assert_same_step(runs["qwen2-moe-tp2-sp-ep2-etp1"], base)
