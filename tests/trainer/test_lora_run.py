"""`armor train` with LoRA (model.lora) on the tiny synthetic task, in process: the reference is the actor's model with
its adapters off (no second model), the engine keeps the base and gets the adapters alone after every update
(model.lora.weight_sync adapter) and samples what the trainer scores, the anchors come from the same engine with the
adapter off, only the adapters move and have optimizer state, and a resume from the checkpoint repeats the
uninterrupted step exactly. (Against a serve-local server: tests/rollout/test_trainer_with_servers.py.)"""

import json
from pathlib import Path

import torch

from state_trees import saved_modules
from training_runs import LORA, adapter_push_bytes, resume_from, run_metrics, run_overrides
from megatron_armor.config import load_config
from megatron_armor.trainer.run.train import run_training

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


def test_armor_lora_run_trains_adapters_against_the_base_and_resumes_exactly(synthetic_cache, tmp_path):
    full = tmp_path / "full"
    assert run_training(load_config(CONFIG, [*run_overrides(synthetic_cache, full, 2), *LORA])) == 0
    rows = run_metrics(full)
    for step in (1, 2):  # the engine's logprobs are the trainer's: it samples the merged actor
        assert rows[step]["mismatch/logprob_abs_diff"] < 1e-5, rows[step]
        assert rows[step]["optim/grad_norm"] > 0
    assert rows[1]["mix_kl/kl_on_ref"] == 0  # B = 0: the actor starts as the base, which is the reference
    assert rows[2]["mix_kl/kl_on_ref"] != 0  # one update later the actor left the base; the reference stayed

    first, second = (saved_modules(full / "checkpoints" / f"step_{step:06d}") for step in (1, 2))
    for step in (1, 2):  # each push moves the adapters alone, as PEFT names them
        assert rows[step]["perf/weight_sync_bytes"] == adapter_push_bytes(second["actor"])
    assert "ref" not in second  # the reference is the base with the adapters off: nothing of its own to save
    adapters = [key for key in second["actor"] if "_adapter." in key]
    assert adapters and all(not torch.equal(first["actor"][key], second["actor"][key])
                            for key in adapters if key.endswith("lora_b"))
    assert all(torch.equal(first["actor"][key], value) for key, value in second["actor"].items()
               if key not in adapters and isinstance(value, torch.Tensor))  # the base is frozen
    record = json.loads((full / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert record["extra"]["lora_base"]["fingerprint"]  # the base the adapters belong to (test_lora_base.py)
    moments = [key for key in second["optimizer"] if key.startswith("optimizer.state.")]
    assert moments and all("_adapter." in key for key in moments)

    part = tmp_path / "part"
    resume_from(full, part, 1)
    assert run_training(load_config(CONFIG, [*run_overrides(synthetic_cache, part, 2), *LORA]), resume=True) == 0
    resumed, expected = run_metrics(part)[2], rows[2]
    deterministic = [key for key in expected if not key.startswith("perf/")]
    assert {key: resumed[key] for key in deterministic} == {key: expected[key] for key in deterministic}
