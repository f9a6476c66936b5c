"""The planner's bookkeeping on a recipe's config: micro-batch tokens from the token budget, the frozen models the
algorithm keeps, the KV cache colocated servers get, advice that re-plans each knob, and a MoE model's expert layout."""

import math
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_armor.algorithms import build_algorithm
from megatron_armor.config import load_config
from megatron_armor.planning.memory import parameter_count
from megatron_armor.planning.planner import GIB, Hardware, advice, knob_changes, memory_plan, plan_inputs, plan_run

EXAMPLES = Path(__file__).parents[2] / "examples"
H100 = Hardware(gpus=128, gpu_memory_gb=80)


def inputs_of(recipe: str, *overrides: str, hardware: Hardware = H100):
    cfg = load_config(str(EXAMPLES / recipe), list(overrides))
    return plan_inputs(cfg, build_algorithm(cfg), hardware)


def test_micro_batch_tokens_follow_the_token_budget():
    max_len = 2048 + 20480
    assert inputs_of("qwen3-8b-base/armor.yaml").micro_batch_tokens == 2 * max_len  # micro_batch_size 2, padded
    budget = inputs_of("qwen3-8b-base/armor.yaml", "micro_batching.max_tokens=65536")
    assert budget.micro_batch_tokens == 65536
    rank_sequences = 32 * 16 // 16  # mini_batch_size prompts x n_samples over dp 16
    assert budget.micro_batches == math.ceil(rank_sequences * max_len / 65536)
    # a budget below the longest sequence still trains it, alone in its micro-batch
    assert inputs_of("qwen3-8b-base/armor.yaml", "micro_batching.max_tokens=1000").micro_batch_tokens == max_len


def test_frozen_models_follow_the_algorithm():
    assert [name for name, _ in inputs_of("qwen3-8b-base/armor.yaml").frozen] == ["reference"]
    opd = inputs_of("tiny/opd.yaml")
    assert [name for name, _ in opd.frozen] == ["reference", "teacher"]
    remote = inputs_of("tiny/opd.yaml", "opd.teacher_url=http://teacher:1")
    assert [name for name, _ in remote.frozen] == ["reference"]
    assert plan_run(load_config(str(EXAMPLES / "tiny/opd.yaml"), []), H100).flops.teacher > 0


def test_lora_keeps_no_reference_and_only_the_adapters_state():
    """Qwen3-8B's ARMOR recipe with rank-64 adapters (reference resets off): no frozen reference copy, the same base
    weights plus the adapters', and gradients / optimizer state of the adapters alone (a few % of the full run's)."""
    full = memory_plan(inputs_of("qwen3-8b-base/armor.yaml"))
    lora = memory_plan(inputs_of("qwen3-8b-base/armor.yaml", "model.lora.rank=64", "algorithm.ref_reset_period=0"))
    assert full.frozen.keys() == {"reference"} and lora.frozen == {}
    assert lora.state.params == full.state.params + lora.state.trainable
    assert 0 < lora.state.trainable < 0.05 * full.state.params  # ~3% per GPU at TP 4 (the replicated factors)
    assert lora.state.gradients < 0.05 * full.state.gradients and lora.state.optimizer < 0.05 * full.state.optimizer
    assert lora.training_peak < full.training_peak - full.frozen["reference"]


def test_colocated_servers_get_what_the_trainer_leaves():
    inputs = inputs_of("qwen3-1.7b/mipu.yaml", "rollout.memory.release_servers=true", "rollout.backend=sglang",
                       "rollout.sglang.urls=http://s:1")
    gpu, server = inputs.gpu_bytes, parameter_count(inputs.shape, 1, 1) * 2
    plan = memory_plan(inputs)
    resident = plan.state.weights + plan.state.gradients + plan.state.optimizer + sum(plan.frozen.values())
    assert plan.kv_cache == int(min(0.8 * gpu, gpu - inputs.reserve_bytes - resident)) - server
    parked = memory_plan(replace(inputs, offload_trainer=True))
    assert parked.kv_cache == int(0.8 * gpu) - server > plan.kv_cache
    small = memory_plan(replace(inputs, gpu_bytes=int(24e9)))  # the trainer's state leaves no room for a server
    assert small.kv_cache < 0 and not small.fits


def test_advice_replans_every_knob():
    inputs = inputs_of("qwen3-8b-base/armor.yaml", "recompute.granularity=none", "train.logprob_head=torch")
    assert not memory_plan(inputs).fits
    rows = advice(inputs, max_len=2048 + 20480)
    knobs = [row.split(":")[0] for row in rows]
    assert "turn on recompute.granularity full" in knobs and "set train.logprob_head fused" in knobs
    assert rows[0].endswith("(fits)")  # those that fit first
    fused = memory_plan(replace(inputs, layout=inputs.layout.with_(head="fused")))
    assert f"set train.logprob_head fused: peak {fused.training_peak / GIB:.1f} GiB" in rows


