"""`armor ray-train` options. Ray is imported only when the command runs, so `armor` starts fast.

Wiring (cli.py): the parser gets `armor train`'s options plus `add_ray_arguments`; after the config
is loaded, `run_ray_train(args, cfg)` is the exit code.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from megatron_armor.config import ArmorConfig, ConfigError

if TYPE_CHECKING:
    from megatron_armor.launch.ray_job import RayJobConfig

log = logging.getLogger(__name__)


def add_ray_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The Ray-only options of `armor ray-train` (the training options are `armor train`'s)."""
    group = parser.add_argument_group("ray job")
    group.add_argument("--ray-address", help="Ray cluster to join (default: $RAY_ADDRESS, else start a local one)")
    group.add_argument("--placement", choices=["disaggregated", "colocated"], default="disaggregated",
                       help="separate GPUs for trainer and servers, or shared GPUs with memory hand-off (GPU only)")
    group.add_argument("--num-servers", type=int, default=1, help="SGLang servers of the actor policy")
    group.add_argument("--num-ref-servers", type=int, default=1, help="SGLang servers of the reference policy (armor)")
    group.add_argument("--server-kind", choices=["sglang", "local"], default="sglang",
                       help="sglang.launch_server, or the CPU stand-in (armor serve-local)")
    group.add_argument("--server-tp", type=int, default=1, help="GPUs per SGLang server (--tp-size)")
    group.add_argument("--mem-fraction", type=float, help="SGLang --mem-fraction-static")
    group.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                       help="extra flag for every server, repeatable (e.g. --server-arg=--dtype=bfloat16)")
    group.add_argument("--cpus-per-actor", type=float, default=1.0, help="CPUs reserved per trainer rank / server")
    group.add_argument("--monitor-interval", type=float, default=30.0, help="seconds between dead-server checks")
    group.add_argument("--placement-timeout", type=float, default=300.0,
                       help="seconds Ray may take to place each placement group before the job fails")
    return parser


def job_from_args(args: argparse.Namespace) -> RayJobConfig:
    from megatron_armor.launch.ray_job import RayJobConfig

    return RayJobConfig(
        placement=args.placement, num_servers=args.num_servers, num_ref_servers=args.num_ref_servers,
        server_kind=args.server_kind, server_tp_size=args.server_tp, mem_fraction_static=args.mem_fraction,
        server_args=tuple(args.server_arg), cpus_per_actor=args.cpus_per_actor,
        monitor_interval_s=args.monitor_interval, placement_timeout_s=args.placement_timeout,
    )


def run_ray_train(args: argparse.Namespace, cfg: ArmorConfig) -> int:
    """`armor ray-train` after the config is loaded: join (or start) Ray, run the job, exit code."""
    import ray

    from megatron_armor.launch.ray_job import run_ray_job
    from megatron_armor.launch.servers import PlacementError
    from megatron_armor.launch.trainer_ranks import TrainerJobError
    from megatron_armor.rollout.router import RouterError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ray.init(address=args.ray_address)
    try:
        run_ray_job(cfg, job_from_args(args), resume=args.resume, overwrite=args.overwrite)
        return 0
    except (TrainerJobError, RouterError, PlacementError, ConfigError) as error:
        log.error("%s", error)
        return 1
    finally:
        ray.shutdown()
