"""A pool of session slots: N producer states, each owned by at most one session.

A server holding several conversations keeps one producer state per conversation so the next
turn can reuse its KV rows. Memory bounds how many: the pool has ``slots`` of them. A turn
for a session

* runs in the slot that session owns, continuing from the state its previous turn left (the
  producer's ``try_reuse_prefix`` then keeps whatever prefix of the new prompt that state
  actually fed, :mod:`turbospark_jax.core.kv_prefix`);
* otherwise takes a free slot, or else the least recently used one, and starts it from a
  fresh state. Taking a slot that held a *different* session's non-empty state is an
  eviction, reported per turn (``evicted``) and counted (:attr:`SessionPool.evictions`), so
  whoever sizes the pool sees whether it is being churned.

No session ever continues from another session's state. The fed-token keying would make
doing so harmless for a correct producer (different ids, no reuse), but the pool does not
lean on that: a slot changing owner always starts fresh.

**Donation.** A producer may consume the buffers of the state it is given (a
``BlockProducer(donate=True)``). So the pool hands a slot's state to exactly one turn, forgets
it at that moment, and afterwards keeps only the state the completion returned. A turn that
ends in an error (``completion.state is None``) or an exception leaves the slot fresh; the
session keeps the slot, now empty.

**Concurrency: serialized.** Each slot has a lock held for the whole turn. A second turn that
needs a busy slot (the same session from another thread, or any session when every slot is
busy) waits until it is released, then re-decides which slot to use: ownership may have moved
while it waited. ``SessionPool(..., wait=0)`` refuses instead (:class:`SessionError`), and a
positive ``wait`` bounds the wait in seconds. A thread that would wait for slots only it
holds (an unfinished stream of its own) is refused at once rather than waiting for itself.
Turns in different slots run concurrently.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Generator, Hashable
from typing import Any

from turbospark_jax.core.checks import is_int
from turbospark_jax.core.protocols import LogitProducer
from turbospark_jax.core.state import copy_state
from turbospark_jax.core.streams import Stream, StreamEvent
from turbospark_jax.errors import BadInputError, SessionError
from turbospark_jax.generation.completion import Completion, CompletionRequest
from turbospark_jax.generation.driver import Begin, prepare

__all__ = ["SessionId", "SessionPool", "SlotInfo"]

#: What identifies a session: any hashable value but ``None`` (which marks a free slot).
SessionId = Hashable


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """A snapshot of one slot, for introspection.

    Fields:
      index: the slot's index.
      owner: the session that owns it, ``None`` when free.
      fed_tokens: positions the stored state has consumed (0: fresh).
      last_used: turn stamp of the last turn served here (0: never); larger is more recent.
      busy: whether a turn is running in it now.
      evicted: whether the last turn served here evicted a different session.
    """

    index: int
    owner: SessionId | None
    fed_tokens: int
    last_used: int
    busy: bool
    evicted: bool


@dataclasses.dataclass(eq=False)
class _Slot:
    """One slot; every field is read and written under the pool's condition.

    ``state`` is ``None`` for a fresh slot (the completion then starts from ``init_state``,
    and an idle empty slot holds no buffers) and while a turn has it.
    """

    index: int
    state: Any = None
    fed_ids: tuple[int, ...] = ()
    owner: SessionId | None = None
    last_used: int = 0
    evicted: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    holder: int | None = None  # thread ident of the turn holding ``lock``


class SessionPool:
    """``slots`` producer states shared by any number of sessions.

    Args:
      producer: any :class:`~turbospark_jax.core.protocols.LogitProducer` (a
        :class:`~turbospark_jax.core.protocols.SpeculativeProducer` for speculative turns).
      slots: how many states to keep (>= 1).
      wait: how long a turn waits for a busy slot, in seconds: ``None`` waits as long as it
        takes (turns on one slot are serialized), ``0`` refuses at once.

    Raises:
      SessionError: ``slots`` is not a positive integer or ``wait`` is negative.
      BadInputError: ``producer`` is not a producer.
    """

    def __init__(self, producer: LogitProducer, slots: int, *, wait: float | None = None) -> None:
        if not is_int(slots) or int(slots) < 1:
            raise SessionError(
                f"a session pool needs at least one slot; got slots={slots!r}. Use slots=1 "
                "for a single conversation, more to keep several conversations' states"
            )
        if wait is not None and (isinstance(wait, bool) or not (
            isinstance(wait, int | float) and 0 <= wait < math.inf
        )):
            raise SessionError(
                f"wait must be None (wait for a busy slot) or seconds >= 0; got {wait!r}"
            )
        if not isinstance(producer, LogitProducer):
            raise BadInputError(
                f"{type(producer).__name__} is not a LogitProducer; pass the producer the "
                "completions should run on"
            )
        self.producer = producer
        self.wait = wait
        self._slots = [_Slot(index=i) for i in range(int(slots))]
        self._cond = threading.Condition()
        self._clock = 0
        self._evictions = 0

    # -- turns ----------------------------------------------------------------------------

    def stream(
        self,
        session_id: SessionId,
        request: CompletionRequest,
        *,
        tokenizer: Any | None = None,
    ) -> Stream[Completion]:
        """Start a turn for ``session_id``; iterate for stream events, then read ``.result``.

        The request is validated now; the slot is taken when iteration starts and given back
        when it ends. Iterate to the end, or close the stream (or use it as a context manager):
        an abandoned turn holds its slot until it is closed or collected, and leaves the slot
        fresh. The stepper is picked as
        :func:`~turbospark_jax.generation.driver.stream_completion` picks it (speculative
        rounds for a producer that can draft, unless ``request.draft_len == 0``).

        Args:
          session_id: the conversation (any hashable value but ``None``).
          request: the completion to run; its ``prompt_ids`` are the whole conversation so far.
          tokenizer: for text, stop strings and deltas.

        Returns:
          The turn's stream; its result is the
          :class:`~turbospark_jax.generation.completion.Completion`
          with ``usage.slot`` and ``usage.evicted`` filled in and ``state`` left ``None`` (the
          pool keeps the state).

        Raises:
          SessionError: ``session_id`` is ``None`` or unhashable.
          BadInputError: an invalid request (nothing is touched).
        """
        _check_session_id(session_id)
        # Validated here, once, without running anything or touching a state, so bad input
        # raises before any slot is taken; the turn starts from the slot's own state.
        begin = prepare(self.producer, request, tokenizer)
        return Stream(self._turn(session_id, begin))

    def generate(
        self,
        session_id: SessionId,
        request: CompletionRequest,
        *,
        tokenizer: Any | None = None,
    ) -> Completion:
        """Run a turn for ``session_id`` to the end (see :meth:`stream`).

        Raises:
          SessionError: a bad session id, or the slot stayed busy past the pool's ``wait``.
          BadInputError: an invalid request (nothing is touched).
        """
        return self.stream(session_id, request, tokenizer=tokenizer).drain()

    def _turn(
        self, session_id: SessionId, begin: Begin
    ) -> Generator[StreamEvent, None, Completion]:
        slot, evicted = self._claim(session_id, create=True)
        completion: Completion | None = None
        try:
            inner = Stream(begin(self._take_state(slot), None))
            yield from inner
            completion = inner.result
        finally:
            self._release(slot, store=completion, reset=True)
        assert completion is not None
        usage = dataclasses.replace(completion.usage, slot=slot.index, evicted=evicted)
        return dataclasses.replace(completion, usage=usage, state=None)

    # -- sessions ---------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of slots."""
        return len(self._slots)

    @property
    def evictions(self) -> int:
        """Turns so far that discarded a different session's non-empty state."""
        with self._cond:
            return self._evictions

    def slot_of(self, session_id: SessionId) -> int | None:
        """Index of the slot ``session_id`` owns, or ``None`` when it owns none.

        Raises:
          SessionError: ``session_id`` is ``None`` or unhashable.
        """
        _check_session_id(session_id)
        with self._cond:
            slot = self._owned(session_id)
            return None if slot is None else slot.index

    def sessions(self) -> dict[SessionId, int]:
        """Every session that owns a slot, mapped to the slot's index."""
        with self._cond:
            return {s.owner: s.index for s in self._slots if s.owner is not None}

    def slot_table(self) -> list[SlotInfo]:
        """A snapshot of every slot, in index order."""
        with self._cond:
            return [
                SlotInfo(
                    index=s.index,
                    owner=s.owner,
                    fed_tokens=len(s.fed_ids),
                    last_used=s.last_used,
                    busy=s.lock.locked(),
                    evicted=s.evicted,
                )
                for s in self._slots
            ]

    def session_slot_evicted(self, session_id: SessionId) -> bool:
        """Whether the last turn of ``session_id`` discarded a different session's state.

        Raises:
          SessionError: ``session_id`` owns no slot (it never ran, was dropped or evicted).
        """
        with self._cond:
            return self._require_owned(session_id).evicted

    def fed_ids_of(self, session_id: SessionId) -> tuple[int, ...]:
        """The ids the state of ``session_id`` has consumed (empty for a fresh slot).

        Raises:
          SessionError: ``session_id`` owns no slot.
        """
        with self._cond:
            return self._require_owned(session_id).fed_ids

    def state_of(self, session_id: SessionId) -> Any:
        """A copy of the state stored for ``session_id`` (``None`` for a fresh slot).

        A copy, because a donating producer would consume the stored buffers if the caller
        fed the original to a completion. Waits for a running turn as turns do.

        Raises:
          SessionError: ``session_id`` owns no slot, or its slot stayed busy past ``wait``.
        """
        slot = self._claim(session_id, create=False)[0]
        try:
            return None if slot.state is None else copy_state(slot.state)
        finally:
            self._release(slot)

    def drop(self, session_id: SessionId) -> None:
        """Forget ``session_id``: its slot becomes free and fresh. Waits for a running turn.

        Raises:
          SessionError: ``session_id`` owns no slot, or its slot stayed busy past ``wait``.
        """
        slot = self._claim(session_id, create=False)[0]
        with self._cond:
            slot.owner, slot.evicted = None, False
        self._release(slot, reset=True)

    # -- slot bookkeeping (override points for the tests' controls) ------------------------

    def _assign(self, slot: _Slot, session_id: SessionId) -> bool:
        """Give ``slot`` to ``session_id`` for a turn; return whether that evicted another.

        Called under the condition with the slot locked. A slot changing owner starts fresh:
        the previous owner's state is dropped here, before the turn can see it.
        """
        if slot.owner == session_id:
            return False
        evicted = slot.owner is not None and bool(slot.fed_ids)
        slot.state, slot.fed_ids, slot.owner = None, (), session_id
        return evicted

    def _owned(self, session_id: SessionId) -> _Slot | None:
        return next((s for s in self._slots if s.owner is not None and s.owner == session_id),
                    None)

    def _require_owned(self, session_id: SessionId) -> _Slot:
        _check_session_id(session_id)
        slot = self._owned(session_id)
        if slot is None:
            raise SessionError(
                f"session {session_id!r} holds no slot (it never ran a turn here, was dropped, "
                f"or was evicted by another session); sessions holding slots: "
                f"{sorted(map(repr, self.sessions()))}"
            )
        return slot

    def _candidate(self, session_id: SessionId, create: bool) -> _Slot | None:
        """The slot a turn of ``session_id`` should use now, busy or not; ``None``: wait."""
        owned = self._owned(session_id)
        if owned is not None or not create:
            return owned
        idle = [s for s in self._slots if not s.lock.locked()]
        # A free slot before any owned one; among owned ones the least recently used.
        return min(idle, key=lambda s: (s.owner is not None, s.last_used), default=None)

    def _claim(self, session_id: SessionId, *, create: bool) -> tuple[_Slot, bool]:
        """Lock the slot for ``session_id``; return it and whether taking it evicted another.

        ``create`` is for turns: take a slot when the session has none. Otherwise the session
        must own one (introspection and :meth:`drop`).
        """
        me = threading.get_ident()
        deadline = None if self.wait is None else time.monotonic() + self.wait
        with self._cond:
            while True:
                if not create:
                    self._require_owned(session_id)
                slot = self._candidate(session_id, create)
                if slot is not None and not slot.lock.locked():
                    break
                # Waiting on slots only this thread can free would never end.
                mine = [s.index for s in self._slots if s.holder == me]
                if (slot is not None and slot.holder == me) or (
                    slot is None and len(mine) == len(self._slots)
                ):
                    raise SessionError(
                        f"this thread already runs a turn in slot(s) {mine} that session "
                        f"{session_id!r} would have to wait for; finish or close that stream "
                        "before starting another turn"
                    )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    where = "its slot is" if slot is not None else "every slot is"
                    raise SessionError(
                        f"session {session_id!r}: {where} running another turn and this pool "
                        f"refuses to wait longer than wait={self.wait} s; retry later, or "
                        "build the pool with wait=None to serialize turns"
                    )
                self._cond.wait(remaining)
            slot.lock.acquire()  # cannot block: it was free under the condition
            slot.holder = me
            evicted = False
            if create:
                evicted = self._assign(slot, session_id)
                self._evictions += int(evicted)
                self._clock += 1
                slot.last_used, slot.evicted = self._clock, evicted
            return slot, evicted

    def _take_state(self, slot: _Slot) -> Any:
        # The turn now owns the state's buffers (a donating producer consumes them), so the
        # slot must never offer it again: only the completion's state comes back.
        with self._cond:
            state, slot.state, slot.fed_ids = slot.state, None, ()
            return state

    def _release(
        self, slot: _Slot, *, store: Completion | None = None, reset: bool = False
    ) -> None:
        """Unlock ``slot``, storing the state of ``store`` when it has one, else leaving the
        slot fresh when ``reset`` (a failed turn, a drop) or as it is (introspection)."""
        with self._cond:
            if store is not None and store.state is not None:
                slot.state, slot.fed_ids = store.state, tuple(store.fed_ids)
            elif reset:
                slot.state, slot.fed_ids = None, ()
            slot.holder = None
            slot.lock.release()
            self._cond.notify_all()


def _check_session_id(session_id: Any) -> None:
    if session_id is None:
        raise SessionError("session_id must not be None (None marks a free slot)")
    try:
        hash(session_id)
    except TypeError as e:
        raise SessionError(
            f"session_id must be hashable (a str or int, say); got {type(session_id).__name__}"
        ) from e