def test_expert_tensor_parallelism_regroups_the_experts():
    """The MoE recipe's TP 4 x DP 16 with its experts over EP 32 at expert TP 1 instead of EP 8 at expert TP 4 (TP's):
    each GPU holds as many expert parameters (4 whole experts of each layer instead of a quarter of 16) with the same
    2 expert data-parallel replicas, while the tokens routed to its experts, no longer gathered over TP, take less
    activation memory. A TP raise is advised only where the expert layout still divides TP x DP."""
    recipe = "qwen3-30b-a3b/armor.yaml"
    tp4, etp1 = inputs_of(recipe), inputs_of(recipe, "parallel.expert_parallel_size=32",
                                             "parallel.expert_tensor_parallel_size=1")
    assert (tp4.layout.expert_tp, tp4.layout.expert_dp, etp1.layout.expert_tp, etp1.layout.expert_dp) == (4, 2, 1, 2)
    assert memory_plan(etp1).state == memory_plan(tp4).state
    assert memory_plan(etp1).activations.peak < memory_plan(tp4).activations.peak

    def tp_raises(*overrides: str) -> list[str]:
        inputs = inputs_of(recipe, "parallel.tensor_parallel_size=1", "parallel.data_parallel_size=32",
                           "parallel.expert_parallel_size=32", *overrides)
        return [knob for knob, _ in knob_changes(inputs, max_len=1024) if knob.startswith("raise tp")]

    assert tp_raises() == []  # expert TP follows TP: 2 x 32 expert ranks would not divide 2 x 16
    assert tp_raises("parallel.expert_tensor_parallel_size=1") == [
        "raise tp to 2 (dp 16; sequence parallel)", "raise tp to 4 (dp 8; sequence parallel)"]


def test_context_parallelism_splits_each_sequence_over_its_ranks():
    """At CP 2 a rank holds half of each (padded) sequence: half the activations and logits of CP 1 on as many
    GPUs, with TE's ring K/V in flight on top, and the same state (the distributed optimizer shards over DP x CP).
    Sequences are padded to a multiple of 2 x CP x TP."""
    recipe = "qwen3-8b-base-long/armor.yaml"
    cp2 = inputs_of(recipe)
    cp1 = inputs_of(recipe, "parallel.context_parallel_size=1", "parallel.data_parallel_size=16")
    assert (cp2.layout.cp, cp2.layout.dp, cp2.layout.dp_cp) == (2, 8, 16)
    assert cp2.micro_batch_tokens == cp1.micro_batch_tokens == 32768  # a multiple of 2 x 2 x 4 already
    split, whole = memory_plan(cp2), memory_plan(cp1)
    assert split.state == whole.state
    assert 2 * split.activations.saved == whole.activations.saved and 2 * split.logits.peak == whole.logits.peak
    k = 8 // 4 * 128  # kv heads / tp x head_dim
    assert split.activations.exchange == 16384 * 2 * 2 * k * 2 and whole.activations.exchange == 0
    assert inputs_of(recipe, "data.max_prompt_length=2047").micro_batch_tokens == 32768  # 32767 padded to 16
    assert inputs_of(recipe, "parallel.context_parallel_size=1", "parallel.data_parallel_size=16",
                     "data.max_prompt_length=2047").micro_batch_tokens == 32767


def test_plan_advises_context_parallelism_for_responses_that_do_not_fit():
    inputs = inputs_of("qwen3-8b-base-long/armor.yaml", "parallel.context_parallel_size=1",
                       "parallel.data_parallel_size=16")
    assert not memory_plan(inputs).fits
    rows = advice(inputs, max_len=32768)
    assert "set parallel.context_parallel_size 2 (dp 8; each sequence split over 2 GPUs)" in [
        row.split(":")[0] for row in rows]
    changed = dict(knob_changes(inputs, 32768))["set parallel.context_parallel_size 2 (dp 8; each sequence split "
                                                "over 2 GPUs)"]
    assert changed.layout == inputs.layout.with_(cp=2, dp=8) and memory_plan(changed).fits
    # a MoE model is advised CP too, where its expert layout still divides TP x DP (EP 8 of TP 4 x DP 8, not of DP 4)
    assert [knob for knob, _ in knob_changes(inputs_of("qwen3-30b-a3b/armor.yaml"), 10240)
            if knob.startswith("set parallel.context_parallel_size")] == [
        "set parallel.context_parallel_size 2 (dp 8; each sequence split over 2 GPUs)"]


def test_context_parallel_ranks_hold_the_same_experts():
    """A MoE model's expert data-parallel group spans the CP ranks (Megatron regroups TP x CP x DP for the experts):
    CP 2 at half the DP keeps the expert state per GPU and halves the activations."""
    recipe = "qwen3-30b-a3b/armor.yaml"
    cp1, cp2 = inputs_of(recipe), inputs_of(recipe, "parallel.context_parallel_size=2", "parallel.data_parallel_size=8")
    assert (cp1.layout.expert_dp, cp2.layout.expert_dp) == (2, 2)
    assert memory_plan(cp2).state == memory_plan(cp1).state
    assert 2 * memory_plan(cp2).activations.saved == memory_plan(cp1).activations.saved


def test_a_context_parallel_layout_the_gpus_cannot_hold_is_refused():
    with pytest.raises(ValueError, match=r"tp x pp x cp = 12 GPUs do not divide the 128 GPUs"):
        inputs_of("qwen3-8b-base/armor.yaml", "parallel.context_parallel_size=3", "parallel.data_parallel_size=4")
