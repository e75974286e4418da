"""Speculative rounds as pure functions, and many rounds in one device call.

A round, with the last emitted token ``pending`` not yet fed to the target:

1. **draft** up to ``m`` proposals (a
   :class:`~turbospark_jax.speculative.drafters.base.DeviceDrafter`);
2. **verify** ``[pending, *proposals]`` in one block of the target's block program
   (:func:`~turbospark_jax.engine.program.feed_block`, the step plain decoding runs);
3. **judge** them with :func:`judge` (greedy point masses or rejection sampling);
4. **commit**: keep the verified rows of what was accepted (a cursor move for KV caches, a
   pick from the per-row tape for recurrent models) and bring the drafter to the same place.

:func:`compiled_rounds` runs rounds until a token budget is reached, a stop id is emitted or
logits turn non-finite, writing the emitted tokens (and the target rows behind them) into
output buffers; the host sees the burst only when it ends. A :class:`RoundsSpec` says which
program that is: the pair, the verify width, greedy or sampled, whether the target rows are
recorded, and the burst's form.

On a GPU a ``while_loop`` whose trip count is data reads its predicate back to the host every
iteration, so the call holds the host until its last round and the next call's host work
cannot overlap it. A burst whose rounds hold no such loop runs as a loop of known trip count
instead (:data:`FIXED_ROUNDS` iterations, each a round under ``lax.cond`` while the burst's
condition holds): the same rounds, the same tokens, and a call that returns to the host at
once. That is every greedy burst of a ``DeviceDrafter.loop_free`` drafter (n-gram lookup, the
oracle; draft models, the Gemma 4 assistant and the MTP head, whose draft loops are then
bounded, :func:`~turbospark_jax.speculative.bounded_loops.loop_within`; the MTP head and
block drafters caught up before the chain, ``DeviceDrafter.catch_up``), compiled with its
while loops recorded as CUDA graphs (``device_flags.fixed_rounds_options``), and on an
accelerator every sampled burst of a drafter whose sampled rounds hold no loop at all
(``DeviceDrafter.sampled_loop_free``: n-gram lookup, the oracle), whose judge then shapes its
rows side by side (:func:`sampled_rounds_bounded` says why not on a CPU). Bursts that record
the target rows keep the ``while_loop``.

:func:`judge` is shared with the host rounds (the reference the device rounds are tested
against): with the same keys both emit the same tokens. The host rounds recompute a sampling
drafter's ``q`` from its logits (:func:`proposal_distributions`); the device draft loop keeps
each row's ``q`` as it samples, and the two agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from turbospark_jax.core import sampling
from turbospark_jax.core.protocols import NON_FINITE, RUNNING, STOPPED_ON_TOKEN
from turbospark_jax.core.state import buffers_only, by_value, merge_parts, restore_by_value
from turbospark_jax.engine import loop_graphs as device_flags
from turbospark_jax.engine.program import BlockState, feed_block
from turbospark_jax.models.base import BlockModel
from turbospark_jax.speculative.bounded_loops import bounded_while
from turbospark_jax.speculative.drafters.base import MAX_DRAFT, DeviceDrafter

#: The most tokens one device burst of rounds emits before it returns to the host (a round
#: may pass the burst's budget by up to ``MAX_DRAFT``; the buffers hold that too). The plain
#: loop's most (:attr:`~turbospark_jax.generation.completion.BurstSizer.MOST`): a call's fixed
#: host cost is paid once per burst, and a burst whose loop stops on data holds the host until
#: it ends, so none of that cost overlaps the device.
MAX_BURST = 256
#: The most tokens a burst that records the target rows emits: its rows buffer is
#: ``[RECORDED_BURST + MAX_DRAFT + 1, V]`` float32, a quarter of MAX_BURST's, and recording
#: into the larger one is slower.
RECORDED_BURST = 64
#: The rounds of a call of known trip count (:attr:`RoundsSpec.fixed`): the call runs this
#: many loop iterations, each a round while the burst's condition holds and nothing after it
#: (a ``lax.cond``), so it emits what the ``while_loop`` form emits up to its last round and
#: then returns; the host's next call takes over from there.
FIXED_ROUNDS = 32


@struct.dataclass(kw_only=True)
class DraftSampler:
    """What a sampling drafter needs of the request (all traced).

    Fields:
      params: the request's sampling settings (the drafter samples like the target).
      history: the penalty bookkeeping after every emitted token.
      key: the request's drafting key (``fold_in(request_key, 1)``).
      index: int32 ``[]``, the generation index of the first proposal's token: proposal
        ``i`` samples with ``token_key(key, index + i)``.
    """

    params: sampling.SamplingParams
    history: sampling.History
    key: jax.Array
    index: jax.Array
    #: Static: the request is greedy (the rounds' greedy variant); a drafter may then draft
    #: :func:`~turbospark_jax.core.sampling.greedy_token`\ s and skip its ``q``.
    greedy: bool = struct.field(pytree_node=False, default=False)
    #: Static: the burst runs as a loop of known trip count, so a drafter's loops inside the
    #: round are to be bounded too
    #: (:func:`~turbospark_jax.speculative.bounded_loops.loop_within`); in a ``while_loop``
    #: burst they stay ``while_loop``\ s.
    bounded: bool = struct.field(pytree_node=False, default=False)


def history_rows(history: sampling.History, tokens: jax.Array) -> sampling.History:
    """``history`` extended by ``tokens[:i]`` for every ``i`` in ``0 .. len(tokens)``: a
    History whose leaves have a leading axis of ``len(tokens) + 1`` rows."""
    vocab = history.counts.shape[0]
    onehots = jax.nn.one_hot(tokens, vocab, dtype=jnp.int32)  # ids outside V add nothing
    before = jnp.concatenate([jnp.zeros((1, vocab), jnp.int32), jnp.cumsum(onehots, axis=0)])
    return sampling.History(counts=history.counts + before, seen=history.seen | (before > 0))


def proposal_distributions(
    drafter_rows: jax.Array, proposals: jax.Array, count: jax.Array,
    params: sampling.SamplingParams, history: sampling.History,
) -> jax.Array:
    """q for each proposal: the distribution it was sampled from, under the same shaping as
    the target's p (the history grows by the proposals before it). The host rounds' way; a
    device drafter returns the same rows from its draft loop.

    drafter_rows: f32[MAX_DRAFT, V]; proposals: i32[MAX_DRAFT]; ``count`` are real. Returns
    f32[MAX_DRAFT, V] with zero rows past ``count``.
    """
    rows_hist = jax.tree.map(lambda a: a[:-1], history_rows(history, proposals))
    q = jax.vmap(sampling.probabilities, in_axes=(0, None, 0))(drafter_rows, params, rows_hist)
    return jnp.where((jnp.arange(q.shape[0]) < count)[:, None], q, 0.0)


def leading_finite_rows(rows: jax.Array, drafted: jax.Array) -> jax.Array:
    """How many of the ``drafted + 1`` live rows of ``rows`` (f32[MAX_DRAFT + 1, V]) are
    finite before the first that is not (int32 ``[]``)."""
    live = jnp.arange(rows.shape[0]) <= drafted
    ok = jnp.all(jnp.isfinite(rows), axis=1) & live
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))


def point_masses(proposals: jax.Array, count: jax.Array, vocab: int) -> jax.Array:
    """The proposal distributions of a deterministic drafter: one-hot rows, zero past
    ``count``."""
    q = jax.nn.one_hot(proposals, vocab, dtype=jnp.float32)
    return jnp.where((jnp.arange(q.shape[0]) < count)[:, None], q, 0.0)


@struct.dataclass
class _JudgedRow:
    """The judge's loop carry: the row it is at (the proposals kept so far), that row's
    processed logits and distribution ``p``, and whether its proposal was kept."""

    row: jax.Array
    processed: jax.Array
    p: jax.Array
    kept: jax.Array


def judge(
    rows: jax.Array,
    q: jax.Array,
    proposals: jax.Array,
    m: jax.Array,
    params: sampling.SamplingParams,
    history: sampling.History,
    key: jax.Array,
    index: jax.Array,
    bounded: bool = False,
) -> tuple[jax.Array, jax.Array, sampling.History]:
    """Accept or reject ``m`` proposals against target rows; returns (tokens, count, history).

    rows: f32[MAX_DRAFT + 1, V] target logits (row ``i`` follows ``feed[i]``); q:
    f32[MAX_DRAFT, V] proposal distributions; proposals: i32[MAX_DRAFT]. Proposal ``i`` is kept
    with probability ``min(1, p(x) / q(x))`` while every earlier one was kept; the first
    rejection is replaced by a draw from the normalised ``max(0, p - q)``, and when all ``m``
    are kept a bonus token is drawn from row ``m``. At temperature 0 ``p`` and ``q`` are point
    masses: keep while the proposal is the target's argmax, then the argmax. Emits ``count``
    tokens (``tokens[:count]``; -1 after); token ``index + i`` uses ``token_key(key, index +
    i)`` for the bonus draw, as plain decoding does.

    Only the rows up to the first rejection are shaped into ``p`` (each may sort the
    vocabulary for top-k/top-p), one at a time: the rows after it are never read. ``bounded``
    (static): no loop; all ``draft + 1`` rows are shaped side by side (more sorting, nothing
    that stops on data), with the same decisions and draws.
    """
    accept_key = jax.random.fold_in(key, 2)
    resample_key = jax.random.fold_in(key, 3)
    draft = proposals.shape[0]
    hist = history_rows(history, proposals)  # row i: after the proposals before it
    i = jnp.arange(draft, dtype=jnp.int32)
    u = jax.vmap(lambda j: jax.random.uniform(sampling.token_key(accept_key, index + j)))(i)
    u_q = u * q[i, proposals]  # proposal i is kept while u_q[i] < p_i(proposals[i])

    def next_row(c: _JudgedRow) -> _JudgedRow:
        j = c.row
        processed = sampling.process_logits(rows[j], params, jax.tree.map(lambda a: a[j], hist))
        p = sampling.distribution(processed, params)
        at = jnp.minimum(j, draft - 1)
        keep = (j < m) & (u_q[at] < p[proposals[at]])
        return _JudgedRow(row=j + keep.astype(jnp.int32), processed=processed, p=p, kept=keep)

    if bounded:
        # every row shaped at once: draft + 1 sorts side by side, and no loop at all (a loop
        # of conditionals, each holding a sort, is not safe with while loops recorded as
        # CUDA graphs)
        processed_all = jax.vmap(sampling.process_logits, in_axes=(0, None, 0))(
            rows, params, hist)
        p_all = jax.vmap(sampling.distribution, in_axes=(0, None))(processed_all, params)
        keep = (i < m) & (u_q < p_all[i, proposals])
        accepted = jnp.sum(jnp.cumprod(keep.astype(jnp.int32)))
        processed, p = processed_all[accepted], p_all[accepted]
    else:
        # A loop, not a map over the rows: it stops at the first rejection, so it shapes
        # accepted + 1 rows and row ``accepted``'s processed logits serve the bonus draw as
        # well. A ``while_loop``: a trip count that is data.
        zeros = jnp.zeros((rows.shape[1],), jnp.float32)
        start = _JudgedRow(row=jnp.int32(0), processed=zeros, p=zeros, kept=jnp.bool_(True))
        last = jax.lax.while_loop(lambda c: c.kept, next_row, start)
        accepted, processed, p = last.row, last.processed, last.p
    at = jax.tree.map(lambda a: a[accepted], hist)
    bonus = sampling.draw_processed(processed, params, sampling.token_key(key, index + accepted))
    q_at = jnp.where(accepted < draft, q[jnp.minimum(accepted, draft - 1)], 0.0)
    residual = jnp.maximum(p - q_at, 0.0)
    resampled = sampling.categorical(
        sampling.token_key(resample_key, index + accepted),
        jnp.where(residual > 0, jnp.log(jnp.where(residual > 0, residual, 1.0)), -jnp.inf),
    )
    rejected = (params.temperature > 0) & (jnp.sum(residual) > 0) & (accepted < m)
    final = jnp.where(rejected, resampled, bonus).astype(jnp.int32)
    out = jnp.concatenate([proposals, jnp.full((1,), -1, jnp.int32)])
    out = jnp.where(jnp.arange(draft + 1) < accepted, out, -1).at[accepted].set(final)
    return out, accepted + 1, at.add(final)


def judge_greedy(
    rows: jax.Array,
    proposals: jax.Array,
    m: jax.Array,
    params: sampling.SamplingParams,
    history: sampling.History,
) -> tuple[jax.Array, jax.Array, sampling.History]:
    """:func:`judge` for a greedy request, in the compiled rounds' greedy variant: keep
    proposals while each is its row's greedy token, then emit the greedy token of the row
    after the last kept one. The same tokens, count and history as :func:`judge` at
    temperature 0 (where ``p`` is a point mass at that token and every drafter's ``q`` is one
    at its proposal), without the distributions, the uniform draws or any branch on the
    temperature."""
    draft = proposals.shape[0]
    hist = history_rows(history, proposals)  # row i: after the proposals before it
    targets = jax.vmap(sampling.greedy_token, in_axes=(0, None, 0))(rows, params, hist)
    i = jnp.arange(draft, dtype=jnp.int32)
    keep = (i < m) & (proposals == targets[:draft])
    accepted = jnp.sum(jnp.cumprod(keep.astype(jnp.int32)))
    final = targets[accepted]
    out = jnp.concatenate([proposals, jnp.full((1,), -1, jnp.int32)])
    out = jnp.where(jnp.arange(draft + 1) < accepted, out, -1).at[accepted].set(final)
    at = jax.tree.map(lambda a: a[accepted], hist)
    return out, accepted + 1, at.add(final)


@struct.dataclass(kw_only=True)
class RoundControl:
    """The request's side of a burst of rounds; all traced.

    Fields:
      params, history: sampling settings and penalty bookkeeping after every emitted token.
      key: the request's base key (judging; drafting uses ``fold_in(key, 1)``).
      gen_index: int32 ``[]``, tokens emitted before this burst.
      remaining: int32 ``[]``, tokens the request may still emit (``max_tokens - gen_index``).
      budget: int32 ``[]``, return to the host once this many tokens were emitted.
      draft_len: int32 ``[]``, proposals per round (at most MAX_DRAFT).
      stop_ids: int32 ``[MAX_STOP_IDS]``, padded with -1.
    """

    params: sampling.SamplingParams
    history: sampling.History
    key: jax.Array
    gen_index: jax.Array
    remaining: jax.Array
    budget: jax.Array
    draft_len: jax.Array
    stop_ids: jax.Array


@struct.dataclass(kw_only=True)
class RoundsOutput:
    """What a burst of rounds returns besides the states.

    Fields:
      tokens: int32[burst + MAX_DRAFT + 1], the emitted tokens (``count`` are real); ``burst``
        is :func:`burst_limit` of the call.
      logits: float32[same, V] target rows behind them (``[1, V]`` when not recorded).
      count: int32 ``[]`` tokens emitted.
      finish: int32 ``[]`` RUNNING, STOPPED_ON_TOKEN or NON_FINITE.
      history: the bookkeeping after the emitted tokens.
      rounds: int32 ``[]`` rounds run.
      sizes: int32[burst, 2], ``(drafted, accepted)`` of each round.
    """

    tokens: jax.Array
    logits: jax.Array
    count: jax.Array
    finish: jax.Array
    history: sampling.History
    rounds: jax.Array
    sizes: jax.Array


def _commit_target(
    model: BlockModel, before: BlockState, after: BlockState, keep: jax.Array
) -> BlockState:
    """The target after a verify that fed from ``before``'s cursor, keeping ``keep`` rows."""
    if model.records_tape:  # recurrent leaves: restore the values, then pick from the tape
        restored = restore_by_value(after, by_value(before))
        after = restored.replace(cache=model.retain_rows(restored.cache, after.cache, keep))
    return after.replace(fed=after.fed.moved_to(before.fed.count + keep))


