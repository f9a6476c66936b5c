"""Tools: plain Python functions with a JSON schema, the model's tool calls parsed from its text, and calls run off
the event loop under a time-out.

A tool call is written by the model as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes style,
as the templates of agentic/chat_templates.py teach it); a turn may hold several (parallel calls). `parse_tool_calls`
never raises: a call whose JSON does not parse, or that names no known tool or wrong arguments, comes back as an
`InvalidCall` with the reason, for the environment to tell the model.

Where a call runs: a coroutine function is awaited on the event loop (I/O-bound tools, the sandbox); a plain
function runs in a thread pool, or with `cpu_bound` in a process pool (it must then be importable by name: a
module-level function). A call past its time-out raises `ToolTimeout`: a coroutine is cancelled (the sandbox kills
its process), but a Python function cannot be stopped safely, so its thread or process finishes in the background;
run code that may never end in the sandbox (agentic/sandbox.py).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_OUTPUT_BYTES = 64 * 1024  # what a tool's result (or the sandbox's output) may hold by default

# Where plain-function tools and synchronous environment methods run: the thread pool `driver.run_rollouts` owns
# while it runs (a thread per trajectory in flight), else (None) the event loop's default pool.
WORKER_THREADS: ContextVar[Executor | None] = ContextVar("agentic_worker_threads", default=None)


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker thread (`WORKER_THREADS`), awaited without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(WORKER_THREADS.get(), functools.partial(fn, *args))


class ToolError(RuntimeError):
    """A tool that raised or timed out: the trajectory fails (`Status.FAILED`) with this message. `calls`: the tool
    calls of the turn it ended (for the metrics), set by whoever ran them."""

    calls: int = 1


class ToolTimeout(ToolError):
    pass


@dataclass(frozen=True)
class Tool:
    """A function the policy may call. `parameters`: the JSON schema of its keyword arguments (an "object" schema:
    `properties`, `required`); `timeout_s`: wall-clock limit of one call; `cpu_bound`: run in a process pool;
    `max_output_bytes`: the result's text is cut to this many UTF-8 bytes, a marker saying so (`result_text`)."""

    fn: Callable[..., Any]
    parameters: Mapping[str, Any]
    description: str = ""
    name: str = ""
    timeout_s: float = 10.0
    cpu_bound: bool = False
    max_output_bytes: int = MAX_OUTPUT_BYTES

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.fn.__name__)
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type 'object'")
        if self.timeout_s <= 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")
        if self.max_output_bytes < 1:
            raise ValueError(f"tool {self.name!r}: max_output_bytes must be >= 1, got {self.max_output_bytes}")

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates take in `tools=`."""
        description = self.description or inspect.getdoc(self.fn) or ""
        return {"type": "function", "function": {"name": self.name, "description": description,
                                                 "parameters": dict(self.parameters)}}

    def result_text(self, result: Any) -> str:
        """`result` as the policy reads it: a string as it is, anything else as JSON; past `max_output_bytes` (UTF-8)
        cut there, and "[cut: output limit of N bytes]" appended."""
        text = result if isinstance(result, str) else json.dumps(result)
        encoded = text.encode()
        if len(encoded) <= self.max_output_bytes:
            return text
        kept = encoded[:self.max_output_bytes].decode(errors="ignore")  # a character cut in two is dropped
        return f"{kept}\n[cut: output limit of {self.max_output_bytes} bytes]"

    def argument_problem(self, arguments: Any) -> str | None:
        """Why `arguments` do not fit the schema (not an object, a required key missing, an unknown key), or None."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        known = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        unknown = [k for k in arguments if k not in known]
        if missing or unknown:
            return f"tool {self.name!r}: missing arguments {missing}, unknown arguments {unknown}"
        return None


@dataclass(frozen=True)
class ToolCall:
    tool: Tool
    arguments: dict[str, Any]


@dataclass(frozen=True)
class InvalidCall:
    """A `<tool_call>` block that cannot be run: `text` is what the model wrote, `reason` why it cannot run."""

    text: str
    reason: str


def parse_tool_calls(text: str, tools: Mapping[str, Tool]) -> list[ToolCall | InvalidCall]:
    """The tool calls written in `text`, in order; malformed ones as `InvalidCall` (never an exception)."""
    calls: list[ToolCall | InvalidCall] = []
    for block in _CALL.findall(text):
        try:
            payload = json.loads(block)
        except json.JSONDecodeError as error:
            calls.append(InvalidCall(block, f"the tool call is not valid JSON ({error})"))
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            calls.append(InvalidCall(block, 'a tool call must be {"name": ..., "arguments": {...}}'))
            continue
        tool = tools.get(payload["name"])
        arguments = payload.get("arguments", {})
        problem = (f"no tool named {payload['name']!r} (tools: {sorted(tools)})" if tool is None
                   else tool.argument_problem(arguments))
        calls.append(InvalidCall(block, problem) if problem else ToolCall(tool, arguments))
    return calls


@dataclass(frozen=True)
class ToolRunner:
    """Where tool calls run (module docstring). `threads`: the executor of plain functions (None: `WORKER_THREADS`);
    `processes`: that of `cpu_bound` ones (e.g. a `ProcessPoolExecutor` the environment's
    module owns), required by such tools."""

    threads: Executor | None = None
    processes: Executor | None = None

    async def run(self, call: ToolCall) -> Any:
        """The tool's result; ToolTimeout past `timeout_s`, ToolError when it raised."""
        tool = call.tool
        if inspect.iscoroutinefunction(tool.fn):
            work = tool.fn(**call.arguments)
        else:
            executor = self.processes if tool.cpu_bound else (self.threads or WORKER_THREADS.get())
            work = asyncio.get_running_loop().run_in_executor(executor, functools.partial(tool.fn, **call.arguments))
        try:
            return await asyncio.wait_for(work, tool.timeout_s)
        except TimeoutError:
            raise ToolTimeout(f"tool {tool.name!r} timed out after {tool.timeout_s:g} s") from None
        except Exception as error:
            raise ToolError(f"tool {tool.name!r} raised {type(error).__name__}: {error}") from error


def tool_calls_text(calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """How a model writes `calls` ((name, arguments) pairs): for demonstrations and tests."""
    return "".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls)
