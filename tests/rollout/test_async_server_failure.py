"""A rollout server SIGKILLed while `armor train --rollout.mode async` (TP=2, 2 ranks) generates from it.

The servers are real `http_server` processes. At learning rate 0 the weights never change and every sample's seed
derives from its prompt's sampler position (async) and index, not from the server that answers it, so a run whose
server dies mid-generation must train exactly the batches of an uninterrupted run: the same prompts (the sampler
position every checkpoint saves: gen_batch_size x the generation batches trained so far) and the same samples (a
request lost with the server is answered again by another, and nothing is dropped or repeated). The trainer must not
deadlock: the run finishes in time. So it must with multi-turn rollouts: no trajectory is lost with the server.
"""

import json
import threading
import time
from pathlib import Path

import pytest
from launcher import Launch, armor

from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig, TRANSPORT_ERRORS, http_call

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")
STEPS = 3  # a generation batch after the kill sends the dead server a request even if none was in flight
GEN_BATCH = 8  # prompts per generation batch (no filtering: one batch fills a step, but for a prompt with no
TRAIN_BATCH = 8  # correct anchor), and per step (examples/tiny/armor.yaml's train_batch_size)
BATCH = ("train/reward_mean", "train/accuracy", "response/length_mean", "filter/prompts_kept", "armor/anchors_used",
         "armor/anchor_accuracy", "filter/prompts_generated", "train/num_gen_batches")
LOSSES = ("loss/policy_loss", "policy/entropy", "mismatch/logprob_abs_diff")  # of the same samples at lr 0


AGENTIC_TASK = Path(__file__).parents[1] / "trainer" / "agentic_task"
AGENTIC = {  # turns -> the run's overrides
    "single": (),
    "multi": ("--rollout.agentic.environment", f"{AGENTIC_TASK / 'two_turns.py'}:TwoTurnArithmetic",
              "--rollout.agentic.chat_template", str(AGENTIC_TASK / "char_chat.jinja"),
              "--rollout.agentic.max_turns", "2"),
}


def _train(run_dir: Path, actors, refs, cache: Path, log_dir: Path, *extra: str) -> Launch:
    """`armor train` in async mode at lr 0 against the servers (the client's own dispatcher: its retries are counted
    in rollout/*retries; SGLang's router would retry a dead worker's requests itself)."""
    return armor("train", "--config", CONFIG, "--max-steps", str(STEPS), "--run-dir", str(run_dir),
                 "--task.cache_dir", str(cache), "--task.num_train_rows", "400", "--task.num_val_rows", "16",
                 "--eval.every", "0", "--eval.before_train", "false", "--checkpoint.every", "1",
                 "--checkpoint.keep_last", "0", "--checkpoint.save_model", "false", "--logging.tensorboard", "false",
                 "--logging.plot", "false", "--logging.progress_bar", "false", "--optimizer.lr", "0",
                 "--train.gen_batch_size", str(GEN_BATCH), "--algorithm.filter_groups", "false",
                 "--rollout.backend", "sglang", "--rollout.mode", "async", "--rollout.max_staleness", str(STEPS),
                 "--rollout.sglang.router", "none", "--rollout.sglang.urls", ",".join(s.url for s in actors),
                 "--rollout.sglang.ref_urls", ",".join(s.url for s in refs), *extra,
                 nproc=2, log_dir=log_dir, timeout=240)  # the recipe's TP=2; a deadlock fails the launch


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _samplers(run_dir: Path) -> list[dict]:
    """The sampler position each checkpoint saved (steps 1..STEPS)."""
    return [json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())["sampler"]
            for step in range(1, STEPS + 1)]


def _serve(start_server, tiny_model_factory):
    """A new server (an untrained checkpoint: every run pushes its weights first), once it is healthy."""
    server = start_server(tiny_model_factory("qwen2"))
    SGLangEngine([server.url], SGLangEngineConfig(startup_timeout_s=120, poll_interval_s=0.2))
    return server


@pytest.fixture(scope="module")
def servers(start_server, tiny_model_factory):
    """An actor server and a reference server that no test kills (the module's runs take turns on them)."""
    return _serve(start_server, tiny_model_factory), _serve(start_server, tiny_model_factory)


class KillWhenGenerating(threading.Thread):
    """SIGKILLs `server` during its `period`-th period of generating (a /generate request running), so a request
    of the asynchronous generator is lost with it; `killed_at` is then set."""

    IDLE_S = 0.05  # a period ends after this long without a running request (requests queued back to back are one)

    def __init__(self, server, period: int) -> None:
        super().__init__(daemon=True)
        self.server, self.period, self.killed_at = server, period, None
        self.stop = threading.Event()

    def run(self) -> None:
        periods, last_busy = 0, -float("inf")
        while not self.stop.is_set() and self.server.proc.poll() is None:
            try:
                loads = http_call(self.server.url, "/v1/loads", method="GET", timeout=5)["loads"]
            except TRANSPORT_ERRORS:
                continue
            now, running = time.monotonic(), loads[0]["num_running_reqs"]
            if running:
                periods += now - last_busy > self.IDLE_S
                last_busy = now
            if running and periods == self.period:
                self.server.proc.kill()
                self.server.proc.wait()
                self.killed_at = time.monotonic()
                return
            time.sleep(0.002)


