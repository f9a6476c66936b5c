"""`armor train` with LoRA (model.lora) on the tiny synthetic task, in process: the reference is the actor's model with
its adapters off (no second model), the engine keeps the base and gets the adapters alone after every update
(model.lora.weight_sync adapter) and samples what the trainer scores, the anchors come from the same engine with the
adapter off, only the adapters move and have optimizer state, the checkpoints hold the adapters alone (not the base:
model.path's, which they name), a resume from one repeats the uninterrupted step exactly, and each holds the adapters in
PEFT's format too, which `peft` loads onto the HF base model to give the trainer's logprobs. GRPO + KL, MIPU and OPD
train adapters the same way: GRPO + KL's and MIPU's KL is to the base with the adapters off, and MIPU's gate rolls the
adapters back exactly. ARMOR's merged push (model.lora.weight_sync merged) sends the whole merged model, the engine
then samples what the trainer scores, and the anchors come from the reference's own engine of the base. (Against a
serve-local server: tests/rollout/test_trainer_with_servers.py.)"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from state_trees import bit_identical, saved_modules
from training_runs import LORA, adapter_push_bytes, resume_from, run_metrics, run_overrides
from megatron_armor.config import LoRAConfig, load_config
from megatron_armor.convert.loading import load_gpt_model
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.hf_config import load_model_shape
from megatron_armor.models.lora import apply_lora
from megatron_armor.trainer.checkpointing.checkpoint import load_modules
from megatron_armor.trainer.run.train import run_training
from megatron_armor.trainer.step_inputs.policies import Policy

EXAMPLES = Path(__file__).parents[2] / "examples" / "tiny"
CONFIG = str(EXAMPLES / "armor.yaml")


@pytest.fixture(scope="module")
def lora_run(synthetic_cache, tmp_path_factory):
    """Two LoRA steps, a checkpoint after each (with its PEFT export)."""
    run_dir = tmp_path_factory.mktemp("lora") / "full"
    assert run_training(load_config(CONFIG, [*run_overrides(synthetic_cache, run_dir, 2), *LORA])) == 0
    return run_dir


def test_armor_lora_run_trains_adapters_against_the_base_and_resumes_exactly(lora_run, synthetic_cache, tmp_path):
    full = lora_run
    rows = run_metrics(full)
    for step in (1, 2):  # the engine's logprobs are the trainer's: it samples the base with the pushed adapter
        assert rows[step]["mismatch/logprob_abs_diff"] < 1e-5, rows[step]
        assert rows[step]["optim/grad_norm"] > 0
    assert rows[1]["mix_kl/kl_on_ref"] == 0  # B = 0: the actor starts as the base, which is the reference
    assert rows[2]["mix_kl/kl_on_ref"] != 0  # one update later the actor left the base; the reference stayed

    checkpoint = full / "checkpoints" / "step_000002"
    first, second = (saved_modules(full / "checkpoints" / f"step_{step:06d}") for step in (1, 2))
    for step in (1, 2):  # each push moves the adapters alone, as PEFT names them
        assert rows[step]["perf/weight_sync_bytes"] == adapter_push_bytes(second["actor"])
    assert_adapters_alone(second)  # the base is frozen and model.path holds it; the reference is the base, nothing else
    adapters = second["actor"]
    assert all(not torch.equal(first["actor"][key], adapters[key]) for key in adapters if key.endswith("lora_b"))
    record = json.loads((checkpoint / "trainer_state.json").read_text())
    base = Path(record["extra"]["lora_base"]["path"])  # the base the adapters belong to (test_lora_base.py)
    assert record["extra"]["lora_base"]["fingerprint"]
    # its size: the adapters and their two Adam moments (fp32), RNG states and metadata (here 302 KiB: 183 KiB of
    # adapter state), less than those with the base's weights (429 KiB) would take
    adapter_bytes = sum(tensor.numel() * tensor.element_size() for tensor in adapters.values())
    stored = sum(path.stat().st_size for path in (checkpoint / "state").rglob("*") if path.is_file())
    base_bytes = sum(path.stat().st_size for path in base.glob("*.safetensors"))
    assert 3 * adapter_bytes <= stored < 3 * adapter_bytes + base_bytes, (adapter_bytes, stored, base_bytes)

    part = tmp_path / "part"
    resume_from(full, part, 1)
    assert run_training(load_config(CONFIG, [*run_overrides(synthetic_cache, part, 2), *LORA]), resume=True) == 0
    resumed, expected = run_metrics(part)[2], rows[2]
    deterministic = [key for key in expected if not key.startswith("perf/")]
    assert {key: resumed[key] for key in deterministic} == {key: expected[key] for key in deterministic}


def assert_adapters_alone(saved: dict) -> None:
    """A LoRA checkpoint's modules (`saved_modules`) hold the actor's adapters and their Adam moments alone, and
    nothing of a reference (the base with the adapters off)."""
    assert "ref" not in saved
    assert saved["actor"] and all("_adapter." in key for key in saved["actor"]), sorted(saved["actor"])
    moments = [key for key in saved["optimizer"] if key.startswith("optimizer.state.")]
    assert moments and all("_adapter." in key for key in moments), moments


@dataclass(frozen=True)
class AlgorithmRun:
    """A LoRA run on the tiny task (another algorithm than ARMOR, or another weight sync): its example config, the
    overrides beyond the LoRA run's, its RL steps, and what its metrics (by step), checkpoints (`saved_modules` by
    step) and base model (model.path) must show beyond the adapter-only checkpoints of every LoRA run."""

    config: str
    overrides: list[str]
    steps: int
    check: Callable[[dict[int, dict], dict[int, dict], Path], None]


def _kl_to_the_base(rows: dict[int, dict], saved: dict[int, dict], base: Path) -> None:
    """The adapters start at B = 0, so the first update's policy is the reference (the base: the adapters off) and
    its KL (k3) is 0 exactly; the second's, one update later, is not. The engine holds model.path's base with the
    pushed adapters and samples what the trainer scores: the trainer's base has not moved."""
    assert rows[1]["loss/kl_to_ref"] == 0
    assert rows[2]["loss/kl_to_ref"] > 0
    for step in (1, 2):
        assert rows[step]["mismatch/logprob_abs_diff"] < 1e-5, rows[step]
        assert rows[step]["perf/weight_sync_bytes"] == adapter_push_bytes(saved[2]["actor"])


