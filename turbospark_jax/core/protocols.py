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

Capabilities are declared, never probed: each optional one is a ``supports_*`` / ``can_*``
answer next to the method it unlocks, with the seed's refusing default ("no reuse", "no
chunked drafter prefill", "no retaining rollback", ...), and an optional family of methods
(:class:`DeviceDecoder`) is a mixin a producer inherits. Defaults that cannot be honoured raise
:class:`~turbospark_jax.errors.UnsupportedCapabilityError` rather than quietly doing something
weaker.

Donation: producers backed by large device buffers may *consume* the buffers of the state they
are given (XLA buffer donation), so that decoding does not copy a KV cache every step. Such a
producer documents it; keep :meth:`SpeculativeProducer.checkpoint` (small, never donated) or a
copy made with :func:`turbospark_jax.core.state.copy_state` when an old value must stay usable.

Preconditions are checks: every method refuses, before any work, a state that is not one of
its producer's (:meth:`LogitProducer.check_state`), an id that is not an integer inside the
vocabulary, a position that does not continue the state, a count of the wrong type or range,
raising :class:`~turbospark_jax.errors.BadInputError` (``ContextOverflowError`` for length),
so the state handed in is untouched and still usable.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import jax
import numpy as np

from turbospark_jax.core.checks import as_token_ids
from turbospark_jax.core.state import FedRecord
from turbospark_jax.errors import UnsupportedCapabilityError

State = TypeVar("State")
Checkpoint = TypeVar("Checkpoint")

#: Logits are float32 vectors of length ``vocab_size`` (rows of such vectors for ``verify``).
Logits = jax.Array

#: How a device burst ended (``DecodeBurst.finish``, and the speculative rounds' bursts).
RUNNING, STOPPED_ON_TOKEN, NON_FINITE = 0, 1, 2


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

    @property
    def accepts_embeddings(self) -> bool:
        """Whether prompts may carry injected embeddings (images in placeholder spans).

        A producer that says so takes ``injection=`` (a
        :class:`~turbospark_jax.core.injection.Injection` for the whole prompt) as a keyword of
        :meth:`produce`, :meth:`produce_prefill` and, when it is a
        :class:`ChunkedPrefillRunner`, of ``prefill_chunk`` and ``prefill_chunk_with_status``;
        each call injects the rows that fall on the positions it feeds and records their
        identities in the fed record. Default: no (token ids only)."""
        return False

    @abc.abstractmethod
    def init_state(self) -> State:
        """A fresh state: nothing fed, nothing cached."""

    def reset(self, state: State | None = None) -> State:
        """The seed's ``reset``: forget everything and return a fresh initial state.

        ``state`` is accepted so callers can write ``state = p.reset(state)``; it is ignored.
        """
        del state
        return self.init_state()

    def check_state(self, state: State) -> None:
        """Refuse, before any work, a value that is not a usable state of this producer.

        Every method that takes a state runs this check first, and the loops run it on a
        state handed in before they start. The default accepts anything: a producer that
        cannot tell its states apart says nothing rather than guess.

        Raises:
          BadInputError: ``state`` is not a state this producer made (another type, another
            model's layout, another producer's), or its buffers were consumed by donation.
        """
        del state

    @abc.abstractmethod
    def fed_record(self, state: State) -> FedRecord:
        """The record of what ``state`` has consumed, position by position: reuse, history
        bookkeeping and speculative commits key on it (docs/design.md, "Keyed on what was
        fed")."""

    @property
    def can_rewind(self) -> bool:
        """Whether :meth:`rewind` can move a state back to any earlier position. Default: no
        (a recurrent state summarises every fed token and cannot be cut)."""
        return False

    def rewind_floor(self, state: State) -> int:
        """The earliest position :meth:`rewind` (and a rollback) can move ``state`` back to:
        0 when every row is kept; a sliding-window ring's oldest still-needed row otherwise.
        Meaningless (the default answers the cursor) when the producer cannot rewind."""
        return 0 if self.can_rewind else int(self.fed_record(state).count)

    def rewind(self, state: State, count: int) -> State:
        """``state`` as if it had consumed only its first ``count`` positions.

        Raises:
          UnsupportedCapabilityError: the producer cannot rewind (the default).
          BadInputError: ``count`` is negative or past what the state has consumed.
        """
        del state, count
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} cannot rewind a state; keep a checkpoint and roll back"
        )

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

        Raises:
          BadInputError: ``prompt_ids`` is empty (no answer can be shorter than it) or holds
            something other than token ids of this vocabulary; ``state`` is not one of ours.
        """
        self.check_state(state)
        require_prompt(prompt_ids, self.vocab_size)
        del state, injected
        return 0, self.init_state()

    @abc.abstractmethod
    def produce(self, state: State, token: int, position: int) -> tuple[Logits, State]:
        """Feed ``token`` at ``position`` and return the logits for the next position.

        Returns ``(logits, new_state)``; ``logits`` is float32 of shape ``[vocab_size]``.
        Raises :class:`~turbospark_jax.errors.BadInputError` for an id outside the vocabulary
        (or not an integer), a position that does not continue the state, or a state that is
        not this producer's; ``ContextOverflowError`` when the state is full.
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

        Raises :class:`~turbospark_jax.errors.BadInputError` on an empty chunk, ids that are
        not integers of the vocabulary, or a start that does not continue the state;
        ``ContextOverflowError`` when the chunk does not fit.
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

    def supports_parallel_prefill(self) -> bool:
        """Whether :meth:`prefill_parallel` is available. Default: no."""
        return False

    def prefill_parallel(
        self, state: State, tokens: Sequence[int], start_position: int, *, chunk: int = 2048
    ) -> tuple[Logits, State]:
        """A faster prefill in wide batched passes, equal to :meth:`prefill_chunk` only within
        a tolerance the producer states (never part of a bitwise guarantee). The default
        refuses: only called when :meth:`supports_parallel_prefill` is true."""
        del state, tokens, start_position, chunk
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} has no parallel prefill; use prefill_chunk"
        )


