"""The speculative loop: ``run_raw_completion_speculative``, lossless greedy and sampled.

It drives a :class:`~turbospark_jax.core.protocols.SpeculativeProducer` by the protocol's
contracts, in one of two ways:

* **on the device**, when the producer runs whole rounds there
  (:meth:`~turbospark_jax.core.protocols.SpeculativeProducer.device_rounds`, see
  :mod:`turbospark_jax.speculative.rounds`): one device call runs rounds until ``burst`` tokens are
  out,
  and the host handles text and stop strings between bursts; each call is queued
  (``continue_rounds``) before the one before it is read, so the device does not wait for
  the host between them;
* **on the host**, round by round through the protocol's methods: the reference the device
  loop is tested against, and the path for drafters that cannot run on the device.

**Prompt walk.** After prefix reuse, the target consumes the prompt while the drafter is
primed over every known pair: in chunks through ``prefill_chunk_priming_drafter`` when the
producer supports it, otherwise token by token (``produce_prefill`` for the target only when
``supports_headless_prefill``, else ``produce``) with ``prime_drafter``. The last prompt token
goes through ``produce``; its logits give the first token exactly as the plain loop does.

**A host round**, with the last emitted token ``t`` not yet fed:

1. bring the drafter to the target's position (it may have drafted past it, or lag by the
   last proposal of a round that kept them all) and keep the target checkpoint (a value);
2. draft ``m`` proposals: ``draft_block`` for block drafters, else a device ``draft_burst``
   or ``draft_step`` repeatedly, sampling each draft token with the request's settings
   (which gives the proposal distribution ``q``);
3. ``verify([t, *proposals])`` in one target pass;
4. :func:`~turbospark_jax.speculative.rounds.judge` (the device rounds use the same function);
5. restore the target with ``rollback_retaining`` (keeping the fed rows that survived) when
   it can keep them (a tape of one block cannot replay rows of a verify's earlier blocks),
   otherwise ``rollback`` and a shortened re-verify; ``record_committed``.

The emitted tokens pass through the same :class:`~turbospark_jax.generation.completion.Emission` as
in
the plain loop (stop tokens, stop strings, max_tokens), and the target ends having fed exactly
the tokens before the last emitted one, so the fed record matches the plain loop's even when a
stop lands inside an accepted block.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Generator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.core import sampling
from turbospark_jax.core.protocols import NON_FINITE, SpeculativeProducer
from turbospark_jax.core.streams import Stream, StreamEvent
from turbospark_jax.errors import BadInputError, ContextOverflowError
from turbospark_jax.generation.completion import (
    NON_FINITE_LOGITS,
    PRODUCER_FAILURES,
    BurstSizer,
    Completion,
    CompletionRequest,
    Emission,
    FinishReason,
    add_to_history,
    rewind_overshoot,
    validate_request,
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
    "SpeculativeStats",
    "run_raw_completion_speculative",
    "speculative_events",
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
      draft_s, verify_s: host loop only: seconds drafting and verifying (device work waited
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
      ``draft_len``
        (1..``MAX_DRAFT``, default 4) is the proposals per round.
      tokenizer, state: as for the plain loop.

    Returns:
      The completion, with ``speculative`` holding :class:`SpeculativeStats`.

    Raises:
      BadInputError: an invalid request or draft length, or a producer that cannot draft;
        nothing is touched.
    """
    return Stream(speculative_events(producer, request, tokenizer, state)).drain()


def speculative_events(
    producer: SpeculativeProducer,
    request: CompletionRequest,
    tokenizer: Any | None,
    state: Any | None,
    progress: Callable[[int, int], None] | None = None,
) -> Generator[StreamEvent, None, Completion]:
    """The speculative loop as a generator: validates now, runs as it is consumed;
    ``progress(fed, total)`` hears how far the prompt walk has got."""
    if not isinstance(producer, SpeculativeProducer):
        raise BadInputError(
            f"{type(producer).__name__} is not a SpeculativeProducer; pair a target with a "
            "drafter (turbospark_jax.speculative.pair.SpeculativePair)"
        )
    params = validate_request(producer, request, tokenizer, state)
    if request.injection is not None:
        raise BadInputError(
            "images (injected embeddings) run in the plain loop only; pass draft_len=0 to "
            "decode this prompt without drafting"
        )
    draft_len = DEFAULT_DRAFT_LEN if request.draft_len is None else request.draft_len
    if not 1 <= draft_len <= MAX_DRAFT:
        raise BadInputError(
            f"draft_len must be an integer in 1..{MAX_DRAFT} for speculative decoding, got "
            f"{draft_len!r}"
        )
    out = Emission(request, tokenizer, [int(t) for t in request.prompt_ids])
    return _Loop(producer, request, out, params, draft_len, progress).run(state)


