"""The environment interface: what a multi-turn task gives the policy, answers it with, and scores.

An environment is a class named in the config as `package.module:Class` or `path/to/file.py:Class`
(`load_environment`). The driver (agentic/driver.py) makes one instance per trajectory, so an instance may keep the
episode's state in attributes. Its methods may be plain functions (run in a worker thread, off the event loop) or
coroutines (awaited on the loop: for I/O-bound work).

    class Countdown(Environment):
        def reset(self, row):                      # the first messages of an episode
            self.answer = row["answer"]
            return [{"role": "user", "content": row["prompt"]}]
        def step(self, messages):                  # answer the last assistant turn
            return EnvReply([{"role": "user", "content": "Go on."}], done=len(messages) >= 5)
        def score(self, messages):                 # reward of the finished trajectory
            return float(self.answer in messages[-1]["content"])
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_armor.agentic.render import Message
from megatron_armor.config.plugins import import_attribute


class MalformedMessages(ValueError):
    """An environment answered something other than a list of {"role": str, "content": str} messages."""


@dataclass
class EnvReply:
    """An environment's answer to an assistant turn.

    messages: the new messages (tool results, a simulated user's reply); done: the episode ends here (`messages`
    are then not shown to the policy); reward: this turn's reward, if the environment gives per-turn rewards;
    invalid: the turn was unusable (e.g. malformed tool calls): the driver ends the trajectory `aborted` after
    `rollout.agentic.max_invalid_turns` such turns in a row; tool_calls / tool_errors: counts for the metrics.
    """

    messages: list[Message] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    invalid: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(abc.ABC):
    """One episode of a multi-turn task (module docstring). `tools`: the JSON schemas offered to the chat template
    (`apply_chat_template(tools=...)`), or None."""

    tools: list[dict] | None = None

    @abc.abstractmethod
    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """The conversation's first messages for dataset row `row`."""

    @abc.abstractmethod
    def step(self, messages: Sequence[Message]) -> EnvReply:
        """Answer the conversation so far, whose last message is the policy's turn."""

    @abc.abstractmethod
    def score(self, messages: Sequence[Message]) -> float:
        """The trajectory's reward, once it has ended."""

    def close(self) -> None:
        """Release what the episode holds (processes, files); called once, however the episode ended."""


def check_messages(messages: Any, source: str) -> list[Message]:
    """`messages` if it is a list of chat messages (each a dict with str "role" and "content"), else
    MalformedMessages naming `source` and the first bad item."""
    if not isinstance(messages, list):
        raise MalformedMessages(f"{source} returned {type(messages).__name__}, not a list of messages")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise MalformedMessages(f"{source} returned a malformed message at index {i}: {message!r:.200} (each "
                                    "message must be a dict with string 'role' and 'content')")
    return messages


def load_environment(path: str) -> type[Environment]:
    """The `Environment` subclass named by `path` (`package.module:Class` or `path/to/file.py:Class`)."""
    cls = import_attribute(path, "environment", "package.module:Class")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {path!r} is {cls!r}, not a subclass of megatron_armor.agentic.environment."
                         "Environment")
    return cls
