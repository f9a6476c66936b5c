"""One full ARMOR step as a Ray job: 2 trainer ranks (TP=2) and 2 rollout servers (actor, reference) as actors,
each server behind its own SGLang router on the driver."""

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

from megatron_armor.config import load_config
from megatron_armor.launch.ray_job import (
    ACTOR_SERVERS, REFERENCE_SERVERS, SERVER_ROLES, RayJobConfig, _pointed_at, _server_spec, run_ray_job,
)
from megatron_armor.launch.server_process import server_command

CONFIG = Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml"


def test_armor_step_as_ray_job(ray_cluster, synthetic_cache, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(CONFIG, [
        "train.max_steps=1", f"logging.run_dir={run_dir}", f"task.cache_dir={synthetic_cache}",
        "task.num_train_rows=400", "task.num_val_rows=16", "eval.max_prompts=8", "logging.tensorboard=false",
        "logging.progress_bar=false", "logging.plot=false", "eval.before_train=false", "checkpoint.save_model=false",
        "rollout.sglang.router=sglang",  # a router even for one server
    ])
    job = RayJobConfig(server_kind="local", server_host="127.0.0.1", cpus_per_actor=0.4, monitor_interval_s=5.0,
                     log_dir=str(tmp_path / "server-logs"))
    run_ray_job(cfg, job)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(row for row in rows if row["step"] == 1)
    assert math.isfinite(step["loss/policy_loss"])
    assert step["mismatch/logprob_abs_diff"] < 1e-3  # the servers sampled with the trainer's weights
    assert step["armor/anchors_used"] == step["filter/prompts_kept"] == 8  # anchors from the reference server
    # The ranks generated through the driver's routers, which take one prompt per request: the 16 x 7 on-policy
    # samples are 112 requests over both ranks (rollout/* sums the ranks' clients; without a router: 8 requests).
    assert step["rollout/requests"] >= 16 * 7
    deadline = time.monotonic() + 30  # Ray frees killed actors and removed placement groups asynchronously
    while ray_cluster.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_cluster.available_resources().get("CPU", 0) == 2  # every actor and placement group released


def test_colocated_jobs_hand_the_gpu_over_both_ways():
    """Colocated: the servers release their memory for training phases, the trainer parks its state for the rest."""
    cfg = load_config(CONFIG, [])
    groups = {ACTOR_SERVERS: SimpleNamespace(urls=["http://10.0.0.1:30000"], router=None),
              REFERENCE_SERVERS: SimpleNamespace(urls=["http://10.0.0.1:30001"], router=SimpleNamespace(url="r"))}
    colocated = _pointed_at(cfg, groups, colocated=True).rollout
    assert (colocated.backend, colocated.sglang.urls, colocated.sglang.ref_urls) == (
        "sglang", "http://10.0.0.1:30000", "http://10.0.0.1:30001")
    assert (colocated.sglang.router_url, colocated.sglang.ref_router_url) == (None, "r")
    assert colocated.memory.release_servers and colocated.memory.offload_trainer
    disaggregated = _pointed_at(cfg, groups, colocated=False).rollout
    assert not disaggregated.memory.release_servers and not disaggregated.memory.offload_trainer


def test_actor_servers_return_routed_experts_under_r3():
    """train.routing_replay rollout: the actor's servers start with --enable-return-routed-experts (SGLang's flag,
    which `armor serve-local` shares); the reference's, and every server under the other modes, without it.
    Colocated, only the reference's keep a CPU copy of their weights (pushed once, they must survive releases)."""
    for replay, actor_flag in (("rollout", True), ("recompute", False), ("none", False)):
        cfg = load_config(CONFIG, [f"train.routing_replay={replay}"])
        for placement in ("disaggregated", "colocated"):
            job = RayJobConfig(server_kind="local", placement=placement)
            specs = {role.name: _server_spec(cfg, job, role, "/ckpt", seed_offset=0) for role in SERVER_ROLES}
            commands = {name: server_command(spec, host="h", port=1, seed=0) for name, spec in specs.items()}
            assert ("--enable-return-routed-experts" in commands["actor"]) == actor_flag, replay
            assert "--enable-return-routed-experts" not in commands["reference"], replay
            assert [specs[name].enable_weights_cpu_backup for name in ("actor", "reference")] == [
                False, placement == "colocated"]
