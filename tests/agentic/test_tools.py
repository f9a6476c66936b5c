"""Tool-call parsing (malformed calls become reasons, never exceptions) and where tool calls run."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor

import pytest

from agentic_helpers import ADD_SCHEMA, add
from megatron_armor.agentic.tools import (
    InvalidCall, Tool, ToolCall, ToolRunner, ToolTimeout, parse_tool_calls, tool_calls_text,
)

TOOLS = {"add": Tool(add, ADD_SCHEMA)}


def test_parallel_calls_parse_in_order_and_malformed_ones_say_why():
    text = ("first " + tool_calls_text([("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})])
            + '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
            + '<tool_call>["add"]</tool_call>'
            + tool_calls_text([("mul", {"a": 1}), ("add", {"a": 1}), ("add", {"a": 1, "b": 2, "c": 3})]))
    calls = parse_tool_calls(text, TOOLS)
    assert calls[:2] == [ToolCall(TOOLS["add"], {"a": 1, "b": 2}), ToolCall(TOOLS["add"], {"a": 3, "b": 4})]
    reasons = [c.reason for c in calls[2:]]
    assert all(isinstance(c, InvalidCall) for c in calls[2:]) and len(reasons) == 5
    assert reasons[0].startswith("the tool call is not valid JSON (Expecting")
    assert reasons[1] == 'a tool call must be {"name": ..., "arguments": {...}}'
    assert reasons[2] == "no tool named 'mul' (tools: ['add'])"
    assert reasons[3] == "tool 'add': missing arguments ['b'], unknown arguments []"
    assert reasons[4] == "tool 'add': missing arguments [], unknown arguments ['c']"
    assert parse_tool_calls("no calls here", TOOLS) == []


def test_tool_schema_is_the_chat_templates_function_form():
    assert TOOLS["add"].schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.", "parameters": ADD_SCHEMA}}


def test_plain_tools_run_in_threads_cpu_bound_ones_in_processes_and_time_outs_raise():
    seen = []

    def where() -> str:
        seen.append(threading.current_thread() is threading.main_thread())
        return "ok"

    async def slow() -> str:
        await asyncio.sleep(5)

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as processes:
        runner = ToolRunner(processes=processes)
        pid = asyncio.run(runner.run(ToolCall(Tool(os.getpid, {"type": "object"}, cpu_bound=True), {})))
        assert pid != os.getpid()
        assert asyncio.run(runner.run(ToolCall(Tool(where, {"type": "object"}), {}))) == "ok" and seen == [False]
        with pytest.raises(ToolTimeout, match="tool 'slow' timed out after 0.1 s"):
            asyncio.run(runner.run(ToolCall(Tool(slow, {"type": "object"}, timeout_s=0.1), {})))
