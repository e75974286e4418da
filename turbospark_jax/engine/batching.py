"""Batched serving: every session slot's state stacked on one leading axis, advanced together.

A server holding ``B`` session slots keeps their :class:`~turbospark_jax.engine.program.BlockState`
values stacked into one pytree whose leaves have a leading axis of ``B``. Three kinds of
compiled program work on the stack:

* **decode** (:func:`decode_step`): ``jax.vmap`` of the single-sequence block step
  (:func:`~turbospark_jax.engine.program.feed_block` with one live row), then per-row sampling,
  advances every decoding row by one token per call. For a model whose rows keep their bits
  whatever the number of rows mapped (:func:`rows_agree_in_batches`) it comes in
  **buckets** (:func:`buckets`): one program for each ``b`` in the powers of two below ``B``
  and ``B`` itself, over the first ``b`` rows of the stack (:func:`on_first_rows`), and a
  call runs the smallest bucket that holds every active row. So one stream in row 0 costs
  one row's work, not ``B``'s, provided the caller keeps its live rows packed at the bottom
  of the stack. Any other model has the one bucket of ``B`` rows;
* **row swap** (:meth:`BatchedDecoder.swap_rows`): exchanges two rows' states and controls on
  the device, which is how a caller packs its rows (one program whatever the rows);
* **row copy** (:meth:`BatchedDecoder.copy_row`): overwrites one row's state with another's on
  the device, the source left as it was, which is how a caller lets a request start from a
  prefix another row has fed (one program whatever the rows);
* **prefill** (:func:`prefill_step`): gathers ``P`` rows, feeds each up to ``C`` prompt tokens in
  ``W``-wide blocks (``jax.vmap`` of ``feed_block`` with ``W`` rows, ``live`` of them real,
  inside one loop with a traced trip count), scatters them back, and draws the first token of
  the rows whose prompt ends there.

**Images** (embeddings injected at prompt positions, :mod:`turbospark_jax.core.injection`): the
prefill takes, beside the tokens, each fed position's injected identity and embedding row
(``injected``, ``embeds``), which the block program reads instead of the token's embedding
and records in the row's fed record (so prefix reuse tells one image from another). That
variant of the prefill is traced only when a call feeds an image; text-only calls run the
program without those inputs, unchanged.

A request joins by having its row set between two calls and leaves by being marked idle; rows a
call does not advance are fed with ``live = 0``, which writes nothing to their cache or fed
record, and keep their sampling controls unchanged.

Why a row's result does not depend on its neighbours: ``B``, ``P``, ``C`` and ``W`` are fixed,
so each program and every shape in it are the same on every call whoever is in flight; ``vmap``
maps each row's computation independently (no reduction runs across rows), so a row's values
flow only from its own inputs. What such a program *may* still depend on is the row's index,
the bucket's row count, and for the prefill, where a prompt's blocks start. A GEMM kernel can
treat rows differently by their place in a tile; and ``vmap`` folds the mapped rows into the
rows of each product, so a library dot (XLA's on the CPU, a GPU's GEMM) may sum a row another
way for another row count. That is why only a model whose kernels are the row-invariant Pallas
kernels (:mod:`turbospark_jax.kernels.rowinv`: under ``vmap`` each row runs programs of its
own, the same for any row count) gets buckets. A prompt's blocks start ``W`` apart from
wherever the row's state stood, and the block program's guarantee (any split of a prompt into
live counts gives the same bits, padding rows writing nothing) is what makes a prompt fed in
chunks, after any reused prefix, equal to the same prompt fed alone. The batching tests check
that a request's tokens and logits are bitwise equal to serving it alone in every slot index
and for the neighbour mixes, arrival orders, shared prefixes and prompt lengths they fuzz, on
XLA's CPU backend with the toy attention model, and across buckets and rows moved in
mid-generation with a toy whose block runs row by row under ``vmap`` and with a dense model on
the row-invariant kernels (in the Pallas interpreter on a CPU). On a GPU it must be checked
again on the device (the same tests run there, the dense model on the compiled kernels).

What a bucket costs beside its rows' work: the program reads the first ``b`` rows as a slice
of the donated stack and writes them back with one ``dynamic_update_slice``; XLA materialises
the slice, so a step copies the ``b`` rows' state in and out once (the rows above are not
touched). The ``B`` bucket has no such copy (its slice is the whole stack).

Sampling cost: under ``vmap`` the sampler's ``lax.cond`` becomes a select that computes both
branches for every row, so each program comes in variants chosen per call from the rows in it:
with the top-k/top-p sort only when some row has top-k or top-p on, and with log-probabilities
only when some row asks for them. Neither changes any row's token or logits
(:func:`~turbospark_jax.core.sampling.draw`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from turbospark_jax.core import sampling
from turbospark_jax.core.checks import as_int, as_token, as_token_ids
from turbospark_jax.core.state import without_auxiliary
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.engine.program import BlockState, feed_block
from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.plan import KernelPlan
from turbospark_jax.models.base import BlockModel

__all__ = ["MAX_TOP_LOGPROBS", "BatchedDecoder", "RowControls", "StepResult", "buckets",
           "decode_step", "on_first_rows", "prefill_step", "rows_agree_in_batches"]

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


def _where_rows(mask: jax.Array, new: Any, old: Any) -> Any:
    """``new`` in the rows where ``mask`` (bool[B]) is set, else ``old``, leaf by leaf."""
    return jax.tree.map(
        lambda n, o: jnp.where(mask.reshape(mask.shape + (1,) * (n.ndim - 1)), n, o), new, old
    )


def _draw_rows(
    logits: jax.Array, rows: RowControls, active: jax.Array, *, truncate: bool, logprobs: bool,
    allowed: jax.Array | None = None,
) -> tuple[RowControls, StepResult]:
    """Sample each row's next token from its ``logits`` (``[B, V]``) with its own settings and
    key; the active rows' controls move on (the token to feed, penalty history, index).

    ``allowed`` (bool[B, V], optional): the ids each row may draw (a constrained request's
    mask; all set for a free row, whose logits then pass through unchanged). The masked
    logits are what the row draws from and what comes back; ``finite`` reads the raw ones.

    ``truncate`` and ``logprobs`` are static: ``truncate`` False compiles the sampler without
    the top-k/top-p sort (:func:`~turbospark_jax.core.sampling.draw`), ``logprobs`` False without
    the log-softmax and top-``K`` (zeros come back). The caller chooses them from the rows in
    the call; neither changes any row's token or logits."""
    draw = functools.partial(sampling.draw, truncate=truncate)
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    keys = jax.vmap(lambda data, i: sampling.token_key(jax.random.wrap_key_data(data), i))(
        rows.keys, rows.gen_index
    )
    drawn = jax.vmap(draw)(logits, rows.params, rows.history, keys).astype(jnp.int32)
    size, k = logits.shape[0], min(MAX_TOP_LOGPROBS, logits.shape[1])
    if logprobs:
        lp, top_ids, top_lp = jax.vmap(_logprob_row)(logits, drawn)
    else:
        lp = jnp.zeros((size,), jnp.float32)
        top_ids, top_lp = jnp.zeros((size, k), jnp.int32), jnp.zeros((size, k), jnp.float32)
    grown = jax.vmap(sampling.History.add)(rows.history, drawn)
    rows = rows.replace(
        tokens=jnp.where(active, drawn, rows.tokens),
        history=_where_rows(active, grown, rows.history),
        gen_index=rows.gen_index + active.astype(jnp.int32),
    )
    out = StepResult(logits=logits, sampled=drawn, finite=finite, logprob=lp, top_ids=top_ids,
                     top_logprobs=top_lp)
    return rows, out


