"""The `armor` command line.

    armor train --config FILE [--section.field VALUE ...]   RL training (ARMOR / GRPO / GRPO + KL / MIPU / OPD)
    armor ray-train --config FILE [--num-servers N ...]     the same as a Ray job (trainer ranks + SGLang servers)
    armor serve-local --model DIR --port N                   the CPU engine behind SGLang's HTTP API
    armor serve-teacher --model DIR --tp N --pp M --port P   a Megatron OPD teacher scoring tokens over HTTP
    armor diagnose --base DIR --checkpoints DIR ...          parameter-space diagnostics of updates
    armor convert hf-to-megatron|megatron-to-hf ...          checkpoint conversion (HF <-> Megatron dist ckpt)
    armor eval --checkpoints CKPT... --datasets FILE --out DIR   avg@k / pass@k / maj@k of checkpoints on benchmarks
    armor plan --config FILE --gpus N --gpu-memory-gb M      per-GPU memory and RL-step FLOPs of a layout
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from megatron_armor.config import MOVED_FIELDS, ConfigError, config_fields, load_config
from megatron_armor.config.loading import configured_algorithm
from megatron_armor.config.section_registry import register_plugin_sections
from megatron_armor.config.base import default_of
from megatron_armor.convert.cli import add_convert_subcommand
from megatron_armor.diagnostics.cli import add_diagnose_subcommand
from megatron_armor.evaluation.cli import add_eval_subcommand
from megatron_armor.distributed.launch import torchrun_command
from megatron_armor.launch.ray_cli import add_ray_arguments, run_ray_train
from megatron_armor.planning.cli import add_plan_subcommand, run_plan
from megatron_armor.rewards.registry import RewardError
from megatron_armor.rollout.serve_cli import add_serve_local_subcommand
from megatron_armor.teacher.serve_cli import add_serve_teacher_subcommand, run_serve_teacher
from megatron_armor.utils.net import free_port
from megatron_armor.utils.quiet import quiet_third_party_noise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="armor", description="ARMOR / GRPO RL post-training on Megatron-Core.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_train_arguments(commands.add_parser(
        "train", help="run RL training", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run RL training. Every config field can be set as --section.field VALUE (overrides the YAML).",
    ))
    add_ray_arguments(add_train_arguments(commands.add_parser(
        "ray-train", help="run RL training as a Ray job (trainer ranks and rollout servers as actors)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run RL training on a Ray cluster: trainer ranks and SGLang servers (actor and, for ARMOR, "
                    "reference) are placed as Ray actors; the training options are those of `armor train`.",
    )))
    add_serve_local_subcommand(commands).set_defaults(handler=run_serve_local)
    add_serve_teacher_subcommand(commands).set_defaults(handler=run_serve_teacher)
    add_diagnose_subcommand(commands)
    add_convert_subcommand(commands)
    add_eval_subcommand(commands).set_defaults(handler=run_eval)
    add_plan_subcommand(commands, add_config_arguments)
    return parser


def run_serve_local(args: argparse.Namespace) -> int:
    """`armor serve-local`: the server (torch and the engine) is imported only when the command runs."""
    from megatron_armor.rollout.http_server import run_serve_local as serve

    return serve(args)


def run_eval(args: argparse.Namespace) -> int:
    """`armor eval`: on --nproc > 1 local ranks relaunched under torchrun; the run (torch, the engines) is imported
    only when the command runs. A bad dataset list, row or checkpoint is exit code 2, before any generation."""
    if "WORLD_SIZE" not in os.environ and args.nproc > 1:
        import subprocess

        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        return subprocess.call(torchrun_argv(sys.argv[1:], args.nproc, free_port()), env=env)
    quiet_third_party_noise()
    from megatron_armor.trainer.run.evaluate import EvalRun, run_eval as evaluate

    try:
        evaluate(EvalRun(args.checkpoints, args.datasets, args.out, seed=args.seed, progress_bar=args.progress_bar,
                         sglang_urls=args.sglang_urls))
    except ValueError as error:  # settings, dataset rows, checkpoint names and models (all ValueError subclasses)
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def add_train_arguments(train: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `armor train` (and `armor ray-train`): config file, shorthands, every config field."""
    add_config_arguments(train, run_options=True)
    return train