@dataclasses.dataclass(frozen=True)
class RoundsSpec:
    """Which compiled burst of rounds to run; hashable, static under ``jit``.

    Fields:
      target: the target's block model; the rounds verify in one block of its program.
      drafter: the drafter's device form.
      width: the rows of the target program's block (``draft_len < width``).
      greedy: the greedy variant (:func:`judge_greedy`, drafters drafting argmax tokens): the
        same tokens as the sampled one at temperature 0, with none of the sampling machinery
        and no branch on the temperature, which can cost a GPU a host round trip each.
      record_logits: keep the target row behind every emitted token.
      max_keys: the host's bound on every position the burst's verify blocks hold, plus one
        (a speed hint for a target that declares ``bounds_keys``; see
        :func:`~turbospark_jax.engine.program.feed_block`).
      fixed: run the burst as a loop of :data:`FIXED_ROUNDS` iterations instead of a
        ``while_loop`` (the same rounds either way).
      bounded: a sampled judge shapes every row side by side instead of looping to the first
        rejection (the same tokens either way).

    :meth:`choose` picks the form a request runs; a test may force either form with
    ``dataclasses.replace`` and compare.
    """

    target: BlockModel
    drafter: DeviceDrafter
    width: int
    greedy: bool
    record_logits: bool
    max_keys: int | None = None
    fixed: bool = False
    bounded: bool = False

    @classmethod
    def choose(cls, target: BlockModel, drafter: DeviceDrafter, width: int, *, greedy: bool,
               record_logits: bool, max_keys: int | None = None,
               bounded: bool | None = None) -> RoundsSpec:
        """The spec a request runs: ``bounded`` as :func:`sampled_rounds_bounded` says unless
        given, and the fixed form where no loop in it stops on data (a loop-free drafter,
        greedy or with a bounded judge) and the target rows are not recorded (recording keeps
        the ``while_loop`` until the fixed form is timed faster end to end)."""
        if bounded is None:
            bounded = sampled_rounds_bounded(drafter, greedy)
        fixed = _fixed_form(drafter, greedy, bounded, record_logits)
        return cls(target=target, drafter=drafter, width=width, greedy=greedy,
                   record_logits=record_logits, max_keys=max_keys, fixed=fixed,
                   bounded=bounded)

    @property
    def compiler_options(self) -> dict[str, str] | None:
        """The burst's compiler options: a greedy fixed burst records its while loops as CUDA
        graphs; every other burst takes XLA's defaults."""
        return device_flags.fixed_rounds_options(self.greedy) if self.fixed else None


