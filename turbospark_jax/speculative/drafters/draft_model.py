"""A separate, smaller model as the drafter: any producer with the target's vocabulary.

The drafter keeps its own producer state (its own KV rows and fed record), primed over the
committed tokens and moved back with :meth:`~turbospark_jax.core.protocols.LogitProducer.rewind`
when a round rejects what it drafted. Over a
:class:`~turbospark_jax.engine.producer.BlockProducer` whose model can rewind it also runs in
the device loop (:class:`DraftModelDevice`): its draft steps are the same block program
``step`` runs, with the sampling inside the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from turbospark_jax.core import sampling
from turbospark_jax.core.checks import as_int
from turbospark_jax.core.protocols import ChunkedPrefillRunner, DeviceDecoder, LogitProducer
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.engine.program import BlockState, feed_block
from turbospark_jax.errors import BadInputError
from turbospark_jax.models.base import BlockModel
from turbospark_jax.speculative.drafters.base import MAX_DRAFT, DeviceDrafter, Drafter, draft_loop

if TYPE_CHECKING:  # the rounds import the drafters package; an annotation needs no cycle
    from turbospark_jax.speculative.rounds import DraftSampler


class DraftModelDrafter(Drafter):
    """Drafts with ``producer.produce``; any producer works, a rewinding one best.

    Args:
      producer: the draft model's producer (same vocabulary as the target).
    """

    def __init__(self, producer: LogitProducer) -> None:
        if not isinstance(producer, LogitProducer):
            raise BadInputError(
                f"a draft model must be a LogitProducer (a BlockProducer), got "
                f"{type(producer).__name__}"
            )
        self.producer = producer

    @property
    def vocab_size(self) -> int:
        return self.producer.vocab_size

    @property
    def max_positions(self) -> int | None:
        return self.producer.max_positions

    def init_state(self) -> Any:
        return self.producer.init_state()

    def check_state(self, state: Any) -> None:
        self.producer.check_state(state)

    def position(self, state: Any) -> int:
        return int(self.producer.fed_record(state).count)

    def prime(self, state: Any, tokens: Sequence[int], start: int) -> Any:
        tokens = [int(t) for t in tokens]
        if not tokens:
            return state
        if isinstance(self.producer, ChunkedPrefillRunner):
            return self.producer.prefill_chunk(state, tokens, start)[1]
        for i, tok in enumerate(tokens):
            state = self.producer.produce_prefill(state, tok, start + i)
        return state

    def rewind(self, state: Any, position: int, known: Callable[[], Sequence[int]]) -> Any:
        have = self.position(state)
        if have == position:
            return state
        if position < have:
            if self.producer.can_rewind:
                return self.producer.rewind(state, position)
            state, have = self.producer.init_state(), 0  # a recurrent draft model starts over
        return self.prime(state, list(known())[have:position], have)

    def step(self, state: Any, token: int, position: int) -> tuple[jax.Array, Any]:
        return self.producer.produce(state, int(token), position)

    def supports_bursts(self) -> bool:
        return isinstance(self.producer, DeviceDecoder)

    def burst(
        self, state: Any, token: int, position: int, count: int, *,
        params: Any, history: Any, key: jax.Array, index: int,
    ) -> tuple[list[int], jax.Array, Any]:
        # The producer's device decode is the same block program ``step`` runs, with the
        # sampling inside the loop: one call instead of ``count``, the same bits.
        del position  # decode continues at the state's own cursor, which is ``position``
        count = as_int("count", count, low=1)
        tokens: list[int] = []
        rows = []
        while len(tokens) < count:  # more than one call only past the producer's burst cap
            steps = min(count - len(tokens), self.producer.steps_per_call)
            burst, state = self.producer.decode(
                state, int(token), steps, params=params, history=history, key=key,
                gen_index=index + len(tokens),
            )
            tokens += burst.tokens
            rows.append(burst.logits)
            if len(burst.tokens) < steps:
                break  # non-finite logits ended the burst
            token, history = burst.tokens[-1], burst.history
        logits = rows[0] if len(rows) == 1 else jnp.concatenate(rows)
        return tokens, logits, state

    def on_device(self) -> tuple[DeviceDrafter, Any] | None:
        p = self.producer
        if not (isinstance(p, BlockProducer) and p.model.rewindable and p.width >= 2):
            return None
        return DraftModelDevice(model=p.model, width=p.width), p.params


@dataclasses.dataclass(frozen=True)
class DraftModelDevice(DeviceDrafter):
    """A rewinding draft model's steps inside the device loop.

    At a round's start the drafter may lag the committed sequence by one position (it never
    consumed the last proposal of a round that kept them all): its first step feeds that
    committed id and the pending token as one block of two live rows, then one row per step.
    """

    point_mass = False
    loop_free = True

    model: BlockModel
    width: int

    def propose(
        self, params: Any, state: BlockState, target: BlockState, pending: jax.Array,
        m: jax.Array, sampler: DraftSampler,
    ) -> tuple[jax.Array, jax.Array, jax.Array, BlockState]:
        rows_w = jnp.arange(self.width, dtype=jnp.int32)
        lag = target.fed.count - state.fed.count
        catch_up = jnp.take(target.fed.ids, state.fed.count + rows_w, mode="clip")
        first = jnp.where(rows_w < lag, catch_up, jnp.where(rows_w == lag, pending, 0))
        head = m >= 0  # traced, as in the block program's per-step flag

        def cond(c):
            i, _, _, _, _, _, finite = c
            return (i < m) & finite

        def body(c):
            i, st, tokens, proposals, q, hist, _ = c
            live = jnp.where(i == 0, lag + 1, 1)
            logits, st = feed_block(self.model, params, st, tokens, live, head)
            last = logits[live - 1]
            finite = jnp.all(jnp.isfinite(last))
            if sampler.greedy:  # static: the same token, no branch on the temperature, and
                # no q (the greedy judge reads none)
                tok = sampling.greedy_token(last, sampler.params, hist)
            else:
                key = sampling.token_key(sampler.key, sampler.index + i)
                # The row is shaped once for both the draw and its q (what ``sample`` and
                # ``probabilities`` would each compute, sorting once instead of twice).
                processed = sampling.process_logits(last, sampler.params, hist)
                tok = sampling.draw_processed(processed, sampler.params, key)
                q = q.at[i].set(sampling.distribution(processed, sampler.params))
            proposals = jnp.where(finite, proposals.at[i].set(tok), proposals)
            hist = hist.add(tok)
            nxt = jnp.zeros((self.width,), jnp.int32).at[0].set(tok)
            return i + 1, st, nxt, proposals, q, hist, finite

        vocab = self.model.vocab_size
        init = (jnp.int32(0), state, first, jnp.zeros((MAX_DRAFT,), jnp.int32),
                jnp.zeros((MAX_DRAFT, vocab), jnp.float32), sampler.history, jnp.bool_(True))
        steps, state, _, proposals, q, _, finite = draft_loop(cond, body, init, sampler)
        # Non-finite logits end the drafting: the proposals before them stand and, as in the
        # host rounds, the drafter goes back to the committed sequence.
        count = jnp.where(finite, steps, steps - 1)
        state = jnp_rewind(state, jnp.where(finite, state.fed.count, target.fed.count))
        q = jnp.where((jnp.arange(MAX_DRAFT) < count)[:, None], q, 0.0)
        return proposals, q, count, state

    def commit(self, state: BlockState, keep: jax.Array) -> BlockState:
        return jnp_rewind(state, jnp.minimum(state.fed.count, keep))


def jnp_rewind(state: BlockState, count: jax.Array) -> BlockState:
    """A rewinding model's state moved back to ``count`` positions (traced)."""
    return state.replace(fed=state.fed.moved_to(count))
