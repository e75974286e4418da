"""The target side of speculative decoding for a block producer.

:class:`BlockVerifying` is the :class:`~turbospark_jax.core.protocols.VerifyingTarget` side of
:class:`~turbospark_jax.engine.producer.BlockProducer`, which it is a part of (it is not used
alone: it feeds through the producer's state checks, plans and program call). A verify feeds
a drafted block in blocks of the producer's width and returns every row's logits; a
checkpoint is the state's by-value leaves, and a rollback restores them (the append-only
buffers keep the rows a verify wrote, so a rollback that retains some of them only moves the
cursor, replaying a recurrent model's rows from its tape).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from turbospark_jax.core.checks import as_int, as_token_ids, is_int
from turbospark_jax.core.protocols import VerifyingTarget
from turbospark_jax.core.state import FedRecord, by_value, restore_by_value
from turbospark_jax.engine.program import BlockState
from turbospark_jax.errors import BadInputError, ProducerFailedError, UnsupportedCapabilityError

__all__ = ["BlockVerifying"]


class BlockVerifying(VerifyingTarget[BlockState, BlockState]):
    """Verify, checkpoint and roll back for
    :class:`~turbospark_jax.engine.producer.BlockProducer` (see
    :class:`~turbospark_jax.core.protocols.VerifyingTarget`)."""

    def verify(
        self, state: BlockState, feed: Sequence[int], base: int
    ) -> tuple[jax.Array, BlockState]:
        feed = self._check_tokens(feed, base, state, what="verify block")
        rows = []
        for i in range(0, len(feed), self.width):
            block = feed[i : i + self.width]
            plan = self._plan([block], head_on_last=True)
            out, state = self._call(state, plan, self._idle, 1)
            rows.append(out.logits[: len(block)])
        return (rows[0] if len(rows) == 1 else jnp.concatenate(rows)), state

    def checkpoint(self, state: BlockState) -> BlockState:
        self._require_state(state)
        return by_value(state)

    def rollback(self, state: BlockState, point: BlockState) -> BlockState:
        self._check_ancestor(state, point)
        return restore_by_value(state, point)

    def supports_retaining_rollback(self) -> bool:
        return True

    def retaining_rollback_keeps(self, verified_rows: int, keep_rows: int) -> bool:
        return not 0 < keep_rows <= self._tape_gone(verified_rows)

    def _tape_gone(self, fed: int) -> int:
        """Rows of a verify of ``fed`` rows that the tape no longer holds: all but the last
        block's, for a model that records one (none otherwise)."""
        if not self.model.records_tape or not fed:
            return 0
        return self.width * ((fed - 1) // self.width)

    def rollback_retaining(
        self, state: BlockState, point: BlockState, keep_rows: int
    ) -> BlockState:
        # Rows the verify wrote stay in the append-only buffers; keeping them is moving the
        # cursor past them. Models with by-value recurrent leaves replay them from a tape.
        self._check_ancestor(state, point)
        base = int(point.fed.count)
        if not is_int(keep_rows) or not 0 <= int(keep_rows) <= int(state.fed.count) - base:
            raise BadInputError(
                f"keep_rows={keep_rows!r} but the last verify fed "
                f"{int(state.fed.count) - base} rows after the checkpoint"
            )
        keep_rows = int(keep_rows)
        restored = restore_by_value(state, point)
        if self.model.records_tape:
            # The tape holds the rows of the last block only; a verify wider than the block
            # ran in several, and the earlier rows' states are gone.
            fed = int(state.fed.count) - base
            last_block = self._tape_gone(fed)
            if 0 < keep_rows <= last_block:
                raise UnsupportedCapabilityError(
                    f"the verify fed {fed} rows in blocks of {self.width}; the tape keeps only "
                    f"the last block, so keep_rows={keep_rows} cannot be replayed. Verify at "
                    f"most width={self.width} rows per round, or use rollback and re-verify"
                )
            restored = restored.replace(
                cache=self.model.retain_rows(restored.cache, state.cache, keep_rows - last_block)
            )
        return self._with_count(restored, base + keep_rows)

    def record_committed(self, state: BlockState, tokens: Sequence[int], pos0: int) -> BlockState:
        # verify already recorded what it fed; this checks the caller and the record agree, so
        # a loop that miscounts fails here rather than answering a later turn wrongly.
        self._require_state(state)
        tokens = as_token_ids("tokens", tokens, self.vocab_size, allow_empty=True)
        pos0 = as_int("pos0", pos0, low=0)
        record = state.fed.to_host()
        end = pos0 + len(tokens)
        if end > record.count or list(record.ids[pos0:end]) != [int(t) for t in tokens]:
            raise ProducerFailedError(
                f"record_committed({list(tokens)}, pos0={pos0}) disagrees with the fed record "
                f"{list(record.ids[pos0:end])} (cursor {record.count})"
            )
        return state

    def _check_ancestor(self, state: BlockState, point: BlockState) -> None:
        """Refuse a checkpoint that is not of this producer or not an ancestor of ``state``."""
        self._require_state(state)
        if not isinstance(point, BlockState) or not isinstance(point.fed, FedRecord):
            raise BadInputError(
                f"a checkpoint must come from checkpoint(); got {type(point).__name__}"
            )
        if int(point.fed.owner) != self.identity:
            raise BadInputError(
                "this checkpoint was taken from another producer; roll a state back only to "
                "checkpoints of the producer that made it"
            )
        # A recurrent model restores its leaves by value from anywhere; a ring only what it holds.
        floor = self.rewind_floor(state) if self.can_rewind else 0
        if int(point.fed.count) < min(floor, int(state.fed.count)):
            raise BadInputError(
                f"this checkpoint (at position {int(point.fed.count)}) is older than the "
                f"sliding-window cache still holds (from {floor} on)"
            )
        if not state.fed.descends_from(point.fed):
            raise BadInputError(
                f"this checkpoint (at position {int(point.fed.count)}) is not an ancestor of "
                f"the state (at position {int(state.fed.count)}): the state never fed what the "
                "checkpoint had, so rolling back would claim positions it never consumed"
            )
