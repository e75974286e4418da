"""(target, drafter) as one :class:`~turbospark_jax.protocols.SpeculativeProducer`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import struct

from turbospark_jax.drafters.base import Drafter
from turbospark_jax.errors import BadInputError
from turbospark_jax.protocols import ChunkedPrefillRunner, SpeculativeProducer, VerifyingTarget


@struct.dataclass(kw_only=True)
class PairState:
    """Fields:
      target:  the target producer's state.
      drafter: the drafter's state.
      known:   host tuple of the ids the target has consumed, position by position (what
               drafters look up and prime from; mirrors the target's fed record).
    """

    target: Any
    drafter: Any
    known: tuple[int, ...] = struct.field(pytree_node=False, default=())


@struct.dataclass(kw_only=True)
class PairCheckpoint:
    """Fields: target: the target's checkpoint; known: how many known ids to keep."""

    target: Any
    known: int = struct.field(pytree_node=False, default=0)


class SpeculativePair(SpeculativeProducer[PairState, PairCheckpoint]):
    """Pair a verifying target with a drafter.

    Args:
      target: a :class:`~turbospark_jax.protocols.VerifyingTarget` (``BlockProducer``).
      drafter: a :class:`~turbospark_jax.drafters.base.Drafter` with the same vocabulary.

    Raises:
      BadInputError: the vocabularies differ.
    """

    def __init__(self, target: VerifyingTarget, drafter: Drafter) -> None:
        if target.vocab_size != drafter.vocab_size:
            raise BadInputError(
                f"the drafter's vocabulary has {drafter.vocab_size} ids but the target's has "
                f"{target.vocab_size}; a drafter must share the target's tokenizer"
            )
        self.target = target
        self.drafter = drafter

    # -- plain producer: the target ------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def max_positions(self) -> int | None:
        return self.target.max_positions

    def init_state(self) -> PairState:
        return PairState(target=self.target.init_state(), drafter=self.drafter.init_state())

    def try_reuse_prefix(
        self, state: PairState, prompt_ids: Sequence[int], *,
        injected: Mapping[int, int] | None = None,
    ) -> tuple[int, PairState]:
        n, target = self.target.try_reuse_prefix(state.target, prompt_ids, injected=injected)
        known = state.known[:n]
        # Leave the drafter at exactly ``n`` too: rewind it, then prime what it lacks.
        drafter = self.drafter.rewind(
            state.drafter, known, min(n, self.drafter.consumed(state.drafter))
        )
        for position in range(self.drafter.consumed(drafter), n):
            drafter = self.drafter.prime(drafter, known, position)
        return n, PairState(target=target, drafter=drafter, known=known)

    def produce(self, state: PairState, token: int, position: int) -> tuple[jax.Array, PairState]:
        logits, target = self.target.produce(state.target, token, position)
        return logits, state.replace(target=target, known=(*state.known, int(token)))

    def produce_prefill(self, state: PairState, token: int, position: int) -> PairState:
        target = self.target.produce_prefill(state.target, token, position)
        return state.replace(target=target, known=(*state.known, int(token)))

    def prefill_chunk(
        self, state: PairState, tokens: Sequence[int], start_position: int
    ) -> tuple[jax.Array, PairState]:
        if not isinstance(self.target, ChunkedPrefillRunner):
            raise BadInputError(f"{type(self.target).__name__} has no chunked prefill")
        logits, target = self.target.prefill_chunk(state.target, tokens, start_position)
        return logits, state.replace(target=target, known=(*state.known, *map(int, tokens)))

    # -- drafter side ----------------------------------------------------------------------

    def prime_drafter(self, state: PairState, next_token: int, position: int) -> PairState:
        # The drafter consumes the committed token at ``position``; ``next_token`` (known
        # during the prompt) is what a head-style drafter would pair it with.
        del next_token
        self._require_known(state, position)
        return state.replace(drafter=self.drafter.prime(state.drafter, state.known, position))

    def supports_chunked_drafter_prefill(self) -> bool:
        return isinstance(self.target, ChunkedPrefillRunner)

    def prefill_chunk_priming_drafter(
        self, state: PairState, tokens: Sequence[int], start_position: int,
        next_token: int | None,
    ) -> tuple[jax.Array, PairState]:
        logits, state = self.prefill_chunk(state, tokens, start_position)
        # Prime every position whose next token is known: all of the chunk but, when the
        # chunk ends the prompt, its last token (left for the first draft step).
        last = start_position + len(tokens) - (1 if next_token is None else 0)
        drafter = state.drafter
        for position in range(start_position, last):
            drafter = self.drafter.prime(drafter, state.known, position)
        return logits, state.replace(drafter=drafter)

    def draft_step(
        self, state: PairState, token: int, position: int
    ) -> tuple[jax.Array, PairState]:
        logits, drafter = self.drafter.step(state.drafter, token, position)
        return logits, state.replace(drafter=drafter)

    def supports_draft_bursts(self) -> bool:
        """Whether :meth:`draft_burst` can replace repeated :meth:`draft_step` calls."""
        return self.drafter.supports_bursts()

    def draft_burst(
        self, state: PairState, token: int, position: int, count: int, **sampling: Any
    ) -> tuple[list[int], jax.Array, PairState]:
        """``count`` draft steps and their sampling in one device call (see
        :meth:`~turbospark_jax.drafters.base.Drafter.burst`)."""
        proposals, logits, drafter = self.drafter.burst(
            state.drafter, token, position, count, **sampling
        )
        return proposals, logits, state.replace(drafter=drafter)

    def drafts_block_passes(self) -> bool:
        return self.drafter.drafts_blocks

    def draft_block(
        self, state: PairState, anchor: int, base: int, block: int
    ) -> tuple[list[int], PairState]:
        known = (*state.known[:base], int(anchor))
        proposals, drafter = self.drafter.block(state.drafter, known, block)
        return proposals, state.replace(drafter=drafter)

    def rewind_drafter(self, state: PairState, position: int) -> PairState:
        drafter = self.drafter.rewind(state.drafter, state.known, position)
        return state.replace(drafter=drafter)

    def supports_headless_prefill(self) -> bool:
        # Neither drafter reads the target's hidden states, so skipping its head is safe.
        return True

    # -- target side -----------------------------------------------------------------------

    def checkpoint(self, state: PairState) -> PairCheckpoint:
        return PairCheckpoint(target=self.target.checkpoint(state.target), known=len(state.known))

    def rollback(self, state: PairState, point: PairCheckpoint) -> PairState:
        target = self.target.rollback(state.target, point.target)
        return state.replace(target=target, known=state.known[: point.known])

    def supports_retaining_rollback(self) -> bool:
        return self.target.supports_retaining_rollback()

    def rollback_retaining(
        self, state: PairState, point: PairCheckpoint, keep_rows: int
    ) -> PairState:
        target = self.target.rollback_retaining(state.target, point.target, keep_rows)
        return state.replace(target=target, known=state.known[: point.known + keep_rows])

    def record_committed(self, state: PairState, tokens: Sequence[int], pos0: int) -> PairState:
        target = self.target.record_committed(state.target, tokens, pos0)
        if list(state.known[pos0 : pos0 + len(tokens)]) != [int(t) for t in tokens]:
            raise BadInputError(f"record_committed({list(tokens)}, {pos0}) was never fed")
        return state.replace(target=target)

    def verify(
        self, state: PairState, feed: Sequence[int], base: int
    ) -> tuple[jax.Array, PairState]:
        rows, target = self.target.verify(state.target, feed, base)
        return rows, state.replace(target=target, known=(*state.known, *map(int, feed)))

    def _require_known(self, state: PairState, position: int) -> None:
        if not 0 <= position < len(state.known):
            raise BadInputError(
                f"prime_drafter at position {position}, but the target has consumed only "
                f"{len(state.known)} positions; feed the target first"
            )

