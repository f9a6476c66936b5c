"""`ServerGroup`: N rollout servers as Ray actors in a placement group; health, restarts, shutdown.

Each server gets one bundle of `tp_size` GPUs (CPU only when the spec is the CPU stand-in), its own
port on its node and its own seed. `restart_dead()` brings back any server whose process died;
`shutdown()` stops every subprocess, then the actors and the placement group. Use as a context
manager so an exception on the driver still shuts everything down. With a `router` (SGLang's, see
rollout/router.py) the servers are registered with it once healthy, and a dead server is deregistered before
its restart and registered again once it holds the weights the others serve (the trainer's next push reaches it:
until then it would answer with the checkpoint's weights).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatron_armor.launch.server_process import RolloutServer, ServerConfig
from megatron_armor.rollout.router import SGLangRouter
from megatron_armor.rollout.sglang_engine import server_weight_version

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """Ray could not place a placement group in time (the cluster lacks the resources)."""


def reserve_bundles(bundle: dict[str, float], count: int, *, name: str, timeout_s: float) -> PlacementGroup:
    """A PACK placement group of `count` x `bundle`, once Ray has placed it. PlacementError (the group
    removed) if it is not placed within `timeout_s`, naming the bundles and the cluster's resources."""
    group = placement_group([bundle] * count, strategy="PACK", name=name)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        keys = sorted({"CPU", "GPU", *bundle})

        def amounts(resources: dict[str, float]) -> str:
            return ", ".join(f"{key} {resources.get(key, 0):g}" for key in keys)

        raise PlacementError(
            f"placement group {name!r}: Ray could not place {count} x {bundle} (strategy PACK) within {timeout_s:g} s; "
            f"the cluster has {amounts(ray.cluster_resources())} in all, {amounts(ray.available_resources())} free. "
            "Ask for fewer or smaller bundles (servers, tp size, cpus per actor) or add nodes"
        ) from None
    return group


@dataclass(frozen=True)
class Placement:
    """Where a group's actors go: their own placement group (None: make one) or given bundles of another.

    cpus_per_actor may be fractional (a CPU-only test cluster hosts several actors per core).
    gpu_fraction: the GPU share an actor claims in a shared (colocated) bundle; 1.0 = whole bundle.
    timeout_s: how long Ray may take to place a group's own placement group.
    """

    placement_group: PlacementGroup | None = None
    bundle_indices: tuple[int, ...] | None = None
    cpus_per_actor: float = 1.0
    gpu_fraction: float = 1.0
    timeout_s: float = 300.0