@struct.dataclass
class _Burst:
    """The burst's loop carry.

    Fields:
      rounds: rounds run.
      target, drafter: the states after them.
      pending: the last emitted token (not fed yet).
      emitted: tokens emitted.
      tokens, rows: the output buffers (rows ``[1, V]`` when not recorded).
      finish: RUNNING, STOPPED_ON_TOKEN or NON_FINITE.
      history: the penalty bookkeeping after the emitted tokens.
      sizes: ``(drafted, accepted)`` of each round.
    """

    rounds: jax.Array
    target: BlockState
    drafter: Any
    pending: jax.Array
    emitted: jax.Array
    tokens: jax.Array
    rows: jax.Array
    finish: jax.Array
    history: sampling.History
    sizes: jax.Array


def _run_rounds(
    spec: RoundsSpec,
    target_params: Any,
    drafter_params: Any,
    buffers: BlockState,
    values: BlockState,
    drafter_state: Any,
    pending: jax.Array,
    control: RoundControl,
    no_injected: jax.Array,
    no_embeds: jax.Array | None,
) -> tuple[BlockState, BlockState, Any, RoundsOutput]:
    # no_injected / no_embeds: the target producer's "nothing injected" rows, passed in as
    # data as the block program's are, so a verify compiles like a decode step.
    target, drafter, width = spec.target, spec.drafter, spec.width
    vocab = target.vocab_size
    most = burst_limit(spec.record_logits)
    out_rows = most + MAX_DRAFT + 1
    draft_key = jax.random.fold_in(control.key, 1)
    # Always true, but traced like plain decoding's per-step flag: a constant would let XLA
    # fold the head's condition away and compile the verify unlike the decode step. A target
    # whose widths agree computes its rows alike in any program (its decode programs run the
    # head unbranched too), so it takes the constant: no branch, no host sync per round.
    head = True if target.widths_agree else control.draft_len >= 0

    def cond(c: _Burst) -> jax.Array:
        return (c.finish == RUNNING) & (c.emitted < control.budget) & (
            c.emitted < control.remaining) & (c.rounds < most)

    def body(c: _Burst) -> _Burst:
        n, hist = c.emitted, c.history
        index = control.gen_index + n
        m = jnp.clip(jnp.minimum(control.draft_len, control.remaining - n - 1), 0, MAX_DRAFT)
        sampler = DraftSampler(params=control.params, history=hist, key=draft_key, index=index,
                               greedy=spec.greedy, bounded=spec.fixed)
        proposals, q, drafted, dst = drafter.propose(drafter_params, c.drafter, c.target,
                                                     c.pending, m, sampler)
        if q is None:
            q = point_masses(proposals, drafted, vocab)
        fits = min(width - 1, MAX_DRAFT)  # the host keeps draft_len <= width - 1
        feed = jnp.zeros((width,), jnp.int32).at[0].set(c.pending)
        feed = feed.at[1 : fits + 1].set(proposals[:fits])
        with jax.named_scope("verify"):
            rows, verified = feed_block(target, target_params, c.target, feed, drafted + 1,
                                        head, no_injected, no_embeds, max_keys=spec.max_keys)
        rows = jnp.zeros((MAX_DRAFT + 1, vocab), jnp.float32).at[: fits + 1].set(
            rows[: fits + 1]
        )
        # Judge only the proposals whose rows lead up to the first non-finite one (the rows
        # after it follow it causally): the tokens plain decoding would emit before its
        # failure are emitted here too. A non-finite first row ends the burst.
        good = leading_finite_rows(rows, drafted)
        finite = good > 0
        judged = jnp.minimum(drafted, jnp.maximum(good - 1, 0))
        with jax.named_scope("judge"):
            if spec.greedy:
                toks, count, new_hist = judge_greedy(rows, proposals, judged, control.params,
                                                     hist)
            else:
                toks, count, new_hist = judge(rows, q, proposals, judged, control.params, hist,
                                              control.key, index, spec.bounded)
        slots = jnp.arange(MAX_DRAFT + 1)
        stops = jnp.any(toks[:, None] == control.stop_ids[None, :], axis=1) & (slots < count)
        stopped = jnp.any(stops)
        kept = jnp.where(stopped, jnp.argmax(stops) + 1, count)
        kept = jnp.where(finite, kept, 0)
        st = _commit_target(target, c.target, verified, kept)
        at = jnp.where(slots < kept, n + slots, out_rows + slots)  # others dropped
        out_rows_now = c.rows
        if spec.record_logits:
            out_rows_now = out_rows_now.at[at].set(rows, mode="drop", unique_indices=True)
        return _Burst(
            rounds=c.rounds + 1,
            target=st,
            drafter=drafter.commit(dst, st.fed.count),
            pending=jnp.where(kept > 0, toks[jnp.maximum(kept - 1, 0)], c.pending),
            emitted=n + kept,
            tokens=c.tokens.at[at].set(toks, mode="drop", unique_indices=True),
            rows=out_rows_now,
            finish=jnp.where(~finite, NON_FINITE,
                             jnp.where(stopped, STOPPED_ON_TOKEN, RUNNING)),
            history=jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_hist, hist),
            sizes=c.sizes.at[c.rounds].set(jnp.where(finite, jnp.stack([judged, count - 1]),
                                                     0)),
        )

    init = _Burst(
        rounds=jnp.int32(0),
        target=merge_parts(buffers, values),
        drafter=drafter_state,
        pending=pending,
        emitted=jnp.int32(0),
        tokens=jnp.full((out_rows,), -1, jnp.int32),
        rows=jnp.zeros((out_rows if spec.record_logits else 1, vocab), jnp.float32),
        finish=jnp.int32(RUNNING),
        history=control.history,
        sizes=jnp.zeros((most, 2), jnp.int32),
    )
    if spec.fixed:  # a loop of known trip count: a round while the condition holds, then none
        last = bounded_while(cond, body, init, FIXED_ROUNDS)  # the call ends at the cut
    else:
        last = jax.lax.while_loop(cond, body, init)
    out = RoundsOutput(tokens=last.tokens, logits=last.rows, count=last.emitted,
                       finish=last.finish, history=last.history, rounds=last.rounds,
                       sizes=last.sizes)
    return buffers_only(last.target), by_value(last.target), last.drafter, out


