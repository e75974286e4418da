"""Speculative rounds as steppers of the generation driver, and their statistics.

The driver (:mod:`turbospark_jax.generation.driver`) reuses the prefix, walks the prompt
(priming the drafter over every known pair), samples the first token and emits; a stepper
here makes the rest of the tokens by the
:class:`~turbospark_jax.core.protocols.SpeculativeProducer` protocol's contracts, in one of
two ways:

* :class:`DeviceRounds`, when the producer runs whole rounds on the device
  (:meth:`~turbospark_jax.core.protocols.SpeculativeProducer.launch_rounds`, see
  :mod:`turbospark_jax.speculative.rounds`): one device call runs rounds until ``burst``
  tokens are out, and the host handles text and stop strings between calls; each call is
  queued (``continue_rounds``) before the one before it is read, so the device does not wait
  for the host between them;
* :class:`HostRounds`, round by round through the protocol's methods: the reference the
  device rounds are tested against, and the path for pairs that cannot run rounds on the
  device (a drafter without a device form, a target that is no block producer, a draft
  length past the target's verify width);
* :class:`ConstrainedRounds`, host rounds for a constrained request: the proposals are
  checked against the constraint before the verify, each verified row is masked as plain
  decoding masks it and sampled as plain decoding samples it, so the tokens and the masked
  rows are those of plain constrained decoding.

**A host round**, with the last emitted token ``t`` not yet fed:

1. bring the drafter to the target's position (it may have drafted past it, or lag by the
   last proposal of a round that kept them all) and keep the target checkpoint (a value);
2. draft ``m`` proposals: ``draft_block`` for block drafters, else a device ``draft_burst``
   or ``draft_step`` repeatedly, sampling each draft token with the request's settings
   (which gives the proposal distribution ``q``);
3. ``verify([t, *proposals])`` in one target pass;
4. :func:`~turbospark_jax.speculative.rounds.judge` (the device rounds use the same function);
5. once the driver has pushed the emitted tokens, restore the target with
   ``rollback_retaining`` (keeping the fed rows that survived) when it can keep them (a tape
   of one block cannot replay rows of a verify's earlier blocks), otherwise ``rollback`` and
   a shortened re-verify; ``record_committed``.

The target ends having fed exactly the tokens before the last emitted one, so the fed record
matches plain decoding's even when a stop lands inside an accepted block.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.core import sampling
from turbospark_jax.core.protocols import SpeculativeProducer
from turbospark_jax.core.streams import Stream
from turbospark_jax.errors import BadInputError, ContextOverflowError
from turbospark_jax.generation.completion import (
    NON_FINITE_LOGITS,
    BurstSizer,
    Completion,
    CompletionRequest,
    add_to_history,
)
from turbospark_jax.generation.driver import (
    Decoding,
    Step,
    Stepper,
    device_step,
    masked_logits,
    start,
)
from turbospark_jax.speculative.drafters.base import DEFAULT_DRAFT_LEN, MAX_DRAFT
from turbospark_jax.speculative.rounds import (
    judge,
    leading_finite_rows,
    point_masses,
    proposal_distributions,
)

__all__ = [
    "MAX_DRAFT",
    "ConstrainedRounds",
    "DeviceRounds",
    "HostRounds",
    "SpeculativeStats",
    "rounds_stepper",
    "run_raw_completion_speculative",
]

_judge = jax.jit(judge)
_leading_finite_rows = jax.jit(leading_finite_rows)
_proposal_distributions = jax.jit(proposal_distributions)
_point_masses = jax.jit(point_masses, static_argnums=2)


@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    """What the rounds did.

    Fields:
      rounds: verify passes.
      drafted: proposals verified.
      accepted: proposals kept.
      drafted_by_position: proposals verified at draft position ``i`` (0 = first).
      accepted_by_position: proposals kept at draft position ``i``.
      on_device: whether the rounds ran on the device.
      device_s: seconds inside device calls of rounds (drafting, verifying and judging).
      draft_s, verify_s: host rounds only: seconds drafting and verifying (device work waited
        for); zero on the device, where the three run inside one call.
      host_s: the rest of the decode time (text, stop strings, bookkeeping, dispatch).
    """

    rounds: int
    drafted: int
    accepted: int
    drafted_by_position: list[int]
    accepted_by_position: list[int]
    on_device: bool = False
    device_s: float = dataclasses.field(default=0.0, compare=False)
    draft_s: float = dataclasses.field(default=0.0, compare=False)
    verify_s: float = dataclasses.field(default=0.0, compare=False)
    host_s: float = dataclasses.field(default=0.0, compare=False)

    @property
    def acceptance_rate(self) -> float:
        """Kept proposals over verified proposals."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a round commits on average: kept proposals plus the replacement or bonus."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """For each draft position, the fraction of verified proposals there that were kept."""
        return [a / d if d else 0.0 for a, d in zip(
            self.accepted_by_position, self.drafted_by_position, strict=True)]

    def summary(self) -> str:
        """Several lines for ``--stats``."""
        by_pos = " ".join(f"{a:.2f}" for a in self.acceptance_by_position)
        where = "device" if self.on_device else "host"
        times = (f"device {self.device_s:.3f}s, host {self.host_s:.3f}s" if self.on_device else
                 f"draft {self.draft_s:.3f}s, verify {self.verify_s:.3f}s, host "
                 f"{self.host_s:.3f}s")
        return (
            f"speculative ({where} rounds): {self.rounds} rounds, drafted {self.drafted}, "
            f"accepted {self.accepted} ({self.acceptance_rate:.2f}), mean acceptance length "
            f"{self.mean_acceptance_length:.2f} tokens/round\n"
            f"  acceptance by position: {by_pos}\n  time: {times}"
        )


