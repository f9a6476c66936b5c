"""`armor train` (TP=2) with rollouts from three SGLang-schema servers: two for the actor (each gets the
weights from its own trainer rank, as colocated servers do) and one for the reference policy, handing
their memory to the trainer for its phases, and the trainer parking its own for rollouts, as in colocated
placement (`armor ray-train --placement colocated` sets both); and a LoRA run in process whose actor and anchors
come from one server, with the adapter (pushed by path) and without."""

import json
from pathlib import Path

from launcher import armor
from state_trees import saved_modules
from training_runs import LORA, adapter_push_bytes, run_metrics, run_overrides

from megatron_armor.config import load_config
from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig, http_call
from megatron_armor.trainer.run.train import run_training

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


def test_armor_step_with_remote_engines(start_server, tiny_model_factory, synthetic_cache, tmp_path):
    # The servers load an untrained checkpoint of the same shape: the trainer must push the actor's
    # and the reference's (warm-started) weights before the first rollout.
    # The reference's weights are pushed once: its server keeps them across releases; the actor's, pushed
    # after every update, need no backup (serve-local refuses to generate from weights a release lost).
    # Rank r pushes to actor server r (rollout.push_assignment): both must hold the actor's weights.
    actors = [start_server(tiny_model_factory("qwen2")) for _ in range(2)]
    actor = actors[0]
    ref = start_server(tiny_model_factory("qwen2"), "--enable-weights-cpu-backup")
    SGLangEngine([*(a.url for a in actors), ref.url], SGLangEngineConfig(startup_timeout_s=120, poll_interval_s=0.2))
    run_dir = tmp_path / "run"
    proc = armor("train", "--config", CONFIG, "--max-steps", "2", "--checkpoint.every", "1",
                 "--run-dir", str(run_dir), "--task.cache_dir", str(synthetic_cache), "--task.num_train_rows", "400",
                 "--task.num_val_rows", "16", "--eval.max_prompts", "8", "--logging.tensorboard", "false",
                 "--logging.progress_bar", "false", "--rollout.backend", "sglang",
                 "--rollout.sglang.urls", ",".join(a.url for a in actors), "--rollout.sglang.ref_urls", ref.url,
                 "--rollout.memory.release_servers", "true", "--rollout.memory.offload_trainer", "true",
                 nproc=2, log_dir=tmp_path / "logs")  # the recipe's TP=2
    assert proc.returncode == 0, proc.output[-6000:] + actor.output()[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = rows[1]
    assert step["mismatch/logprob_abs_diff"] < 1e-3  # the server sampled with the trainer's actor weights
    assert step["armor/anchors_used"] == step["filter/prompts_kept"] == 8  # correct anchors: reference pushed
    assert step["rollout/requests"] > 0 and step["rollout/retries"] == 0
    # Validation also ran on the pushed (warm-started) weights: an untrained model scores about 0.
    assert rows[0]["val/accuracy"] > 0.05
    # The servers refuse to generate or load weights while released: the run succeeding shows the trainer
    # released them only for its own phases (building the models, each step's update, each checkpoint,
    # which reads the parked optimizer state); each took its memory back. After an update or a checkpoint
    # the actor's servers got their weights' memory back first, the push (the release lost the old ones:
    # serve-local refuses to generate from them), then their KV cache (a staged resume).
    assert step["perf/memory_handoff_seconds"] > 0 and step["memory/trainer_parked_gib"] > 0
    for server in (*actors, ref):
        info = http_call(server.url, "/server_info", method="GET", timeout=10)
        assert info["memory_releases"] == 5 and info["released_memory_tags"] == []  # build, 2 x (update, checkpoint)
    loads = [http_call(s.url, "/server_info", method="GET")["weight_loads_without_kv_cache"] for s in (*actors, ref)]
    assert loads[0] > 0 and loads[1] > 0 and loads[2] == 0  # every bucket of the update's push; the reference: at start
    versions = {http_call(a.url, "/model_info", method="GET")["weight_version"] for a in actors}
    assert len(versions) == 1  # both actor servers got every push


def test_armor_lora_run_samples_the_actor_and_its_anchors_from_one_server(serving, tiny_model_factory, synthetic_cache,
                                                                        tmp_path, monkeypatch):
    """ARMOR with LoRA (model.lora.weight_sync adapter) in process against one serve-local server (its HTTP server on
    loopback, in a thread of this process) and no reference server: the server loaded an untrained checkpoint, so the
    trainer pushes the base once (the reference's weights), then the adapter alone at start and after every update, by path
    (model.lora.push_dir: a PEFT directory per push, loaded with /load_lora_adapter; the tensor push is
    tests/rollout/test_lora_engine.py's); the actor samples with it (`lora_path`), ARMOR's anchors come from the same
    server without it."""
    calls: list[str | None] = []  # the adapter of every sampling call of the server's engine (not health checks)
    loaded: list[str] = []  # the directory of every adapter load by path
    adapter_loads: list[str] = []  # the name of every adapter load, by path or from tensors
    with serving(tiny_model_factory("qwen2")) as server:
        engine = server.state.engine
        generate, load, load_from_path = engine.generate, engine.load_lora_adapter, engine.load_lora_adapter_from_path

        def recording(prompts, sampling, **options):
            if sampling.max_new_tokens > 1:
                calls.append(options.get("lora"))
            return generate(prompts, sampling, **options)

        def loading(name, config, named_tensors):
            adapter_loads.append(name)
            return load(name, config, named_tensors)

        def loading_from_path(name, path):
            loaded.append(path)
            return load_from_path(name, path)

        monkeypatch.setattr(engine, "generate", recording)
        monkeypatch.setattr(engine, "load_lora_adapter", loading)
        monkeypatch.setattr(engine, "load_lora_adapter_from_path", loading_from_path)
        url = f"http://127.0.0.1:{server.state.port}"
        run_dir, push_dir = tmp_path / "run", tmp_path / "adapters"
        overrides = [*run_overrides(synthetic_cache, run_dir, 2), *LORA, "rollout.backend=sglang",
                     f"rollout.sglang.urls={url}", f"model.lora.push_dir={push_dir}"]
        assert run_training(load_config(CONFIG, overrides)) == 0
        assert http_call(url, "/model_info", method="GET")["weight_version"] == "1"  # one full push: the base
        assert list(engine.adapters.loaded) == ["actor"]
    versions = [f"actor-rank0-v{v:06d}" for v in (1, 2, 3)]  # pushed at start and after each of the two updates
    assert loaded == [str(push_dir / name) for name in versions]
    assert adapter_loads == ["actor"] * 3  # every adapter the server loaded came by path
    assert sorted(p.name for p in push_dir.iterdir()) == versions[-2:]  # the older ones pruned
    assert all(sorted(p.name for p in (push_dir / v).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
               for v in versions[-2:])
    rows = run_metrics(run_dir)
    adapters = adapter_push_bytes(saved_modules(run_dir / "checkpoints" / "step_000002")["actor"])
    for step in (1, 2):
        assert rows[step]["perf/weight_sync_bytes"] == adapters
        assert rows[step]["mismatch/logprob_abs_diff"] < 1e-4  # the server sampled with the trainer's adapter
        assert rows[step]["armor/anchors_used"] > 0
    assert rows[1]["mix_kl/kl_on_ref"] == 0  # B = 0 at first: the anchors' base is the actor
    assert {None, "actor"} <= set(calls)  # the anchors without the adapter, the actor's samples with it
