"""`armor train` (TP=2): one SGLang-schema server for actor and reference (rollout.anchors.engine shared), cached
anchors, weights pushed per tensor (the replicated ones from the trainer's own storage in shared memory, the gathered
ones staged)."""

import json
from pathlib import Path

from launcher import armor

from megatron_armor.data.datasets import write_jsonl
from megatron_armor.rewards.arithmetic import make_rows
from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


def test_one_server_serves_actor_and_reference_with_cached_anchors(
    start_server, tiny_model_factory, synthetic_cache, tmp_path
):
    # The server loads an untrained checkpoint: anchors are correct only if the reference's (warm-started)
    # weights were pushed, and on-policy logprobs match the trainer's only if the actor's were pushed back.
    server = start_server(tiny_model_factory("qwen2"))
    SGLangEngine([server.url], SGLangEngineConfig(startup_timeout_s=120, poll_interval_s=0.2))
    # 16 training prompts = one generation batch (reshuffled each time); the cache holds 8 of them, so every
    # later batch serves 8 prompts from it and samples the anchors of the other 8. A step trains 20 prompts, more
    # than one batch holds, so every step generates two batches at least, whatever the samples are.
    train = tmp_path / "train.jsonl"
    write_jsonl(make_rows(400, seed=1234)[:16], train)
    run_dir = tmp_path / "run"
    proc = armor("train", "--config", CONFIG, "--max-steps", "2",
                 "--run-dir", str(run_dir), "--task.cache_dir", str(synthetic_cache), "--task.num_train_rows", "400",
                 "--task.num_val_rows", "16", "--data.train_path", str(train), "--eval.every", "0",
                 "--eval.before_train", "false", "--checkpoint.every", "2", "--checkpoint.save_model", "false",
                 "--logging.tensorboard", "false", "--logging.progress_bar", "false", "--logging.plot", "false",
                 "--train.train_batch_size", "20", "--train.mini_batch_size", "10",
                 # the actor moves away from the reference at once, far enough for the check below to have a margin
                 "--optimizer.lr", "2e-3", "--optimizer.warmup_steps", "0",
                 "--rollout.anchors.ref_n", "2", "--rollout.backend", "sglang", "--rollout.sglang.urls", server.url,
                 "--rollout.anchors.engine", "shared", "--rollout.anchors.cache", "true",
                 "--rollout.anchors.cache_max_prompts", "8", "--rollout.weight_sync.payload", "per_tensor",
                 nproc=2, log_dir=tmp_path / "logs")  # the recipe's TP=2
    assert proc.returncode == 0, proc.output[-6000:] + server.output()[-2000:]
    assert "[rank 0] INFO megatron_armor: weights in shared memory for per-tensor pushes" in proc.output
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, second = rows
    assert first["armor/anchor_cache_hits"] == 8 * (first["train/num_gen_batches"] - 1)
    assert second["armor/anchor_cache_hits"] == 8 * second["train/num_gen_batches"]
    for row in rows:
        # Each generation batch swaps the weights once: actor samples, reference pushed, anchors; next batch:
        # anchors first, actor pushed back, actor samples.
        assert row["rollout/weight_swaps"] == row["train/num_gen_batches"] >= 2
        assert row["mismatch/logprob_abs_diff"] < 1e-3  # every on-policy sample came from the actor's weights
        assert row["armor/anchors_used"] == row["filter/prompts_kept"] == 20  # correct anchors: reference pushed
    # The actor left the reference, so a missed swap would show above: the mean of log pi_old - log pi_ref over the
    # actor's samples estimates KL(pi_old || pi_ref) >= 0.
    assert second["mix_kl/kl_on_old"] > 1e-3
    state = json.loads((run_dir / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert len(state["extra"]["anchor_cache"]["prompts"]) == 8
