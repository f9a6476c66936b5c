"""`armor serve-local` wiring in the real `armor` parser."""

from megatron_armor.cli import build_parser
from megatron_armor.rollout.serve_cli import run_serve_local


def test_serve_local_subcommand_parses_into_run_arguments():
    args = build_parser().parse_args(["serve-local", "--model", "/ckpt", "--port", "31000"])
    assert (args.command, args.model, args.host, args.port, args.random_seed) == ("serve-local", "/ckpt", "127.0.0.1", 31000, 0)
    assert args.handler is run_serve_local
