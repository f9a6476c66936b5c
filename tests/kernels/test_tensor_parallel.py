"""TP=2 over gloo: two vocab shards with all-reduced statistics equal torch on the concatenated weight."""

import torch
from kernel_cases import tolerances
from launcher import run_workers


def test_two_vocab_shards_match_full_vocab_reference(tmp_path):
    results = run_workers("fused_kernels_tp.py", 2, tmp_path)
    for rank, result in enumerate(results):
        for dtype_name, errors in result.items():
            tol = tolerances(getattr(torch, dtype_name))
            where = f"rank {rank} {dtype_name}"
            assert errors["logprobs_max"] <= 0, where
            for name in ("logprobs", "entropy", "loss", "loss_stats"):
                assert errors[name] <= tol["forward"], f"{where} {name}: {errors[name]:.3g}"
            for name in ("logprobs_grad_hidden", "logprobs_grad_weight", "loss_grad_hidden", "loss_grad_weight"):
                assert errors[name] <= tol["grad"], f"{where} {name}: {errors[name]:.3g}"
    replicated = ("logprobs", "entropy", "loss", "logprobs_grad_hidden", "loss_grad_hidden")  # all-reduced: equal
    assert all(results[0][d][k] == results[1][d][k] for d in results[0] for k in replicated)
