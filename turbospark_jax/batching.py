"""Batched decoding: every session slot's state stacked on one leading axis, decoded together.

A server holding ``B`` session slots keeps their :class:`~turbospark_jax.block_program.BlockState`
values stacked into one pytree whose leaves have a leading axis of ``B``. One compiled program,
``jax.vmap`` of the single-sequence block step (:func:`~turbospark_jax.block_program.feed_block`
with one live row, then per-row sampling), advances every decoding row by one token per call.
A request joins by having its row set between two calls and leaves by being marked idle; idle
rows are fed with ``live = 0``, which writes nothing to their cache or fed record, and keep their
sampling history unchanged.

Why a row's result does not depend on its neighbours: the batch size ``B`` is fixed, so the
program and every shape in it are the same on every call whoever is in flight; ``vmap`` maps each
row's computation independently (no reduction runs across rows), so a row's values flow only from
its own inputs. What such a program *may* still depend on is the row's index (a GEMM kernel can
treat rows differently by their place in a tile). ``tests/test_batching.py`` checks that a
request's tokens and logits are bitwise equal to serving it alone in every slot index and for
the neighbour mixes and arrival orders it fuzzes; on XLA's CPU backend this held for the toy
attention model, and in a one-off check of the embedded model (four greedy and sampled requests
arriving at different steps, rows 0-3; not in the suite, its compile is slow). On a GPU it must be
checked again on the device (the same test runs there); that has not been done yet.

A cost of ``vmap``: the sampler's ``lax.cond`` (sort-based top-k/top-p or not; sampled or
greedy) becomes a select that computes both branches for every row, so every row pays for a
sort over the vocabulary even when greedy.

Prefill is not batched here: a request's prompt runs through the producer's own exact chunked
program on that row's state alone (:meth:`BatchedDecoder.take_row` / :meth:`put_row`), so the
scheduler can place prefill chunks between decode steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from turbospark_jax import sampling
from turbospark_jax.block_producer import BlockProducer
from turbospark_jax.block_program import BlockState, feed_block
from turbospark_jax.checks import as_int, as_token
from turbospark_jax.errors import BadInputError
from turbospark_jax.models.base import BlockModel
from turbospark_jax.state import without_auxiliary

__all__ = ["MAX_TOP_LOGPROBS", "BatchedDecoder", "RowControls", "StepResult", "token_logprobs"]

#: Alternatives per token the step reports log-probabilities for (OpenAI's limit is 20).
MAX_TOP_LOGPROBS = 20


@struct.dataclass(kw_only=True)
class RowControls:
    """Per-row decode controls, stacked over the ``B`` rows; all data, never static.

    Fields:
      tokens:    int32[B]          the token each row feeds at the next step (the last sampled).
      params:    SamplingParams    each field ``[B]``: the row's request's sampling settings.
      history:   History           ``counts`` int32[B, V], ``seen`` bool[B, V]: penalties.
      keys:      uint32[B, 2]      raw key data of each request's base key (``request_key``).
      gen_index: int32[B]          index of the token the next step samples (for ``token_key``).
    """

    tokens: jax.Array
    params: sampling.SamplingParams
    history: sampling.History
    keys: jax.Array
    gen_index: jax.Array


@struct.dataclass(kw_only=True)
class StepResult:
    """What one batched step returns besides the new stack and controls.

    Fields:
      logits:   float32[B, V]  each row's next-token logits (idle rows: meaningless).
      sampled:  int32[B]       the token each row drew.
      finite:   bool[B]        whether the row's logits were all finite.
      logprob:  float32[B]     log-probability of the drawn token under the raw logits.
      top_ids:  int32[B, K]    the ``K = MAX_TOP_LOGPROBS`` likeliest ids, best first.
      top_logprobs: float32[B, K]  their log-probabilities.
    """

    logits: jax.Array
    sampled: jax.Array
    finite: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def _logprob_row(logits: jax.Array, token: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probability of ``token`` and the top ``K`` under ``softmax(logits)`` (row-local)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32))
    top_lp, top_ids = jax.lax.top_k(lp, min(MAX_TOP_LOGPROBS, lp.shape[0]))
    return lp[token], top_ids.astype(jnp.int32), top_lp


#: :func:`_logprob_row` for one host-side row (the first token, sampled after the prefill).
token_logprobs = jax.jit(_logprob_row)


def _row_step(
    model: BlockModel, params: Any, state: BlockState, token: jax.Array, live: jax.Array,
    sp: sampling.SamplingParams, history: sampling.History, key_data: jax.Array,
    gen_index: jax.Array,
) -> tuple[jax.Array, BlockState, jax.Array]:
    """One row: feed ``token`` (when ``live``), return its logits, new state and draw."""
    logits, state = feed_block(model, params, state, token[None], live, jnp.bool_(True))
    row = logits[0]
    key = sampling.token_key(jax.random.wrap_key_data(key_data), gen_index)
    drawn = sampling.sample(row, sp, history, key).astype(jnp.int32)
    return row, state, drawn


def decode_step(
    model: BlockModel, params: Any, stack: BlockState, rows: RowControls, active: jax.Array,
) -> tuple[BlockState, RowControls, StepResult]:
    """Advance every active row by one token (jittable; ``active`` is bool[B])."""
    live = active.astype(jnp.int32)
    step = functools.partial(_row_step, model, params)
    logits, stack, drawn = jax.vmap(step)(
        stack, rows.tokens, live, rows.params, rows.history, rows.keys, rows.gen_index
    )
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    lp, top_ids, top_lp = jax.vmap(_logprob_row)(logits, drawn)
    grown = jax.vmap(sampling.History.add)(rows.history, drawn)
    keep = lambda new, old: jnp.where(  # noqa: E731
        active.reshape(active.shape + (1,) * (new.ndim - 1)), new, old
    )
    rows = rows.replace(
        tokens=jnp.where(active, drawn, rows.tokens),
        history=jax.tree.map(keep, grown, rows.history),
        gen_index=rows.gen_index + live,
    )
    out = StepResult(logits=logits, sampled=drawn, finite=finite, logprob=lp, top_ids=top_ids,
                     top_logprobs=top_lp)
    return stack, rows, out


@functools.cache
def _compiled_step(model: BlockModel, step: Callable[..., Any]) -> Any:
    return jax.jit(functools.partial(step, model), donate_argnums=(1, 2))


@functools.cache
def _row_io() -> tuple[Any, Any]:
    take = jax.jit(lambda tree, i: jax.tree.map(lambda x: x[i], tree))
    put = jax.jit(
        lambda tree, i, row: jax.tree.map(lambda x, r: x.at[i].set(r), tree, row),
        donate_argnums=(0,),
    )
    return take, put


class BatchedDecoder:
    """``B`` rows of one :class:`BlockProducer`'s states, decoded one token per call, together.

    Args:
      producer: the single-sequence producer (its model, params and capacity; its states are
        the rows, and its own program prefills them).
      rows: ``B``, the number of rows (the server's session slots).

    Raises:
      BadInputError: ``producer`` is not a :class:`BlockProducer` or ``rows`` is below 1.
    """

    #: The batched step; the tests swap in a row-mixing one as the control.
    step_fn: Callable[..., Any] = staticmethod(decode_step)

    def __init__(self, producer: BlockProducer, rows: int) -> None:
        if not isinstance(producer, BlockProducer):
            raise BadInputError(
                f"batched decoding needs a BlockProducer, got {type(producer).__name__}"
            )
        self.producer = producer
        self.size = as_int("rows", rows, low=1)
        fresh = without_auxiliary(producer.init_state())[0]
        self.stack: BlockState = jax.tree.map(lambda x: jnp.stack([x] * self.size), fresh)
        vocab = producer.vocab_size
        one = sampling.SamplingParams.greedy()
        self.controls = RowControls(
            tokens=jnp.zeros((self.size,), jnp.int32),
            params=jax.tree.map(lambda x: jnp.stack([x] * self.size), one),
            history=sampling.History(
                counts=jnp.zeros((self.size, vocab), jnp.int32),
                seen=jnp.zeros((self.size, vocab), jnp.bool_),
            ),
            keys=jnp.zeros((self.size, 2), jnp.uint32),
            gen_index=jnp.zeros((self.size,), jnp.int32),
        )
        self._step = _compiled_step(producer.model, type(self).step_fn)
        self._take, self._put = _row_io()

    def take_row(self, index: int) -> BlockState:
        """A copy of row ``index``'s state, a state of :attr:`producer` (to prefill it)."""
        return self._take(self.stack, jnp.int32(self._index(index)))

    def put_row(self, index: int, state: BlockState) -> None:
        """Store ``state`` (a state of :attr:`producer`, snapshots dropped) as row ``index``."""
        self.producer.check_state(state)
        bare = without_auxiliary(state)[0]
        self.stack = self._put(self.stack, jnp.int32(self._index(index)), bare)

    def start_row(
        self, index: int, *, token: int, params: sampling.SamplingParams,
        history: sampling.History, seed: int, gen_index: int,
    ) -> None:
        """Set row ``index`` to decode a request from ``token`` (its last sampled, not fed)."""
        index = self._index(index)
        token = as_token("token", token, self.producer.vocab_size)
        sampling.check_sampling_args(params, history, None, self.producer.vocab_size)
        key = jax.random.key_data(sampling.request_key(seed))
        row = RowControls(tokens=jnp.int32(token), params=params, history=history, keys=key,
                          gen_index=jnp.int32(as_int("gen_index", gen_index, low=0)))
        self.controls = self._put(self.controls, jnp.int32(index), row)

    def step(self, active: np.ndarray) -> StepResult:
        """Advance the rows where ``active`` (bool[B]) is set by one token, in one call."""
        active = np.asarray(active, bool)
        if active.shape != (self.size,):
            raise BadInputError(f"active must be bool[{self.size}], got shape {active.shape}")
        self.stack, self.controls, out = self._step(
            self.producer.params, self.stack, self.controls, jnp.asarray(active)
        )
        return out

    def _index(self, index: int) -> int:
        return as_int("index", index, low=0, high=self.size - 1)
