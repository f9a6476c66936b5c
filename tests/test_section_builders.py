"""Config sections build their components (`config/builders.py`): every section that names a component has its
builder registered once the run's entry point is imported, the name and the registration agree, and each builder
makes what the component's own constructor makes from the section's fields."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from megatron_armor.config import (
    AnchorsConfig, CheckpointConfig, DataConfig, LoggingConfig, MemoryHandoffConfig, MicroBatchingConfig,
    ModelConfig, RewardConfig, SamplingConfig, SubspaceConfig, WeightSyncConfig,
)
from megatron_armor.config.builders import Buildable, builder_of, builds
from megatron_armor.config.root import config_sections

# The sections that build a component of the run (the ones issue 28 names among them).
BUILT_BY_SECTIONS = {
    "optimizer", "rollout", "rollout.weight_sync", "checkpoint", "monitor", "data", "logging", "rollout.memory",
    "micro_batching", "subspace", "rollout.sampling", "rollout.anchors", "rollout.agentic", "reward", "parallel",
    "model", "rollout.local", "rollout.sglang",
}

# Run in a fresh interpreter: what importing `armor train`'s entry point registers, nothing this process imported.
_REGISTRY_PROBE = """
import importlib, json
import megatron_armor.trainer.run.train
from megatron_armor.config.builders import Buildable, builder_of

def subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from subclasses(sub)

found = {}
for cls in subclasses(Buildable):
    module, _, attribute = cls.component.partition(":")
    named = importlib.import_module(module)
    for part in attribute.split("."):
        named = getattr(named, part)
    found[cls.__qualname__] = [builder_of(cls) is not None, builder_of(cls) == named]
