"""The Megatron teacher scoring server at TP=2 and PP=2 (two gloo ranks) against the in-process teacher at
TP=1 and the HF forward of the same checkpoint; a wrong vocabulary and a dying rank give clear errors."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from launcher import run_workers
from transformers import AutoModelForCausalLM

from megatron_armor.models.hf_config import ModelConfigError
from megatron_armor.rollout.process import ManagedProcess
from megatron_armor.rollout.sglang_engine import TRANSPORT_ERRORS, ServerError, http_call
from megatron_armor.teacher.launcher import TeacherError, TeacherServerGroup
from megatron_armor.teacher.protocol import ScoreRequest
from megatron_armor.teacher.scorer import TeacherClient
from megatron_armor.teacher.serve_cli import TeacherServerConfig
from megatron_armor.utils.net import free_port

TEMPERATURE = 0.7
# (prompt ids, response ids) of different lengths; the server scores every token after the first
SEQUENCES = [([5, 17, 33], [40, 41, 2, 0]), ([9, 9], [70, 12, 3, 88, 91, 5, 6]), ([60, 61, 62, 63], [1])]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    group = TeacherServerGroup(TeacherServerConfig(str(model_dir), tensor_parallel_size=2, port=0, micro_batch_size=2),
                               log_dir=tmp_path_factory.mktemp("teacher-logs"))
    try:
        group.wait_healthy(timeout_s=300)
        yield group
    finally:
        group.stop()


def hf_logprobs(model_dir, sequence: list[int]) -> torch.Tensor:
    """[L - 1] log_softmax(logits / T) of tokens 1..L-1 from the HF model (fp32)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, :-1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]


def test_tp2_server_matches_hf_and_the_in_process_tp1_teacher(server, model_dir, tmp_path):
    client = TeacherClient([server.url])
    sequences = [p + r for p, r in SEQUENCES]
    scores = client.score(ScoreRequest(sequences, TEMPERATURE))
    for sequence, logprobs in zip(sequences, scores):
        torch.testing.assert_close(torch.tensor(logprobs), hf_logprobs(model_dir, sequence), atol=1e-4, rtol=0)

    # The trainer's view: [B, S] label-aligned tables of the same batch, in-process (TP=1) vs the server.
    [result] = run_workers("teacher_scoring.py", 1, tmp_path / "w", str(model_dir), server.url, str(TEMPERATURE),
                           json.dumps(SEQUENCES))
    in_process, remote = torch.tensor(result["in_process"]), torch.tensor(result["remote"])
    mask = torch.tensor(result["response_mask"])
    assert int(mask.sum()) == sum(len(r) for _, r in SEQUENCES)
    assert (in_process[mask > 0] < 0).all()  # real logprobs on every response token, 0 elsewhere
    assert (remote[mask == 0] == 0).all()
    torch.testing.assert_close(remote, in_process, atol=1e-5, rtol=0)


def test_serve_teacher_cli_at_pp2_matches_hf(model_dir, tmp_path):
    """`armor serve-teacher --pp 2` (torchrun, two pipeline stages, micro-batches padded to equal shapes)."""
    port = free_port("127.0.0.1")
    process = ManagedProcess(tmp_path / "serve-teacher.log")
    process.start([sys.executable, "-m", "megatron_armor.cli", "serve-teacher", "--model", str(model_dir), "--pp", "2",
                   "--port", str(port), "--micro-batch-size", "2"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.alive(), process.log_tail()
            try:
                http_call(url, "/health_generate", method="GET", timeout=30)
                break
            except (ServerError, *TRANSPORT_ERRORS):
                assert time.monotonic() < deadline, process.log_tail()
                time.sleep(0.5)
        sequences = [p + r for p, r in SEQUENCES]
        for sequence, logprobs in zip(sequences, TeacherClient([url]).score(ScoreRequest(sequences, TEMPERATURE))):
            torch.testing.assert_close(torch.tensor(logprobs), hf_logprobs(model_dir, sequence), atol=1e-4, rtol=0)
    finally:
        process.stop()
    assert processes_with_argument(f"--port {port}") == [], "teacher ranks outlived `armor serve-teacher`"


def processes_with_argument(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text` (Linux /proc)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:  # exited while we looked
            pass
    return pids


def test_server_reports_its_vocabulary_and_a_different_student_vocabulary_is_refused(server):
    client = TeacherClient([server.url])
    [info] = client.model_info()
    assert (info["vocab_size"], info["tensor_parallel_size"], info["pipeline_parallel_size"]) == (128, 2, 1)
    client.check_vocab(128)
    with pytest.raises(ModelConfigError, match="has vocab_size 128, the student has 256"):
        client.check_vocab(256)


def test_bad_scoring_request_is_refused_with_the_reason(server):
    client = TeacherClient([server.url])
    with pytest.raises(TeacherError, match=r"400.*outside the vocabulary \[0, 128\)"):
        client.score(ScoreRequest([[1, 500]], TEMPERATURE))


def test_a_dying_teacher_rank_gives_an_error_that_names_it(server):
    """Runs last: kills teacher rank 1; the next request fails at once, naming the rank and quoting its log."""
    os.kill(server.ranks[1].pid, signal.SIGKILL)
    client = TeacherClient([server.url], timeout_s=60, group=server)
    with pytest.raises(TeacherError, match=r"teacher rank 1 exited with code -9"):
        client.score(ScoreRequest([[1, 2, 3]], TEMPERATURE))
