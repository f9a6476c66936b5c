"""`ToolEnv`: an environment whose answers are the results of the tool calls in the policy's last turn."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from megatron_armor.agentic.environment import EnvReply, Environment, Message
from megatron_armor.agentic.tools import InvalidCall, Tool, ToolCall, ToolError, ToolRunner, parse_tool_calls


class ToolEnv(Environment):
    """Offers `tools` through the tokenizer's chat template (their schemas in `tools=`). Each assistant turn's tool
    calls run concurrently on `runner`, and their results come back in order, one "tool" message per call; an
    invalid call (malformed JSON, unknown tool, wrong arguments) is answered with the reason instead and makes the
    turn invalid. A turn without tool calls ends the episode. A tool that raises or times out ends it too, as a
    failure (`ToolError`). Subclasses write `reset` and `score`."""

    def __init__(self, tools: Sequence[Tool], runner: ToolRunner = ToolRunner()) -> None:
        self._tools = {t.name: t for t in tools}
        if len(self._tools) != len(tools):
            raise ValueError(f"tool names must be unique, got {[t.name for t in tools]}")
        cpu_bound = [t.name for t in tools if t.cpu_bound]
        if cpu_bound and runner.processes is None:
            raise ValueError(f"tools {cpu_bound} are cpu_bound: give ToolEnv a ToolRunner(processes=...)")
        self.runner = runner
        self.tools = [t.schema for t in tools]

    async def step(self, messages: Sequence[Message]) -> EnvReply:
        calls = parse_tool_calls(messages[-1]["content"], self._tools)
        if not calls:
            return EnvReply(done=True)
        runs = [self.runner.run(c) for c in calls if isinstance(c, ToolCall)]
        results = iter(await asyncio.gather(*runs, return_exceptions=True))  # all end before any error is raised
        replies = [f"invalid tool call: {c.reason}" if isinstance(c, InvalidCall) else next(results) for c in calls]
        errors = [r for r in replies if isinstance(r, BaseException)]
        if errors:
            error = errors[0] if isinstance(errors[0], ToolError) else ToolError(str(errors[0]))
            error.calls = len(calls)
            raise error
        invalid = sum(isinstance(c, InvalidCall) for c in calls)
        texts = [r if isinstance(c, InvalidCall) else c.tool.result_text(r) for c, r in zip(calls, replies)]
        return EnvReply([{"role": "tool", "content": text} for text in texts], invalid=invalid > 0,
                        tool_calls=len(calls), tool_errors=invalid)