@dataclasses.dataclass(frozen=True)
class DeviceBurst:
    """The host view of one burst run on the device (plain decode steps or speculative rounds).

    Fields:
      tokens: the tokens emitted, in order (a stop token included when one ended the burst).
      finish: RUNNING (budget used), STOPPED_ON_TOKEN or NON_FINITE (the tokens before the
        failing step are kept).
      history: the penalty bookkeeping after the last emitted token.
      logits: float32 ``[len(tokens), V]``, read back to the host: row ``i`` is the target
        row token ``i`` was drawn from; ``None`` when not asked for.
      rounds: for speculative bursts, ``(drafted, accepted)`` per verify round; empty for
        plain decoding.
    """

    tokens: list[int]
    finish: int
    history: Any
    logits: np.ndarray | None
    rounds: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class LaunchedBurst:
    """A decode burst handed to the device and not read back yet.

    What the host knows of it without waiting for the device; the rest stays with the
    producer that launched it, for :meth:`DeviceDecoder.collect` to read and for
    :meth:`DeviceDecoder.continue_decode` to chain another burst onto.

    Fields:
      steps: the steps it asked for (it runs fewer when a stop ends it, and none when a burst
        it continues ended the generation).
      reach: the most positions the state it returned can have consumed once it has run.
      call: the producer's own record of the call (opaque).
    """

    steps: int
    reach: int
    call: Any


