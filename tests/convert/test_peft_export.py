"""The PEFT export of a LoRA actor: `peft` loads it onto the HF base model, which then gives the Megatron model's
logits with its adapters on; a MoE model's routed experts' adapters too (per-expert HF names, which peft converts to
its adapters of transformers 5's stacked experts)."""

import json

import pytest
import torch
from safetensors import safe_open

from megatron_armor.config import LoRAConfig
from megatron_armor.convert.peft_export import save_peft_adapter
from megatron_armor.convert.weights import load_hf_weights
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.models.hf_config import load_model_shape, transformer_config
from megatron_armor.models.lora import apply_lora, lora_adapters


@pytest.fixture(scope="module")
def megatron_world():
    initialize_distributed(1, 1, 1)
    yield
    destroy_distributed()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
def test_peft_loads_the_export_and_gives_the_trainer_s_logits(megatron_world, tiny_model_factory, tmp_path, arch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint = tiny_model_factory(arch)
    shape = load_model_shape(checkpoint)
    model = build_gpt_model(shape, transformer_config(shape), trainable=True)
    load_hf_weights(model, checkpoint, shape)
    lora = LoRAConfig(rank=4, alpha=8.0, experts=bool(shape.num_experts))
    apply_lora(model, lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for adapter in lora_adapters(model):  # a trained adapter's B
            adapter.lora_b.copy_(torch.randn(adapter.lora_b.shape, generator=generator) * 0.1)
        tokens = torch.randint(1, shape.vocab_size, (2, 9), generator=generator)
        logits = model(tokens, torch.arange(9).expand_as(tokens), attention_mask=None)  # [b, S, V]
    out = save_peft_adapter(model, shape, lora, tmp_path / "adapter", base_model=str(checkpoint))

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["base_model_name_or_path"] == str(checkpoint)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    if shape.num_experts:  # every layer's every expert, as peft names the HF checkpoint's per-expert layers
        with safe_open(out / "adapter_model.safetensors", "pt") as f:
            experts = {key.split(".mlp.experts.")[1] for key in f.keys() if ".mlp.experts." in key}
        assert experts == {f"{e}.{proj}.lora_{f}.weight" for e in range(shape.num_experts)
                           for proj in ("gate_proj", "up_proj", "down_proj") for f in "AB"}
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(tokens).logits
        peft_logits = PeftModel.from_pretrained(base, out).eval()(tokens).logits
    vocab = shape.vocab_size
    assert (peft_logits - base_logits).abs().max() > 1e-2  # the adapters change the model
    torch.testing.assert_close(peft_logits[..., :vocab], logits[..., :vocab], rtol=0, atol=1e-4)
