"""State building blocks shared by every producer.

Two ideas live here.

**The fed-token record.** Every producer with memory keeps the ids it actually consumed, in
position order, and for each position whether the input there was an injected embedding (and
which one). Prefix reuse, history bookkeeping, rollback and speculative commits all key on this
record, never on counts derived elsewhere.

**Append-only buffers versus by-value leaves.** A state dataclass marks its large buffers with
:func:`append_only`: rows at positions ``>= fed.count`` are dead, so such a buffer rolls back by
moving the cursor and can be donated to XLA without losing anything a checkpoint needs. A
:func:`ring` is such a buffer that keeps only its most recent positions (a sliding window's
rows). Every other leaf is small and rolls back by value. :func:`by_value` extracts the small
part (that is what a checkpoint keeps), :func:`restore_by_value` puts it back, and
:func:`live_equal` compares two states on what is live.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# NOT_INJECTED (the identity of a position that consumed its token id) lives with the reuse
# rule in kv_prefix; the fed record stores it.
from turbospark_jax.core.kv_prefix import NOT_INJECTED

_APPEND_ONLY = "turbospark_append_only_axis"
_RING = "turbospark_ring_live"
_SCRATCH = "turbospark_scratch"
_AUXILIARY = "turbospark_auxiliary"


@jax.jit
def _cursor_at(prefix: jax.Array, count: Any) -> tuple[jax.Array, jax.Array]:
    """A record's cursor at ``count`` and its digest, read back from ``prefix``: one dispatch
    when called from the host (four eager ops cost four on a GPU)."""
    count = jnp.asarray(count, jnp.int32)
    return count, jnp.where(count > 0, prefix[jnp.maximum(count - 1, 0)], jnp.uint32(0))


def append_only(axis: int) -> Any:
    """Mark a state field as an append-only buffer whose ``axis`` is the position axis."""
    return struct.field(pytree_node=True, metadata={_APPEND_ONLY: axis})


def ring(axis: int, live: str) -> Any:
    """Mark a state field as a ring buffer: position ``p`` sits in slot ``p % slots`` of ``axis``.

    A ring travels like an append-only buffer (donated, moved back with the cursor, never
    restored by value), but writing a position overwrites the one ``slots`` before it, so the
    cursor can move back only as far as the rows the ring still holds (the model that keeps
    it states the limit). ``live`` names an int field of the same dataclass: how many
    positions before the cursor the model will still read (a sliding window's
    ``window - 1``); :func:`live_view` treats the slots of older positions as dead.
    """
    return struct.field(pytree_node=True, metadata={_APPEND_ONLY: axis, _RING: live})


def scratch() -> Any:
    """Mark a state field as scratch: carried along (a verify tape, say) but not part of what
    the state *means*, so :func:`live_equal` ignores it."""
    return struct.field(pytree_node=True, metadata={_SCRATCH: True})


def auxiliary(default: Any = ()) -> Any:
    """Mark a state field as auxiliary: kept with the state between calls (snapshots a later
    reuse may restore) but never passed to a compiled program (its structure changes as it
    grows) and not part of what the state means (:func:`live_equal` drops it)."""
    return struct.field(pytree_node=True, default=default, metadata={_AUXILIARY: True})


def _position_digest(positions: jax.Array, ids: jax.Array, injected: jax.Array) -> jax.Array:
    """A 32-bit mix of (position, id, injected identity): uint32 per position (jittable)."""
    x = (positions.astype(jnp.uint32) * jnp.uint32(0x9E3779B1)
         ^ ids.astype(jnp.uint32) * jnp.uint32(0x85EBCA77)
         ^ injected.astype(jnp.uint32) * jnp.uint32(0xC2B2AE3D))
    # murmur3's finaliser: every input bit reaches every output bit.
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


@struct.dataclass(kw_only=True)
class FedRecord:
    """What a state has consumed, position by position, and whose state it is.

    Fields (``T`` = the state's position capacity):
      ids:      int32[T]  token id fed at each position; rows >= count are dead.
      injected: int32[T]  identity of the embedding injected at each position,
                          ``NOT_INJECTED`` (0) where the token id itself was embedded.
      prefix:   uint32[T] the digest of positions ``0 .. p`` at row ``p``: the lineage.
      count:    int32[]   number of positions consumed: the cursor.
      digest:   uint32[]  the digest of the first ``count`` positions (0 for none).
      owner:    uint32[]  the identity of the producer whose state this is (0: none).

    The digest of a prefix is a sum of per-position mixes, so a record extends it in any
    block shape and moves back by reading ``prefix``. A checkpoint keeps ``count``, ``digest``
    and ``owner`` (they are by value); it is an ancestor of a state exactly when the state has
    the same owner, has fed at least as far, and its ``prefix`` at the checkpoint's cursor
    equals the checkpoint's digest (:meth:`descends_from`).
    """

    ids: jax.Array = append_only(axis=0)
    injected: jax.Array = append_only(axis=0)
    prefix: jax.Array = append_only(axis=0)
    count: jax.Array
    digest: jax.Array
    owner: jax.Array

    @classmethod
    def empty(cls, capacity: int, owner: int | jax.Array = 0) -> FedRecord:
        return cls(
            ids=jnp.zeros((capacity,), jnp.int32),
            injected=jnp.zeros((capacity,), jnp.int32),
            prefix=jnp.zeros((capacity,), jnp.uint32),
            count=jnp.zeros((), jnp.int32),
            digest=jnp.zeros((), jnp.uint32),
            owner=jnp.asarray(owner, jnp.uint32),
        )

    @classmethod
    def from_ids(cls, ids: Sequence[int], capacity: int | None = None) -> FedRecord:
        """A record of ``ids`` consumed in order (nothing injected), built on the host."""
        capacity = len(ids) if capacity is None else capacity
        empty = cls.empty(capacity)
        if not ids:
            return empty
        return empty.append(jnp.asarray(list(ids), jnp.int32), jnp.int32(len(ids)))

    @property
    def capacity(self) -> int:
        return int(self.ids.shape[0])

    def append(self, tokens: jax.Array, live: jax.Array,
               injected: jax.Array | None = None) -> FedRecord:
        """Record ``tokens[:live]`` at the cursor (jittable; rows past ``live`` write nothing),
        with ``injected`` (int32 ``[W]``, default none) the identity of the embedding each row
        consumed instead of its token's: it enters the lineage digest too, so the same ids
        with another image are another lineage."""
        rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        if injected is None:
            injected = jnp.full_like(rows, NOT_INJECTED)
        injected = injected.astype(jnp.int32)
        # Rows past ``live`` go to distinct out-of-range slots (dropped), so every target
        # differs and the scatter may say so.
        pos = jnp.where(rows < live, self.count + rows, self.capacity + rows)
        mixes = jnp.where(rows < live, _position_digest(self.count + rows, tokens, injected), 0)
        running = self.digest + jnp.cumsum(mixes, dtype=jnp.uint32)
        scatter = {"mode": "drop", "unique_indices": True}
        return self.replace(
            ids=self.ids.at[pos].set(tokens.astype(jnp.int32), **scatter),
            injected=self.injected.at[pos].set(injected, **scatter),
            prefix=self.prefix.at[pos].set(running, **scatter),
            count=self.count + live.astype(jnp.int32),
            digest=running[-1],
        )

    def moved_to(self, count: int | jax.Array) -> FedRecord:
        """The record with its cursor at ``count`` (at most the current one; jittable): the
        rows before it stay, and the digest is read back from ``prefix``."""
        count, digest = _cursor_at(
            self.prefix, np.int32(count) if isinstance(count, int | np.integer) else count)
        return self.replace(count=count, digest=digest)

    def descends_from(self, point: FedRecord) -> bool:
        """Whether ``point`` (a checkpoint's record, by value) is an ancestor of this record:
        same owner, not past this cursor, and the same lineage up to its cursor (host)."""
        owner, count, p_owner, p_count, p_digest = (int(v) for v in jax.device_get(
            (self.owner, self.count, point.owner, point.count, point.digest)))
        if owner != p_owner or not 0 <= p_count <= count:
            return False
        return p_count == 0 or int(self.prefix[p_count - 1]) == p_digest

    def to_host(self) -> HostFedRecord:
        count = int(self.count)
        return HostFedRecord(
            ids=tuple(int(t) for t in np.asarray(self.ids)[:count]),
            injected=tuple(int(t) for t in np.asarray(self.injected)[:count]),
        )


@dataclasses.dataclass(frozen=True)
class HostFedRecord:
    """A host copy of the live part of a :class:`FedRecord`."""

    ids: tuple[int, ...]
    injected: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.ids)


def _append_axes(state: Any) -> dict[str, int]:
    return {
        f.name: f.metadata[_APPEND_ONLY]
        for f in dataclasses.fields(state)
        if _APPEND_ONLY in f.metadata
    }


def _is_state_node(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _split(state: Any, buffers: bool) -> Any:
    # Keep either the append-only buffers or everything else, with None in the other's place.
    if not _is_state_node(state):
        return None if buffers else state
    axes = _append_axes(state)
    changes = {}
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if f.name in axes:
            changes[f.name] = value if buffers else None
        else:
            changes[f.name] = _split(value, buffers)
    return dataclasses.replace(state, **changes)


def without_auxiliary(state: Any) -> tuple[Any, dict[str, Any]]:
    """``state`` with its auxiliary fields emptied, and what they held (for
    :func:`with_auxiliary`): the form a compiled program sees."""
    held = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if f.metadata.get(_AUXILIARY)}
    return dataclasses.replace(state, **{name: () for name in held}), held


def with_auxiliary(state: Any, held: dict[str, Any]) -> Any:
    """Put back what :func:`without_auxiliary` took out."""
    return dataclasses.replace(state, **held)


def durable_values(state: Any) -> Any:
    """The by-value leaves that define ``state`` (buffers and scratch replaced by ``None``):
    what a snapshot keeps. References only: by-value leaves are never donated."""
    if not _is_state_node(state):
        return state
    axes = _append_axes(state)
    changes = {}
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if f.name in axes or f.metadata.get(_SCRATCH) or f.metadata.get(_AUXILIARY):
            changes[f.name] = None
        else:
            changes[f.name] = durable_values(value)
    return dataclasses.replace(state, **changes)


def restore_durable(state: Any, values: Any) -> Any:
    """``state`` with the leaves :func:`durable_values` kept taken from ``values``; buffers,
    scratch and auxiliary fields stay as they are."""
    if not _is_state_node(values):
        return state if values is None else values
    changes = {f.name: restore_durable(getattr(state, f.name), getattr(values, f.name))
               for f in dataclasses.fields(values)}
    return dataclasses.replace(state, **changes)


def by_value(state: Any) -> Any:
    """The small, by-value part of ``state``: every append-only buffer replaced by ``None``."""
    return _split(state, buffers=False)


def buffers_only(state: Any) -> Any:
    """The append-only part of ``state``: every by-value leaf replaced by ``None``.

    With :func:`by_value` this splits a state into what may be donated to XLA (the buffers)
    and what a checkpoint keeps (the values); :func:`merge_parts` joins them again.
    """
    return _split(state, buffers=True)


def merge_parts(buffers: Any, values: Any) -> Any:
    """Join :func:`buffers_only` and :func:`by_value` halves back into one state: the
    append-only buffers of ``buffers`` with every other leaf of ``values``."""
    if not _is_state_node(values):
        return values
    axes = _append_axes(values)
    changes = {}
    for f in dataclasses.fields(values):
        if f.name in axes:
            changes[f.name] = getattr(buffers, f.name)
        else:
            changes[f.name] = merge_parts(getattr(buffers, f.name), getattr(values, f.name))
    return dataclasses.replace(values, **changes)


def restore_by_value(state: Any, values: Any) -> Any:
    """``state`` with its by-value leaves taken from ``values`` (as made by :func:`by_value`):
    the buffers stay, so this is :func:`merge_parts` of the state and the values."""
    return merge_parts(state, values)


def copy_state(state: Any) -> Any:
    """A deep copy of every array leaf, so the copy survives donation of the original."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, state)


def live_view(state: Any, count: int | None = None) -> Any:
    """``state`` with dead rows of every append-only buffer zeroed, as numpy arrays.

    ``count`` is the cursor; by default that of the state's own :class:`FedRecord` (nested
    states with their own record, such as a drafter's, use theirs).
    """
    if isinstance(state, jax.Array | np.ndarray):
        return np.asarray(state)
    if isinstance(state, (tuple, list)):
        return type(state)(live_view(s) for s in state)
    if not _is_state_node(state):
        return state
    own = state if isinstance(state, FedRecord) else None
    if own is None:
        fed = next(
            (getattr(state, f.name) for f in dataclasses.fields(state)
             if isinstance(getattr(state, f.name), FedRecord)),
            None,
        )
        own = fed
    if own is not None:
        count = int(own.count)
    axes = _append_axes(state)
    changes = {}
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if f.metadata.get(_AUXILIARY):
            changes[f.name] = ()
        elif f.metadata.get(_SCRATCH):
            changes[f.name] = jax.tree.map(lambda x: np.zeros_like(np.asarray(x)), value)
        elif f.name in axes and isinstance(value, tuple | list) and not value:
            changes[f.name] = value  # no layer of this kind: nothing to stack
        elif f.name in axes:
            arr = np.array(value)
            if count is None:
                raise ValueError(f"field {f.name!r} is append-only but no cursor is known")
            index: list[Any] = [slice(None)] * arr.ndim
            axis = axes[f.name]
            if _RING in f.metadata:
                slots = arr.shape[axis]
                dead = np.ones(slots, bool)
                keep = getattr(state, f.metadata[_RING])
                if slots:
                    dead[np.arange(max(0, count - keep), count) % slots] = False
                index[axis] = dead
            else:
                index[axis] = slice(count, None)
            arr[tuple(index)] = 0
            changes[f.name] = arr
        elif isinstance(value, FedRecord):
            changes[f.name] = live_view(value)
        else:
            changes[f.name] = live_view(value, count)
    return dataclasses.replace(state, **changes)


def tree_bitwise_equal(a: Any, b: Any) -> bool:
    """Whether two pytrees have the same structure and bitwise-equal leaves."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    if ta != tb:
        return False
    for x, y in zip(la, lb, strict=True):
        x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not np.array_equal(x.view(np.uint8), y.view(np.uint8)):
            return False
    return True


def live_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of two states on their live rows and by-value leaves."""
    return tree_bitwise_equal(live_view(a), live_view(b))
