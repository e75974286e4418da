"""One request's work inside the serving engine.

A request on the batched path is one :class:`Job` per choice: its slot, how far its prompt
is fed, its emission (stop tokens, detokenizer, stop strings, ``max_tokens``), its constraint
and the log-probabilities it reports. The scheduler (:class:`~turbospark_jax.server.engine.Engine`)
decides when a job's row is fed and drawn; a job turns each drawn token into its events
(:meth:`Job.push`) and says what its next draw may pick (:meth:`Job.constrain`).

A speculative request holds no slot: :func:`run_speculative` runs it on the speculative
loop's stream, in a thread of its own, and sends its events the same way.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from turbospark_jax.core import sampling
from turbospark_jax.core.constraints import Constraint
from turbospark_jax.core.kv_prefix import NOT_INJECTED
from turbospark_jax.core.streams import Stream
from turbospark_jax.generation.completion import Completion, Emission, FinishReason, TokenLogprob
from turbospark_jax.server.requests import (
    SHUTDOWN_MESSAGE,
    Delta,
    Done,
    EngineObserver,
    Failed,
    ServeRequest,
    Sink,
    Ticket,
)
from turbospark_jax.server.slots import SlotRecord

__all__ = ["ChoiceGroup", "Job", "indexed_sink", "run_speculative"]


@dataclasses.dataclass(eq=False)
class ChoiceGroup:
    """The choices of one request with ``n > 1``: where the first one's row stood one token
    short of the prompt's end (``None`` until its prefill gets there)."""

    saved: Any = None


def indexed_sink(sink: Sink, index: int) -> Sink:
    """``sink`` with every event stamped as choice ``index``'s."""
    return lambda event: sink(dataclasses.replace(event, index=index))