class _Stats:
    def __init__(self, draft_len: int, on_device: bool) -> None:
        self.rounds = 0
        self.drafted = [0] * draft_len
        self.accepted = [0] * draft_len
        self.on_device = on_device
        self.seconds = {"device": 0.0, "draft": 0.0, "verify": 0.0}

    def record(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        for i in range(drafted):
            self.drafted[i] += 1
        for i in range(accepted):
            self.accepted[i] += 1

    def timed(self, phase: str, started: float, result: Any) -> Any:
        jax.block_until_ready(result)
        self.seconds[phase] += time.perf_counter() - started
        return result

    def freeze(self, decode_s: float) -> SpeculativeStats:
        busy = sum(self.seconds.values())
        return SpeculativeStats(
            rounds=self.rounds,
            drafted=sum(self.drafted),
            accepted=sum(self.accepted),
            drafted_by_position=list(self.drafted),
            accepted_by_position=list(self.accepted),
            on_device=self.on_device,
            device_s=self.seconds["device"],
            draft_s=self.seconds["draft"],
            verify_s=self.seconds["verify"],
            host_s=max(decode_s - busy, 0.0),
        )


def run_raw_completion_speculative(
    producer: SpeculativeProducer,
    request: CompletionRequest,
    *,
    tokenizer: Any | None = None,
    state: Any | None = None,
) -> Completion:
    """Run a speculative completion to the end (the seed's entry point).

    Args:
      producer: a :class:`~turbospark_jax.core.protocols.SpeculativeProducer`, usually a
        :class:`~turbospark_jax.speculative.pair.SpeculativePair`.
      request: as for :func:`~turbospark_jax.generation.driver.run_raw_completion`; its
        ``draft_len`` (1..``MAX_DRAFT``, default 4) is the proposals per round.
      tokenizer, state: as for plain decoding.

    Returns:
      The completion, with ``speculative`` holding :class:`SpeculativeStats`.

    Raises:
      BadInputError: an invalid request or draft length, or a producer that cannot draft;
        nothing is touched.
    """
    return Stream(start(producer, request, tokenizer, state, speculative=True)).drain()


def rounds_stepper(producer: Any, request: CompletionRequest) -> Stepper:
    """The stepper of a speculative completion: :class:`DeviceRounds` when the producer runs
    the request's draft length on the device, else :class:`HostRounds`.

    Raises:
      BadInputError: the producer cannot draft, the request injects images, or its
        ``draft_len`` is 0.
    """
    if not isinstance(producer, SpeculativeProducer):
        raise BadInputError(
            f"{type(producer).__name__} is not a SpeculativeProducer; pair a target with a "
            "drafter (turbospark_jax.speculative.pair.SpeculativePair)"
        )
    if request.injection is not None:
        raise BadInputError(
            "images (injected embeddings) are decoded plainly only; pass draft_len=0 to "
            "decode this prompt without drafting"
        )
    draft_len = DEFAULT_DRAFT_LEN if request.draft_len is None else request.draft_len
    if draft_len == 0:
        raise BadInputError(
            f"draft_len must be an integer in 1..{MAX_DRAFT} for speculative decoding, got 0"
        )
    if request.constraint is not None:
        return ConstrainedRounds(producer, draft_len)
    if draft_len <= producer.device_draft_limit():
        return DeviceRounds(draft_len, request.burst)
    return HostRounds(producer, draft_len)


class DeviceRounds(Stepper):
    """Bursts of speculative rounds on the device.

    The next call is queued on the device before this one is read (``continue_rounds``: its
    first token, index and tokens left are this one's, taken there), so the device runs it
    while the host reads and emits; after a stop id it runs no round, and after a stop
    string its rows are rewound with the rest of the overshoot."""

    def __init__(self, draft_len: int, burst: int | None) -> None:
        self.draft_len = draft_len
        self.sizer = BurstSizer(burst)
        self.stats = _Stats(draft_len, on_device=True)
        self.launched: Any = None  # rounds on their way
        self.since = 0.0  # when the last call was read

    def advance(self, state: Any, run: Decoding) -> tuple[Step, Any]:
        p, req = run.producer, run.request
        if self.launched is None:
            self.since = time.perf_counter()
            self.launched, state = p.launch_rounds(
                state, run.out.tokens[-1], draft_len=self.draft_len, budget=self.sizer.next(),
                params=run.params, history=run.history, key=run.key, gen_index=run.emitted,
                remaining=run.left, stop_ids=list(req.stop_token_ids),
                record_logits=req.record_logits,
            )
        queued = None
        # The call on its way emits a token at least: queue another only if one may follow.
        if run.left - 1 > 0:
            try:
                queued, state = p.continue_rounds(state, self.launched, self.sizer.next())
            except ContextOverflowError:  # refused before any work: read this one first
                queued = None
        burst = p.collect_rounds(self.launched)
        self.launched = queued
        now = time.perf_counter()
        self.stats.seconds["device"] += now - self.since  # the burst was read back
        self.sizer.observed(len(burst.tokens), now - self.since)
        self.since = now
        for drafted, accepted in burst.rounds:
            self.stats.record(drafted, accepted)
        return device_step(burst), state

    def report(self, decode_s: float) -> SpeculativeStats:
        return self.stats.freeze(decode_s)


@dataclasses.dataclass(frozen=True)
class _Round:
    """A host round waiting for the driver: the target checkpoint before it, what it fed and
    where."""

    point: Any
    feed: list[int]
    base: int


class HostRounds(Stepper):
    """Speculative rounds through the protocol's methods, one round a step."""

    def __init__(self, producer: SpeculativeProducer, draft_len: int) -> None:
        self.producer = producer
        self.draft_len = draft_len
        self.stats = _Stats(draft_len, on_device=False)
        self.pending: _Round | None = None

    def advance(self, state: Any, run: Decoding) -> tuple[Step, Any]:
        p, stats = self.producer, self.stats
        pending = run.out.tokens[-1]
        index = run.emitted
        base = len(run.out.prompt) + index - 1  # where the pending token goes
        m_cap = min(self.draft_len, run.left - 1)
        state = _realign_drafter(p, state, base)
        point = p.checkpoint(state)
        started = time.perf_counter()
        proposals, q, state = stats.timed(
            "draft", started, _draft(p, state, pending, base, m_cap, run, index)
        )
        feed = [pending, *proposals]
        started = time.perf_counter()
        rows, state = stats.timed("verify", started, p.verify(state, feed, base))
        padded = _pad_rows(rows, MAX_DRAFT + 1)
        # As on the device: judge the proposals up to the first non-finite row only.
        good = int(_leading_finite_rows(padded, jnp.int32(len(proposals))))
        if good == 0:
            return Step(tokens=(), rows=(), history=run.history,
                        error=NON_FINITE_LOGITS), state
        m = min(len(proposals), good - 1)
        toks, count, history = _judge(
            padded, q, _padded(proposals), jnp.int32(m), run.params, run.history, run.key,
            jnp.int32(index),
        )
        emitted = [int(t) for t in np.asarray(toks[: int(count)])]
        stats.record(m, len(emitted) - 1)
        self.pending = _Round(point=point, feed=feed, base=base)
        return Step(tokens=emitted, rows=[rows[i] for i in range(len(emitted))],
                    history=history), state

    def settle(self, state: Any, kept: int) -> Any:
        """Keep the fed rows of the pending token and the emitted tokens before the last
        one kept (the last emitted token is never fed, as in plain decoding)."""
        done, self.pending = self.pending, None
        if done is None or kept == 0:
            return state
        p, feed, base = self.producer, done.feed, done.base
        if p.retaining_rollback_keeps(len(feed), kept):
            state = p.rollback_retaining(state, done.point, kept)
        else:
            state = p.verify(p.rollback(state, done.point), feed[:kept], base)[1]
        return p.record_committed(state, feed[:kept], base)

    def report(self, decode_s: float) -> SpeculativeStats:
        return self.stats.freeze(decode_s)


class ConstrainedRounds(HostRounds):
    """Host rounds for a constrained request, emitting exactly what
    :class:`~turbospark_jax.generation.driver.ConstrainedSteps` emits.

    A round with the pending token ``t`` fed first:

    * when the constraint forces a run, the run (up to the draft width a round) is the
      round's block: verified after ``t`` and emitted whole, each token's row the logits
      masked to it alone;
    * otherwise the drafter proposes; the proposals are walked through a copy of the
      constraint and cut before the first one it forbids, and before any position where a
      forced run begins or the text is complete (plain decoding samples nothing there).
      After the verify, row ``i`` is masked with the constraint's mask after the first ``i``
      proposals and sampled with token ``index + i``'s key and the history so far, exactly as
      plain decoding samples it; the round keeps going while the sample equals the proposal,
      and emits the first sample that differs (or the one after the last proposal).

    Acceptance by equality with plain decoding's own sample makes the output that of plain
    decoding, sampled or greedy, for any drafter; a drafter that agrees more often only makes
    rounds longer.
    """

    def __init__(self, producer: SpeculativeProducer, draft_len: int) -> None:
        super().__init__(producer, draft_len)
        self.queue: list[int] = []  # a forced run taken from the constraint, not emitted

    def advance(self, state: Any, run: Decoding) -> tuple[Step, Any]:
        p, stats, c = self.producer, self.stats, run.constraint
        assert c is not None
        pending, index = run.out.tokens[-1], run.emitted
        base = len(run.out.prompt) + index - 1
        state = _realign_drafter(p, state, base)
        point = p.checkpoint(state)
        if not self.queue:
            self.queue = c.forced(run.left)
        if self.queue:
            block, self.queue = self.queue[:MAX_DRAFT], self.queue[MAX_DRAFT:]
            masks = []
            for t in block:
                only = np.zeros(p.vocab_size, bool)
                only[t] = True
                masks.append(only)
            proposals, walked = block, None
        else:
            m_cap = min(self.draft_len, run.left - 1)
            started = time.perf_counter()
            drafted, _, state = stats.timed("draft", started,
                                            _draft(p, state, pending, base, m_cap, run, index))
            proposals, masks = _allowed_prefix(c.fork(), drafted, run.request.stop_token_ids)
            walked = len(drafted)
        feed = [pending, *proposals]
        started = time.perf_counter()
        rows, state = stats.timed("verify", started, p.verify(state, feed, base))
        self.pending = _Round(point=point, feed=feed, base=base)
        tokens, kept_rows, history = [], [], run.history
        for i, allowed in enumerate(masks):
            if not bool(jnp.all(jnp.isfinite(rows[i]))):
                return Step(tokens=tokens, rows=kept_rows, history=history,
                            error=NON_FINITE_LOGITS), state
            row = masked_logits(rows[i], allowed)
            if walked is None:  # a forced token: emitted, not sampled
                token = proposals[i]
            else:
                key = sampling.token_key(run.key, index + i)
                token = int(sampling.sample(row, run.params, history, key))
                c.advance(token)
            tokens.append(token)
            kept_rows.append(row)
            history = add_to_history(history, token)
            if walked is not None and (i >= len(proposals) or token != proposals[i]):
                break
        if walked is not None:
            stats.record(walked, sum(1 for i, t in enumerate(tokens[: len(proposals)])
                                     if t == proposals[i]))
        return Step(tokens=tokens, rows=kept_rows, history=history,
                    pending=bool(self.queue)), state


def _allowed_prefix(walk: Any, drafted: list[int],
                    stops: tuple[int, ...]) -> tuple[list[int], list[np.ndarray]]:
    """The proposals the constraint allows in a row (``walk``, a copy, moves past them) and
    the masks to sample under: one per kept proposal, plus one for the position after them
    unless a forced run begins there or the text is complete."""
    kept: list[int] = []
    masks: list[np.ndarray] = []
    for t in [*drafted, None]:
        if walk.is_done or walk.fork().forced(1):
            return kept, masks  # plain decoding samples nothing at this position
        allowed = walk.allowed_mask()
        masks.append(allowed)
        if t is None or not allowed[t] or t in stops:
            return kept, masks
        walk.advance(t)
        kept.append(t)
    return kept, masks


def _draft(p: Any, state: Any, anchor: int, base: int, m_cap: int, run: Decoding,
           index: int) -> tuple[list[int], jax.Array, Any]:
    """Up to ``m_cap`` proposals after ``anchor``, their proposal distributions and the
    state."""
    vocab = p.vocab_size
    if m_cap <= 0:
        return [], jnp.zeros((MAX_DRAFT, vocab), jnp.float32), state
    if p.drafts_block_passes():
        proposals, state = p.draft_block(state, anchor, base, m_cap)
        proposals = [int(t) for t in proposals[:m_cap]]
        q = _point_masses(_padded(proposals), jnp.int32(len(proposals)), vocab)
        return proposals, q, state
    draft_key = jax.random.fold_in(run.key, 1)
    if p.supports_draft_bursts():
        proposals, rows, state = p.draft_burst(
            state, anchor, base, m_cap, params=run.params, history=run.history,
            key=draft_key, index=index,
        )
        if len(proposals) < m_cap:  # non-finite drafter logits cut the burst short
            state = p.rewind_drafter(state, base)
    else:
        proposals, rows, tok, hist = [], [], anchor, run.history
        for i in range(m_cap):
            logits, state = p.draft_step(state, tok, base + i)
            tok = int(sampling.sample(logits, run.params, hist,
                                      sampling.token_key(draft_key, index + i)))
            hist = add_to_history(hist, tok)
            proposals.append(tok)
            rows.append(logits)
        rows = jnp.stack(rows)
    rows = _pad_rows(jnp.asarray(rows)[: len(proposals)], MAX_DRAFT)
    q = _proposal_distributions(rows, _padded(proposals), jnp.int32(len(proposals)),
                                run.params, run.history)
    return proposals, q, state


def _realign_drafter(p: Any, state: Any, base: int) -> Any:
    """Bring the drafter to ``base`` consumed positions: rewind it to where the accepted
    prefix ended (it may have drafted past), then prime what it lacks."""
    if p.drafter_position(state) > base:
        state = p.rewind_drafter(state, base)
    while (at := p.drafter_position(state)) < base:
        state = p.prime_drafter(state, 0, at)  # next token: only a head-style drafter uses it
    return state


def _padded(proposals: list[int]) -> jax.Array:
    padded = np.zeros((MAX_DRAFT,), np.int32)
    padded[: len(proposals)] = proposals
    return jnp.asarray(padded)


@functools.partial(jax.jit, static_argnums=(1,))
def _pad_rows(rows: jax.Array, n: int) -> jax.Array:
    return jnp.zeros((n, rows.shape[-1]), jnp.float32).at[: rows.shape[0]].set(rows)
