"""The producer protocols: functional interfaces over an explicit state value.

A producer object holds only configuration and parameters. Everything that changes while a
conversation runs (KV rows, recurrent state, the record of fed tokens, a script cursor) lives in
a *state* value that every method takes and returns anew. Keeping an old state is therefore a
checkpoint, and using it again is a rollback; a session pool is a set of state values.

Three protocols build on each other, mirroring the seed runtime's traits:

* :class:`LogitProducer`: one token in, next-token logits out.
* :class:`ChunkedPrefillRunner`: a whole prompt chunk in one call, held to byte-identity with
  the token-by-token path.
* :class:`SpeculativeProducer`: a drafter side that proposes tokens and a target side that
  verifies a block of them in one pass.

Methods with a default here carry the seed's capability defaults: a producer that does not
override them answers "no reuse", "not evicted", "no chunked drafter prefill", and so on.
Defaults that cannot be honoured raise :class:`~turbospark_jax.errors.UnsupportedCapabilityError`
rather than quietly doing something weaker.

Donation: producers backed by large device buffers may *consume* the buffers of the state they
are given (XLA buffer donation), so that decoding does not copy a KV cache every step. Such a
producer documents it; keep :meth:`SpeculativeProducer.checkpoint` (small, never donated) or a
copy made with :func:`turbospark_jax.state.copy_state` when an old value must stay usable.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import jax

from turbospark_jax.errors import UnsupportedCapabilityError

State = TypeVar("State")
Checkpoint = TypeVar("Checkpoint")

#: Logits are float32 vectors of length ``vocab_size`` (rows of such vectors for ``verify``).
Logits = jax.Array


class LogitProducer(abc.ABC, Generic[State]):
    """Produces next-token logits from a state value, one fed token at a time."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Length of every logits vector this producer returns."""

    @property
    def max_positions(self) -> int | None:
        """How many positions a state can hold, or ``None`` when unbounded."""
        return None

    @abc.abstractmethod
    def init_state(self) -> State:
        """A fresh state: nothing fed, nothing cached."""

    def reset(self, state: State | None = None) -> State:
        """The seed's ``reset``: forget everything and return a fresh initial state.

        ``state`` is accepted so callers can write ``state = p.reset(state)``; it is ignored.
        """
        del state
        return self.init_state()

    def try_reuse_prefix(
        self,
        state: State,
        prompt_ids: Sequence[int],
        *,
        injected: Mapping[int, int] | None = None,
    ) -> tuple[int, State]:
        """Commit to continuing from ``state`` for the leading ``n`` ids of ``prompt_ids``.

        Returns ``(n, new_state)`` where ``new_state`` has been rewound so that exactly the
        first ``n`` prompt tokens are consumed; the caller feeds ``prompt_ids[n:]`` next. This
        is a commitment, not a query: a state that ran past the agreed prefix (the usual case:
        it covers the previous reply, which comes back re-tokenized from text) is moved back.

        Implementations must compare against the ids the state actually *fed*, never against a
        count derived elsewhere, and must stop before any position that consumed input the ids
        do not describe (an injected embedding) unless ``injected`` (position -> identity of the
        embedding the new prompt injects there) names the same embedding. ``n`` never equals
        ``len(prompt_ids)``: at least one token is left to feed, or there would be no logits.

        The default reuses nothing and answers ``(0, fresh state)``.
        """
        del state, prompt_ids, injected
        return 0, self.init_state()

    def session_slot_evicted(self, state: State) -> bool:
        """Whether serving the generation that produced ``state`` discarded another session.

        Answers the narrow question "was a *different* session's non-empty state thrown away
        to make room", not "is a pool configured". ``False`` for producers without a pool.
        """
        del state
        return False

    @abc.abstractmethod
    def produce(self, state: State, token: int, position: int) -> tuple[Logits, State]:
        """Feed ``token`` at ``position`` and return the logits for the next position.

        Returns ``(logits, new_state)``; ``logits`` is float32 of shape ``[vocab_size]``.
        Raises :class:`~turbospark_jax.errors.BadInputError` for an id outside the vocabulary
        or a position that does not continue the state.
        """

    def produce_prefill(self, state: State, token: int, position: int) -> State:
        """Feed a prompt token whose logits nobody will read.

        May skip the output head, but must leave every other part of the state (cache rows,
        cursor, fed record) exactly as :meth:`produce` would. The default calls ``produce``.
        """
        return self.produce(state, token, position)[1]