@dataclasses.dataclass(eq=False)
class Job:
    """One choice of a request on the batched path, from its queueing to its end."""

    request: ServeRequest
    sink: Sink
    ticket: Ticket
    params: sampling.SamplingParams
    emission: Emission
    submitted: float
    slot: SlotRecord | None = None
    reused: int = 0
    shared_from: SlotRecord | None = None  # the other slot whose row or copy it started from
    evicted: bool = False
    fed: int | None = None  # prompt positions the row holds while prefilling (None: not set up)
    decoding: bool = False
    prefill_s: float = 0.0
    first_token_s: float = 0.0
    last_token_at: float = 0.0
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    constraint: Constraint | None = None
    forced: list[int] = dataclasses.field(default_factory=list)  # taken, not yet drawn
    drawing_forced: bool = False  # the mask of the call in flight holds one forced token
    index: int = 0  # the choice it is of its request
    group: ChoiceGroup | None = None  # the request's choices, when it has several

    @property
    def prompt(self) -> list[int]:
        return self.emission.prompt

    @property
    def injection(self) -> Any:
        """The request's injected embeddings (images), or ``None``."""
        return self.request.completion.injection

    @property
    def follows(self) -> bool:
        """Whether it starts from the first choice's copy rather than a prefill of its own."""
        return self.group is not None and self.index > 0

    @property
    def session(self) -> str | None:
        """The session whose slot it continues (choice 0 only)."""
        return self.request.session_id if self.index == 0 else None

    def marks(self, count: int) -> tuple[int, ...] | None:
        """The image identity each of the prompt's first ``count`` positions takes (0: its
        token's own embedding), or ``None`` for a prompt without images."""
        if self.injection is None:
            return None
        identities = self.injection.identity_map()
        return tuple(identities.get(i, NOT_INJECTED) for i in range(count))

    def fed_so_far(self) -> tuple[int, ...]:
        """What the job's row holds when it stops before its end: a decoding row its prompt
        as the prefill wrote it, a prefilling one the part fed so far, one not yet set up the
        slot's previous state."""
        if self.fed is None:
            return self.slot.fed_ids
        return tuple(self.prompt[: len(self.prompt) if self.decoding else self.fed])

    def image_rows(self, end: int, model: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """The injected identities and embedding rows of the prompt positions from
        :attr:`fed` to ``end`` (the next chunk), or ``None`` when no position there takes an
        image's embedding."""
        injection = self.injection
        if injection is None:
            return None
        count = end - self.fed
        rows, identities = injection.rows_for(self.fed, count)
        hit = rows >= 0
        if not hit.any():
            return None
        embeds = np.zeros((count, model.embedding_size), model.embedding_dtype)
        embeds[hit] = np.asarray(injection.embeds)[rows[hit]]
        return identities, embeds

    def constrain(self, allowed: np.ndarray, *, first: bool) -> None:
        """Write the mask of the job's next draw into ``allowed`` (its row of the call's
        masks): its forced token alone while it has a forced run to emit (taken from the
        constraint after its first token, as the plain driver takes it), else the
        constraint's mask. The job must have a constraint."""
        if not first and not self.forced:
            left = self.request.completion.max_tokens - len(self.emission.tokens)
            self.forced = self.constraint.forced(left)
        self.drawing_forced = bool(self.forced)
        if self.forced:
            allowed[:] = False
            allowed[self.forced[0]] = True
        else:
            allowed[:] = self.constraint.allowed_mask()

    def push(self, token: int, row: Any, lp: Any, top_ids: Any,
             top_lp: Any) -> FinishReason | None:
        """Take one drawn token: record its log-probabilities (when asked for), advance the
        constraint, send the text it releases; returns why the job ends there, or ``None``."""
        entries = []
        wanted = self.request.top_logprobs
        if wanted is not None:
            top = tuple((int(t), float(v)) for t, v in zip(top_ids[:wanted], top_lp[:wanted],
                                                           strict=True))
            entries = [TokenLogprob(token=token, logprob=float(lp), top=top)]
            self.logprobs += entries
        c = self.constraint
        if c is not None:
            if self.drawing_forced:
                self.forced.pop(0)
            else:
                c.advance(token)
        event, finish = self.emission.push(token, row)
        if c is not None:
            if finish is None and c.is_done and not self.forced:
                finish = FinishReason.CONSTRAINT_END
            elif finish is FinishReason.LENGTH and not c.is_satisfied:
                finish = FinishReason.CONSTRAINT_UNMET
        if event is not None:
            self.sink(Delta(text=event.text, token_ids=list(event.token_ids), logprobs=entries))
        elif entries:
            self.sink(Delta(text="", token_ids=[token], logprobs=entries))
        return finish


def run_speculative(stream: Stream[Completion], sink: Sink, ticket: Ticket,
                    observer: EngineObserver, lock: threading.Lock,
                    cut: Callable[[], bool]) -> None:
    """Run one speculative request's ``stream`` to its end under ``lock`` (one such request
    at a time), sending its events to ``sink``; a cancelled ``ticket`` stops it silently and
    ``cut()`` (the engine's shutdown grace is over) ends it as
    :class:`~turbospark_jax.server.requests.Failed` marked ``shutdown``."""
    submitted = time.perf_counter()
    with lock:
        first = True
        with stream:
            for event in stream:
                if ticket.cancelled:
                    observer.request_ended("cancelled", 0)
                    return
                if cut():
                    observer.request_ended("shutdown", 0)
                    sink(Failed(SHUTDOWN_MESSAGE, shutdown=True))
                    return
                if first:
                    observer.first_token(time.perf_counter() - submitted)
                    first = False
                sink(Delta(text=event.text, token_ids=list(event.token_ids), logprobs=[]))
        completion = stream.result
    assert completion is not None
    observer.request_ended(completion.finish_reason.value, len(completion.token_ids))
    if completion.finish_reason is FinishReason.ERROR:
        sink(Failed(completion.error or "generation failed"))
    else:
        sink(Done(completion=dataclasses.replace(completion, state=None), logprobs=[], tail=""))
