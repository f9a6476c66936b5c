"""`armor ray-train`: the training job as a Ray job: trainer ranks and rollout servers as actors.

    driver: prepare the task (model/data paths) -> start servers (actor policy, and reference for
            ARMOR; disaggregated groups at once), each group behind its own SGLang router on the driver
            when `rollout.sglang.router` picks one -> trainer ranks run `run_training` with `rollout.backend
            sglang` pointed at them -> restart (and re-register) dead servers while training -> shut
            everything down.

Placement:
- disaggregated: the trainer ranks get one placement group (a GPU each) and every server group its
  own (tp_size GPUs per server). Trainer and rollout GPUs are separate; nothing is handed off.
- colocated (GPU only): server i shares bundle i (one GPU) with trainer rank i; servers run with
  --enable-memory-saver and a small --mem-fraction-static. One GPU per bundle means server
  tp_size 1. The trainer loop hands the GPU memory back and forth (`rollout.memory.release_servers`,
  trainer/colocation/memory_handoff.py): the servers release it before training and resume it before the weight push.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import ray
from ray.util.placement_group import remove_placement_group

from megatron_armor.algorithms import ANCHORS, TEACHER, Algorithm, check_algorithm_config
from megatron_armor.config import ArmorConfig, ConfigError, validate
from megatron_armor.launch.server_process import ServerConfig
from megatron_armor.launch.servers import Placement, ServerGroup, reserve_bundles
from megatron_armor.launch.trainer_ranks import TrainerRanks
from megatron_armor.rollout.router import RouterConfig, SGLangRouter, use_sglang_router
from megatron_armor.scoring.routes import REPLAY_MODES
from megatron_armor.trainer.run.task_setup import TaskPaths, prepare_task

log = logging.getLogger(__name__)

COLOCATED_GPU_FRACTION = 0.45  # trainer rank and rollout server(s) each claim part of a shared GPU bundle


@dataclass(frozen=True)
class RayJobConfig:
    """How the job is laid out on the Ray cluster (the training itself is the ArmorConfig)."""

    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    num_servers: int = 1  # actor-policy servers (colocated: one per trainer rank)
    num_ref_servers: int = 1  # reference-policy servers for ARMOR anchors (colocated: one per trainer rank)
    server_kind: Literal["sglang", "local"] = "sglang"  # local: the CPU stand-in
    server_tp_size: int = 1
    mem_fraction_static: float | None = None
    server_args: tuple[str, ...] = ()  # extra flags for every server
    server_host: str | None = None  # None: each node's IP; "127.0.0.1" for a one-node job
    cpus_per_actor: float = 1.0
    monitor_interval_s: float = 30.0  # how often dead servers are looked for
    placement_timeout_s: float = 300.0  # how long Ray may take to place each placement group
    log_dir: str | None = None  # server logs (default: the node's temp dir)


@dataclass(frozen=True)
class ServerRole:
    """A policy whose rollout servers the job starts, as a group of their own: which checkpoint they load, how many
    there are, how they run and which rollout.sglang fields point the trainer at them. The job asks the role
    (`SERVER_ROLES`); nothing compares role names."""

    name: str  # the server group's name (its placement group, its logs)
    model_path: Callable[[TaskPaths], str]  # the checkpoint its servers load
    count: Callable[[RayJobConfig], int]  # its servers in a disaggregated job (colocated: one per trainer rank)
    needed: Callable[[ArmorConfig, Algorithm], bool]  # whether the run samples from servers of this policy
    urls_field: str  # the rollout.sglang field that lists its servers for the trainer
    router_field: str  # the rollout.sglang field that names its router
    # Colocated: its weights are pushed once, not after every hand-off, so they must survive the servers' memory
    # releases (--enable-weights-cpu-backup).
    weights_survive_release: bool = False
    records_routes: bool = False  # train.routing_replay rollout (R3) replays the experts its servers route to


def _separate_anchor_engine(cfg: ArmorConfig, algorithm: Algorithm) -> bool:
    """ARMOR's anchors sampled by an engine of their own (rollout.anchors.engine separate; not under model.lora
    weight_sync adapter, where they come from the actor's servers with the adapter off)."""
    return (ANCHORS in algorithm.step_sources(cfg).extra_samples and cfg.rollout.anchors.engine == "separate"
            and not cfg.model.lora.adapter_sync)


ACTOR_SERVERS = ServerRole(
    "actor", model_path=lambda paths: paths.model_path, count=lambda job: job.num_servers,
    needed=lambda cfg, algorithm: True, urls_field="urls", router_field="router_url", records_routes=True,
)
# The anchors' routes are the reference's: R3 replays none of them.
REFERENCE_SERVERS = ServerRole(
    "reference", model_path=lambda paths: paths.ref_path, count=lambda job: job.num_ref_servers,
    needed=_separate_anchor_engine, urls_field="ref_urls", router_field="ref_router_url", weights_survive_release=True,
)
SERVER_ROLES: tuple[ServerRole, ...] = (ACTOR_SERVERS, REFERENCE_SERVERS)  # in start order


