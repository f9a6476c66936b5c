"""`armor serve-local` wiring in the real `armor` parser."""

import pytest

from megatron_armor.cli import build_parser, run_serve_local


def test_serve_local_subcommand_parses_into_run_arguments():
    args = build_parser().parse_args(["serve-local", "--model", "/ckpt", "--port", "31000"])
    assert (args.command, args.model, args.host, args.port, args.random_seed, args.device) == (
        "serve-local", "/ckpt", "127.0.0.1", 31000, 0, "cpu")
    assert args.handler is run_serve_local


def test_serve_local_refuses_a_device_it_cannot_use_before_binding():
    args = build_parser().parse_args(["serve-local", "--model", "/ckpt", "--port", "0", "--device", "cuda:7"])
    with pytest.raises(ValueError, match=r"device 'cuda:7' is not a visible GPU \(\d+ visible\)"):
        run_serve_local(args)
    args.device = "xpu"
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        run_serve_local(args)