print(json.dumps(found))
"""


def test_importing_the_run_registers_the_component_every_section_names():
    buildable = {name for name, cls in config_sections() if issubclass(cls, Buildable)}
    assert buildable == BUILT_BY_SECTIONS
    result = subprocess.run([sys.executable, "-c", _REGISTRY_PROBE], capture_output=True, text=True, check=True)
    found = json.loads(result.stdout.strip().splitlines()[-1])
    by_class = {cls.__qualname__: name for name, cls in config_sections() if name in buildable}
    assert set(found) >= set(by_class)
    unregistered = [by_class[c] for c, (registered, named) in found.items() if c in by_class and not registered]
    misnamed = [by_class[c] for c, (registered, named) in found.items() if c in by_class and registered and not named]
    assert (unregistered, misnamed) == ([], [])


def test_a_section_whose_component_was_never_imported_says_which_module_registers_it():
    @dataclasses.dataclass
    class Orphan(Buildable):
        component = "somewhere.components:Thing"

    with pytest.raises(LookupError, match=r"Orphan.build: its component somewhere.components:Thing is not "
                                          r"registered; import somewhere.components first"):
        Orphan().build(x=1)


def test_a_section_builds_one_component_with_the_runtime_objects_it_is_given():
    @dataclasses.dataclass
    class Scaled(Buildable):
        component = "tests.test_section_builders:scale"
        factor: int = 3

    def scale(settings: Scaled, *, value: int) -> int:
        return settings.factor * value

    assert builds(Scaled)(scale) is scale
    assert builds(Scaled)(scale) is scale  # the same builder again changes nothing
    assert Scaled(factor=5).build(value=7) == 35
    with pytest.raises(ValueError, match="already builds .*scale; it cannot also build .*<lambda>"):
        builds(Scaled)(lambda settings: None)


def test_the_sampling_section_builds_the_training_and_validation_requests():
    from megatron_armor.rollout.base import SamplingParams

    section = SamplingConfig(temperature=0.7, top_p=0.9, val_temperature=0.0, val_top_p=1.0, max_new_tokens=33)
    assert section.build(stop_token_ids=(2, 5)) == SamplingParams(0.7, 0.9, 33, (2, 5))
    assert section.build(stop_token_ids=(2,), validation=True) == SamplingParams(0.0, 1.0, 33, (2,))


def test_small_sections_build_their_components_or_none_when_off(tmp_path):
    from megatron_armor.scoring.micro_batches import MicroBatching
    from megatron_armor.trainer.checkpointing.checkpoint import checkpoint_root
    from megatron_armor.trainer.checkpointing.checkpoint_save import checkpoint_saver
    from megatron_armor.trainer.colocation.memory_handoff import memory_handoff
    from megatron_armor.trainer.rollouts.anchor_cache import AnchorCache, anchor_cache
    from megatron_armor.trainer.update.optimizer import run_subspace_constraint
    from megatron_armor.utils.metrics import MetricsLogger

    built = {AnchorsConfig: anchor_cache, MemoryHandoffConfig: memory_handoff, SubspaceConfig: run_subspace_constraint,
             MicroBatchingConfig: MicroBatching, CheckpointConfig: checkpoint_saver, LoggingConfig: MetricsLogger}
    assert {section: builder_of(section) for section in built} == built  # registered by importing the component

    assert AnchorsConfig(cache=False).build() is None
    anchors = AnchorsConfig(cache=True, cache_max_prompts=7)
    cache = anchors.build()
    assert isinstance(cache, AnchorCache) and cache.settings is anchors
    assert MemoryHandoffConfig(release_servers=False).build(actor_engine=None, ref_engine=None) is None
    assert SubspaceConfig().build(model=None) is None  # off by default: no constraint, the model is not read
    batching = MicroBatchingConfig(micro_batch_size=3, max_tokens=96)
    assert batching.build(pad_to_multiple_of=4) == MicroBatching(batching, 4)

    saver = CheckpointConfig(keep_last=3, async_save=True, keep_best="val/accuracy", best_mode="min").build(
        run_dir=tmp_path)
    assert (saver.root, saver.keep_last, saver.async_save) == (checkpoint_root(tmp_path), 3, True)
    assert (saver.best.metric, saver.best.lower_is_better, saver.best.step) == ("val/accuracy", True, None)
    assert CheckpointConfig(keep_best=None).build(run_dir=tmp_path).best is None

    logger = LoggingConfig(run_dir=str(tmp_path / "run"), tensorboard=False).build(enabled=True)
    logger.log(1, {"train/reward_mean": 0.5})
    logger.close()
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text()) == {"step": 1, "train/reward_mean": 0.5}


def test_the_reward_section_builds_its_functions():
    from megatron_armor.rewards import math_dapo
    from megatron_armor.rewards.reward_fns import RewardFns

    assert builder_of(RewardConfig) == RewardFns.load

    rewards = RewardConfig(train_fn="megatron_armor.rewards.math_dapo:verify", val_fn=None, audit_fns=[]).build()
    assert rewards.train is math_dapo.verify and rewards.val is math_dapo.verify and rewards.audits.names == ()


def test_the_weight_sync_section_builds_the_transport_of_its_method(tmp_path):
    from megatron_armor.rollout.weight_transport import DiskTransport, DistributedTransport, TensorTransport

    def post_all(path, body_for):
        raise AssertionError("nothing is pushed")

    for method, cls in (("tensor", TensorTransport), ("distributed", DistributedTransport), ("disk", DiskTransport)):
        settings = WeightSyncConfig(method=method, dir=str(tmp_path), bucket_mb=2)
        transport = settings.build(servers=[], post_all=post_all, group_timeout_s=12.0)
        assert type(transport) is cls
        assert (transport.settings, transport.settings.bucket_bytes, transport.group_timeout_s) == (settings, 2 << 20, 12.0)
        transport.close()
    with pytest.raises(ValueError, match=r"weight_sync disk needs a directory the servers can read"):
        WeightSyncConfig(method="disk").build(servers=[], post_all=post_all)


def test_the_data_section_builds_the_training_sampler_and_the_validation_rows(tmp_path, tiny_model_factory):
    from megatron_armor.data.datasets import load_prompt_rows, write_jsonl
    from megatron_armor.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_factory("qwen2"))
    write_jsonl([{"question": f"q{i}", "answer": str(i)} for i in range(6)], tmp_path / "train.jsonl")
    write_jsonl([{"question": "v", "answer": "1"}], tmp_path / "val.jsonl")
    data = DataConfig(prompt_key="question", max_prompt_length=64, shuffle=False)
    prompts = data.build(tokenizer=tokenizer, train_path=str(tmp_path / "train.jsonl"),
                         val_path=str(tmp_path / "val.jsonl"), batch_size=4, seed=11)
    expected = load_prompt_rows(tmp_path / "train.jsonl", tokenizer=tokenizer, prompt_key="question")
    assert [row.prompt_ids for row in prompts.train.next_batch()] == [row.prompt_ids for row in expected[:4]]
    assert (prompts.train.seed, prompts.train.shuffle) == (11, False)
    assert [row.row["answer"] for row in prompts.validation] == ["1"]
    no_validation = data.build(tokenizer=tokenizer, train_path=str(tmp_path / "train.jsonl"), val_path=None,
                               batch_size=2, seed=0)
    assert no_validation.validation == []
    assert no_validation.train.next_batch()[0].prompt_ids == expected[0].prompt_ids


def test_the_model_section_builds_a_policy_s_model_in_its_dtype_with_its_routing_for_the_actor(tiny_model_factory):
    from megatron_armor.convert.loading import load_policy_model
    from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
    from megatron_armor.models.hf_config import load_model_shape

    path = tiny_model_factory("qwen2_moe")
    shape = load_model_shape(path)
    section = ModelConfig(params_dtype="bfloat16", moe_load_balancing="seq_aux_loss", moe_aux_loss_coeff=0.01)
    assert builder_of(ModelConfig) is load_policy_model
    initialize_distributed(1, 1, 1)
    try:
        actor = section.build(path=path, shape=shape, trainable=True)
        frozen = section.build(path=path, shape=shape)
    finally:
        destroy_distributed()
    assert {p.dtype for p in actor.parameters()} == {p.dtype for p in frozen.parameters()} == {torch.bfloat16}
    assert (actor.config.moe_router_load_balancing_type, actor.config.moe_aux_loss_coeff) == ("seq_aux_loss", 0.01)
    assert frozen.config.moe_aux_loss_coeff == 0.0
    assert all(p.requires_grad for p in actor.parameters()) and not any(p.requires_grad for p in frozen.parameters())
    scored = dict(frozen.named_parameters())
    for name, trained in actor.named_parameters():
        assert torch.equal(trained, scored[name]), name  # the same checkpoint loaded into both
