"""Rollout servers as Ray actors: health, restart of a killed server, clean shutdown."""

import os
import signal
import time
from pathlib import Path

import pytest

from megatron_armor.launch.server_process import ServerConfig, server_command
from megatron_armor.launch.servers import Placement, PlacementError, ServerGroup
from megatron_armor.rollout.router import RouterConfig, SGLangRouter
from megatron_armor.rollout.sglang_engine import http_call


def test_sglang_command_carries_the_launch_settings():
    spec = ServerConfig(model_path="/ckpt", tp_size=2, mem_fraction_static=0.8, seed=7, enable_memory_saver=True,
                      enable_weights_cpu_backup=True, extra_args=("--dtype", "bfloat16"))
    cmd = server_command(spec, host="10.0.0.1", port=30001, seed=spec.seed_for(3))
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    value = {flag: cmd[cmd.index(flag) + 1] for flag in ("--model-path", "--tp-size", "--port", "--random-seed",
                                                         "--mem-fraction-static")}
    assert value == {"--model-path": "/ckpt", "--tp-size": "2", "--port": "30001",
                     "--random-seed": "13", "--mem-fraction-static": "0.8"}  # seed 7 + 3 servers x 2 GPUs
    assert "--enable-memory-saver" in cmd and "--enable-weights-cpu-backup" in cmd and cmd[-2:] == ["--dtype", "bfloat16"]
    assert "--enable-weights-cpu-backup" not in server_command(ServerConfig(model_path="/ckpt"), host="h", port=1, seed=0)
    for kind in ("sglang", "local"):  # serve-local takes SGLang's flag for recording routed experts
        flags = [server_command(ServerConfig(model_path="/ckpt", kind=kind, return_routed_experts=routes), host="h",
                                port=1, seed=0) for routes in (True, False)]
        assert "--enable-return-routed-experts" in flags[0] and "--enable-return-routed-experts" not in flags[1], kind
    lora = server_command(ServerConfig(model_path="/ckpt", max_lora_rank=8), host="h", port=1, seed=0)
    assert lora[lora.index("--enable-lora"):][:5] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                                                      "all"]
    assert "--enable-lora" not in server_command(ServerConfig(model_path="/ckpt", max_lora_rank=8, kind="local"),
                                                 host="h", port=1, seed=0)


def test_local_stand_in_has_no_tensor_parallelism():
    with pytest.raises(ValueError, match="tp_size must be 1"):
        ServerConfig(model_path="/ckpt", kind="local", tp_size=2)


def _gone(pid: int, timeout: float = 30.0) -> bool:
    """True once `pid` has exited (a zombie not yet reaped by its parent counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_group_restarts_a_killed_server_which_rejoins_the_router_once_synced(ray_cluster, tiny_model_factory, tmp_path):
    spec = ServerConfig(model_path=str(tiny_model_factory("qwen2")), kind="local", startup_timeout_s=120,
                      poll_interval_s=0.2)
    router = SGLangRouter(spec=RouterConfig(worker_timeout_s=60), log_dir=str(tmp_path))
    group = ServerGroup(spec, 2, name="actor", host="127.0.0.1", placement=Placement(cpus_per_actor=0.25),
                        log_dir=str(tmp_path), router=router)
    with router, group:
        assert len(set(group.urls)) == 2
        worker_ids = router.workers()
        assert sorted(worker_ids) == sorted(group.urls)  # registered once healthy
        for url in group.urls:
            assert http_call(url, "/model_info", method="GET")["is_generation"]
        pids = group.pids()
        assert group.restart_dead() == []
        for url in group.urls:  # as a push's last request sets it
            http_call(url, "/update_weight_version", {"new_version": "3"})
        os.kill(pids[0], signal.SIGKILL)
        assert _gone(pids[0], timeout=10)
        # /proc shows the killed leader as a zombie while its other threads are still exiting; waitpid
        # (and so the group's liveness check) reports the death only once they have: poll until it does.
        deadline, restarted = time.monotonic() + 30, []
        while not restarted and time.monotonic() < deadline:
            restarted = group.restart_dead()
        assert restarted == [0]
        http_call(group.urls[0], "/health_generate", method="GET")  # same URL, healthy again
        new_pids = group.pids()
        assert new_pids[0] != pids[0] and new_pids[1] == pids[1]
        # deregistered; it holds the checkpoint's weights (version "default") until a push reaches it
        assert list(router.workers()) == [group.urls[1]] and group.restart_dead() == []
        assert list(router.workers()) == [group.urls[1]]
        http_call(group.urls[0], "/update_weight_version", {"new_version": "3"})
        assert group.restart_dead() == []
        new_ids = router.workers()  # registered again once synced: a new id
        assert new_ids[group.urls[0]] != worker_ids[group.urls[0]] and new_ids[group.urls[1]] == worker_ids[group.urls[1]]
    assert all(_gone(pid) for pid in new_pids)
    assert group.placement_group is None


def test_unplaceable_group_fails_naming_bundles_and_cluster(ray_cluster):
    from ray.util.placement_group import placement_group_table

    spec = ServerConfig(model_path="/never-started", kind="local")
    bundles = r"Ray could not place 2 x \{'CPU': 64\.0\} \(strategy PACK\) within 0\.5 s; the cluster has CPU 2, GPU 0 in all"
    with pytest.raises(PlacementError, match=rf"placement group 'actor-servers': {bundles}, CPU [\d.]+, GPU 0 free"):
        ServerGroup(spec, 2, name="actor", placement=Placement(cpus_per_actor=64.0, timeout_s=0.5))
    states = [group["state"] for group in placement_group_table().values()
              if group["name"] == "actor-servers" and group["bundles"][0].get("CPU") == 64.0]
    assert states == ["REMOVED"]  # not left pending