class _Loop:
    """One speculative completion; :meth:`run` is the generator."""

    def __init__(self, producer: SpeculativeProducer, request: CompletionRequest,
                 out: Emission, params: sampling.SamplingParams, draft_len: int,
                 progress: Callable[[int, int], None] | None = None):
        self.p, self.req, self.params, self.draft_len = producer, request, params, draft_len
        self.out = out
        self.progress = progress
        self.on_device = draft_len <= producer.device_draft_limit()
        self.sizer = BurstSizer(request.burst)
        # Device rounds on their way (queued before the call before them was read), and when
        # the last call was read.
        self.launched: Any = None
        self.since = 0.0

    def run(self, state: Any | None) -> Generator[StreamEvent, None, Completion]:
        p, req = self.p, self.req
        t0 = time.perf_counter()
        out = self.out
        prompt = out.prompt
        state = state if state is not None else p.init_state()
        reused, state = p.try_reuse_prefix(state, prompt)
        key = sampling.request_key(req.seed)
        history = sampling.History.from_prompt(prompt, p.vocab_size)
        stats = _Stats(self.draft_len, self.on_device)
        finish, error, first_token_s = None, None, 0.0
        try:
            logits, state = self._prompt_walk(state, prompt, reused)
        except PRODUCER_FAILURES as exc:
            finish, error = FinishReason.ERROR, str(exc)
        prefill_s = time.perf_counter() - t0
        if finish is None and not bool(np.all(np.isfinite(np.asarray(logits)))):
            finish, error = FinishReason.ERROR, NON_FINITE_LOGITS
        if finish is None:
            tok = int(sampling.sample(logits, self.params, history, sampling.token_key(key, 0)))
            history = add_to_history(history, tok)
            first_token_s = time.perf_counter() - t0 - prefill_s
            event, finish = out.push(tok, logits)
            if event is not None:
                yield event

        while finish is None:
            if self.on_device:
                finish, history, state = yield from self._device_burst(
                    state, out, history, key, stats
                )
            else:
                finish, history, state = yield from self._host_round(
                    state, out, history, key, stats
                )
            if finish is FinishReason.ERROR and out.failure is None:
                error = NON_FINITE_LOGITS
        if finish is not FinishReason.ERROR:
            state = rewind_overshoot(p, state, len(prompt) + len(out.tokens) - 1)
        decode_s = time.perf_counter() - t0 - prefill_s - first_token_s
        event, completion = out.finish(
            p, finish, error, state, reused=reused, started=t0, prefill_s=prefill_s,
            first_token_s=first_token_s, speculative=stats.freeze(decode_s),
        )
        if event is not None:
            yield event
        return completion

    # -- the prompt -------------------------------------------------------------------------

    def _prompt_walk(self, state: Any, prompt: list[int], start: int) -> tuple[Any, Any]:
        p, size = self.p, self.req.prefill_chunk_size

        def told(end: int) -> None:
            if self.progress is not None:
                self.progress(end - start, len(prompt) - start)

        if p.supports_chunked_drafter_prefill():
            logits = None
            for a in range(start, len(prompt), size):
                b = min(a + size, len(prompt))
                nxt = prompt[b] if b < len(prompt) else None
                logits, state = p.prefill_chunk_priming_drafter(state, prompt[a:b], a, nxt)
                told(b)
            return logits, state
        for pos in range(start, len(prompt) - 1):
            if p.supports_headless_prefill():
                state = p.produce_prefill(state, prompt[pos], pos)
            else:
                state = p.produce(state, prompt[pos], pos)[1]
            state = p.prime_drafter(state, prompt[pos + 1], pos)
            told(pos + 1)
        out = p.produce(state, prompt[-1], len(prompt) - 1)
        told(len(prompt))
        return out

    # -- rounds on the device ---------------------------------------------------------------

    def _device_burst(self, state, out, history, key, stats):
        """One device call of rounds; yields the events, returns (finish, history, state).

        The next call is queued on the device before this one is read (``continue_rounds``:
        its first token, index and tokens left are this one's, taken there), so the device
        runs it while the host reads and emits; after a stop id it runs no round, and after
        a stop string its rows are rewound with the rest of the overshoot."""
        req = self.req
        if self.launched is None:
            self.since = time.perf_counter()
            self.launched, state = self.p.launch_rounds(
                state, out.tokens[-1], draft_len=self.draft_len, budget=self.sizer.next(),
                params=self.params, history=history, key=key, gen_index=len(out.tokens),
                remaining=req.max_tokens - len(out.tokens), stop_ids=list(req.stop_token_ids),
                record_logits=req.record_logits,
            )
        queued = None
        # The call on its way emits a token at least: queue another only if one may follow.
        if req.max_tokens - len(out.tokens) - 1 > 0:
            try:
                queued, state = self.p.continue_rounds(state, self.launched,
                                                       self.sizer.next())
            except ContextOverflowError:  # refused before any work: read this one first
                queued = None
        burst = self.p.collect_rounds(self.launched)
        self.launched = queued
        now = time.perf_counter()
        stats.seconds["device"] += now - self.since  # the burst was read back
        self.sizer.observed(len(burst.tokens), now - self.since)
        self.since = now
        for drafted, accepted in burst.rounds:
            stats.record(drafted, accepted)
        rows = np.asarray(burst.logits) if burst.logits is not None else [None] * len(burst.tokens)
        for tok, row in zip(burst.tokens, rows, strict=True):
            event, finish = out.push(tok, row)
            if event is not None:
                yield event
            if finish is not None:
                return finish, burst.history, state
        return (FinishReason.ERROR if burst.finish == NON_FINITE else None), burst.history, state

    def _host_round(self, state, out, history, key, stats):
        """One round through the protocol's methods; yields the events, returns (finish,
        history, state)."""
        p, req = self.p, self.req
        pending = out.tokens[-1]
        index = len(out.tokens)
        base = len(out.prompt) + index - 1  # where the pending token goes
        m_cap = min(self.draft_len, req.max_tokens - index - 1)
        state = self._realign_drafter(state, base)
        point = p.checkpoint(state)
        started = time.perf_counter()
        proposals, q, state = stats.timed(
            "draft", started, self._draft(state, pending, base, m_cap, history, key, index)
        )
        feed = [pending, *proposals]
        started = time.perf_counter()
        rows, state = stats.timed("verify", started, p.verify(state, feed, base))
        padded = _pad_rows(rows, MAX_DRAFT + 1)
        # As on the device: judge the proposals up to the first non-finite row only.
        good = int(_leading_finite_rows(padded, jnp.int32(len(proposals))))
        if good == 0:
            return FinishReason.ERROR, history, state
        m = min(len(proposals), good - 1)
        toks, count, history = _judge(
            padded, q, _padded(proposals), jnp.int32(m), self.params, history, key,
            jnp.int32(index),
        )
        emitted = [int(t) for t in np.asarray(toks[: int(count)])]
        stats.record(m, len(emitted) - 1)
        finish, kept = None, 0
        for i, tok in enumerate(emitted):
            event, finish = out.push(tok, rows[i])
            kept = i
            if event is not None:
                yield event
            if finish is not None:
                break
        # Fed rows that stay: the pending token plus the emitted tokens before the last one
        # (the last emitted token is never fed, as in the plain loop).
        keep_rows = 1 + kept
        state = self._restore(state, point, feed, keep_rows, base)
        state = p.record_committed(state, feed[:keep_rows], base)
        return finish, history, state

    def _draft(self, state, anchor, base, m_cap, history, key, index):
        p, vocab = self.p, self.p.vocab_size
        if m_cap <= 0:
            return [], jnp.zeros((MAX_DRAFT, vocab), jnp.float32), state
        if p.drafts_block_passes():
            proposals, state = p.draft_block(state, anchor, base, m_cap)
            proposals = [int(t) for t in proposals[:m_cap]]
            q = _point_masses(_padded(proposals), jnp.int32(len(proposals)), vocab)
            return proposals, q, state
        draft_key = jax.random.fold_in(key, 1)
        if p.supports_draft_bursts():
            proposals, rows, state = p.draft_burst(
                state, anchor, base, m_cap, params=self.params, history=history,
                key=draft_key, index=index,
            )
            if len(proposals) < m_cap:  # non-finite drafter logits cut the burst short
                state = p.rewind_drafter(state, base)
        else:
            proposals, rows, tok, hist = [], [], anchor, history
            for i in range(m_cap):
                logits, state = p.draft_step(state, tok, base + i)
                tok = int(sampling.sample(logits, self.params, hist,
                                          sampling.token_key(draft_key, index + i)))
                hist = add_to_history(hist, tok)
                proposals.append(tok)
                rows.append(logits)
            rows = jnp.stack(rows)
        rows = _pad_rows(jnp.asarray(rows)[: len(proposals)], MAX_DRAFT)
        q = _proposal_distributions(rows, _padded(proposals), jnp.int32(len(proposals)),
                                    self.params, history)
        return proposals, q, state

    def _restore(self, state, point, feed, keep_rows, base):
        p = self.p
        if p.retaining_rollback_keeps(len(feed), keep_rows):
            return p.rollback_retaining(state, point, keep_rows)
        state = p.rollback(state, point)
        return p.verify(state, feed[:keep_rows], base)[1]

    def _realign_drafter(self, state: Any, base: int) -> Any:
        """Bring the drafter to ``base`` consumed positions: rewind it to where the accepted
        prefix ended (it may have drafted past), then prime what it lacks."""
        p = self.p
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