def decode_step(
    model: BlockModel, params: Any, stack: BlockState, rows: RowControls, active: jax.Array,
    allowed: jax.Array | None = None, *, truncate: bool = True, logprobs: bool = True,
) -> tuple[BlockState, RowControls, StepResult]:
    """Advance every active row by one token (jittable; ``active`` is bool[B]): feed the row's
    last drawn token, then draw the next from the logits (masked by ``allowed``, bool[B, V],
    when given)."""
    live = active.astype(jnp.int32)

    def feed(state: BlockState, token: jax.Array, n: jax.Array) -> tuple[jax.Array, BlockState]:
        logits, state = feed_block(model, params, state, token[None], n, jnp.bool_(True))
        return logits[0], state

    logits, stack = jax.vmap(feed)(stack, rows.tokens, live)
    rows, out = _draw_rows(logits, rows, active, truncate=truncate, logprobs=logprobs,
                           allowed=allowed)
    return stack, rows, out


def prefill_step(
    model: BlockModel, params: Any, stack: BlockState, rows: RowControls, index: jax.Array,
    tokens: jax.Array, counts: jax.Array, final: jax.Array, allowed: jax.Array | None = None,
    injected: jax.Array | None = None, embeds: jax.Array | None = None,
    *, truncate: bool = True, logprobs: bool = True,
) -> tuple[BlockState, RowControls, StepResult]:
    """Feed prompt tokens to ``P`` rows at once and draw the first token of rows whose prompt
    ends here (jittable).

    Args:
      stack: the ``B`` rows' states.
      rows: the ``B`` rows' controls (a finishing row's ``gen_index`` is 0, its history the
        prompt's).
      index: int32[P], distinct rows of the stack to feed.
      tokens: int32[P, S, W]: row ``p`` feeds ``tokens[p].ravel()[:counts[p]]``, ``W`` at a
        time (``W``: the width of the block each step feeds).
      counts: int32[P], tokens each row feeds (0: the row is left as it is).
      final: bool[P], whether the row's last fed token ends its prompt (then its first token
        is drawn and its controls move on).
      allowed: bool[P, V] or ``None``: the ids each row's first token may take.
      injected: int32[P, S, W] or ``None``: the identity of the embedding injected at each
        fed position (0: the token's own embedding), laid out as ``tokens``; with it,
        ``embeds`` ([P, S, W, D]) holds the rows (a model that accepts embeddings only).

    Returns:
      The stack, the controls, and the draws (:class:`StepResult` over the ``P`` rows; a row
      not finishing here has meaningless entries).

    Each step of the loop feeds one ``W``-wide block to every row (``live``: how many of its
    tokens are left, clipped to ``[0, W]``), so a row's blocks start ``W`` apart from where
    its state stood, and the loop runs as many steps as the longest row needs (a traced trip
    count: one program whatever the counts)."""
    _, steps_cap, width = tokens.shape
    sub = jax.tree.map(lambda x: x[index], stack)
    n_steps = jnp.minimum(jnp.max((counts + width - 1) // width), steps_cap)
    ends = final & (counts > 0)
    last0 = jnp.zeros((index.shape[0], model.vocab_size), jnp.float32)

    def body(i: jax.Array, carry: tuple[BlockState, jax.Array]) -> tuple[BlockState, jax.Array]:
        sub, last = carry
        live = jnp.clip(counts - i * width, 0, width)
        here = ends & (counts > i * width) & (counts <= (i + 1) * width)
        # One head flag for the whole step (unbatched): the head runs only on steps where some
        # prompt ends, and a row's logits are taken only from the step its prompt ends on.
        feed = functools.partial(feed_block, model, params)
        if injected is None:
            logits, sub = jax.vmap(feed, in_axes=(0, 0, 0, None))(
                sub, tokens[:, i], live, jnp.any(here))
        else:
            logits, sub = jax.vmap(feed, in_axes=(0, 0, 0, None, 0, 0))(
                sub, tokens[:, i], live, jnp.any(here), injected[:, i], embeds[:, i])
        row = jnp.take_along_axis(logits, jnp.maximum(live - 1, 0)[:, None, None], axis=1)[:, 0]
        return sub, jnp.where(here[:, None], row, last)

    sub, last = jax.lax.fori_loop(0, n_steps, body, (sub, last0))
    stack = jax.tree.map(lambda x, r: x.at[index].set(r, unique_indices=True), stack, sub)
    picked = jax.tree.map(lambda x: x[index], rows)
    picked, out = _draw_rows(last, picked, ends, truncate=truncate, logprobs=logprobs,
                             allowed=allowed)
    rows = jax.tree.map(lambda x, r: x.at[index].set(r, unique_indices=True), rows, picked)
    return stack, rows, out


def rows_agree_in_batches(model: BlockModel) -> bool:
    """Whether ``model``'s rows keep their bits whatever the number of rows a ``vmap`` maps
    its block step over: its family has row-invariant kernels and its plan runs them as
    Pallas kernels. (The XLA forms of those kernels keep a row's bits across a *block's*
    widths, but under ``vmap`` their fixed tiles take the mapped rows as rows of the tile's
    product, whose sums XLA's CPU dot orders by the row count; a family on XLA's own products
    has no such promise at all.)"""
    plan = getattr(model, "plan", None)
    return (model.row_invariant_kernels and isinstance(plan, KernelPlan)
            and plan.row_invariant and plan.uses_pallas)


def buckets(size: int) -> tuple[int, ...]:
    """The row counts decode programs are compiled for over a stack of ``size`` rows: every
    power of two below ``size``, then ``size`` (``floor(log2(size)) + 1`` or ``+ 2`` of them)."""
    size = as_int("size", size, low=1)
    return (*(1 << k for k in range(size.bit_length()) if 1 << k < size), size)


def on_first_rows(
    step: Callable[..., Any], model: BlockModel, params: Any, stack: BlockState,
    rows: RowControls, active: jax.Array, *extra: Any, **variant: Any,
) -> tuple[BlockState, RowControls, StepResult]:
    """Run the batched ``step`` over the first ``len(active)`` rows of ``stack`` and ``rows``
    (jittable; ``active`` and any mask in ``extra`` cover those rows only) and write them back
    into the stack in place; the rows above are left as they are. Returns the whole stack and
    controls and the draws of the rows run."""
    size = active.shape[0]

    def first(x: jax.Array) -> jax.Array:
        return x[:size]

    def put(x: jax.Array, new: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(x, new, 0, axis=0)

    sub, sub_rows, out = step(model, params, jax.tree.map(first, stack),
                              jax.tree.map(first, rows), active, *extra, **variant)
    return jax.tree.map(put, stack, sub), jax.tree.map(put, rows, sub_rows), out


@functools.cache
def _compiled(model: BlockModel, fn: Callable[..., Any], truncate: bool, logprobs: bool) -> Any:
    return jax.jit(functools.partial(fn, model, truncate=truncate, logprobs=logprobs),
                   donate_argnums=(1, 2))


@functools.cache
def _compiled_step(model: BlockModel, fn: Callable[..., Any], truncate: bool,
                   logprobs: bool) -> Any:
    """The bucketed decode program (one jit; each bucket's row count is a shape, so each
    compiles once)."""
    return jax.jit(functools.partial(on_first_rows, fn, model, truncate=truncate,
                                     logprobs=logprobs), donate_argnums=(1, 2))


def _device_of(tree: Any) -> jax.Device | None:
    """The one device ``tree``'s arrays live on, else ``None`` (the default)."""
    devices = {d for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)
               for d in leaf.devices()}
    return devices.pop() if len(devices) == 1 else None


@functools.cache
def _row_io() -> tuple[Any, Any]:
    take = jax.jit(lambda tree, i: jax.tree.map(lambda x: x[i], tree))
    put = jax.jit(
        lambda tree, i, row: jax.tree.map(lambda x, r: x.at[i].set(r), tree, row),
        donate_argnums=(0,),
    )
    return take, put


@functools.cache
def _row_swap() -> Any:
    def swap(tree: Any, i: jax.Array, j: jax.Array) -> Any:
        def one(x: jax.Array) -> jax.Array:
            return x.at[i].set(x[j]).at[j].set(x[i])

        return jax.tree.map(one, tree)

    return jax.jit(swap, donate_argnums=(0,))


@functools.cache
def _row_copy() -> Any:
    def copy(tree: Any, source: jax.Array, target: jax.Array) -> Any:
        return jax.tree.map(lambda x: x.at[target].set(x[source]), tree)

    return jax.jit(copy, donate_argnums=(0,))


class BatchedDecoder:
    """``B`` rows of one :class:`BlockProducer`'s states: prompts fed to several rows per call,
    decoded one token per call, together, by the smallest bucket of rows that holds every
    active one (:attr:`buckets`; the caller keeps live rows low with :meth:`swap_rows`).

    Args:
      producer: the single-sequence producer (its model, params, capacity and block width
        ``W``; its states are the rows).
      rows: ``B``, the number of rows (the server's session slots).
      prefill_rows: ``P``, rows one prefill call feeds (at most ``B``).
      prefill_chunk: the most prompt tokens one prefill call feeds a row (rounded up to a
        multiple of ``W``); with ``P`` it fixes the prefill program's shape.

    Raises:
      BadInputError: ``producer`` is not a :class:`BlockProducer`, or a size is below 1.
    """

    #: The batched step; the tests swap in a row-mixing one as the control.
    step_fn: Callable[..., Any] = staticmethod(decode_step)
    #: The batched prefill.
    prefill_fn: Callable[..., Any] = staticmethod(prefill_step)
    #: Whether a model's rows agree across buckets (then it gets them); the tests swap in
    #: their own answer for a toy whose rows do.
    rows_agree: Callable[[BlockModel], bool] = staticmethod(rows_agree_in_batches)

    def __init__(self, producer: BlockProducer, rows: int, *, prefill_rows: int = 4,
                 prefill_chunk: int = 64) -> None:
        if not isinstance(producer, BlockProducer):
            raise BadInputError(
                f"batched decoding needs a BlockProducer, got {type(producer).__name__}"
            )
        self.producer = producer
        self.size = as_int("rows", rows, low=1)
        self.prefill_rows = min(as_int("prefill_rows", prefill_rows, low=1), self.size)
        width = producer.width
        self.prefill_chunk = -(-as_int("prefill_chunk", prefill_chunk, low=1) // width) * width
        #: The row counts of the decode programs, smallest first: :func:`buckets` for a model
        #: whose rows agree across them (:attr:`rows_agree`), else ``B`` alone.
        self.buckets = buckets(self.size) if type(self).rows_agree(producer.model) else (
            self.size,)
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
        # Which rows' settings need the top-k/top-p sort: a call compiles it in only when one
        # of its rows does.
        self._truncates = np.zeros((self.size,), bool)
        self._take, self._put = _row_io()
        self._swap = _row_swap()
        self._copy = _row_copy()

    def take_row(self, index: int) -> BlockState:
        """A copy of row ``index``'s state, a state of :attr:`producer`."""
        return self._take(self.stack, np.int32(self._index(index)))

    def put_row(self, index: int, state: BlockState) -> None:
        """Store ``state`` (a state of :attr:`producer`, snapshots dropped) as row ``index``."""
        self.producer.check_state(state)
        bare = without_auxiliary(state)[0]
        self.stack = self._put(self.stack, np.int32(self._index(index)), bare)

    def swap_rows(self, i: int, j: int) -> None:
        """Exchange rows ``i`` and ``j`` whole (states, controls, whether a row needs the
        sort), on the device in one call; a request in either row carries on from its new
        row with the same bits (each row's result depends on its own inputs alone)."""
        i, j = self._index(i), self._index(j)
        if i == j:
            return
        self.stack, self.controls = self._swap((self.stack, self.controls), np.int32(i),
                                               np.int32(j))
        self._truncates[[i, j]] = self._truncates[[j, i]]

    def copy_row(self, source: int, target: int) -> None:
        """Overwrite row ``target``'s state with row ``source``'s, on the device in one call
        over the stack (no copy of the row passes through the host). Row ``source`` keeps its
        state bit for bit, and no row's controls change (:meth:`start_row` sets the target's
        for its request)."""
        source, target = self._index(source), self._index(target)
        if source != target:
            self.stack = self._copy(self.stack, np.int32(source), np.int32(target))

    def bucket_for(self, active: np.ndarray) -> int:
        """The rows a decode call over ``active`` (bool[B]) runs: the smallest bucket holding
        every active row."""
        used = int(np.flatnonzero(active)[-1]) + 1 if active.any() else 1
        return next(b for b in self.buckets if b >= used)

    def start_row(
        self, index: int, *, params: sampling.SamplingParams, history: sampling.History,
        seed: int, token: int = 0, gen_index: int = 0,
    ) -> None:
        """Set row ``index``'s controls for a request: its settings, penalty history, seed, the
        index of the token it draws next and the token it feeds next (a row about to be
        prefilled draws its first token, index 0, at the end of its prompt)."""
        index = self._index(index)
        token = as_token("token", token, self.producer.vocab_size)
        sampling.check_sampling_args(params, history, None, self.producer.vocab_size)
        key = jax.random.key_data(sampling.request_key(seed))
        row = RowControls(tokens=np.int32(token), params=params, history=history, keys=key,
                          gen_index=np.int32(as_int("gen_index", gen_index, low=0)))
        self.controls = self._put(self.controls, np.int32(index), row)
        self._truncates[index] = sampling.needs_truncation(params, self.producer.vocab_size)

    def prefill(
        self, feeds: list[tuple[int, list[int], bool]], *, logprobs: bool = False,
        allowed: np.ndarray | None = None,
        injected: list[tuple[np.ndarray, np.ndarray] | None] | None = None,
    ) -> StepResult:
        """Feed prompt tokens to up to ``P`` rows in one call.

        Args:
          feeds: ``(row, tokens, final)`` per row: at most :attr:`prefill_chunk` tokens to
            feed at the row's cursor, and whether they end its prompt (then the row draws its
            first token with the controls :meth:`start_row` set).
          logprobs: whether to compute the drawn tokens' log-probabilities.
          allowed: bool[len(feeds), V] or ``None``: the ids each feed's first token may take
            (constrained requests; a free row's entry is all set).
          injected: ``None`` (nothing injected), or per feed ``None`` or ``(identities,
            embeds)``: int32 ``[n]`` and ``[n, D]`` for its ``n`` tokens, the identity and
            row of the embedding each position takes instead of its token's (0: none). The
            call then runs the prefill variant with embeddings.

        Returns:
          The draws, entry ``i`` for ``feeds[i]`` (meaningful where ``final``).

        Raises:
          BadInputError: more than ``P`` feeds, a row twice, or an empty or too long feed
            (nothing is fed).
        """
        if not 1 <= len(feeds) <= self.prefill_rows:
            raise BadInputError(f"a prefill call feeds 1 to {self.prefill_rows} rows, "
                                f"got {len(feeds)}")
        chosen = [self._index(row) for row, _, _ in feeds]
        if len(set(chosen)) != len(chosen):
            raise BadInputError(f"a row may be fed once per prefill call, got rows {chosen}")
        width = self.producer.width
        tokens = np.zeros((self.prefill_rows, self.prefill_chunk), np.int32)
        counts = np.zeros((self.prefill_rows,), np.int32)
        final = np.zeros((self.prefill_rows,), bool)
        for i, (_, toks, last) in enumerate(feeds):
            toks = as_token_ids("tokens", toks, self.producer.vocab_size)
            if len(toks) > self.prefill_chunk:
                raise BadInputError(f"at most {self.prefill_chunk} tokens a row per prefill "
                                    f"call, got {len(toks)}")
            tokens[i, : len(toks)], counts[i], final[i] = toks, len(toks), bool(last)
        # Rows past the feeds: distinct rows that feed nothing (live = 0 writes nothing).
        spare = [r for r in range(self.size) if r not in chosen]
        index = np.asarray(chosen + spare[: self.prefill_rows - len(chosen)], np.int32)
        truncate = bool(np.any(self._truncates[index[: len(feeds)]] & final[: len(feeds)]))
        program = _compiled(self.producer.model, type(self).prefill_fn, truncate, logprobs)
        shaped = tokens.reshape(self.prefill_rows, -1, width)
        extra: tuple[Any, ...] = ()
        if allowed is not None:
            mask = np.ones((self.prefill_rows, self.producer.vocab_size), bool)
            mask[: len(feeds)] = self._mask("allowed", allowed, len(feeds))
            extra = (mask,)
        if injected is not None and any(x is not None for x in injected):
            extra = (extra[0] if extra else None, *self._injected(feeds, injected))
        self.stack, self.controls, out = program(
            self.producer.params, self.stack, self.controls, index, shaped, counts, final,
            *extra,
        )
        return out

    def _injected(self, feeds: list[tuple[int, list[int], bool]],
                  injected: list[tuple[np.ndarray, np.ndarray] | None]) -> tuple[Any, Any]:
        """The prefill's ``injected`` and ``embeds`` inputs from each feed's rows."""
        model = self.producer.model
        if not model.accepts_embeddings:
            raise BadInputError(f"{type(model).__name__} takes no injected embeddings")
        if len(injected) != len(feeds):
            raise BadInputError(f"injected needs one entry per feed ({len(feeds)}), got "
                                f"{len(injected)}")
        width, size = self.producer.width, model.embedding_size
        ids = np.zeros((self.prefill_rows, self.prefill_chunk), np.int32)
        rows = np.zeros((self.prefill_rows, self.prefill_chunk, size), model.embedding_dtype)
        for i, ((_, toks, _), entry) in enumerate(zip(feeds, injected, strict=True)):
            if entry is None:
                continue
            identities, embeds = np.asarray(entry[0], np.int32), np.asarray(entry[1])
            if identities.shape != (len(toks),) or embeds.shape != (len(toks), size):
                raise BadInputError(
                    f"feed {i} has {len(toks)} tokens: its injected identities and embeds must "
                    f"be [{len(toks)}] and [{len(toks)}, {size}], got {list(identities.shape)} "
                    f"and {list(embeds.shape)}")
            ids[i, : len(toks)], rows[i, : len(toks)] = identities, embeds
        return (ids.reshape(self.prefill_rows, -1, width),
                rows.reshape(self.prefill_rows, -1, width, size))

    def step(self, active: np.ndarray, *, logprobs: bool = True,
             allowed: np.ndarray | None = None) -> StepResult:
        """Advance the rows where ``active`` (bool[B]) is set by one token, in one call of the
        smallest bucket holding them (:meth:`bucket_for`); ``logprobs`` False leaves the
        log-probabilities out (zeros); ``allowed`` (bool[B, V]) masks each row's draw (a
        program with the mask is compiled beside the one without).

        Returns:
          The draws of the bucket's ``b`` rows (entry ``i`` for row ``i``; rows past ``b``
          are not run).
        """
        active = np.asarray(active, bool)
        if active.shape != (self.size,):
            raise BadInputError(f"active must be bool[{self.size}], got shape {active.shape}")
        rows = self.bucket_for(active)
        truncate = bool(np.any(self._truncates & active))
        program = _compiled_step(self.producer.model, type(self).step_fn, truncate, logprobs)
        extra = () if allowed is None else (self._mask("allowed", allowed, self.size)[:rows],)
        self.stack, self.controls, out = program(
            self.producer.params, self.stack, self.controls, active[:rows], *extra
        )
        return out

    def warm_up(self, workers: int | None = None) -> None:
        """Compile every program a call can reach, ahead of the calls: the prefill and every
        bucket's decode program with and without the sort, the log-probabilities and the
        mask, on ``workers`` threads (default: one a CPU core; the compiler releases the
        interpreter lock), then the row copies, the row swap and a row's controls. Nothing
        runs on the rows but copies of row 0 onto itself."""
        vocab, width = self.producer.vocab_size, self.producer.width
        fill_args = (self.producer.params, self.stack, self.controls,
                     np.zeros((self.prefill_rows,), np.int32),
                     np.zeros((self.prefill_rows, self.prefill_chunk // width, width), np.int32),
                     np.zeros((self.prefill_rows,), np.int32),
                     np.zeros((self.prefill_rows,), bool))
        jobs = []
        for truncate in (False, True):
            for logprobs in (False, True):
                fill = _compiled(self.producer.model, type(self).prefill_fn, truncate, logprobs)
                step = _compiled_step(self.producer.model, type(self).step_fn, truncate,
                                      logprobs)
                jobs += [(fill, fill_args), (fill, (*fill_args, np.ones((self.prefill_rows,
                                                                          vocab), bool)))]
                for rows in self.buckets:
                    step_args = (self.producer.params, self.stack, self.controls,
                                 np.zeros((rows,), bool))
                    jobs += [(step, step_args),
                             (step, (*step_args, np.ones((rows, vocab), bool)))]
        device = _device_of(self.stack)

        def compile_one(job: tuple[Any, tuple[Any, ...]]) -> None:
            with jax.default_device(device):
                job[0].lower(*job[1]).compile()

        with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
            list(pool.map(compile_one, jobs))
        self.put_row(0, self.take_row(0))
        self.stack = self._copy(self.stack, np.int32(0), np.int32(0))
        one = sampling.SamplingParams.greedy()
        self.start_row(0, params=one, history=sampling.History.from_prompt([0], vocab), seed=0)
        if self.size > 1:  # compiles the swap on rows as a request leaves them; twice: a no-op
            self.swap_rows(0, 1)
            self.swap_rows(0, 1)

    def _mask(self, name: str, allowed: Any, rows: int) -> np.ndarray:
        mask = np.asarray(allowed)
        if mask.dtype != bool or mask.shape != (rows, self.producer.vocab_size):
            raise BadInputError(f"{name} must be bool[{rows}, {self.producer.vocab_size}], got "
                                f"{mask.dtype}{list(mask.shape)}")
        return mask

    def _index(self, index: int) -> int:
        return as_int("index", index, low=0, high=self.size - 1)
