"""The environment loop under bad input, all in one concurrent batch: an environment that raises, answers malformed
messages or never ends; a tool that hangs, crashes or floods its output (the sandbox's, or a plain function returning
100 MB); malformed tool-call JSON. Each trajectory
gets its status and one clear log line, the others finish, and no process or file descriptor is left behind."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import psutil
import pytest

from agentic_helpers import ADD_SCHEMA, PolicyByPrompt, add, play
from megatron_armor.agentic.chat_templates import make_chat_tokenizer
from megatron_armor.agentic.driver import RolloutContext, load_rollout, run_rollouts
from megatron_armor.config import AgenticConfig
from megatron_armor.agentic.environment import EnvReply, Environment, load_environment
from megatron_armor.agentic.metrics import agent_metrics
from megatron_armor.agentic.sandbox import PythonSandbox, python_tool
from megatron_armor.agentic.tool_env import ToolEnv
from megatron_armor.agentic.tools import MAX_OUTPUT_BYTES, Tool, tool_calls_text
from megatron_armor.agentic.trajectory import Status
from megatron_armor.rollout.base import SamplingParams


def hang(seconds: float) -> str:
    time.sleep(seconds)
    return "late"


def crash() -> str:
    raise ZeroDivisionError("the tool divided by zero")


def flood() -> str:
    return "x" * 100_000_000


class CaseEnv(ToolEnv):
    """Behaves as its row's "case" says."""

    def __init__(self) -> None:
        super().__init__([
            Tool(add, ADD_SCHEMA), Tool(hang, {"type": "object", "properties": {"seconds": {}}}, timeout_s=0.2),
            Tool(crash, {"type": "object"}), Tool(flood, {"type": "object"}),
            python_tool(PythonSandbox(timeout_s=5.0, max_output_bytes=2000)),
        ])

    def reset(self, row):
        self.case = row["case"]
        return [{"role": "user", "content": f"case {row['case']}: go"}]

    async def step(self, messages):
        if self.case == "env raises" and len(messages) > 2:
            raise KeyError("the environment lost its state")
        if self.case == "env malformed":
            return EnvReply([{"role": "user", "content": 42}])
        if self.case == "env never ends":
            return EnvReply([{"role": "user", "content": "again"}])
        return await super().step(messages)

    def score(self, messages):
        return 1.0


CASES = {
    "ok": [tool_calls_text([("add", {"a": 2, "b": 3})]), "5"],
    "env raises": [tool_calls_text([("add", {"a": 1, "b": 1})]), "again", "done"],
    "env malformed": ["hello"],
    "env never ends": ["more"],
    "tool hangs": [tool_calls_text([("hang", {"seconds": 1.5})])],
    "tool crashes": [tool_calls_text([("crash", {})])],
    "tool floods": [tool_calls_text([("flood", {})])],
    "python loops": [tool_calls_text([("python", {"code": "while True: pass"})]), "done"],
    "python floods": [tool_calls_text([("python", {"code": "print('x' * 100_000_000)"})]), "done"],
    "bad json": ['<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'],
}
EXPECTED = {
    "ok": Status.COMPLETED, "env raises": Status.FAILED, "env malformed": Status.FAILED,
    "env never ends": Status.TRUNCATED, "tool hangs": Status.FAILED, "tool crashes": Status.FAILED,
    "tool floods": Status.TRUNCATED,  # the 64 KiB of its result shown overrun the trajectory's token budget
    "python loops": Status.COMPLETED, "python floods": Status.COMPLETED, "bad json": Status.ABORTED,
}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_bad_input_gives_each_trajectory_its_status_and_one_log_line_and_leaks_nothing(caplog):
    tokenizer = make_chat_tokenizer("chatml")
    stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    policy = PolicyByPrompt(tokenizer, stop_id, {f"case {c}:": turns for c, turns in CASES.items()})
    fds, children = open_fds(), len(psutil.Process().children(recursive=True))
    with caplog.at_level(logging.ERROR, logger="megatron_armor.agentic.driver"):
        trajectories = play(policy, tokenizer, stop_id, make_env=CaseEnv, rows=[{"case": c} for c in CASES],
                            limits=AgenticConfig(max_turns=4, max_invalid_turns=2), max_in_flight=len(CASES))
    by_case = {t.row["case"]: t for t in trajectories}
    assert {c: t.status for c, t in by_case.items()} == EXPECTED
    failures = {c: r.getMessage() for r in caplog.records for c in CASES
                if f"on row {{'case': {c!r}}}:" in r.getMessage()}
    assert len(caplog.records) == 4 and set(failures) == {c for c, s in EXPECTED.items() if s is Status.FAILED}
    assert "KeyError: 'the environment lost its state'" in failures["env raises"]
    assert "Traceback" in failures["env raises"]  # an unexpected error: its traceback, once
    assert "malformed message at index 0" in failures["env malformed"]
    assert "tool 'hang' timed out after 0.2 s" in failures["tool hangs"]
    assert "tool 'crash' raised ZeroDivisionError: the tool divided by zero" in failures["tool crashes"]
    assert by_case["env never ends"].stats.turns == 4
    tool_says = {c: [m["content"] for m in by_case[c].messages if m["role"] == "tool"] for c in by_case}
    assert tool_says["ok"] == ["5"] and by_case["ok"].reward == 1.0 and by_case["tool crashes"].reward == 0.0
    assert tool_says["python loops"] == ["[killed: time limit]"]
    assert tool_says["python floods"][0].endswith("[killed: output limit]")
    assert len(tool_says["python floods"][0]) < 2100  # the sandbox limit, not 100 MB
    assert tool_says["tool floods"] == ["x" * MAX_OUTPUT_BYTES + f"\n[cut: output limit of {MAX_OUTPUT_BYTES} bytes]"]
    assert all("not valid JSON" in m for m in tool_says["bad json"]) and len(tool_says["bad json"]) == 1
    assert by_case["bad json"].error == "2 invalid turns in a row"
    metrics = agent_metrics(trajectories)
    assert metrics["agent/status_failed"] == pytest.approx(4 / 10)
    # calls: ok, env raises, hang, crash, flood, python loops, python floods, bad json x2; errors: hang, crash, bad
    # json x2
    assert metrics["agent/tool_calls_mean"] == pytest.approx(9 / 10)
    assert metrics["agent/tool_error_rate"] == pytest.approx(4 / 9)
    time.sleep(1.5)  # the hung tool's thread returns (a Python function cannot be stopped)
    assert open_fds() == fds
    assert len(psutil.Process().children(recursive=True)) == children


