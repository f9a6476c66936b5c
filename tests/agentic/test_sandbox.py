"""The sandboxed Python tool's limits: time, memory, output, a fresh working directory, no network, no inherited
environment; nothing left running."""

from __future__ import annotations

import asyncio
import os
import socket

import psutil

from megatron_armor.agentic.sandbox import PythonSandbox, python_tool
from megatron_armor.agentic.tools import ToolCall, ToolRunner

SANDBOX = PythonSandbox(timeout_s=2.0, memory_mb=256, max_output_bytes=1000)
# the same limits with time to spare: on a loaded machine a child's start alone can take seconds, and the cases
# below must be stopped by their own limit, not the time limit
PATIENT = PythonSandbox(timeout_s=60.0, memory_mb=256, max_output_bytes=1000)


def run(code: str, sandbox: PythonSandbox = PATIENT):
    return asyncio.run(sandbox.run(code))


def test_code_runs_in_a_fresh_directory_without_the_parents_environment():
    os.environ["ARMOR_SECRET"] = "x"
    try:
        first = run("import os; open('left.txt', 'w').write('1'); print(sorted(os.listdir('.')), 'ARMOR_SECRET' in "
                    "os.environ)")
    finally:
        del os.environ["ARMOR_SECRET"]
    assert (first.stdout, first.exit_code) == ("['left.txt', 'main.py'] False\n", 0)
    assert run("import os; print(sorted(os.listdir('.')))").stdout == "['main.py']\n"


def test_limits_stop_loops_memory_floods_and_network():
    children = len(psutil.Process().children(recursive=True))
    loop = run("while True: pass", SANDBOX)
    assert loop.timed_out and loop.exit_code < 0 and loop.as_text() == "[killed: time limit]"
    memory = run("x = bytearray(1 << 30)")
    assert memory.exit_code == 1 and "MemoryError" in memory.stderr
    flood = run("print('y' * 100_000_000)")
    assert flood.output_truncated and len(flood.stdout) == 1000 and flood.stdout == "y" * 1000
    with socket.create_server(("127.0.0.1", 0)) as listening:  # reachable from any process of this host's network
        port = listening.getsockname()[1]
        network = run(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                      "    print('connected')\nexcept OSError as e:\n    print('no network:', e)")
    assert network.stdout.startswith("no network:"), network
    assert len(psutil.Process().children(recursive=True)) == children


def test_python_tool_reports_output_and_errors_to_the_policy():
    tool = python_tool(SANDBOX)
    assert tool.timeout_s == 7.0 and tool.schema["function"]["parameters"]["required"] == ["code"]
    out = asyncio.run(ToolRunner().run(ToolCall(tool, {"code": "print(6 * 7)\nraise SystemExit(3)"})))
    assert out == "42\n\n[exit code 3]"