def burst_limit(record_logits: bool) -> int:
    """The most tokens one call of rounds emits: :data:`RECORDED_BURST` when it records the
    target rows, else :data:`MAX_BURST`."""
    return RECORDED_BURST if record_logits else MAX_BURST


def sampled_rounds_bounded(drafter: DeviceDrafter, greedy: bool) -> bool:
    """Whether a sampled burst (not ``greedy``) of ``drafter``'s rounds has a judge that
    shapes its rows side by side: on an accelerator, for a drafter whose sampled rounds hold
    no loop (``DeviceDrafter.sampled_loop_free``), so that the burst holds no loop whose trip
    count is data and runs in the fixed form.

    Not on a CPU: there a loop costs no round trip, while shaping all ``MAX_DRAFT + 1`` rows,
    where the loop shapes those up to the first rejection, costs more than it saves. Not for
    other drafters: their sampled draft loops would have to become conditionals, which cost
    more than the round trips they save."""
    return not greedy and drafter.sampled_loop_free and jax.default_backend() != "cpu"


def runs_fixed_rounds(drafter: DeviceDrafter, greedy: bool, record_logits: bool) -> bool:
    """Whether a burst of ``drafter``'s rounds runs as a loop of :data:`FIXED_ROUNDS`
    iterations by default (:meth:`RoundsSpec.choose`)."""
    return _fixed_form(drafter, greedy, sampled_rounds_bounded(drafter, greedy), record_logits)


def _fixed_form(drafter: DeviceDrafter, greedy: bool, bounded: bool,
                record_logits: bool) -> bool:
    return (greedy or bounded) and drafter.loop_free and not record_logits


def rounds_function(spec: RoundsSpec) -> Any:
    """The burst's function for ``spec``: ``(target_params, drafter_params, target_buffers,
    target_values, drafter_state, pending, control, no_injected, no_embeds)`` to the target's
    buffers and values, the drafter state and the :class:`RoundsOutput`."""
    return functools.partial(_run_rounds, spec)


@functools.cache
def compiled_rounds(spec: RoundsSpec, donate: bool) -> Any:
    """The jitted burst of rounds for ``spec`` (:func:`rounds_function`), with its compiler
    options; the target's append-only buffers and the drafter state are donated when
    ``donate``."""
    return jax.jit(rounds_function(spec), donate_argnums=(2, 4) if donate else (),
                   compiler_options=spec.compiler_options)