def _merged_push(rows: dict[int, dict], saved: dict[int, dict], base: Path) -> None:
    """ARMOR under model.lora.weight_sync merged: each push sends the whole model, W + (alpha / rank) B A in place of
    each adapted W (fp32: 4 bytes per parameter of the base's HF checkpoint), and the engine samples what the trainer
    scores; the anchors come from the reference's own engine, model.path's base, which the trainer scores with the
    adapters off: at B = 0 the actor's logprobs on them are the reference's."""
    assert rows[1]["mix_kl/kl_on_ref"] == 0 and rows[2]["mix_kl/kl_on_ref"] != 0
    params = 0
    for path in base.glob("*.safetensors"):
        with safe_open(path, "pt") as checkpoint:
            params += sum(math.prod(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys())
    for step in (1, 2):
        assert rows[step]["mismatch/logprob_abs_diff"] < 1e-5, rows[step]
        assert rows[step]["perf/weight_sync_bytes"] == 4 * params


def _gate_rolls_the_adapters_back(rows: dict[int, dict], saved: dict[int, dict], base: Path) -> None:
    """MIPU's KL term is to the base too (0 at B = 0). Its gate, forced to accept step 1 and reject step 2, rolls
    step 2's update back: the adapters and their Adam state after it are step 1's, bit for bit."""
    assert rows[1]["loss/kl_to_ref"] == 0 and rows[2]["loss/kl_to_ref"] > 0
    assert (rows[1]["mipu/accepted"], rows[2]["mipu/accepted"], rows[2]["mipu/rollbacks"]) == (1.0, 0.0, 1.0)
    assert bit_identical(saved[2]["actor"], saved[1]["actor"])
    assert bit_identical(saved[2]["optimizer"], saved[1]["optimizer"])


def _distils_the_teacher(rows: dict[int, dict], saved: dict[int, dict], base: Path) -> None:
    """OPD's student, the untrained base with adapters, is far from the teacher (the warm start); the engine samples
    what the trainer scores."""
    assert rows[1]["opd/reverse_kl"] > 0.1
    assert rows[1]["mismatch/logprob_abs_diff"] < 1e-5, rows[1]
    assert rows[1]["perf/weight_sync_bytes"] == adapter_push_bytes(saved[1]["actor"])


GRPO_KL = ["algorithm.name=grpo_kl", "rollout.sampling.actor_n=8"]
ALGORITHM_RUNS = {
    "grpo_kl": AlgorithmRun(CONFIG, GRPO_KL, 2, _kl_to_the_base),
    "armor-merged": AlgorithmRun(CONFIG, ["model.lora.weight_sync=merged"], 2, _merged_push),
    # the gate accepts iff gap >= -c: c = 1e9 at step 0, -1e9 from step 1 on
    "mipu": AlgorithmRun(str(EXAMPLES / "mipu.yaml"), ["mipu.gate_prompts=4", "mipu.gate_n=4", "mipu.c_start=1e9",
                                                      "mipu.c_end=-1e9", "mipu.ramp_steps=1"], 2,
                         _gate_rolls_the_adapters_back),
    "opd": AlgorithmRun(str(EXAMPLES / "opd.yaml"), [], 1, _distils_the_teacher),
}


@pytest.mark.parametrize("name", ALGORITHM_RUNS)
def test_lora_trains_the_adapters_under_every_algorithm(name, synthetic_cache, tmp_path):
    """GRPO + KL, MIPU, OPD and ARMOR with the merged push train the adapters alone: every checkpoint holds them and
    their Adam state and nothing else, the first update moved B off zero, and the run's own checks hold."""
    run = ALGORITHM_RUNS[name]
    run_dir = tmp_path / "run"
    overrides = [*run_overrides(synthetic_cache, run_dir, run.steps), *LORA, "checkpoint.save_peft=false",
                 *run.overrides]
    assert run_training(load_config(run.config, overrides)) == 0
    rows = run_metrics(run_dir)
    saved = {step: saved_modules(run_dir / "checkpoints" / f"step_{step:06d}") for step in range(1, run.steps + 1)}
    for modules in saved.values():
        assert_adapters_alone(modules)
    assert all(modules["actor"][key].abs().max() > 0 for modules in saved.values()
               for key in modules["actor"] if key.endswith("lora_b"))
    record = json.loads((run_dir / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    run.check(rows, saved, Path(record["extra"]["lora_base"]["path"]))


def test_peft_loads_the_checkpoint_s_export_and_gives_the_trainer_s_logprobs(lora_run):
    """The last checkpoint's step_N/peft/ (checkpoint.save_peft, on by default under LoRA) on the HF base model gives
    the logprobs of the trainer's model: the base loaded from model.path with the checkpoint's adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint = lora_run / "checkpoints" / "step_000002"
    base = json.loads((checkpoint / "trainer_state.json").read_text())["extra"]["lora_base"]["path"]
    shape = load_model_shape(base)
    tokens = torch.randint(1, shape.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    initialize_distributed(1, 1, 1)
    try:
        model = load_gpt_model(base, shape)
        apply_lora(model, LoRAConfig(rank=8), seed=1)  # another seed: every adapter tensor comes from the checkpoint
        actor = Policy("actor", model, adapters_only=True)
        actor.load_state_dict(load_modules(checkpoint, {"actor": actor.sharded_state_dict()})["actor"])
        with torch.no_grad():
            trainer = model(tokens, torch.arange(12).expand_as(tokens), attention_mask=None)[..., :shape.vocab_size]
    finally:
        destroy_distributed()
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        base_logits = hf(tokens).logits
        exported = PeftModel.from_pretrained(hf, checkpoint / "peft").eval()(tokens).logits
    config = json.loads((checkpoint / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (8, 16.0, base)
    assert (exported - base_logits).abs().max() > 1e-4  # two updates moved the adapters off B = 0
    torch.testing.assert_close(exported.log_softmax(-1), trainer.log_softmax(-1), rtol=0, atol=1e-5)
