"""The planner's bookkeeping on a recipe's config: micro-batch tokens from the token budget, the frozen models the
algorithm keeps, the KV cache colocated servers get, advice that re-plans each knob, and a MoE model's expert layout."""

import math
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_armor.algorithms import build_algorithm
from megatron_armor.config import RecomputeConfig, load_config
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


@pytest.mark.parametrize("full_recipe, lora_overrides", [
    ("qwen3-8b-base/armor.yaml", ()),  # the LoRA recipe, examples/qwen3-8b-base-lora
    ("qwen2.5-math-7b/armor.yaml", ("model.lora.rank=64",)),
])
def test_lora_plans_less_memory_per_rank_than_full_fine_tuning(full_recipe, lora_overrides, capsys):
    """The 8B LoRA recipe (and the 7B recipe with rank-64 adapters) plan less memory per GPU than their full
    fine-tuning recipes at the same layout: the weights grow by the adapters', gradients and optimizer state shrink to
    theirs and the reference copy goes; `armor plan` prints the saving (full_finetune: the LoRA run's own full
    fine-tuning plan, which is the full recipe's when nothing else differs)."""
    from megatron_armor.cli import main
    from megatron_armor.planning.planner import plan_run

    lora_recipe = "qwen3-8b-base-lora/armor.yaml" if not lora_overrides else full_recipe
    full = memory_plan(inputs_of(full_recipe))
    lora_cfg = load_config(str(EXAMPLES / lora_recipe), list(lora_overrides))
    lora = plan_run(lora_cfg, H100)
    assert lora.memory.state.trainable < 0.05 * full.state.params and lora.memory.frozen == {}
    assert lora.memory.state.weights == full.state.weights + lora.memory.state.trainable * 2  # bf16 adapters
    saved = (full.state.gradients - lora.memory.state.gradients + full.state.optimizer - lora.memory.state.optimizer
             + full.frozen["reference"] - lora.memory.state.trainable * 2)
    assert full.training_peak - lora.memory.training_peak == saved > full.frozen["reference"]
    assert lora.full_finetune.training_peak == full.training_peak
    assert main(["plan", "--config", str(EXAMPLES / lora_recipe), "--gpus", "128", "--gpu-memory-gb", "80",
                 *(part for override in lora_overrides for part in f"--{override}".split("="))]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "LoRA saves" in line)
    assert f"{saved / GIB:.2f} GiB" in line and f"full fine-tuning's peak {full.training_peak / GIB:.2f} GiB" in line


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
    # a MoE model is advised CP too: its experts regroup TP x CP x DP, which CP leaves as it was (EP 8 x expert TP 4
    # divides TP 4 x CP 2 x DP 8 and TP 4 x CP 4 x DP 4; of TP x DP alone, only the first)
    assert [knob for knob, _ in knob_changes(inputs_of("qwen3-30b-a3b/armor.yaml"), 10240)
            if knob.startswith("set parallel.context_parallel_size")] == [
        "set parallel.context_parallel_size 2 (dp 8; each sequence split over 2 GPUs)",
        "set parallel.context_parallel_size 4 (dp 4; each sequence split over 4 GPUs)"]


def test_context_parallel_ranks_hold_the_same_experts():
    """A MoE model's expert data-parallel group spans the CP ranks (Megatron regroups TP x CP x DP for the experts):
    CP 2 at half the DP keeps the expert state per GPU and halves the activations."""
    recipe = "qwen3-30b-a3b/armor.yaml"
    cp1, cp2 = inputs_of(recipe), inputs_of(recipe, "parallel.context_parallel_size=2", "parallel.data_parallel_size=8")
    assert (cp1.layout.expert_dp, cp2.layout.expert_dp) == (2, 2)
    assert memory_plan(cp2).state == memory_plan(cp1).state
    assert 2 * memory_plan(cp2).activations.saved == memory_plan(cp1).activations.saved