class ChunkedPrefillRunner(LogitProducer[State]):
    """A producer that takes a whole prompt chunk in one call.

    The bar is byte-identity: after ``prefill_chunk`` the logits and every state leaf must be
    bitwise equal to what feeding the same tokens one by one would leave. Checked against the
    token-by-token path, never against a second chunked run.
    """

    @abc.abstractmethod
    def prefill_chunk(
        self, state: State, tokens: Sequence[int], start_position: int
    ) -> tuple[Logits, State]:
        """Feed ``tokens`` starting at ``start_position``; return the logits after the last one.

        Raises :class:`~turbospark_jax.errors.BadInputError` on an empty chunk.
        """

    def prefill_chunk_with_status(
        self,
        state: State,
        tokens: Sequence[int],
        start_position: int,
        is_final_prompt_chunk: bool,
    ) -> tuple[Logits, State]:
        """Like :meth:`prefill_chunk`, told whether the chunk holds the last prompt token.

        Producers that have no use for the flag keep the plain behaviour (the default).
        """
        del is_final_prompt_chunk
        return self.prefill_chunk(state, tokens, start_position)


class VerifyingTarget(LogitProducer[State], Generic[State, Checkpoint]):
    """The target side of speculative decoding: verify a block in one pass, roll back by value.

    A single model implements this; :class:`SpeculativeProducer` adds a drafter on top.
    """

    @abc.abstractmethod
    def checkpoint(self, state: State) -> Checkpoint:
        """A value that :meth:`rollback` can restore the target from.

        Small by design: producers whose large buffers only ever append keep just the cursor
        and other by-value leaves; the buffers roll back by moving that cursor.
        """

    @abc.abstractmethod
    def rollback(self, state: State, point: Checkpoint) -> State:
        """Return ``state`` with the target restored to ``point``. The drafter is untouched."""

    def record_committed(self, state: State, tokens: Sequence[int], pos0: int) -> State:
        """Record that a round committed ``tokens`` starting at ``pos0``.

        The batched counterpart of the bookkeeping :meth:`produce` does: after a verify only
        the caller knows how much of the block survived. Default: nothing to record.
        """
        del tokens, pos0
        return state

    def supports_retaining_rollback(self) -> bool:
        """Whether :meth:`rollback_retaining` can run. Default: no."""
        return False

    def rollback_retaining(self, state: State, point: Checkpoint, keep_rows: int) -> State:
        """Restore the target to ``point`` but keep the first ``keep_rows`` rows of the last verify.

        Their cache rows stay and any recurrent state is replayed across them, so the verify's
        logits for row ``keep_rows - 1`` remain valid and no re-verify is needed. ``keep_rows``
        counts the confirmed token plus the accepted proposals (the bonus is not fed yet).
        The default refuses: silently doing the expensive thing is how a broken fast path hides.
        """
        del state, point, keep_rows
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} records no verify tape; use rollback and re-verify"
        )

    @abc.abstractmethod
    def verify(self, state: State, feed: Sequence[int], base: int) -> tuple[Logits, State]:
        """Feed ``feed`` through the target from position ``base`` in one pass.

        Returns ``(logits, new_state)`` with ``logits`` of shape ``[len(feed), vocab_size]``;
        row ``i`` predicts the token after ``feed[i]``.
        """


