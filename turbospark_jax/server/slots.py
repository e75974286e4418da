"""Which session slot a request runs in: the slot table and the choice rule.

A request that names a session continues in the slot that session owns (waiting while that
slot is busy). Otherwise, among idle slots not owned by another named session, it takes the one
whose fed record shares the longest prefix with its prompt (the state then reuses those rows);
when no slot shares anything, a never-used slot, else the least recently used one. Only when
every idle slot belongs to another named session does it take the least recently used of those.
Taking a slot whose state the request will not continue (another owner's, or an anonymous one
sharing nothing) is an eviction, reported in the response's usage.

A slot is an identity (its :attr:`SlotRecord.index`, the ``slot`` a response reports), not a
place: its state sits in some row of the batched stack (:attr:`SlotRecord.row`), and the rows
move. The busy slots are kept in the lowest rows, so a decode call runs only as many rows as
its bucket needs (:mod:`turbospark_jax.engine.batching`): a slot taken from above them is
swapped down to the first idle row (:func:`row_to_take`), and a slot freed below the highest
busy row is swapped with that row (:func:`row_to_free`). A swap exchanges the two records'
rows along with the rows' states, so the owner, the fed record and the kept copy stay with the
state they describe.

A request need not sit in the slot that fed its prefix to reuse it: :func:`choose_donor` finds
the slot (busy or idle, any owner's) whose row holds the longest prefix of the prompt's ids and
image identities, and the engine copies that row into the request's before it feeds the rest;
for a model that cannot rewind, :func:`choose_kept` finds the longest kept copy the prompt
extends. Both are a linear scan over the ``B`` records, each a prefix compare bounded by the
prompt's length: at the slot counts served (tens of rows) that costs far less than one prefill
call, so no tree over the records is kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from turbospark_jax.core.kv_prefix import common_prefix

__all__ = ["Choice", "SlotRecord", "choose_donor", "choose_kept", "choose_slot", "open_prefix",
           "row_to_free", "row_to_take", "swap_rows"]


@dataclasses.dataclass(eq=False)
class SlotRecord:
    """The host's view of one slot.

    Fields:
      index: the slot's identity (what a response reports as its ``slot``).
      owner: the named session that owns it, ``None`` for anonymous or never used.
      fed_ids: what the row's state has consumed (empty: start it fresh).
      last_used: a clock stamp of the last request it served (0: never).
      busy: whether a request runs in it now.
      saved: for a model that cannot rewind, the ids a prompt's prefill had fed when it
        stopped one token short of the prompt's end, and a copy of the row's state there
        (``None``: none kept). A later prompt that extends those ids restarts from the copy.
      row: the row of the batched stack its state sits in now (left at -1, the row
        ``index``).
      fed_marks: the image identity each position of :attr:`fed_ids` took (0: its token's
        own embedding), or ``None`` when no position took an image.
    """

    index: int
    owner: str | None = None
    fed_ids: tuple[int, ...] = ()
    last_used: int = 0
    busy: bool = False
    saved: tuple[tuple[int, ...], Any] | None = None
    row: int = -1
    fed_marks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.row < 0:
            self.row = self.index

    def holds(self, fed_ids: Sequence[int], fed_marks: Sequence[int] | None = None) -> None:
        """Record that the row's state has fed ``fed_ids`` (with the image identities
        ``fed_marks``, ``None`` where no position took one)."""
        self.fed_ids = tuple(fed_ids)
        self.fed_marks = None if fed_marks is None else tuple(fed_marks)

    def forget(self) -> None:
        """Record that nothing in the row (nor a kept copy) is to be reused."""
        self.holds(())
        self.saved = None


@dataclasses.dataclass(frozen=True)
class Choice:
    """A slot for a request: its record, the prefix it shares, whether taking it evicts."""

    slot: SlotRecord
    shared: int
    evicts: bool


def _shared(slot: SlotRecord, prompt: Sequence[int]) -> int:
    return common_prefix(slot.fed_ids, None, prompt, None)


def choose_slot(
    slots: Sequence[SlotRecord], session_id: str | None, prompt: Sequence[int]
) -> Choice | None:
    """The slot a request should take now, or ``None`` when it must wait (its slot is busy, or
    every slot is)."""
    if session_id is not None:
        owned = next((s for s in slots if s.owner == session_id), None)
        if owned is not None:
            return None if owned.busy else Choice(owned, _shared(owned, prompt), False)
    idle = [s for s in slots if not s.busy]
    if not idle:
        return None
    open_slots = [s for s in idle if s.owner is None]
    if open_slots:
        best = max(open_slots, key=lambda s: (_shared(s, prompt), -s.last_used))
        shared = _shared(best, prompt)
        if shared == 0:
            best = min(open_slots, key=lambda s: (bool(s.fed_ids), s.last_used))
        return Choice(best, shared, evicts=shared == 0 and bool(best.fed_ids))
    lru = min(idle, key=lambda s: s.last_used)
    return Choice(lru, 0, evicts=bool(lru.fed_ids))


def open_prefix(slots: Sequence[SlotRecord], prompt: Sequence[int]) -> int:
    """The longest prefix of ``prompt`` that a slot no named session owns has fed (busy or
    not): what a request without a slot of its own could reuse here (0: nothing)."""
    return max((_shared(s, prompt) for s in slots if s.owner is None), default=0)


def choose_donor(
    holdings: Iterable[tuple[SlotRecord, Sequence[int], Sequence[int] | None]],
    prompt: Sequence[int], injected: Mapping[int, int] | None, *, beyond: int,
) -> tuple[SlotRecord, int] | None:
    """The record whose row holds the longest prefix of ``prompt``, and that length, when it is
    longer than ``beyond`` (what the request's own row holds), else ``None``.

    Each holding is ``(record, ids, marks)``: the prompt ids the record's row holds as the
    prefill wrote them and their image identities (``None``: no image). A position matches
    where the ids and the image identity the prompt injects there (``injected``: position ->
    identity) both agree, so a prompt with another picture at the same positions shares
    nothing from there on. The earliest record wins a tie."""
    best: tuple[SlotRecord, int] | None = None
    for record, ids, marks in holdings:
        shared = common_prefix(ids, marks, prompt, injected)
        if shared > (beyond if best is None else best[1]):
            best = (record, shared)
    return best


def choose_kept(slots: Sequence[SlotRecord], own: SlotRecord,
                prompt: Sequence[int]) -> SlotRecord | None:
    """For a model that cannot rewind: the record whose kept copy (:attr:`SlotRecord.saved`)
    stands for the longest proper prefix of ``prompt``, ``own`` on a tie, or ``None`` when none
    does. (A copy is kept only for a prompt without images.)"""
    def length(s: SlotRecord) -> int:
        ids = s.saved[0] if s.saved is not None else None
        fits = ids is not None and len(ids) < len(prompt) and tuple(prompt[: len(ids)]) == ids
        return len(ids) if fits else -1

    best = max(slots, key=lambda s: (length(s), s is own))
    return best if length(best) >= 0 else None


def _at_row(slots: Sequence[SlotRecord], row: int) -> SlotRecord:
    return next(s for s in slots if s.row == row)


def row_to_take(slots: Sequence[SlotRecord], slot: SlotRecord) -> SlotRecord | None:
    """The record whose row ``slot`` (idle, about to turn busy) must swap with so the busy
    slots stay the lowest rows, or ``None`` when it already sits at the first idle row."""
    first_idle = sum(s.busy for s in slots)
    return None if slot.row == first_idle else _at_row(slots, first_idle)


def row_to_free(slots: Sequence[SlotRecord], slot: SlotRecord) -> SlotRecord | None:
    """The record whose row ``slot`` (busy, about to turn idle) must swap with so the busy
    slots stay the lowest rows, or ``None`` when it already sits at the highest busy row."""
    last_busy = sum(s.busy for s in slots) - 1
    return None if slot.row == last_busy else _at_row(slots, last_busy)


def swap_rows(a: SlotRecord, b: SlotRecord) -> None:
    """Record that the states of ``a`` and ``b`` have exchanged rows."""
    a.row, b.row = b.row, a.row