class ServerGroup:
    """`num_servers` servers of `spec`, started in parallel and healthy when the constructor returns
    (with `wait=False`: once `wait_ready()` returns, so that several groups can start at once).

    host None binds each server to its node's IP (reachable from other nodes); "127.0.0.1" keeps a
    single-node job on loopback.
    """

    def __init__(
        self, spec: ServerConfig, num_servers: int, *, name: str = "rollout", host: str | None = None,
        placement: Placement = Placement(), log_dir: str | None = None, router: SGLangRouter | None = None,
        wait: bool = True,
    ) -> None:
        if num_servers < 1:
            raise ValueError(f"ServerGroup {name!r} needs num_servers >= 1, got {num_servers}")
        self.spec, self.name, self.router = spec, name, router
        gpus = 0 if spec.kind == "local" else spec.tp_size
        self._own_pg = placement.placement_group is None
        if self._own_pg:
            bundle = {"CPU": placement.cpus_per_actor, **({"GPU": gpus} if gpus else {})}
            self.placement_group = reserve_bundles(bundle, num_servers, name=f"{name}-servers",
                                                   timeout_s=placement.timeout_s)
            bundles = tuple(range(num_servers))
        else:
            self.placement_group = placement.placement_group
            bundles = placement.bundle_indices or tuple(range(num_servers))
            if len(bundles) != num_servers:
                raise ValueError(f"ServerGroup {name!r}: {num_servers} servers but {len(bundles)} bundle indices")
        actor_cls = ray.remote(_ServerActor)
        self._actors = [
            actor_cls.options(
                num_cpus=placement.cpus_per_actor, num_gpus=gpus * placement.gpu_fraction,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=b),
            ).remote(spec, i, host, log_dir)
            for i, b in enumerate(bundles)
        ]
        self.urls: list[str] = []  # known once the servers are healthy
        self._unsynced: set[int] = set()  # restarted, not registered with the router until they hold current weights
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until every server is healthy, then register them with the router (the group is shut
        down if one fails)."""
        try:
            self.urls = self._gather("wait_healthy")
            if self.router is not None:
                self.router.add_workers(self.urls)
        except Exception:
            self.shutdown()
            raise
        log.info("%s servers ready: %s", self.name, ", ".join(self.urls))

    def pids(self) -> list[int]:
        """Process id of each server (on its node), in server order."""
        return self._gather("pid")

    def restart_dead(self) -> list[int]:
        """Restart every server whose process died; returns their indices (once they are healthy again). With a
        router, a restarted server rejoins it on the first call that finds it synced (`_register_synced`; the job
        calls this every poll)."""
        if self.router is not None:
            self._register_synced()
            for i, alive in enumerate(self._gather("alive")):
                if not alive:
                    self.router.remove_worker(self.urls[i])  # no requests for it while it restarts
        restarted = [i for i, done in enumerate(self._gather("ensure_alive")) if done]
        for i in restarted:
            log.warning("%s server %d (%s) had died and was restarted%s", self.name, i, self.urls[i],
                        "; it rejoins the router once it holds the weights the others serve" if self.router else "")
        if self.router is not None and restarted:
            for i in restarted:  # one that died after the liveness check above is still registered
                self.router.remove_worker(self.urls[i])
            self._unsynced.update(restarted)
            self._register_synced()
        return restarted

    def _register_synced(self) -> None:
        """Register with the router each restarted server whose weight_version is the one every registered server
        reports (the trainer pushed to it too). With no registered server up it is registered at once, checkpoint
        weights and all (nothing else could serve the rollout that the next push waits for); before any push, every
        server reports the checkpoint's version, so a restarted one matches at once too."""
        if not self._unsynced:
            return
        # "None" from servers that report no version: then every one of the group does, and all count as synced
        versions = [server_weight_version(url, timeout=10.0) for url in self.urls]
        serving = {version for i, version in enumerate(versions) if i not in self._unsynced and version is not None}
        synced = [i for i in sorted(self._unsynced) if versions[i] is not None and serving <= {versions[i]}]
        if synced:
            self.router.add_workers([self.urls[i] for i in synced])
            self._unsynced -= set(synced)
            for i in synced:
                log.info("%s server %d (%s) rejoined the router (weight_version %s)", self.name, i, self.urls[i],
                         versions[i])

    def shutdown(self) -> None:
        """Stop every server process, kill the actors and free the placement group (idempotent)."""
        actors, self._actors = self._actors, []
        if actors:
            ray.get([a.stop.remote() for a in actors])
            for actor in actors:
                ray.kill(actor)
        if self._own_pg and self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _gather(self, method: str) -> list:
        """Call `method` on every actor in parallel; a failure names the group and the server."""
        refs = [getattr(a, method).remote() for a in self._actors]
        results = []
        for i, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayError as error:
                raise RuntimeError(f"{self.name} server {i}: {method} failed: {error}") from error
        return results


class _ServerActor:
    """The Ray actor around one `RolloutServer`; it lives on the node and GPUs Ray gave it."""

    def __init__(self, spec: ServerConfig, index: int, host: str | None, log_dir: str | None) -> None:
        self.server = RolloutServer(spec, index, host=host or ray.util.get_node_ip_address(), log_dir=log_dir)

    def wait_healthy(self) -> str:
        return self.server.wait_healthy()

    def pid(self) -> int:
        return self.server.pid()

    def alive(self) -> bool:
        return self.server.alive()

    def ensure_alive(self) -> bool:
        return self.server.ensure_alive()

    def stop(self) -> None:
        self.server.stop()
