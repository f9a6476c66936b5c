"""The rollout backends by name (`rollout.backend`), as `weight_transport.TRANSPORTS` names the SGLang
weight-update paths: each builds a rank's on-policy and anchor engines from the `rollout` section (`rollout.build`,
`rollout_engines`), whose sub-section named after the backend holds its own settings and builds one policy's engine
(`rollout.local.build`: `LocalEngine.load`; `rollout.sglang.build`: `sglang_client`, with the router it starts), and
checks the rules the backend needs when the config is loaded.

A new backend is one `RolloutBackend` subclass in `ROLLOUT_BACKENDS`, its settings sub-section and its name
among `RolloutConfig.backend`'s choices; the trainer's set-up (`trainer/run/build.py`) only looks it up.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass, field, replace

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_armor.config import RolloutConfig, SGLangClientConfig
from megatron_armor.config.builders import builds
from megatron_armor.convert.megatron_checkpoint import is_megatron_checkpoint
from megatron_armor.models.hf_config import load_model_shape
from megatron_armor.rollout.base import RolloutEngine
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.push_assignment import push_urls_of_this_rank
from megatron_armor.rollout.router import RouterConfig, SGLangRouter, use_sglang_router
from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig


@dataclass(frozen=True)
class EngineSite:
    """What a rank's engines need from the run besides the `rollout` section.

    model_path / ref_path: the actor's and the reference's checkpoints (HF directory or Megatron checkpoint);
    pad_token_id: the tokenizer's; rank: this process's global rank (an SGLang client's dispatcher starts its
    round-robin there, so ranks spread their requests); placement: where in-process engines run,
    {"device": ..., "dtype": ...} or {} (on the CPU in float32); record_routes: the actor's engine records the
    experts it routes to (train.routing_replay rollout); log_dir: where routers started here log;
    reference_engine: False when the reference samples from the actor's engine, which holds the base (model.lora
    weight_sync adapter): no engine of its own is built.
    """

    model_path: str
    ref_path: str
    pad_token_id: int
    rank: int = 0
    placement: dict = field(default_factory=dict)
    record_routes: bool = False
    log_dir: str | None = None
    reference_engine: bool = True


class RolloutBackend:
    """Builds the engines of one backend."""

    def engines(self, rollout: RolloutConfig, site: EngineSite) -> tuple[RolloutEngine, RolloutEngine]:
        """(on-policy engine, anchor engine), one object when rollout.anchors.engine is shared or the site builds no
        reference engine (collective)."""
        raise NotImplementedError

    def pushes_weights_by_handle(self, rollout: RolloutConfig) -> bool:
        """Whether weight pushes hand the engines the trainer's own weight storage (no staging copy), which on
        CPU must then live in shared memory. False unless the backend says otherwise."""
        return False


class LocalBackend(RolloutBackend):
    """In-process HF models on every rank: the actor's and, unless the anchors share it, the reference's."""

    def engines(self, rollout: RolloutConfig, site: EngineSite) -> tuple[RolloutEngine, RolloutEngine]:
        actor = local_engine(site.model_path, rollout, site, record_routes=site.record_routes)
        if rollout.anchors.engine == "shared" or not site.reference_engine:
            return actor, actor
        return actor, local_engine(site.ref_path, rollout, site)


class SGLangBackend(RolloutBackend):
    """Clients of SGLang servers (rollout.sglang.urls, and ref_urls for separate anchors); each starts from
    whatever its servers loaded, and the trainer pushes the weights before the first rollout."""

    def engines(self, rollout: RolloutConfig, site: EngineSite) -> tuple[RolloutEngine, RolloutEngine]:
        client, sglang = SGLangEngineConfig(weight_sync=rollout.weight_sync), rollout.sglang

        def engine(urls: str, router_url: str | None, client: SGLangEngineConfig = client):
            push_urls = push_urls_of_this_rank(urls.split(","), rollout.weight_sync.method)  # collective
            return sglang.build(urls=urls, router_url=router_url, client=client, log_dir=site.log_dir,
                                push_urls=push_urls, first_server=site.rank)

        actor_client = client
        if site.record_routes:
            shape = load_model_shape(site.model_path)
            actor_client = replace(client, routed_experts_shape=(shape.num_layers, shape.moe_top_k))
        actor = engine(sglang.urls, sglang.router_url, actor_client)
        ref = engine(sglang.ref_urls, sglang.ref_router_url) if sglang.ref_urls and site.reference_engine else actor
        return actor, ref

    def pushes_weights_by_handle(self, rollout: RolloutConfig) -> bool:
        """rollout.weight_sync.payload per_tensor with method tensor (SGLang's load_format null on handles)."""
        weight_sync = rollout.weight_sync
        return weight_sync.method == "tensor" and weight_sync.payload == "per_tensor"


ROLLOUT_BACKENDS: dict[str, RolloutBackend] = {"local": LocalBackend(), "sglang": SGLangBackend()}


@builds(RolloutConfig)
def rollout_engines(rollout: RolloutConfig, *, site: EngineSite) -> tuple[RolloutEngine, RolloutEngine]:
    """(on-policy engine, anchor engine) of rollout.backend at `site` (`RolloutBackend.engines`: collective)."""
    return ROLLOUT_BACKENDS[rollout.backend].engines(rollout, site)


def local_engine(path: str, rollout: RolloutConfig, site: EngineSite, *, record_routes: bool = False) -> LocalEngine:
    """An in-process engine for an HF checkpoint, or, for a Megatron checkpoint, an engine built from
    its (verbatim) HF config whose weights the trainer pushes before the first rollout."""
    model = path
    if is_megatron_checkpoint(path):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    return rollout.local.build(model=model, pad_token_id=site.pad_token_id, record_routes=record_routes,
                               **site.placement)


@builds(SGLangClientConfig)
def sglang_client(
    sglang: SGLangClientConfig, *, urls: str, router_url: str | None, client: SGLangEngineConfig = SGLangEngineConfig(),
    log_dir: str | None = None, push_urls: list[str] | None = None, first_server: int = 0,
) -> SGLangEngine:
    """The client of the servers at comma-separated `urls` (rollout.sglang's urls or ref_urls), generating through a
    router if one is wanted.

    `router_url`: a router already in front of `urls` (set by `armor ray-train`). Without one, this
    process starts its own router (on loopback, stopped at exit; log in `log_dir`) when `sglang.router`
    (rollout.sglang) asks for it. `push_urls`: the servers this process pushes weights to (default: all);
    `first_server`: see `SGLangEngine`.
    """
    servers = urls.split(",")
    if router_url is None and use_sglang_router(sglang.router, len(servers)):
        router = SGLangRouter(servers, RouterConfig(policy=sglang.router_policy), log_dir=log_dir)
        atexit.register(router.stop)
        router_url = router.url
    return SGLangEngine(servers, client, router_url=router_url, push_urls=push_urls, first_server=first_server)
