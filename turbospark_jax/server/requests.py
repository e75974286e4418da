"""What a client hands the serving engine and what it hears back.

A :class:`ServeRequest` goes to :meth:`~turbospark_jax.server.engine.Engine.submit` with a
``sink`` callable; the engine calls the sink from its scheduler thread with zero or more
:class:`Delta`, then exactly one :class:`Done` or :class:`Failed` (none after the
:class:`Ticket` is cancelled). A request with several choices gets each choice's events
stamped with its ``index``; :func:`choice_seed` says which seed each choice samples with. An
:class:`EngineObserver` hears about requests and steps (the metrics collector is one).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from turbospark_jax.core.checks import as_int
from turbospark_jax.generation.completion import Completion, CompletionRequest, TokenLogprob

if TYPE_CHECKING:
    from turbospark_jax.server.engine import Engine

__all__ = ["SHUTDOWN_MESSAGE", "UNAVAILABLE_RETRY_S", "Delta", "Done", "EngineObserver", "Event",
           "Failed", "ServeRequest", "Sink", "Ticket", "choice_seed"]


def choice_seed(seed: int, index: int) -> int:
    """The seed choice ``index`` of a request with several choices samples with.

    Choice 0 keeps ``seed``, so a request's first choice is the request with one choice;
    choice ``i > 0`` takes the first 8 bytes (little-endian) of the BLAKE2b digest of the
    text ``"{seed}:{i}"``, a seed in ``[0, 2**64)`` that no nearby seed's choices share. A
    choice is reproduced alone by sending this seed with one choice.

    Raises:
      BadInputError: ``seed`` or ``index`` is not a non-negative integer.
    """
    seed, index = as_int("seed", seed, low=0), as_int("index", index, low=0)
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclasses.dataclass(frozen=True)
class ServeRequest:
    """One request to the engine.

    Fields:
      completion: what to generate (its ``prompt_ids`` are the whole prompt).
      session_id: the session to continue, or ``None`` to let the engine pick a slot.
      top_logprobs: ``None`` for no log-probabilities; else report the chosen token's and this
        many alternatives' (0..20) per token.
      n: how many choices to generate (at most the engine's slots); choice ``i`` samples
        with :func:`choice_seed` of the completion's seed and ``i``, and its events carry
        ``index = i``. Only choice 0 continues the named session's slot.
    """

    completion: CompletionRequest
    session_id: str | None = None
    top_logprobs: int | None = None
    n: int = 1


@dataclasses.dataclass(frozen=True)
class Delta:
    """Text released by one generated token (possibly empty while a stop string is undecided).

    Fields:
      text: the released text.
      token_ids: the tokens it accounts for.
      logprobs: one entry per token when the request asked for them.
      index: the choice it belongs to (0 for a request with one choice).
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    index: int = 0


@dataclasses.dataclass(frozen=True)
class Done:
    """The request ended normally.

    Fields:
      completion: the whole result; ``usage.slot`` and ``usage.evicted`` are filled in (slot
        ``None`` for a speculative request); ``completion.text`` is every delta's text joined.
      logprobs: every generated token's entry (when asked for).
      tail: text released at the end (held back for a stop string that did not complete).
      index: the choice it belongs to.
    """

    completion: Completion
    logprobs: list[TokenLogprob]
    tail: str
    index: int = 0


@dataclasses.dataclass(frozen=True)
class Failed:
    """The request (or one of its choices, ``index``) failed after it started; the text
    already streamed stays valid. ``shutdown``: the engine shut down before it ended (a
    retry elsewhere or later may succeed)."""

    message: str
    index: int = 0
    shutdown: bool = False


Event = Delta | Done | Failed

#: The retry hint of a refusal because the engine takes no work (a restart takes a while).
UNAVAILABLE_RETRY_S = 5.0

#: Why a request cut off by a shutdown ended.
SHUTDOWN_MESSAGE = "the server shut down before the reply was complete"
Sink = Callable[[Event], None]


class EngineObserver:
    """What the engine tells a metrics collector; every hook does nothing by default."""

    def request_started(self, prompt_tokens: int, cached_tokens: int, evicted: bool) -> None:
        """A request got its slot and reused ``cached_tokens`` of its prompt."""

    def prefix_shared(self, tokens: int) -> None:
        """A request's reused ``tokens`` came from another slot's row or kept copy (they are
        among its ``cached_tokens`` too)."""

    def first_token(self, seconds: float) -> None:
        """A request's first token came ``seconds`` after it was submitted."""

    def next_token(self, seconds: float) -> None:
        """A later token came ``seconds`` after the request's previous one."""

    def request_ended(self, outcome: str, generated: int) -> None:
        """A request ended (``outcome``: a finish reason, ``error`` or ``cancelled``); each
        choice of a request with several ends on its own."""

    def choices(self, n: int) -> None:
        """A request asking for ``n > 1`` choices was queued."""

    def step(self, rows: int, seconds: float) -> None:
        """One batched decode step advanced ``rows`` requests in ``seconds``."""

    def prefill(self, rows: int, tokens: int) -> None:
        """One prefill call fed ``tokens`` prompt tokens over ``rows`` requests."""


class Ticket:
    """A submitted request: cancel it when its client goes away."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.cancelled = False

    def cancel(self) -> None:
        """Stop the request; its slot is free before the next decode step. Idempotent."""
        self.cancelled = True
        self._engine._wake()