def test_environment_classes_load_by_module_or_file_path(tmp_path):
    file = tmp_path / "my_env.py"
    file.write_text("from megatron_armor.agentic.environment import Environment\n"
                    "class Echo(Environment):\n"
                    "    def reset(self, row): return [{'role': 'user', 'content': row['prompt']}]\n"
                    "    def step(self, messages): return None\n"
                    "    def score(self, messages): return 0.0\n"
                    "NotAnEnv = dict\n")
    assert load_environment(f"{file}:Echo").__name__ == "Echo"
    assert load_environment("agentic_helpers:AddEnv").__name__ == "AddEnv"
    with pytest.raises(ValueError, match="is <class 'dict'>, not a subclass of .*Environment"):
        load_environment(f"{file}:NotAnEnv")
    with pytest.raises(ValueError, match="environment 'nowhere:Env': cannot import module 'nowhere'"):
        load_environment("nowhere:Env")


def test_rollout_functions_load_from_the_config_and_a_trajectory_breaking_the_contract_fails_its_row(tmp_path,
                                                                                                     caplog):
    """rollout.agentic.rollout_fn: one of it and environment; an async function; what it returns is a `Trajectory`
    whose segments end with a sampled token (what the trainer's samples are cut to), or the row's trajectory fails,
    logged once."""
    file = tmp_path / "my_rollout.py"
    file.write_text("from megatron_armor.agentic.trajectory import Segment, Status, Trajectory, TrajectoryStats\n"
                    "async def context_last(ctx, row):\n"
                    "    segment = Segment([1, 2, 3], [0, 1, 0], [0.0, -1.0, 0.0])\n"
                    "    return Trajectory(row, [segment], Status.COMPLETED, 1.0, [], [], TrajectoryStats())\n"
                    "async def nothing(ctx, row):\n"
                    "    return None\n"
                    "def blocking(ctx, row):\n"
                    "    return None\n")
    with pytest.raises(ValueError, match=r"rollout.agentic.environment \(e:E\) and rollout.agentic.rollout_fn \(m:f\) "
                                         "are two ways to roll a trajectory out: set one of them"):
        AgenticConfig(environment="e:E", rollout_fn="m:f")
    with pytest.raises(ValueError, match="blocking' is <function blocking .*>, not an async function"):
        load_rollout(AgenticConfig(rollout_fn=f"{file}:blocking"))
    ctx = RolloutContext(generator=None, tokenizer=None, sampling=SamplingParams())
    with caplog.at_level(logging.ERROR, logger="megatron_armor.agentic.driver"):
        trajectories = [asyncio.run(run_rollouts(ctx, load_rollout(AgenticConfig(rollout_fn=f"{file}:{name}")),
                                                 [{"case": name}]))[0] for name in ("context_last", "nothing")]
    assert [(t.status, t.segments) for t in trajectories] == [(Status.FAILED, [])] * 2
    assert trajectories[0].error.startswith("ValueError: segment 0 of a trajectory must start with its prompt "
                                            "(context, mask 0), end with a sampled token (mask 1)")
    assert trajectories[1].error == "TypeError: the rollout function returned NoneType, not a Trajectory"
    assert len(caplog.records) == 2


