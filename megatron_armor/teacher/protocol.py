"""SGLang's prefill-only scoring form of `POST /generate`, as pure functions (sglang.md §2).

A teacher scores token sequences it did not generate: `input_ids` is a batch (list of lists),
`sampling_params.max_new_tokens` is 0, `return_logprob` is true and `logprob_start_len` 0. Each
output item's `meta_info.input_token_logprobs` holds one `[logprob, token_id, null]` triple per
input token; the first token has no context, so its logprob is null. Logprobs are
log_softmax(logits / temperature) of the token that was there, as SGLang computes them.

Shared by the client (`scorer.TeacherClient`) and our Megatron server (`server`), so both speak
one dialect, which a real SGLang server also speaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScoreRequest:
    """sequences: token ids to score, each of length L >= 1; temperature > 0."""

    sequences: list[list[int]]
    temperature: float


def score_request_body(request: ScoreRequest) -> dict[str, Any]:
    """The /generate body that asks for the logprob of every token of every sequence."""
    return {
        "input_ids": [list(s) for s in request.sequences],
        "sampling_params": {"max_new_tokens": 0, "temperature": request.temperature},
        "return_logprob": True, "logprob_start_len": 0, "stream": False,
    }


def parse_score_request(body: dict[str, Any], vocab_size: int) -> ScoreRequest:
    """A /generate body -> ScoreRequest; ValueError (the server answers 400) for anything but scoring."""
    sequences = body.get("input_ids")
    if not isinstance(sequences, list) or not sequences or not all(isinstance(s, list) and s for s in sequences):
        raise ValueError("input_ids must be a non-empty batch (list) of non-empty token id lists")
    for row, seq in enumerate(sequences):
        bad = [t for t in seq if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"input_ids[{row}] holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    params = body.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params]
    if any(int(p.get("max_new_tokens", 128)) != 0 for p in params):
        raise ValueError("this server only scores: send sampling_params.max_new_tokens = 0")
    temperatures = {float(p.get("temperature", 1.0)) for p in params}
    if len(temperatures) != 1 or min(temperatures) <= 0:
        raise ValueError(f"sampling_params.temperature must be one value > 0 for the whole batch, got {sorted(temperatures)}")
    if not body.get("return_logprob") or body.get("logprob_start_len") != 0:
        raise ValueError("scoring needs return_logprob = true and logprob_start_len = 0")
    return ScoreRequest([list(s) for s in sequences], temperatures.pop())


def score_item_body(sequence: Sequence[int], logprobs: Sequence[float], rid: str, weight_version: str) -> dict[str, Any]:
    """One output item: `logprobs` [L - 1] are those of tokens 1..L-1 of `sequence` [L]."""
    triples = [[None, sequence[0], None]] + [[lp, t, None] for lp, t in zip(logprobs, sequence[1:])]
    return {
        "output_ids": [],
        "meta_info": {
            "id": rid, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(sequence),
            "completion_tokens": 0, "cached_tokens": 0, "weight_version": weight_version,
            "input_token_logprobs": triples, "output_token_logprobs": [],
        },
    }


def parse_score_response(sequences: Sequence[Sequence[int]], body: Any) -> list[list[float]]:
    """A /generate reply -> per sequence [L - 1] logprobs of tokens 1..L-1.

    ValueError when the reply does not score exactly the tokens that were sent.
    """
    if not isinstance(body, list) or len(body) != len(sequences):
        got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
        raise ValueError(f"/generate returned {got} items for a batch of {len(sequences)} sequences")
    scores = []
    for row, (seq, item) in enumerate(zip(sequences, body)):
        triples = (item.get("meta_info") or {}).get("input_token_logprobs")
        if triples is None or [int(t[1]) for t in triples] != list(seq):
            raise ValueError(f"item {row} of the /generate reply does not score the {len(seq)} input tokens that were "
                             "sent (meta_info.input_token_logprobs missing or different)")
        scores.append([float(t[0]) for t in triples[1:]])
    return scores
