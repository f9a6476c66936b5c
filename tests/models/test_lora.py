"""LoRA adapters on a tiny Megatron model (one process): B = 0 gives the base's outputs bit for bit, the adapters'
gradients equal a plain-torch reference, only adapters reach DDP's buffers and the optimizer, bad settings fail."""

import pytest
import torch

from megatron_armor.config import ConfigError, LoRAConfig, OptimizerConfig
from megatron_armor.convert.weights import load_hf_weights
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.models.hf_config import load_model_shape, transformer_config
from megatron_armor.models.lora import LoRAError, adapters_disabled, apply_lora, lora_adapters
from megatron_armor.trainer.update.optimizer import optimizer_step, wrap_for_training, zero_grads

LORA = LoRAConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def megatron_world():
    initialize_distributed(1, 1, 1)
    yield
    destroy_distributed()


def _model(checkpoint, **config):
    shape = load_model_shape(checkpoint)
    model = build_gpt_model(shape, transformer_config(shape, **config), trainable=True)
    load_hf_weights(model, checkpoint, shape)
    return model


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(1, vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))  # [b, S]


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, attention_mask=None)  # [b, S, V]


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _randomize_b(model, seed: int = 1) -> None:
    """Nonzero B factors (a trained adapter's), so that A gets gradients and the adapter changes the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in lora_adapters(model):
            adapter.lora_b.copy_(torch.randn(adapter.lora_b.shape, generator=generator) * 0.1)


def test_zero_b_gives_the_base_bit_for_bit_and_disabled_adapters_give_it_back(megatron_world, tiny_model_factory):
    checkpoint = tiny_model_factory()
    model = _model(checkpoint)
    tokens = _tokens(load_model_shape(checkpoint).vocab_size)
    with torch.no_grad():
        base = _logits(model, tokens)
        adapters = apply_lora(model, LORA)
        assert len(adapters) == 4 * 2  # qkv, proj, fc1, fc2 in each of the 2 layers
        assert torch.equal(_logits(model, tokens), base)
        _randomize_b(model)
        assert not torch.allclose(_logits(model, tokens), base)
        with adapters_disabled(model):
            assert torch.equal(_logits(model, tokens), base)
        assert all(adapter.enabled for adapter in adapters)


def _reference_hooks(model, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> list:
    """Plain-torch LoRA on `model`'s linear layers: output + x @ A^T @ B^T * scale, A and B leaf tensors."""
    handles = []
    for name, module in model.named_modules():
        if name in factors:
            a, b = factors[name]
            handles.append(module.register_forward_hook(
                lambda mod, args, out, a=a, b=b: (out[0] + args[0] @ a.T @ b.T * scale, out[1])))
    return handles