async def slow_lookup(key: str) -> str:
    """Look a key up in a slow service."""
    await asyncio.sleep(0.5)
    return key.upper()


class LookupEnv(ToolEnv):
    finished: list[str] = []  # the cases, in the order their episodes ended

    def __init__(self) -> None:
        super().__init__([Tool(slow_lookup, {"type": "object", "properties": {"key": {}}}), Tool(add, ADD_SCHEMA)])

    def reset(self, row):
        self.case = row["case"]
        return [{"role": "user", "content": f"case {row['case']}:"}]

    def score(self, messages):
        return 0.0

    def close(self):
        self.finished.append(self.case)


def test_a_slow_tool_holds_only_its_own_trajectory():
    """Per-trajectory tasks: a trajectory whose tool takes 0.5 s does not delay the one doing four quick turns,
    which finishes first (a turn-synchronous loop would make every turn of it wait for the slow tool)."""
    tokenizer = make_chat_tokenizer("chatml")
    stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    quick = [tool_calls_text([("add", {"a": i, "b": 1})]) for i in range(3)] + ["done"]
    policy = PolicyByPrompt(tokenizer, stop_id, {"case slow:": [tool_calls_text([("slow_lookup", {"key": "k"})]),
                                                                "done"],
                                                 "case quick:": quick})
    trajectories = play(policy, tokenizer, stop_id, make_env=LookupEnv, rows=[{"case": "slow"}, {"case": "quick"}],
                        max_in_flight=2)
    assert [t.stats.turns for t in trajectories] == [2, 4] and LookupEnv.finished == ["quick", "slow"]
    assert [m["content"] for m in trajectories[0].messages if m["role"] == "tool"] == ["K"]
    assert trajectories[0].stats.tool_s >= 0.5 > trajectories[1].stats.tool_s


class GradedEnv(Environment):
    """A simulated user who grades every turn (reward 0.5 per turn) and asks again until the third."""

    def reset(self, row):
        return [{"role": "user", "content": f"case {row['case']}:"}]

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        return EnvReply([{"role": "user", "content": "Again."}], done=turns == 3, reward=0.5 * turns)

    def score(self, messages):
        return 1.0


def test_per_turn_rewards_and_the_token_budget():
    """Per-turn rewards are kept in order; a trajectory whose next turn would pass max_total_tokens is sampled only up
    to the budget and ends truncated, its tokens within it."""
    tokenizer = make_chat_tokenizer("chatml")
    stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    policy = PolicyByPrompt(tokenizer, stop_id, {"case a:": ["one two three"]})
    (graded,) = play(policy, tokenizer, stop_id, make_env=GradedEnv, rows=[{"case": "a"}])
    assert (graded.status, graded.turn_rewards, graded.reward) == (Status.COMPLETED, [0.5, 1.0, 1.5], 1.0)
    (segment,) = graded.segments
    budget = len(segment.token_ids) - 2  # the third turn's last tokens do not fit
    (cut,) = play(policy, tokenizer, stop_id, make_env=GradedEnv, rows=[{"case": "a"}],
                  limits=AgenticConfig(max_total_tokens=budget))
    assert cut.status is Status.TRUNCATED and cut.stats.turns == 3 and cut.turn_rewards == [0.5, 1.0]
    assert cut.segments[0].token_ids == segment.token_ids[:budget]


def test_every_trajectory_in_flight_gets_a_thread_for_its_plain_function_tool():
    """24 trajectories whose tool is a plain (blocking) function that returns only once all 24 calls are inside it
    at the same time: more than the event loop's default pool (min(32, cores + 4) threads) would run at once here."""
    calls = 24
    barrier = threading.Barrier(calls, timeout=20)

    def meet() -> str:
        barrier.wait()
        return "met"

    class MeetEnv(ToolEnv):
        def __init__(self):
            super().__init__([Tool(meet, {"type": "object"}, timeout_s=30)])

        def reset(self, row):
            return [{"role": "user", "content": f"case {row['case']}:"}]

        def score(self, messages):
            return 0.0

    tokenizer = make_chat_tokenizer("chatml")
    stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    policy = PolicyByPrompt(tokenizer, stop_id, {f"case {i}:": [tool_calls_text([("meet", {})]), "done"]
                                                 for i in range(calls)})
    trajectories = play(policy, tokenizer, stop_id, make_env=MeetEnv, rows=[{"case": i} for i in range(calls)],
                        max_in_flight=calls)
    assert {t.status for t in trajectories} == {Status.COMPLETED}
    assert all([m["content"] for m in t.messages if m["role"] == "tool"] == ["met"] for t in trajectories)