@pytest.fixture(scope="module")
def uninterrupted(servers, synthetic_cache, tmp_path_factory):
    """(metrics rows, checkpoint sampler positions) of the async run at lr 0 with no server killed."""
    actor, ref = servers
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    proc = _train(run_dir, [actor], [ref], synthetic_cache, run_dir.parent / "logs")
    assert proc.returncode == 0, proc.output[-6000:]
    rows = _rows(run_dir)
    assert all(row["rollout/ref_retries"] == row["rollout/retries"] == 0 for row in rows)
    return rows, _samplers(run_dir)


def _check_same_training(run_dir: Path, uninterrupted) -> list[dict]:
    """The run in `run_dir` trained the uninterrupted run's prompts and samples; its metrics rows."""
    rows, (reference_rows, reference_samplers) = _rows(run_dir), uninterrupted
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row, reference in zip(rows, reference_rows, strict=True):
        assert row["filter/prompts_kept"] == row["armor/anchors_used"] == TRAIN_BATCH, row["step"]  # full batches
        assert {k: row[k] for k in BATCH} == {k: reference[k] for k in BATCH}, row["step"]
        assert {k: row[k] for k in LOSSES} == pytest.approx({k: reference[k] for k in LOSSES}, rel=1e-5, abs=1e-7)
    # Each checkpoint saved the position after exactly the generation batches trained so far (within epoch 0):
    # no prompt drawn twice or skipped; the uninterrupted run saved the same.
    drawn = [GEN_BATCH * int(sum(row["train/num_gen_batches"] for row in rows[: step + 1])) for step in range(STEPS)]
    assert _samplers(run_dir) == [{"epoch": 0, "cursor": cursor} for cursor in drawn] == reference_samplers
    return rows


def test_async_run_with_a_reference_server_killed_mid_generation_trains_the_uninterrupted_run_s_batches(
    start_server, tiny_model_factory, servers, synthetic_cache, tmp_path, uninterrupted,
):
    """ARMOR's anchors come from two reference servers (pushed once, before the first step; equally loaded servers
    take turns, rank 0's client starting at the first); the first is killed in its second period of
    generating (the asynchronous generator's anchors of a batch after the first, generated while step 1 trains or
    waits for them). Its lost requests, and later ones sent before each rank's client knows it is dead, are re-sent
    to the other reference server."""
    actor, ref = servers
    victim = _serve(start_server, tiny_model_factory)
    actors, refs = [actor], [victim, ref]
    killer = KillWhenGenerating(victim, period=2)
    killer.start()
    run_dir = tmp_path / "run"
    began = time.monotonic()
    proc = _train(run_dir, actors, refs, synthetic_cache, tmp_path / "logs")
    killer.stop.set()
    assert proc.returncode == 0, proc.output[-6000:]
    assert killer.killed_at is not None and began < killer.killed_at, "the reference server was never killed"
    rows = _check_same_training(run_dir, uninterrupted)
    assert rows[-1]["rollout/ref_failed_requests"] >= 1 and rows[-1]["rollout/ref_retries"] >= 1
    assert rows[-1]["rollout/retries"] == 0  # the actor's server was not touched


@pytest.mark.parametrize("turns", ["single", "multi"])
def test_async_run_with_an_actor_server_killed_mid_generation_trains_the_uninterrupted_run_s_batches(
    start_server, tiny_model_factory, servers, synthetic_cache, tmp_path, uninterrupted, turns,
):
    """The same with the second of two actor servers killed in its second period of generating. Every actor server
    gets every weight push (rank r pushes to server r, rollout/push_assignment.py): rank 1's client leaves the dead
    server out of its pushes, and every rank's client out of generation (`retire_servers`), so the run goes on with
    the other server.

    multi: every sample (anchors too) is a two-turn trajectory (rollout.agentic, tests/trainer/agentic_task/), each
    turn its own request; a turn lost with the server is sent again to the other (its seed derives from its
    trajectory, not its server), so no trajectory is lost: every one completes both turns, every step trains full
    batches, and each checkpoint saved the position after exactly the generation batches trained (no prompt lost or
    drawn twice)."""
    actor, ref = servers
    victim = _serve(start_server, tiny_model_factory)
    actors, refs = [actor, victim], [ref]
    killer = KillWhenGenerating(victim, period=2)
    killer.start()
    run_dir = tmp_path / "run"
    proc = _train(run_dir, actors, refs, synthetic_cache, tmp_path / "logs", *AGENTIC[turns])
    killer.stop.set()
    assert killer.killed_at is not None, "the actor server was never killed"
    assert proc.returncode == 0, proc.output[-6000:]
    assert f"weight push: {victim.url} cannot be reached" in proc.output  # left out of the push, with a warning
    if turns == "single":
        rows = _check_same_training(run_dir, uninterrupted)
    else:
        rows = _rows(run_dir)
        assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
        for row in rows:
            assert row["filter/prompts_kept"] == row["armor/anchors_used"] == TRAIN_BATCH, row["step"]
            assert row["agent/status_completed"] == 1.0 and row["agent/turns_mean"] == 2.0, row["step"]
        batches = [int(sum(row["train/num_gen_batches"] for row in rows[: step + 1])) for step in range(STEPS)]
        assert _samplers(run_dir) == [{"epoch": 0, "cursor": GEN_BATCH * count} for count in batches]
    assert rows[-1]["rollout/failed_requests"] >= 1 and rows[-1]["rollout/retries"] >= 1


