"""Engine results written as OpenAI response objects: bodies, stream chunks, logprobs, usage."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

from turbospark_jax.generation.completion import Completion, FinishReason, TokenLogprob

__all__ = ["TokenTexts", "chat_logprobs", "finish_reason", "text_logprobs", "usage"]


def finish_reason(completion: Completion) -> str:
    """OpenAI's ``finish_reason``: ``length`` when ``max_tokens`` ended it (a constrained reply
    still incomplete included), else ``stop``."""
    ended = completion.finish_reason
    return "length" if ended in (FinishReason.LENGTH, FinishReason.CONSTRAINT_UNMET) else "stop"


def usage(completions: Sequence[Completion], session_id: str | None) -> dict[str, Any]:
    """OpenAI's usage over a request's choices (``completions``, choice 0 first): the prompt
    counted once, the generated tokens of every choice; ``cached_tokens`` the prompt tokens
    choice 0 reused from a slot's state, its own or another's (the other choices start from
    its copy and prefill nothing but the prompt's last token). Plus where it ran: ``slot``
    (choice 0's), ``evicted`` (whether some choice discarded another session's state) and
    ``session_id``."""
    first = completions[0].usage
    generated = sum(c.usage.generated_tokens for c in completions)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": first.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": first.reused_tokens},
        "slot": first.slot,
        "evicted": any(bool(c.usage.evicted) for c in completions),
        "session_id": session_id,
    }


class TokenTexts:
    """Each id's own text (``decode([id])``), cached: what logprobs name tokens by."""

    def __init__(self, tokenizer: Any) -> None:
        self._text = functools.lru_cache(maxsize=65536)(
            lambda i: tokenizer.decode([i]) if tokenizer is not None else str(i)
        )

    def __call__(self, token: int) -> str:
        return self._text(int(token))


def text_logprobs(entries: list[TokenLogprob], texts: TokenTexts, offset: int) -> dict[str, Any]:
    """``/v1/completions`` logprobs: tokens, their logprobs, top alternatives, text offsets."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(texts(e.token))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{texts(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """``/v1/chat/completions`` logprobs: ``{"content": [token, logprob, bytes, top]}``."""

    def one(token: int, lp: float) -> dict[str, Any]:
        text = texts(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [
        {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
        for e in entries
    ]}


def now() -> int:
    """``created``: seconds since the epoch."""
    return int(time.time())