class DeviceDecoder(abc.ABC):
    """An optional capability: decode bursts that sample on the device.

    A producer that mixes this in runs ``steps`` produce + sample + stop-id steps in one device
    call; the generation loop then returns to the host once per burst instead of per token.
    A burst can be launched without waiting for it (:meth:`launch_decode`), and the next one
    chained onto it before it is read (:meth:`continue_decode`: its first token, token index
    and penalty history are the earlier burst's, taken on the device), so the device runs
    the next burst while the host reads this one's tokens (:meth:`collect`).
    """

    #: The most steps one :meth:`decode` call runs.
    steps_per_call: int
    #: How far back from the furthest position it fed a state may still be moved (a rewind
    #: or a rollback to a checkpoint taken before a burst), or ``None`` for any distance. A
    #: caller that may take a burst back keeps the burst within it.
    step_back_limit: int | None = None

    @abc.abstractmethod
    def launch_decode(
        self,
        state: Any,
        token: int,
        steps: int,
        *,
        params: Any,
        history: Any,
        key: jax.Array,
        gen_index: int,
        stop_ids: Sequence[int] = (),
        record_logits: bool = True,
    ) -> tuple[LaunchedBurst, Any]:
        """Start feeding ``token`` and decoding up to ``steps`` tokens; return at once. Step
        ``i`` samples with ``token_key(key, gen_index + i)`` so the tokens do not depend on
        how a generation is cut into bursts. The last sampled token is never fed. Arguments
        are checked before anything runs (bad ones raise and leave ``state`` as it was)."""

    @abc.abstractmethod
    def continue_decode(
        self, state: Any, after: LaunchedBurst, steps: int
    ) -> tuple[LaunchedBurst, Any]:
        """Chain up to ``steps`` more tokens of the same generation onto ``after`` (launched
        by this producer; ``state`` is the one its launch returned), without waiting for it:
        the burst feeds the last token ``after`` sampled and keeps its settings, key,
        stop ids and token index. When ``after`` ends on a stop id or non-finite logits, the
        chained burst runs no step (it is read back empty, the state unchanged by it)."""

    @abc.abstractmethod
    def collect(self, launched: LaunchedBurst) -> DeviceBurst:
        """Wait for ``launched`` and read its tokens back."""

    def decode(
        self,
        state: Any,
        token: int,
        steps: int,
        *,
        params: Any,
        history: Any,
        key: jax.Array,
        gen_index: int,
        stop_ids: Sequence[int] = (),
        record_logits: bool = True,
    ) -> tuple[DeviceBurst, Any]:
        """One burst, launched and read back: :meth:`launch_decode` then :meth:`collect`."""
        launched, state = self.launch_decode(
            state, token, steps, params=params, history=history, key=key,
            gen_index=gen_index, stop_ids=stop_ids, record_logits=record_logits,
        )
        return self.collect(launched), state


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
        """Return ``state`` with the target restored to ``point``. The drafter is untouched.

        Raises :class:`~turbospark_jax.errors.BadInputError` when ``point`` is not a
        checkpoint of an ancestor of ``state`` taken from this producer.
        """

    def record_committed(self, state: State, tokens: Sequence[int], pos0: int) -> State:
        """Record that a round committed ``tokens`` starting at ``pos0``.

        The batched counterpart of the bookkeeping :meth:`produce` does: after a verify only
        the caller knows how much of the block survived. Default: nothing to record. A
        producer that keeps a record refuses ids of the wrong type or a negative ``pos0``
        (BadInputError) and a commit its record does not hold (ProducerFailedError).
        """
        del tokens, pos0
        return state

    def supports_retaining_rollback(self) -> bool:
        """Whether :meth:`rollback_retaining` can run. Default: no."""
        return False

    def retaining_rollback_keeps(self, verified_rows: int, keep_rows: int) -> bool:
        """Whether :meth:`rollback_retaining` can keep ``keep_rows`` of a verify that fed
        ``verified_rows`` rows (a producer whose tape holds one block cannot replay rows of
        earlier blocks). Default: :meth:`supports_retaining_rollback`."""
        del verified_rows, keep_rows
        return self.supports_retaining_rollback()

    def rollback_retaining(self, state: State, point: Checkpoint, keep_rows: int) -> State:
        """Restore the target to ``point`` but keep the first ``keep_rows`` rows of the last verify.

        Their cache rows stay and any recurrent state is replayed across them, so the verify's
        logits for row ``keep_rows - 1`` remain valid and no re-verify is needed. ``keep_rows``
        counts the confirmed token plus the accepted proposals (the bonus is not fed yet).
        The default refuses: silently doing the expensive thing is how a broken fast path hides.

        Raises :class:`~turbospark_jax.errors.BadInputError` as :meth:`rollback` does, and for
        a ``keep_rows`` that is not an integer in ``0 .. rows fed since the checkpoint``.
        """
        del state, point, keep_rows
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} records no verify tape; use rollback and re-verify"
        )

    @abc.abstractmethod
    def verify(self, state: State, feed: Sequence[int], base: int) -> tuple[Logits, State]:
        """Feed ``feed`` through the target from position ``base`` in one pass.

        Returns ``(logits, new_state)`` with ``logits`` of shape ``[len(feed), vocab_size]``;
        row ``i`` predicts the token after ``feed[i]``. Refuses what :meth:`prefill_chunk`
        refuses.
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
        plausible tokens that the target keeps rejecting. ``position`` must be one the target
        has consumed (BadInputError otherwise).
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
        """Move the drafter's cursor to ``position``, where the accepted prefix ended (an
        integer no further than the target has consumed; BadInputError otherwise)."""

    @abc.abstractmethod
    def drafter_position(self, state: State) -> int:
        """How many positions the drafter has consumed (read from the drafter's state)."""

    def supports_draft_bursts(self) -> bool:
        """Whether :meth:`draft_burst` can replace repeated :meth:`draft_step` calls. Default:
        no."""
        return False

    def draft_burst(
        self, state: State, token: int, position: int, count: int, *,
        params: Any, history: Any, key: jax.Array, index: int,
    ) -> tuple[list[int], Logits, State]:
        """``count`` draft steps and their sampling in one device call: exactly what ``count``
        :meth:`draft_step` calls plus sampling token ``i`` with ``token_key(key, index + i)``
        would propose. Returns ``(proposals, drafter_logits[count, V], state)``; fewer
        proposals when the drafter's logits turned non-finite. The default refuses."""
        del state, token, position, count, params, history, key, index
        raise UnsupportedCapabilityError(f"{type(self).__name__} has no draft bursts")

    def supports_headless_prefill(self) -> bool:
        """Whether :meth:`produce_prefill` (which may skip the head) can drive the drafter.

        False by default: a drafter that reads the post-head hidden state would be primed
        from stale values by a headless prefill.
        """
        return False

    def device_draft_limit(self) -> int:
        """The largest ``draft_len`` :meth:`device_rounds` takes; 0 (the default) when it runs
        no rounds on the device, and the speculative loop drives drafter and target call by
        call instead."""
        return 0

    def launch_rounds(
        self, state: State, pending: int, *, draft_len: int, budget: int, params: Any,
        history: Any, key: jax.Array, gen_index: int, remaining: int,
        stop_ids: Sequence[int] = (), record_logits: bool = True,
    ) -> tuple[LaunchedBurst, State]:
        """Start speculative rounds on the device, until ``budget`` tokens are emitted, a
        stop id is emitted or logits turn non-finite; return at once (:meth:`collect_rounds`
        reads them back).

        Each round drafts up to ``min(draft_len, remaining - 1)`` tokens after ``pending``
        (the last emitted token, not yet fed), verifies them in one target pass, judges them
        (lossless: greedy point masses or rejection sampling, with the host rounds' keys:
        token ``gen_index + i`` of the request) and commits. ``remaining`` counts the tokens
        the request may still emit, so a round never drafts past ``max_tokens``. The last
        emitted token is never fed. The default refuses. A judgement uses the verified rows up
        to the first non-finite one only; a non-finite first row ends the burst
        (``NON_FINITE``).
        """
        del state, pending, draft_len, budget, params, history, key, gen_index, remaining
        del stop_ids, record_logits
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} runs no speculative rounds on the device for this "
            "draft length; see device_draft_limit()"
        )

    def continue_rounds(
        self, state: State, after: LaunchedBurst, budget: int
    ) -> tuple[LaunchedBurst, State]:
        """Chain rounds for up to ``budget`` more tokens of the same request onto ``after``
        (launched by this producer; ``state`` is the one its launch returned), without waiting
        for it: they feed the last token ``after`` emitted and keep its settings, key, stop
        ids, token index and the tokens the request has left. When ``after`` ends on a stop
        id or non-finite logits, or emits every token left, the chained rounds run none. The
        default refuses."""
        del state, after, budget
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} runs no speculative rounds on the device"
        )

    def collect_rounds(self, launched: LaunchedBurst) -> DeviceBurst:
        """Wait for launched rounds and read them back. The default refuses."""
        del launched
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} runs no speculative rounds on the device"
        )

    def device_rounds(
        self, state: State, pending: int, *, draft_len: int, budget: int, params: Any,
        history: Any, key: jax.Array, gen_index: int, remaining: int,
        stop_ids: Sequence[int] = (), record_logits: bool = True,
    ) -> tuple[DeviceBurst, State]:
        """One burst of rounds, launched and read back: :meth:`launch_rounds` then
        :meth:`collect_rounds`."""
        launched, state = self.launch_rounds(
            state, pending, draft_len=draft_len, budget=budget, params=params,
            history=history, key=key, gen_index=gen_index, remaining=remaining,
            stop_ids=stop_ids, record_logits=record_logits,
        )
        return self.collect_rounds(launched), state


def require_prompt(prompt_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The prompt as ``list[int]``; refuse an empty one (``try_reuse_prefix`` answers strictly
    less than its length) and anything but token ids inside the vocabulary."""
    return as_token_ids("prompt_ids", prompt_ids, vocab_size)