def test_async_run_with_partial_rollouts_and_an_actor_server_killed_trains_every_prompt_once(
    start_server, tiny_model_factory, servers, synthetic_cache, tmp_path, uninterrupted,
):
    """The actor-server kill with rollout.partial_rollouts: pushes interrupt the generations on both actor servers and
    they continue from their partial responses, so the kill loses requests that may carry one; they are re-sent to
    the other server (from the prompt and the partial response the client kept). A continued response draws other
    tokens than an uninterrupted one, so only the prompts can be compared: every step trains full batches, and each
    checkpoint saved the uninterrupted run's sampler position (no prompt lost or trained twice)."""
    actor, ref = servers
    victim = _serve(start_server, tiny_model_factory)
    killer = KillWhenGenerating(victim, period=2)
    killer.start()
    run_dir = tmp_path / "run"
    proc = _train(run_dir, [actor, victim], [ref], synthetic_cache, tmp_path / "logs",
                  "--rollout.partial_rollouts", "true")
    killer.stop.set()
    assert killer.killed_at is not None, "the actor server was never killed"
    assert proc.returncode == 0, proc.output[-6000:]
    rows = _rows(run_dir)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(row["filter/prompts_kept"] == row["armor/anchors_used"] == TRAIN_BATCH for row in rows)
    assert all(row["response/length_mean"] > 2 for row in rows)
    assert _samplers(run_dir) == uninterrupted[1]
    assert rows[-1]["rollout/failed_requests"] >= 1 and rows[-1]["rollout/retries"] >= 1


def test_async_run_with_partial_rollouts_continues_interrupted_requests_on_real_servers(
    servers, synthetic_cache, tmp_path,
):
    """rollout.partial_rollouts against a real server process at lr > 0 (the weights change, so the versions a
    response mixes differ), GRPO (the generator's time is all actor generation, long-tailed at temperature 1.6, several
    times a step's training): a request is in flight whenever a step pushes its weights, so the push interrupts it (the
    client aborts it by rid) and it continues under the new weights: trained samples mix versions, none has a token
    more than max_staleness versions old, validation (between the pause and the next step) samples whole responses
    from the paused engine (none cut short by an abort), and the run finishes with the generators drained. What the
    training does to accuracy is not this test's business (it varies with the CPU's arithmetic)."""
    actor, _ = servers
    run_dir = tmp_path / "run"
    proc = armor("train", "--config", CONFIG, "--max-steps", "3", "--run-dir", str(run_dir),
                 "--task.cache_dir", str(synthetic_cache), "--task.num_train_rows", "400", "--task.num_val_rows", "16",
                 "--eval.every", "1", "--eval.max_prompts", "8", "--eval.before_train", "false",
                 "--checkpoint.every", "100", "--checkpoint.save_model", "false", "--logging.tensorboard", "false",
                 "--logging.plot", "false", "--logging.progress_bar", "false", "--optimizer.lr", "5e-4",
                 "--train.gen_batch_size", str(GEN_BATCH),
                 "--algorithm.name", "grpo", "--rollout.sampling.n_samples", "8", "--rollout.sampling.actor_n", "8",
                 "--rollout.sampling.temperature", "1.6", "--rollout.backend", "sglang", "--rollout.mode", "async",
                 "--rollout.max_staleness", "1", "--rollout.partial_rollouts", "true",
                 "--rollout.sglang.router", "none", "--rollout.sglang.urls", actor.url,
                 nproc=2, log_dir=tmp_path / "logs", timeout=240)
    assert proc.returncode == 0, proc.output[-6000:]
    rows = _rows(run_dir)
    assert all(row["async/staleness_max"] <= 1 and row["filter/prompts_kept"] > 0 for row in rows)
    assert all(row["val/response_length"] > 2 and row["val/aborted_fraction"] == 0 for row in rows)  # whole responses
    assert sum(row["async/partial_fraction"] for row in rows[1:]) > 0  # continued under newer weights
    assert rows[-1]["rollout/retries"] == 0  # continued, not re-sent from scratch