def add_config_arguments(train: argparse.ArgumentParser, run_options: bool = False) -> argparse.ArgumentParser:
    """The options that make a config (`overrides_from_args`): config file, shorthands, every config field;
    with `run_options` also those of a run (--resume, --overwrite, --nproc)."""
    train.add_argument("--config", help="YAML config file (sections as in ArmorConfig)")
    train.add_argument("--algo", help="shorthand for --algorithm.name: armor | grpo | grpo_kl | mipu | opd, or a plug-in "
                       "Algorithm class as package.module:ClassName")
    train.add_argument("--max-steps", type=int, help="shorthand for --train.max_steps")
    train.add_argument("--run-dir", help="shorthand for --logging.run_dir")
    if run_options:
        train.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
        train.add_argument("--overwrite", action="store_true",
                           help="delete existing checkpoints in the run directory first")
    train.add_argument("--tp", type=int, help="shorthand for --parallel.tensor_parallel_size")
    train.add_argument("--pp", type=int, help="shorthand for --parallel.pipeline_parallel_size")
    train.add_argument("--dp", type=int, help="shorthand for --parallel.data_parallel_size")
    if run_options:
        train.add_argument(
            "--nproc", type=int,
            help="launch this many local processes with torchrun (default outside torchrun: tp x pp x dp)",
        )
    fields = train.add_argument_group("config fields")
    for dotted, f in config_fields():
        fields.add_argument(f"--{dotted}", dest=f"cfg:{dotted}", metavar="VALUE", default=argparse.SUPPRESS,
                            help=f"{f.metadata.get('help', '')} (default: {default_of(f)!r})")
    for old in MOVED_FIELDS:  # hidden; load_config turns each into "<old> moved to <new>" (exit code 2)
        fields.add_argument(f"--{old}", dest=f"cfg:{old}", metavar="VALUE", default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    return train


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    """`section.field=value` strings for the options the user actually passed."""
    overrides = [f"{key[4:]}={value}" for key, value in vars(args).items() if key.startswith("cfg:")]
    if args.algo is not None:
        overrides.append(f"algorithm.name={args.algo}")
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    if args.run_dir is not None:
        overrides.append(f"logging.run_dir={args.run_dir}")
    for flag, dotted in (("tp", "tensor_parallel_size"), ("pp", "pipeline_parallel_size"), ("dp", "data_parallel_size")):
        if getattr(args, flag) is not None:
            overrides.append(f"parallel.{dotted}={getattr(args, flag)}")
    return overrides


def torchrun_argv(argv: Sequence[str], nproc: int, port: int) -> list[str]:
    """The command that re-runs `armor <argv>` (minus --nproc) on `nproc` local ranks."""
    rest, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        rest.append(arg)
    return torchrun_command(nproc, ["megatron_armor.cli", *rest], master_port=port)


def _register_plugin_sections(argv: Sequence[str] | None) -> None:
    """A plug-in algorithm given by path (--algo / --algorithm.name package.module:ClassName, or the --config file's
    algorithm.name) brings its config sections (`Algorithm.config_sections`) before the parser is built: their
    flags parse and --help lists them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--algo")
    pre.add_argument("--algorithm.name", dest="algorithm_name")
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    name = known.algo or known.algorithm_name  # --algo wins, as in `overrides_from_args`
    try:
        name = configured_algorithm(known.config, [f"algorithm.name={name}"] if name else [])
    except ConfigError:
        return  # a missing or malformed file: load_config reports it, in its command's context
    register_plugin_sections(name)


def _enable_triton_interpreter_without_gpu() -> None:
    """The fused LM head runs on CPU only in Triton's interpreter, which must be chosen before
    triton is imported (Megatron imports it); torchrun children inherit the setting."""
    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        print("note: no GPU; the fused LM head runs in Triton's CPU interpreter (slow; for testing)", file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "1"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _register_plugin_sections(argv)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    if args.command not in ("train", "ray-train", "plan"):
        return args.handler(args)
    quiet_third_party_noise()
    try:
        cfg = load_config(args.config, overrides_from_args(args))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.command == "plan":
        return run_plan(args, cfg)
    if cfg.train.logprob_head == "fused":
        _enable_triton_interpreter_without_gpu()
    from megatron_armor.algorithms import check_algorithm_config  # imports torch: not for --help
    from megatron_armor.evaluation.settings import EvalSettingsError, validation_datasets
    from megatron_armor.rewards.reward_fns import RewardFns

    try:
        check_algorithm_config(cfg)  # its own rules, before any process starts
        RewardFns.load(cfg.reward)  # every reward function loads (module or file, function)
        if cfg.eval.datasets is not None:
            validation_datasets(cfg.eval.datasets, cfg.eval.primary)  # the list, its files and functions
    except (ConfigError, RewardError, EvalSettingsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.command == "ray-train":
        return run_ray_train(args, cfg)
    if "WORLD_SIZE" not in os.environ:
        nproc = args.nproc or cfg.parallel.world_size
        if nproc != cfg.parallel.world_size:
            print(f"error: --nproc {nproc} does not match the layout tp x pp x cp x dp = {cfg.parallel.world_size}",
                  file=sys.stderr)
            return 2
        if nproc > 1:
            import subprocess

            # An explicit thread count also keeps torchrun from printing its OMP_NUM_THREADS banner.
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            return subprocess.call(torchrun_argv(argv, nproc, free_port()), env=env)
    from megatron_armor.trainer.run.train import run_training

    return run_training(cfg, resume=args.resume, overwrite=args.overwrite)


if __name__ == "__main__":
    sys.exit(main())
