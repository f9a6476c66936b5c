"""Chat-template families written here (Jinja strings), and a small byte-level BPE tokenizer trained locally to carry
them: what the token-exact tests, the benchmark and the examples render conversations with (no hub downloads).

Each `ChatFormat` names its template and the token that ends an assistant turn. The families cover what breaks
token exactness in practice: ChatML (Qwen 2.5), Llama 3 headers, a ChatML variant that strips `<think>` reasoning from
every assistant message but the last (Qwen 3), and a ChatML variant that groups the results of parallel tool calls
into one turn. Tool calls are written by the model as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Hermes style) in every family; tool results come back as messages of role "tool".

Templates are written for transformers' Jinja environment (`trim_blocks`, `lstrip_blocks`): it drops a newline
right after a block tag, so one needed there is written `{{ '\\n' }}`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
)

_TOOLS_BLOCK = ("# Tools\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.\n"
                "{% for t in tools %}{{ t | tojson }}\n{% endfor %}")
_CHATML_SYSTEM = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    + _TOOLS_BLOCK + "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
)
_CHATML_TURN = "<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n{{ content }}<|im_end|>\n"
_CHATML_GENERATION = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"

CHATML = (_CHATML_SYSTEM + "{% for m in messages %}{% if m.role != 'system' %}{% set content = m.content %}"
          + _CHATML_TURN + "{% endif %}{% endfor %}" + _CHATML_GENERATION)

# Qwen 3's rule: an assistant message that is not the last one loses its reasoning (what precedes `</think>`).
CHATML_STRIP_THINK = (
    _CHATML_SYSTEM + "{% for m in messages %}{% if m.role != 'system' %}{% set content = m.content %}"
    "{% if m.role == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    + _CHATML_TURN + "{% endif %}{% endfor %}" + _CHATML_GENERATION
)

# Consecutive tool results (one per call of a parallel turn) share one user turn, each in <tool_response> tags.
CHATML_PARALLEL_TOOLS = (
    _CHATML_SYSTEM + "{% for m in messages %}{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role != 'system' %}{% set content = m.content %}" + _CHATML_TURN + "{% endif %}{% endfor %}"
    + _CHATML_GENERATION
)

# Llama 3: header tokens around the role, <|eot_id|> ends every turn, tool results come from role "ipython".
LLAMA3 = (
    "<|begin_of_text|>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}" + _TOOLS_BLOCK + "<|eot_id|>"
    "{% elif messages[0].role == 'system' %}<|start_header_id|>system<|end_header_id|>\n\n{{ messages[0].content }}"
    "<|eot_id|>{% endif %}{% for m in messages %}{% if m.role != 'system' %}"
    "<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and the special token that ends an assistant turn (the policy's stop token)."""

    name: str
    template: str
    end_of_turn: str


CHAT_FORMATS: dict[str, ChatFormat] = {f.name: f for f in (
    ChatFormat("chatml", CHATML, "<|im_end|>"),
    ChatFormat("llama3", LLAMA3, "<|eot_id|>"),
    ChatFormat("chatml_strip_think", CHATML_STRIP_THINK, "<|im_end|>"),
    ChatFormat("chatml_parallel_tools", CHATML_PARALLEL_TOOLS, "<|im_end|>"),
)}

_CORPUS = (
    "The answer is 42. Let me think step by step about it.\n",
    "Compute 12 + 7 * 3 - 5 = 28, then divide by 4.\n",
    '{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}\n',
    "print(sum(range(10)))\nresult = 45\nError: division by zero\n",
    "user assistant system tool ipython\n\n",
)


def make_chat_tokenizer(chat_format: str = "chatml", vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes; merges span characters, so re-encoding decoded text need not
    give back the sampled ids) trained on a few lines of arithmetic, code and tool-call JSON, with `SPECIAL_TOKENS`
    and the chat template of `CHAT_FORMATS[chat_format]`. `vocab_size` counts the special tokens: a model for it
    needs at least that many embedding rows. EOS and padding: `<|endoftext|>` (id 0)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=list(SPECIAL_TOKENS[1:]))
    fast.chat_template = CHAT_FORMATS[chat_format].template
    return fast