def test_adapter_gradients_equal_a_plain_torch_reference(megatron_world, tiny_model_factory):
    checkpoint = tiny_model_factory()
    tokens = _tokens(load_model_shape(checkpoint).vocab_size)
    lora_model = _model(checkpoint)
    apply_lora(lora_model, LORA)
    _randomize_b(lora_model)
    logits = _logits(lora_model, tokens)
    _loss(logits, tokens).backward()

    reference = _model(checkpoint)
    reference.requires_grad_(False)
    factors = {name.removesuffix("_adapter"): (module.lora_a.detach().clone().requires_grad_(),
                                               module.lora_b.detach().clone().requires_grad_())
               for name, module in lora_model.named_modules() if name.endswith("_adapter")}
    _reference_hooks(reference, factors, LORA.alpha / LORA.rank)
    reference_logits = _logits(reference, tokens)
    _loss(reference_logits, tokens).backward()

    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=1e-6)
    for name, (a, b) in factors.items():
        adapter = lora_model.get_submodule(f"{name}_adapter")
        assert a.grad.abs().max() > 0 and b.grad.abs().max() > 0, name
        torch.testing.assert_close(adapter.lora_a.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(adapter.lora_b.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    frozen = [name for name, p in lora_model.named_parameters() if "_adapter." not in name]
    assert frozen and all(lora_model.get_parameter(name).grad is None for name in frozen)


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed-adam"])
def test_only_adapters_reach_ddp_buffers_and_the_optimizer(megatron_world, tiny_model_factory, distributed):
    checkpoint = tiny_model_factory()
    model = _model(checkpoint)
    adapters = apply_lora(model, LORA)
    ddp, optimizer = wrap_for_training(OptimizerConfig(lr=1e-2, warmup_steps=0), model=model, distributed=distributed)
    expected = {id(p) for adapter in adapters for p in (adapter.lora_a, adapter.lora_b)}
    buffered = {id(p) for buffer in ddp.buffers + ddp.expert_parallel_buffers for p in buffer.params}
    assert buffered == expected
    megatron_optimizer = getattr(optimizer, "megatron_optimizer", optimizer)
    parts = getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer])
    if distributed:  # its param_groups hold this rank's fp32 shards; the model parameters they stand for:
        groups = [group for part in parts for group in part.model_fp32_groups + part.model_float16_groups]
    else:
        groups = [group["params"] for group in optimizer.param_groups]
    assert {id(p) for group in groups for p in group} == expected
    base = {name: p.detach().clone() for name, p in model.named_parameters() if "_adapter." not in name}

    tokens = _tokens(load_model_shape(checkpoint).vocab_size)
    zero_grads(ddp, optimizer)
    _loss(_logits(ddp, tokens), tokens).backward()
    ddp.finish_grad_sync()
    assert optimizer_step(ddp, optimizer, lr=1e-2).updated
    assert all(torch.equal(p, base[name]) for name, p in model.named_parameters() if name in base)
    assert any(adapter.lora_b.abs().max() > 0 for adapter in adapters)  # B left zero: the step did nothing
    moments = [state["exp_avg"] for part in parts for state in part.optimizer.state.values()]  # torch's Adam
    assert sum(m.numel() for m in moments) == sum(p.numel() for adapter in adapters
                                                      for p in (adapter.lora_a, adapter.lora_b))


def test_the_rollback_snapshot_holds_the_adapters_alone_and_restores_them_exactly(megatron_world, tiny_model_factory):
    """MIPU's accept / rollback snapshot (`TrainingSnapshot`) of a LoRA actor copies what the optimizer updates, the
    adapters, not the frozen base; a rollback puts adapters and Adam state back, so the step taken again after it
    lands on the first attempt's adapters bit for bit."""
    from megatron_armor.trainer.update.snapshot import TrainingSnapshot

    checkpoint = tiny_model_factory()
    model = _model(checkpoint)
    adapters = apply_lora(model, LORA)
    ddp, optimizer = wrap_for_training(OptimizerConfig(lr=1e-2, warmup_steps=0), model=model)
    tokens = _tokens(load_model_shape(checkpoint).vocab_size)

    trained = [p for adapter in adapters for p in (adapter.lora_a, adapter.lora_b)]

    def step() -> list[torch.Tensor]:
        zero_grads(ddp, optimizer)
        _loss(_logits(ddp, tokens), tokens).backward()
        ddp.finish_grad_sync()
        assert optimizer_step(ddp, optimizer, lr=1e-2).updated
        return [p.detach().clone() for p in trained]

    before = step()  # Adam moments that a rollback must restore, and B off zero
    snapshot = TrainingSnapshot.capture(ddp, optimizer, 1)
    # the adapters alone (4 per layer, A and B each), in the order of the model's parameters
    assert [p.shape for p in snapshot.params] == [p.shape for p in trained]
    assert all(torch.equal(saved, p) for saved, p in zip(snapshot.params, before, strict=True))
    candidate = step()
    assert not any(torch.equal(a, b) for a, b in zip(candidate, before))
    snapshot.restore(ddp, optimizer)
    assert all(torch.equal(p, saved) for p, saved in zip(trained, before, strict=True))
    assert all(torch.equal(again, first) for again, first in zip(step(), candidate, strict=True))


def test_full_recompute_gives_adapters_the_gradients_of_a_kept_run(megatron_world, tiny_model_factory):
    from megatron_armor.config import RecomputeConfig

    checkpoint = tiny_model_factory()
    tokens = _tokens(load_model_shape(checkpoint).vocab_size)
    grads = []
    for recompute in (RecomputeConfig(), RecomputeConfig("full", "uniform", 1)):
        model = _model(checkpoint, recompute=recompute)
        adapters = apply_lora(model, LORA)
        _randomize_b(model)
        _loss(_logits(model, tokens), tokens).backward()
        grads.append([p.grad for adapter in adapters for p in (adapter.lora_a, adapter.lora_b)])
    assert all(g is not None for g in grads[1])
    for kept, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, kept, rtol=0, atol=0)