def run_ray_job(cfg: ArmorConfig, job: RayJobConfig, *, resume: bool = False, overwrite: bool = False) -> None:
    """Run the training job on the connected Ray cluster (call `ray.init` first).

    Raises trainer_ranks.TrainerJobError naming the rank that failed, router.RouterError if a router died, or
    servers.PlacementError if the cluster cannot hold the job; servers, routers, actors and placement groups
    are released in every case.
    """
    algorithm = check_algorithm_config(cfg)
    use_gpus = ray.cluster_resources().get("GPU", 0) > 0
    world = cfg.parallel.world_size
    colocated = job.placement == "colocated"
    if colocated and (not use_gpus or job.server_tp_size != 1):
        raise ConfigError("colocated placement needs a GPU cluster and server_tp_size 1 (one GPU per bundle, shared "
                          f"by a trainer rank and its servers); got {'no GPUs' if not use_gpus else f'server_tp_size {job.server_tp_size}'}")
    # Servers need the checkpoints before the trainer starts.
    paths = prepare_task(cfg, is_main=True, needs_teacher=algorithm.step_sources(cfg).uses(TEACHER))
    bundle = {"CPU": job.cpus_per_actor * (3 if colocated else 1), **({"GPU": 1} if use_gpus else {})}
    trainer_pg = reserve_bundles(bundle, world, name="armor-trainer", timeout_s=job.placement_timeout_s)
    groups: dict[ServerRole, ServerGroup] = {}
    routers: list[SGLangRouter] = []
    try:
        offset = 0
        for role in (role for role in SERVER_ROLES if role.needed(cfg, algorithm)):
            count = world if colocated else role.count(job)
            group = _server_group(cfg, job, role, role.model_path(paths), count, seed_offset=offset,
                                  trainer_pg=trainer_pg)
            offset += count
            groups[role] = group
            routers += [group.router] if group.router else []
        if not colocated:
            for group in groups.values():
                group.wait_ready()
        cfg = _pointed_at(cfg, groups, colocated=colocated)
        gpu_share = (COLOCATED_GPU_FRACTION if colocated else 1.0) if use_gpus else 0.0
        ranks = TrainerRanks(world, trainer_pg, list(range(world)), cpus=job.cpus_per_actor, gpus=gpu_share)

        def restart_dead_servers() -> None:
            for router in routers:
                router.check_alive()
            for group in groups.values():
                group.restart_dead()

        ranks.run(cfg, resume=resume, overwrite=overwrite, poll_s=job.monitor_interval_s, on_poll=restart_dead_servers)
    finally:
        for group in groups.values():
            group.shutdown()
        for router in routers:
            router.stop()
        remove_placement_group(trainer_pg)


def _server_group(
    cfg: ArmorConfig, job: RayJobConfig, role: ServerRole, model_path: str, count: int, *, seed_offset: int,
    trainer_pg,
) -> ServerGroup:
    """`count` servers of `model_path` for `role`, behind their own router when
    rollout.sglang.router picks one. Disaggregated groups (their own GPUs) start at once; colocated ones
    (on the trainer's bundles) one after the other, since an SGLang server sizes its KV cache from the memory
    it finds free on the shared GPU."""
    colocated = job.placement == "colocated"
    spec = _server_spec(cfg, job, role, model_path, seed_offset=seed_offset)
    world = cfg.parallel.world_size
    placement = (Placement(trainer_pg, tuple(range(world)), job.cpus_per_actor, COLOCATED_GPU_FRACTION / 2)
                 if colocated else Placement(cpus_per_actor=job.cpus_per_actor, timeout_s=job.placement_timeout_s))
    router = None
    if use_sglang_router(cfg.rollout.sglang.router, count):
        router = SGLangRouter(spec=RouterConfig(policy=cfg.rollout.sglang.router_policy), log_dir=job.log_dir,
                              host=job.server_host or ray.util.get_node_ip_address())
    try:
        return ServerGroup(spec, count, name=role.name, host=job.server_host, placement=placement, log_dir=job.log_dir,
                           router=router, wait=colocated)
    except BaseException:
        if router is not None:
            router.stop()
        raise


def _server_spec(
    cfg: ArmorConfig, job: RayJobConfig, role: ServerRole, model_path: str, *, seed_offset: int,
) -> ServerConfig:
    """What each server of `role` runs: `job`'s server settings, colocated ones saving GPU memory across hand-offs
    (and their weights, where the role's must survive releases), recording routed experts where the role's are
    replayed under train.routing_replay, serving LoRA adapters under model.lora.weight_sync adapter."""
    colocated = job.placement == "colocated"
    return ServerConfig(
        model_path=model_path, kind=job.server_kind, tp_size=job.server_tp_size,
        mem_fraction_static=job.mem_fraction_static, seed=cfg.train.seed + seed_offset * job.server_tp_size,
        enable_memory_saver=colocated, extra_args=job.server_args,
        enable_weights_cpu_backup=colocated and role.weights_survive_release,
        return_routed_experts=role.records_routes and REPLAY_MODES[cfg.train.routing_replay].engines_record,
        max_lora_rank=cfg.model.lora.rank if cfg.model.lora.adapter_sync else 0,
    )


def _pointed_at(cfg: ArmorConfig, groups: dict[ServerRole, ServerGroup], *, colocated: bool) -> ArmorConfig:
    """`cfg` with rollouts from the groups' servers and routers (each role's rollout.sglang fields; a role without
    a group: none); colocated servers hand their GPU memory to the trainer ranks for each training phase."""
    rollout = cfg.rollout
    fields: dict[str, str | None] = {}
    for role in SERVER_ROLES:
        group = groups.get(role)
        fields[role.urls_field] = ",".join(group.urls) if group else None
        fields[role.router_field] = group.router.url if group and group.router else None
    sglang = dataclasses.replace(rollout.sglang, **fields)
    memory = dataclasses.replace(rollout.memory, release_servers=rollout.memory.release_servers or colocated,
                                 offload_trainer=rollout.memory.offload_trainer or colocated)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(rollout, backend="sglang", sglang=sglang, memory=memory))
    validate(cfg)
    check_algorithm_config(cfg)
    return cfg
