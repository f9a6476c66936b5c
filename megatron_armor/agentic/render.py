"""A conversation as token ids under the tokenizer's chat template, and the template's delta after an assistant
turn: the only place the agentic layer turns text into tokens.

The policy's sampled tokens are never decoded and re-encoded into a trajectory. After a turn the trajectory grows by
`ChatRenderer.continuation`: the text that closes the assistant turn (the template's footer, less the stop token the
policy sampled) and the rendered new messages with the next generation prompt, encoded on their own. Both pieces
are read off renders of a fixed probe conversation, so they depend only on the template, never on what the policy
wrote. `ChatRenderer.ids` renders a whole conversation: the canonical form a trajectory is checked against
(`trajectory.TrajectoryBuilder`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from transformers import PreTrainedTokenizerBase

Message = Mapping[str, Any]  # {"role": str, "content": str, ...}: a chat message as templates read it

# The probe conversation the template's pieces are read from.
_PROBE_USER = {"role": "user", "content": "x"}
_PROBE_REPLY = "y"


class TemplateError(ValueError):
    """A chat template that does not render a conversation as its earlier renders followed by new text."""


class ChatRenderer:
    """Renders conversations with `tokenizer`'s chat template, offering `tools` (JSON schemas, as
    `apply_chat_template(tools=...)` takes them) in every render; `stop_token_ids` end an assistant turn."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_token_ids: Sequence[int],
                 tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        if tokenizer.chat_template is None:
            raise TemplateError("the tokenizer has no chat_template; set one (agentic/chat_templates.py has examples)")
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(stop_token_ids)
        self.tools = list(tools) if tools else None

    def text(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens written in it included, nothing added (no BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def ids(self, messages: Sequence[Message], *, generation_prompt: bool) -> list[int]:
        """The canonical token ids of a conversation: its full render, encoded at once."""
        return self.encode(self.text(messages, generation_prompt=generation_prompt))

    def assistant_message(self, sampled_ids: Sequence[int]) -> dict[str, str]:
        """The assistant message of a turn: its sampled tokens decoded (special tokens kept), the stop token that
        ended it left out (the template writes that itself)."""
        if sampled_ids and sampled_ids[-1] in self.stop_token_ids:
            sampled_ids = sampled_ids[:-1]
        return {"role": "assistant", "content": self.tokenizer.decode(list(sampled_ids), skip_special_tokens=False)}

    @cached_property
    def _probe(self) -> tuple[str, str]:
        """(the probe's render up to the end of its assistant turn, the template's footer after assistant content)."""
        header = self.text([_PROBE_USER], generation_prompt=True)
        turn = [_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}]
        closed = self.text(turn, generation_prompt=False)
        if not closed.startswith(header + _PROBE_REPLY):
            raise TemplateError(f"the chat template does not render an assistant message as the generation prompt "
                                f"followed by its content: {header!r} + {_PROBE_REPLY!r} is no prefix of {closed!r}")
        return closed, closed[len(header) + len(_PROBE_REPLY):]

    def continuation(self, sampled_ids: Sequence[int], new_messages: Sequence[Message]) -> list[int]:
        """The ids that follow an assistant turn's `sampled_ids` in the next prompt: the rest of the turn's footer (all
        of it when no stop token ended the turn, e.g. a turn cut at its token limit), then `new_messages` as the
        template renders them after an assistant turn, then the generation prompt."""
        closed, footer = self._probe
        stop = self.tokenizer.decode(list(sampled_ids[-1:]), skip_special_tokens=False) if (
            sampled_ids and sampled_ids[-1] in self.stop_token_ids) else ""
        closing = footer[len(stop):] if stop and footer.startswith(stop) else footer
        after = self.text([_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}, *new_messages],
                          generation_prompt=True)
        if not after.startswith(closed):
            raise TemplateError(f"the chat template renders earlier messages differently once {len(new_messages)} "
                                f"more follow ({closed!r} is no prefix of {after!r})")
        return self.encode(closing + after[len(closed):])