def test_expert_layouts_over_tp_cp_dp_plan_context_parallelism():
    """GLM-4.5-Air (TP 8 x PP 2 x DP 4, EP 4 at expert TP 8) and DeepSeek-V3 (TP 16 x DP 16, EP 256 at expert TP 1):
    expert TP x EP = 32 and 256 divide TP x CP x DP at CP 2 x DP 2 and CP 2 x DP 8 (Megatron's expert grid), so both
    plan a CP layout on their GPUs with the same expert state per GPU (expert DP 1 either way); an EP that the grid
    cannot hold is refused naming the fields."""
    from megatron_armor.config import ConfigError
    from megatron_armor.planning.planner import context_layouts
    from megatron_armor.planning.shapes import resolve_model_shape

    for recipe, gpus, dp, with_cp in (("glm-4.5-air/armor.yaml", 128, 4, (2, 2)),
                                      ("deepseek-v3/armor.yaml", 384, 16, (2, 8))):
        cfg = load_config(str(EXAMPLES / recipe))
        assert context_layouts(cfg, resolve_model_shape(cfg.model.path)[0], gpus) == ((1, dp), with_cp), recipe
        hardware = Hardware(gpus=gpus, gpu_memory_gb=141)
        cp1 = inputs_of(recipe, hardware=hardware)
        cp2 = inputs_of(recipe, "parallel.context_parallel_size=2", f"parallel.data_parallel_size={with_cp[1]}",
                        hardware=hardware)
        assert (cp1.layout.expert_dp, cp2.layout.expert_dp) == (1, 1)
        assert memory_plan(cp2).state == memory_plan(cp1).state
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel_size \(8\) x parallel.context_parallel_size "
                                          r"\(2\) x parallel.data_parallel_size \(1\) = 16"):
        load_config(str(EXAMPLES / "glm-4.5-air/armor.yaml"),
                    ["parallel.context_parallel_size=2", "parallel.data_parallel_size=1"])


def test_multi_latent_attention_keys_and_values_per_context_parallel_rank():
    """DeepSeek-V3 at TP 16: a = 128 / 16 = 8 heads a rank, each with its own key (e = 8 x (128 + 64) = 1536 elements a
    token) and value (w = 8 x 128 = 1024). The local spec's attention at CP 2 keeps the whole sequence's keys and
    values, e + w = 2560 more elements per local token and layer than at CP 1; selective recomputation keeps only the
    local ones (no change); Transformer Engine's ring holds two K/V chunks in flight: 2 x 2560 elements per local
    token, bf16 (a token of the 2048 + 8192 = 10240 padded to 2 x CP x TP = 64: 10240 already, half of it a rank)."""
    from megatron_armor.planning.activations import layer_elements_per_token

    inputs = inputs_of("deepseek-v3/armor.yaml", "parallel.context_parallel_size=2", "parallel.data_parallel_size=8",
                       hardware=Hardware(gpus=384, gpu_memory_gb=141))
    shape, layout = inputs.shape, inputs.layout.with_(recompute=RecomputeConfig())
    local = layout.with_(local_attention=True)
    for layer in (0, 3):  # dense, MoE
        gathered = layer_elements_per_token(shape, local, layer=layer)
        assert gathered - layer_elements_per_token(shape, local.with_(cp=1), layer=layer) == 2560
        assert gathered - layer_elements_per_token(shape, layout, layer=layer) == 2560  # TE keeps its own K/V only
        assert layer_elements_per_token(shape, local, selective=True, layer=layer) == layer_elements_per_token(
            shape, layout, selective=True, layer=layer)
    assert inputs.micro_batch_tokens == 10240  # micro_batch_size 1
    assert memory_plan(inputs).activations.exchange == 10240 // 2 * 2 * 2560 * 2


def test_a_context_parallel_layout_the_gpus_cannot_hold_is_refused():
    with pytest.raises(ValueError, match=r"tp x pp x cp = 12 GPUs do not divide the 128 GPUs"):
        inputs_of("qwen3-8b-base/armor.yaml", "parallel.context_parallel_size=3", "parallel.data_parallel_size=4")