def test_bad_settings_fail_with_the_field_named(megatron_world, tiny_model_factory):
    with pytest.raises(ConfigError, match="target_modules.*'linear_q'"):
        LoRAConfig(rank=4, target_modules=["linear_q"])
    with pytest.raises(ConfigError, match="model.lora.rank must be >= 0"):
        LoRAConfig(rank=-1)
    model = _model(tiny_model_factory())  # hidden 64, ffn 176
    with pytest.raises(LoRAError, match="rank 65 exceeds .*linear_proj's smaller dimension \(in 64, out 64\)"):
        apply_lora(model, LoRAConfig(rank=65))
    with pytest.raises(LoRAError, match="no routed experts"):
        apply_lora(model, LoRAConfig(rank=4, experts=True))
    for layer in model.decoder.layers:  # a model without MLPs: no layer is named linear_fc1 / linear_fc2
        layer.mlp = torch.nn.Identity()
    with pytest.raises(LoRAError, match=r"\['linear_fc1', 'linear_fc2'\] match no layer"):
        apply_lora(model, LoRAConfig(rank=4))


def test_the_sharded_state_holds_the_adapters_at_their_global_shapes(megatron_world, tiny_model_factory):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    model = _model(tiny_model_factory())  # hidden 64, 4 heads of 16, 2 KV groups: qkv out 128; ffn 176
    apply_lora(model, LORA)
    state = model.sharded_state_dict()  # global shapes: [layers, *the tensor's]
    attention = "decoder.layers.1.self_attention"
    assert state[f"{attention}.linear_qkv_adapter.lora_a"].global_shape == (2, 4, 64)
    assert state[f"{attention}.linear_qkv_adapter.lora_b"].global_shape == (2, 128, 4)
    assert state[f"{attention}.linear_proj_adapter.lora_a"].global_shape == (2, 4, 64)
    assert state["decoder.layers.0.mlp.linear_fc2_adapter.lora_b"].global_shape == (2, 64, 4)
    fc1_b = state["decoder.layers.0.mlp.linear_fc1_adapter.lora_b"]  # gate and up halves sharded apart, as fc1's
    assert isinstance(fc1_b, ShardedTensorFactory) and fc1_b.data.shape == (2 * 176, 4)
    assert state[f"{attention}.linear_qkv.weight"].global_shape == (2, 128, 64)  # the base's keys as without LoRA
    adapter_keys = {key for key in state if "_adapter." in key}
    assert adapter_keys == {f"{prefix}_adapter.{factor}" for prefix in (
        f"decoder.layers.{layer}.{block}.{name}" for layer in range(2)
        for block, name in [("self_attention", "linear_qkv"), ("self_attention", "linear_proj"), ("mlp", "linear_fc1"),
                            ("mlp", "linear_fc2")]) for factor in ("lora_a", "lora_b")}


def test_merged_export_gives_the_adapted_model_in_transformers(megatron_world, tiny_model_factory):
    """`gather_hf_weights` of a LoRA model exports W + (alpha / r) B A under the HF names: loaded into the
    transformers model they give the Megatron model's logits with its adapters on; inside `adapters_disabled` the
    export is the base checkpoint's tensors exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_armor.convert.weights import gather_hf_weights

    checkpoint = tiny_model_factory()
    shape = load_model_shape(checkpoint)
    model = _model(checkpoint)
    apply_lora(model, LORA)
    _randomize_b(model)
    tokens = _tokens(shape.vocab_size)
    with torch.no_grad():
        logits = _logits(model, tokens)
        merged = {name: tensor.clone() for name, tensor in gather_hf_weights(model, shape)}
        with adapters_disabled(model):
            base = dict(gather_hf_weights(model, shape))
    stored = load_file(checkpoint / "model.safetensors")
    assert base.keys() == stored.keys() and all(torch.equal(base[name], stored[name]) for name in stored)
    assert not torch.equal(merged["model.layers.0.mlp.up_proj.weight"], stored["model.layers.0.mlp.up_proj.weight"])
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    hf.load_state_dict(merged)
    with torch.no_grad():
        hf_logits = hf(tokens).logits
    vocab = shape.vocab_size
    torch.testing.assert_close(hf_logits[..., :vocab], logits[..., :vocab], rtol=0, atol=1e-4)
