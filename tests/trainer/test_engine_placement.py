"""Where the trainer's in-process engines run (`trainer/run/build.py`): on the training GPU in the trainer's parameter
dtype when there is one, else on the CPU in float32. No GPU here, so the CPU stands in for it: the path a GPU run
takes (the model cast to bf16 and moved to the device, the prepacked layers falling back to `F.linear`) runs for
real; tests/rollout/test_cuda_local_engine.py checks the engine on a GPU (scripts/gpu_checks.sh engine)."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megatron_armor.config import load_config
from megatron_armor.rollout.backends import EngineSite, local_engine
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.prepacked_linear import PrepackedLinear, prepacking_available
from megatron_armor.trainer.run import build

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


def test_engines_follow_the_training_device_in_the_parameter_dtype(monkeypatch):
    cfg = load_config(CONFIG, ["model.params_dtype=bfloat16"])
    monkeypatch.setattr(build, "training_device", lambda: torch.device("cpu"))
    assert build._engine_placement(cfg) == {}  # on the CPU: float32, where the model is loaded
    monkeypatch.setattr(build, "training_device", lambda: torch.device("cuda", 1))
    assert build._engine_placement(cfg) == {"device": torch.device("cuda", 1), "dtype": torch.bfloat16}


def test_an_engine_placed_in_bf16_samples_with_float32_logprobs_of_its_bf16_weights(prepackable_model):
    path = prepackable_model  # its MLP and LM head would be prepacked in float32
    cfg = load_config(CONFIG, [])
    site = EngineSite(model_path=str(path), ref_path=str(path), pad_token_id=0,
                      placement={"device": torch.device("cpu"), "dtype": torch.bfloat16})
    engine = local_engine(str(path), cfg.rollout, site)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    prompts = [[5, 9, 17, 3], [40, 41, 42], [7, 8, 9, 10, 11, 12, 13]]
    generations = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=0))
    prepacked = [m for m in engine.model.modules() if isinstance(m, PrepackedLinear)]
    assert (prepacked or not prepacking_available()) and all(m._layout is None for m in prepacked)  # F.linear ran
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for generation in generations:
        ids = torch.tensor([generation.prompt_ids + generation.response_ids])
        response = torch.tensor(generation.response_ids)[:, None]
        start = len(generation.prompt_ids) - 1
        with torch.no_grad():
            logits = bf16(input_ids=ids).logits[0, start:-1].float()
        want = torch.log_softmax(logits, -1).gather(-1, response).squeeze(-1)
        # bf16 decoding with a KV cache against a bf16 forward of the whole sequence: bf16 rounding (measured
        # <= 4e-3); a cache that lost the history or sampling from other weights misses by tenths
        torch.testing.assert_close(torch.tensor(generation.logprobs), want, atol=0.02, rtol=0)
