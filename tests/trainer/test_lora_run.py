"""`armor train` with LoRA (model.lora) on the tiny synthetic task, in process: the reference is the actor's model with
its adapters off (no second model), the engine keeps the base and gets the adapters alone after every update
(model.lora.weight_sync adapter) and samples what the trainer scores, the anchors come from the same engine with the
adapter off, only the adapters move and have optimizer state, the checkpoints hold the adapters alone (not the base:
model.path's, which they name), a resume from one repeats the uninterrupted step exactly, and each holds the adapters in
PEFT's format too, which `peft` loads onto the HF base model to give the trainer's logprobs. (Against a serve-local
server: tests/rollout/test_trainer_with_servers.py.)"""

import json
from pathlib import Path

import pytest
import torch

from state_trees import saved_modules
from training_runs import LORA, adapter_push_bytes, resume_from, run_metrics, run_overrides
from megatron_armor.config import LoRAConfig, load_config
from megatron_armor.convert.loading import load_gpt_model
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.hf_config import load_model_shape
from megatron_armor.models.lora import apply_lora
from megatron_armor.trainer.checkpointing.checkpoint import load_modules
from megatron_armor.trainer.run.train import run_training
from megatron_armor.trainer.step_inputs.policies import Policy

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


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
    assert "ref" not in second  # the reference is the base with the adapters off: nothing of its own to save
    adapters = second["actor"]  # the adapters alone: the base is frozen and model.path holds it
    assert adapters and all("_adapter." in key for key in adapters), sorted(adapters)
    assert all(not torch.equal(first["actor"][key], adapters[key]) for key in adapters if key.endswith("lora_b"))
    record = json.loads((checkpoint / "trainer_state.json").read_text())
    base = Path(record["extra"]["lora_base"]["path"])  # the base the adapters belong to (test_lora_base.py)
    assert record["extra"]["lora_base"]["fingerprint"]
    moments = [key for key in second["optimizer"] if key.startswith("optimizer.state.")]
    assert moments and all("_adapter." in key for key in moments)
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
