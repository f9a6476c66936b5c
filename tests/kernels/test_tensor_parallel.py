"""TP=2 over gloo: two vocab shards with all-reduced statistics equal torch on the concatenated weight,
also when the weight carries vocabulary padding in the last shard or across both shards."""

import torch
from kernel_cases import tolerances
from launcher import run_workers

LAYOUTS = ("unpadded", "padded-last-shard", "padded-both-shards")  # tests/workers/fused_kernels_tp.py


def test_two_vocab_shards_match_full_vocab_reference(tmp_path):
    results = run_workers("fused_kernels_tp.py", 2, tmp_path)
    for rank, result in enumerate(results):
        assert sorted(result) == sorted(f"{layout}/{dtype}" for layout in LAYOUTS for dtype in ("float32", "bfloat16"))
        for case, errors in result.items():
            tol = tolerances(getattr(torch, case.split("/")[1]))
            where = f"rank {rank} {case}"
            assert errors["logprobs_max"] <= 0, where
            for name in ("logprobs", "entropy", "loss", "loss_stats"):
                assert errors[name] <= tol["forward"], f"{where} {name}: {errors[name]:.3g}"
            for name in ("logprobs_grad_hidden", "logprobs_grad_weight", "loss_grad_hidden", "loss_grad_weight"):
                assert errors[name] <= tol["grad"], f"{where} {name}: {errors[name]:.3g}"
            assert errors["logprobs_grad_padding"] == errors["loss_grad_padding"] == 0, where
    replicated = ("logprobs", "entropy", "loss", "logprobs_grad_hidden", "loss_grad_hidden")  # all-reduced: equal
    assert all(results[0][c][k] == results[1][c][k] for c in results[0] for k in replicated)
