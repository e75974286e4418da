"""The Qwen3.5 / Qwen3-Next MTP head as a drafter: the target's own next-next-token predictor.

The head (:meth:`~turbospark_jax.models.qwen3_5.model.Qwen35Model.mtp_block_forward`) reads the
trunk's final hidden state at position ``p`` and the token at ``p + 1`` and predicts the token
at ``p + 2``, with one decoder layer of its own KV rows. Its row ``p`` is exact only when made
from the trunk's hidden state, which the target records for every fed position
(``Qwen35Cache.hidden_rows``), so:

* a round first catches the head up over the positions the target has committed since the
  last round (their trunk rows, their next tokens; the pending token is the next token of the
  last one) in blocks of ``W`` rows, and the last row's logits give the first proposal;
* each further proposal chains on the head's own output hidden state, one row a step;
* the chained rows are speculative: at the commit the drafter keeps only the rows made from
  the trunk, and the next round rebuilds the accepted positions from the target's rows.

Proposals are the head's argmax (a deterministic drafter: its proposal distribution is a
point mass, so sampled decoding stays lossless through rejection sampling). The host rounds
draft with the same compiled function the device rounds run, so the two agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from turbospark_jax.core.state import FedRecord
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.models.qwen3_5.model import MTPCache, Qwen35Model
from turbospark_jax.speculative.drafters.base import (
    MAX_DRAFT,
    CatchUpDevice,
    CatchUpDrafter,
    DeviceDrafter,
    draft_loop,
    propose_compiled,
)


@struct.dataclass(kw_only=True)
class MTPState:
    """Fields:
      cache: the head's KV rows (row ``p``: trunk hidden at ``p`` with the token at ``p + 1``).
      fed: the head's rows made from the trunk: ``fed.count`` of them (``ids[p]`` is the token
        at ``p + 1`` it read).
    """

    cache: MTPCache
    fed: FedRecord


class MTPDrafter(CatchUpDrafter):
    """Draft with the target's MTP head.

    Args:
      target: a :class:`~turbospark_jax.engine.producer.BlockProducer` over a Qwen3.5 /
        Qwen3-Next model whose config has an MTP head (``mtp_num_hidden_layers > 0``).

    Raises:
      BadInputError: the target has no MTP head.
    """

    def __init__(self, target: BlockProducer) -> None:
        model = target.model if isinstance(target, BlockProducer) else None
        if not isinstance(model, Qwen35Model) or not model.config.mtp_num_hidden_layers:
            raise BadInputError(
                "the MTP drafter needs a BlockProducer over a Qwen3.5 / Qwen3-Next model with "
                "an MTP head (mtp_num_hidden_layers > 0 and mtp.* weights)"
            )
        if model.config.mtp_num_hidden_layers > 1:
            raise BadInputError(
                f"the MTP drafter chains one head layer; this config has "
                f"{model.config.mtp_num_hidden_layers} (mtp_num_hidden_layers)"
            )
        self.target = target
        self._device = MTPDevice(model=model, width=target.width)

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    def init_state(self) -> MTPState:
        capacity = self.target.capacity
        return MTPState(cache=self.target.model.mtp_init_cache(capacity),
                        fed=FedRecord.empty(capacity))

    def block(self, state: MTPState, known: Sequence[int], count: int, *,
              target: Any = None) -> tuple[list[int], MTPState]:
        if target is None:
            raise BadInputError("the MTP drafter reads the target's state; pass target=")
        proposals, n, state = propose_compiled(self._device, self.target.params, state, target,
                                               jnp.int32(int(known[-1])), jnp.int32(count))
        return [int(t) for t in jax.device_get(proposals)[: int(n)]], state

    def on_device(self) -> tuple[DeviceDrafter, Any]:
        return dataclasses.replace(self._device, caught_up=True), self.target.params


@dataclasses.dataclass(frozen=True)
class MTPDevice(CatchUpDevice):
    """The head's catch-up and chain inside the device loop (see the module docstring;
    ``caught_up``: :class:`~turbospark_jax.speculative.drafters.base.CatchUpDevice`)."""

    model: Qwen35Model
    width: int
    caught_up: bool = False

    def _catch_up_block(self, params: Any, c: tuple, target: Any, pending: jax.Array) -> tuple:
        """One block of up to ``width`` of the head's rows from the trunk's (the positions
        after ``fed.count``, up to the pending token's), with the last row's logits and
        hidden state."""
        cache, fed, _, _ = c
        base = target.fed.count  # the pending token's position
        rows_w = jnp.arange(self.width, dtype=jnp.int32)
        positions = fed.count + rows_w
        live = jnp.minimum(base - fed.count, self.width)
        # the token after each position: committed, or the pending one after the last
        nxt = jnp.where(positions + 1 < base,
                        jnp.take(target.fed.ids, positions + 1, mode="clip"), pending)
        logits, hidden, cache = self.model.mtp_block_forward(
            params, cache, jnp.take(target.cache.hidden_rows, positions, axis=0, mode="clip"),
            nxt, positions, live)
        last = live - 1
        return cache, fed.append(nxt, live), logits[last], hidden[last]

    def _catch_up_start(self, state: MTPState, target: Any) -> tuple:
        dim = target.cache.hidden_rows.shape[-1]
        return (state.cache, state.fed, jnp.zeros((self.model.vocab_size,), jnp.float32),
                jnp.zeros((dim,), target.cache.hidden_rows.dtype))

    def catch_up(self, params: Any, state: MTPState, target: Any) -> MTPState:
        # whole blocks while more than one is left: their next tokens are all committed
        cache, fed, _, _ = self._whole_blocks(
            target.fed.count, lambda c: self._catch_up_block(params, c, target, jnp.int32(0)),
            self._catch_up_start(state, target))
        return MTPState(cache=cache, fed=fed)

    def propose(
        self, params: Any, state: MTPState, target: Any, pending: jax.Array, m: jax.Array,
        sampler: Any,
    ) -> tuple[jax.Array, None, jax.Array, MTPState]:
        # greedy drafting (a point-mass proposal); the sampler says whether to bound the chain
        w = self.width
        base = target.fed.count  # the pending token's position
        dim = target.cache.hidden_rows.shape[-1]

        def catch_up(c):
            return self._catch_up_block(params, c, target, pending)

        # rows 0 .. base - 1 from the trunk
        cache, fed, logits, hidden = self._round_catch_up(
            base, catch_up, self._catch_up_start(state, target))

        def chain(c):
            i, cache, proposals, logits, hidden = c
            tok = jnp.argmax(logits).astype(jnp.int32)
            proposals = proposals.at[i].set(tok)
            row = jnp.zeros((w,), jnp.int32)
            logits_w, hidden_w, cache = self.model.mtp_block_forward(
                params, cache, jnp.zeros((w, dim), hidden.dtype).at[0].set(hidden),
                row.at[0].set(tok), base + i + row, jnp.int32(1))
            return i + 1, cache, proposals, logits_w[0], hidden_w[0]

        count = jnp.clip(m, 0, MAX_DRAFT)
        _, cache, proposals, _, _ = draft_loop(  # at most MAX_DRAFT links
            lambda c: c[0] < count, chain,
            (jnp.int32(0), cache, jnp.zeros((MAX_DRAFT,), jnp.int32), logits, hidden),
            sampler)
        # the chained rows are speculative: the record keeps only the trunk's rows
        return proposals, None, count, MTPState(cache=cache, fed=fed)

    def commit(self, state: MTPState, keep: jax.Array) -> MTPState:
        return state.replace(fed=state.fed.moved_to(jnp.minimum(state.fed.count, keep)))