class SpeculativeProducer(VerifyingTarget[State, Checkpoint]):
    """A producer that can draft ahead of itself and verify a block of drafts in one pass.

    Every method is about the *drafter* except :meth:`verify`, :meth:`checkpoint`,
    :meth:`rollback`, :meth:`rollback_retaining` and :meth:`record_committed`, which are about
    the *target*. The two keep separate caches at separate cursors, and a round moves them to
    different places: the target back to where the block started (then forward over what was
    accepted), the drafter to where the accepted prefix ended.
    """

    # -- drafter side -------------------------------------------------------------------

    @abc.abstractmethod
    def prime_drafter(self, state: State, next_token: int, position: int) -> State:
        """Advance the drafter over a known pair during the prompt walk.

        ``next_token`` is the prompt token at ``position + 1``: known, not guessed. Skipping
        this is silent but ruinous: an unprimed drafter reads rows nobody wrote and proposes
        plausible tokens that the target keeps rejecting.
        """

    def supports_chunked_drafter_prefill(self) -> bool:
        """Whether :meth:`prefill_chunk_priming_drafter` is available. Default: no."""
        return False

    def prefill_chunk_priming_drafter(
        self,
        state: State,
        tokens: Sequence[int],
        start_position: int,
        next_token: int | None,
    ) -> tuple[Logits, State]:
        """A chunk through the target's chunked prefill that also primes the drafter.

        Primes the same pairs the token-at-a-time walk would prime with :meth:`prime_drafter`;
        ``next_token`` is the prompt token after the chunk, ``None`` when the chunk ends the
        prompt (that last position is left to the first draft step). Returns the logits after
        the chunk's last token. The default refuses: only called when
        :meth:`supports_chunked_drafter_prefill` is true.
        """
        del state, tokens, start_position, next_token
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} has no chunked drafter prefill; "
            "check supports_chunked_drafter_prefill() and prime token by token instead"
        )

    @abc.abstractmethod
    def draft_step(self, state: State, token: int, position: int) -> tuple[Logits, State]:
        """One drafting step: feed ``token`` at ``position`` to the drafter, return its logits.

        Returns the drafter's full logits so the caller can shape them like the target's and,
        for rejection sampling, keep the proposal distribution.
        """

    def drafts_block_passes(self) -> bool:
        """Whether this drafter proposes a whole block in one pass (:meth:`draft_block`).

        A property of the producer, asked once per round; a step-wise drafter never sees
        ``draft_block`` and a block drafter never sees ``draft_step``. Default: no.
        """
        return False

    def draft_block(
        self, state: State, anchor: int, base: int, block: int
    ) -> tuple[list[int], State]:
        """Propose ``block`` tokens for positions ``base + 1 .. base + block`` in one pass.

        ``anchor`` is the committed token at ``base``. Returns ``(proposals, new_state)``. The
        default refuses rather than drafting one token, which would pass every losslessness
        check while quietly proposing blocks of one.
        """
        del state, anchor, base, block
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} drafts step by step; drive it with draft_step"
        )

    @abc.abstractmethod
    def rewind_drafter(self, state: State, position: int) -> State:
        """Move the drafter's cursor to ``position``, where the accepted prefix ended."""

    def supports_headless_prefill(self) -> bool:
        """Whether :meth:`produce_prefill` (which may skip the head) can drive the drafter.

        False by default: a drafter that reads the post-head hidden state would be primed
        from stale values by a headless prefill.
        """
        return False


def capabilities(producer: Any) -> dict[str, bool]:
    """What a producer offers, for logs and error messages."""
    caps = {
        "chunked_prefill": isinstance(producer, ChunkedPrefillRunner),
        "speculative": isinstance(producer, SpeculativeProducer),
    }
    if isinstance(producer, SpeculativeProducer):
        caps.update(
            chunked_drafter_prefill=producer.supports_chunked_drafter_prefill(),
            block_drafter=producer.drafts_block_passes(),
            headless_prefill=producer.supports_headless_prefill(),
            retaining_rollback=producer.supports_retaining_rollback(),
        )
    return caps
