"""The rollout backends' registry: one backend per name `rollout.backend` allows, each with the settings
sub-section named after it, the local backend's engines as rollout.anchors.engine asks, and the SGLang client's
pushes as rollout.weight_sync says."""

import typing

from megatron_armor.config import RolloutConfig, SGLangClientConfig, WeightSyncConfig, load_config
from megatron_armor.rollout.backends import ROLLOUT_BACKENDS, EngineSite
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.sglang_engine import SGLangEngineConfig


def test_every_allowed_backend_is_registered_with_its_own_settings():
    allowed = typing.get_args(typing.get_type_hints(RolloutConfig)["backend"])
    assert sorted(ROLLOUT_BACKENDS) == sorted(allowed)
    for name in allowed:
        rollout = load_config(None, ["task.synthetic=arithmetic", f"rollout.backend={name}",
                                     "rollout.sglang.urls=http://a:1", "algorithm.name=grpo"]).rollout
        assert rollout.backend_settings is getattr(rollout, name)
    assert RolloutConfig().backend_settings.in_process
    assert not RolloutConfig(backend="sglang", sglang=SGLangClientConfig(urls="http://a:1")).backend_settings.in_process


def test_local_backend_builds_one_engine_per_policy_unless_the_anchors_share_it(tiny_model_factory):
    checkpoint = str(tiny_model_factory())
    site = EngineSite(model_path=checkpoint, ref_path=checkpoint, pad_token_id=0)
    local = ROLLOUT_BACKENDS["local"]
    actor, ref = local.engines(RolloutConfig(), site)
    assert isinstance(actor, LocalEngine) and isinstance(ref, LocalEngine) and actor.model is not ref.model
    shared = load_config(None, ["task.synthetic=arithmetic", "rollout.anchors.engine=shared"]).rollout
    actor, ref = local.engines(shared, site)
    assert actor is ref
    assert not local.pushes_weights_by_handle(shared)


def test_the_sglang_client_pushes_as_the_weight_sync_section_says():
    """Buckets of bucket_mb MiB, SGLang's load_format null for payload per_tensor (a disk push writes files either
    way), and the trainer's storage handed over (kept in shared memory) only by per_tensor pushes of method tensor."""
    client = SGLangEngineConfig(weight_sync=WeightSyncConfig(payload="per_tensor", bucket_mb=0.5)).weight_sync
    assert (client.bucket_bytes, client.load_format) == (512 * 1024, None)
    default = SGLangEngineConfig().weight_sync
    assert (default.bucket_bytes, default.load_format) == (512 * 1024 * 1024, "flattened_bucket")
    sglang = ROLLOUT_BACKENDS["sglang"]

    def by_handle(method: str, payload: str) -> bool:
        weight_sync = WeightSyncConfig(method=method, dir="/shared", payload=payload)
        return sglang.pushes_weights_by_handle(RolloutConfig(backend="sglang", weight_sync=weight_sync,
                                                             sglang=SGLangClientConfig(urls="http://a:1")))

    assert by_handle("tensor", "per_tensor")
    assert not any(by_handle(method, payload) for method, payload in [
        ("tensor", "flattened_bucket"), ("distributed", "per_tensor"), ("disk", "per_tensor")])
