"""The speculative loop: ``run_raw_completion_speculative``, lossless greedy and sampled.

It drives a :class:`~turbospark_jax.protocols.SpeculativeProducer` by the protocol's
contracts.

**Prompt walk.** After prefix reuse, the target consumes the prompt while the drafter is
primed over every known pair: in chunks through ``prefill_chunk_priming_drafter`` when the
producer supports it, otherwise token by token (``produce_prefill`` for the target only when
``supports_headless_prefill``, else ``produce``) with ``prime_drafter``. The last prompt token
goes through ``produce``; its logits give the first token exactly as the plain loop does.

**A round**, with the last emitted token ``t`` not yet fed:

1. keep the target checkpoint (a value);
2. draft ``m`` proposals: ``draft_block`` once for block drafters, else ``draft_step``
   repeatedly (sampling each draft token from the drafter's logits, shaped by the request's
   sampling settings, which gives the proposal distribution ``q``);
3. ``verify([t, *proposals])`` in one target pass: row ``i`` holds the target logits ``p``
   for the token after ``feed[i]``;
4. accept in one jitted judgement: proposal ``x`` at row ``i`` is kept with probability
   ``min(1, p(x) / q(x))``; the first rejection draws a replacement from the normalised
   ``max(0, p - q)``; if all are kept a bonus token is drawn from the last row. At temperature
   0 ``p`` and ``q`` are point masses, so this is "keep while the proposal is the target's
   argmax" and the replacement and bonus are the argmax: token for token the plain loop's
   greedy output;
5. restore the target with ``rollback_retaining`` (keeping the fed rows that survived) when
   supported, otherwise ``rollback`` and a shortened re-verify;
6. rewind the drafter to where the accepted prefix ended (not where the target went) and
   prime it over whatever it has not consumed yet;
7. ``record_committed``.

The emitted tokens pass through the same :class:`~turbospark_jax.generate.Emission` as in the
plain loop (stop tokens, stop strings, max_tokens), and the target is rolled back to exactly
the tokens before the last emitted one, so the fed record matches the plain loop's even when
a stop lands inside an accepted block.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax import sampling
from turbospark_jax.errors import BadInputError, ProducerExhaustedError, ProducerFailedError
from turbospark_jax.generate import NON_FINITE_LOGITS as _NON_FINITE
from turbospark_jax.generate import (
    Completion,
    CompletionRequest,
    CompletionStream,
    FinishReason,
    StreamEvent,
    add_to_history,
)
from turbospark_jax.protocols import SpeculativeProducer

#: The largest block a round may draft (the judgement is compiled once for this size).
MAX_BLOCK = 8



@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    """What the rounds did.

    Fields:
      rounds: verify passes.
      drafted: proposals verified.
      accepted: proposals kept.
      drafted_by_position: proposals verified at draft position ``i`` (0 = first).
      accepted_by_position: proposals kept at draft position ``i``.
    """

    rounds: int
    drafted: int
    accepted: int
    drafted_by_position: list[int]
    accepted_by_position: list[int]

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


def _judge(
    rows: jax.Array,
    q: jax.Array,
    proposals: jax.Array,
    m: jax.Array,
    params: sampling.SamplingParams,
    history: sampling.History,
    key: jax.Array,
    index: jax.Array,
) -> tuple[jax.Array, jax.Array, sampling.History]:
    """Accept or reject ``m`` proposals against target rows; returns (tokens, count, history).

    rows: f32[MAX_BLOCK + 1, V] target logits; q: f32[MAX_BLOCK, V] proposal distributions;
    proposals: i32[MAX_BLOCK]. Emits ``count`` tokens: the kept proposals and one more.
    """
    accept_key = jax.random.fold_in(key, 2)
    resample_key = jax.random.fold_in(key, 3)

    def row(i, carry):
        tokens, count, done, hist = carry
        p = sampling.probabilities(rows[i], params, hist)
        x = proposals[i]
        proposing = (i < m) & ~done
        u = jax.random.uniform(sampling.token_key(accept_key, index + i))
        keep = proposing & (u * q[i, x] < p[x])
        # The replacement after a rejection, or the bonus after the last proposal.
        greedy_or_bonus = sampling.sample(rows[i], params, hist, sampling.token_key(key, index + i))
        residual = jnp.maximum(p - q[i], 0.0)
        residual_tok = jax.random.categorical(
            sampling.token_key(resample_key, index + i),
            jnp.where(residual > 0, jnp.log(jnp.where(residual > 0, residual, 1.0)), -jnp.inf),
        ).astype(jnp.int32)
        sampled_rejection = (params.temperature > 0) & (jnp.sum(residual) > 0) & (i < m)
        other = jnp.where(sampled_rejection, residual_tok, greedy_or_bonus)
        final = ~done & ~keep & (i <= m)
        tok = jnp.where(keep, x, other)
        emit = keep | final
        tokens = jnp.where(emit, tokens.at[i].set(tok), tokens)
        hist = jax.tree.map(lambda a, b: jnp.where(emit, a, b), hist.add(tok), hist)
        return tokens, count + emit.astype(jnp.int32), done | final, hist

    init = (jnp.full((MAX_BLOCK + 1,), -1, jnp.int32), jnp.int32(0), jnp.bool_(False), history)
    tokens, count, _, history = jax.lax.fori_loop(0, MAX_BLOCK + 1, row, init)
    return tokens, count, history


_judge_jit = jax.jit(_judge)


@functools.partial(jax.jit, static_argnums=(1,))
def _pad_rows(rows: jax.Array, n: int) -> jax.Array:
    return jnp.zeros((n, rows.shape[-1]), jnp.float32).at[: rows.shape[0]].set(rows)


class SpeculativeStream(CompletionStream):
    """The speculative counterpart of :class:`~turbospark_jax.generate.CompletionStream`."""

    def __init__(
        self,
        producer: SpeculativeProducer,
        request: CompletionRequest,
        *,
        block_size: int = 4,
        tokenizer: Any | None = None,
        state: Any | None = None,
    ) -> None:
        if not isinstance(producer, SpeculativeProducer):
            raise BadInputError(
                f"{type(producer).__name__} is not a SpeculativeProducer; pair a target with a "
                "drafter (turbospark_jax.drafters.SpeculativePair)"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not (
            1 <= block_size <= MAX_BLOCK
        ):
            raise BadInputError(
                f"block_size must be an integer in 1..{MAX_BLOCK}, got {block_size!r}"
            )
        self.block_size = block_size
        super().__init__(producer, request, tokenizer=tokenizer, state=state)

    def _run(self) -> Iterator[StreamEvent]:
        p, req = self.producer, self.request
        t0, prompt, state, reused, out, key, history = self._begin()
        draft_key = jax.random.fold_in(key, 1)
        stats = _Stats(self.block_size)
        finish, error, first_token_s = None, None, 0.0
        try:
            logits, state = self._prompt_walk(state, prompt, reused)
        except (ProducerExhaustedError, ProducerFailedError) as exc:
            finish, error = FinishReason.ERROR, str(exc)
        prefill_s = time.perf_counter() - t0
        if finish is None and not bool(np.all(np.isfinite(np.asarray(logits)))):
            finish, error = FinishReason.ERROR, _NON_FINITE
        if finish is None:
            tok = int(sampling.sample(logits, self._params, history, sampling.token_key(key, 0)))
            history = add_to_history(history, tok)
            first_token_s = time.perf_counter() - t0 - prefill_s
            event, finish = out.push(tok, logits)
            if event is not None:
                yield event

        while finish is None:
            base = len(prompt) + len(out.tokens) - 1  # where the pending token goes
            remaining = req.max_tokens - len(out.tokens)
            m_cap = min(self.block_size, remaining - 1)
            # The drafter must have consumed everything the target has before it drafts.
            state = self._realign_drafter(state, base, out.tokens[-1])
            point = p.checkpoint(state)
            proposals, q, state = self._draft(state, out.tokens[-1], base, m_cap, history,
                                              draft_key, len(out.tokens))
            feed = [out.tokens[-1], *proposals]
            rows, state = p.verify(state, feed, base)
            if not bool(jnp.all(jnp.isfinite(rows))):
                finish, error = FinishReason.ERROR, _NON_FINITE
                break
            m = len(proposals)
            toks, count, new_history = _judge_jit(
                _pad_rows(rows, MAX_BLOCK + 1), q, _pad_proposals(proposals),
                jnp.int32(m), self._params, history, key, jnp.int32(len(out.tokens)),
            )
            emitted = [int(t) for t in np.asarray(toks[: int(count)])]
            stats.record(m, len(emitted) - 1)
            history = new_history
            kept = 0
            for i, tok in enumerate(emitted):
                event, finish = out.push(tok, rows[i])
                kept = i
                if event is not None:
                    yield event
                if finish is not None:
                    break
            # Fed rows that stay: the pending token plus the emitted tokens before the last
            # one (the last emitted token is never fed, as in the plain loop).
            keep_rows = 1 + kept
            state = self._restore(state, point, feed, keep_rows, base)
            state = p.record_committed(state, feed[:keep_rows], base)
        event, self.completion = out.finish(
            finish, error, state, prompt_len=len(prompt), reused=reused, started=t0,
            prefill_s=prefill_s, first_token_s=first_token_s, speculative=stats.freeze(),
        )
        if event is not None:
            yield event

    def _prompt_walk(self, state: Any, prompt: list[int], start: int) -> tuple[Any, Any]:
        p, size = self.producer, self.request.prefill_chunk_size
        self._drafter_at = start
        if p.supports_chunked_drafter_prefill():
            logits = None
            for a in range(start, len(prompt), size):
                b = min(a + size, len(prompt))
                nxt = prompt[b] if b < len(prompt) else None
                logits, state = p.prefill_chunk_priming_drafter(state, prompt[a:b], a, nxt)
            self._drafter_at = len(prompt) - 1
            return logits, state
        for pos in range(start, len(prompt) - 1):
            if p.supports_headless_prefill():
                state = p.produce_prefill(state, prompt[pos], pos)
            else:
                state = p.produce(state, prompt[pos], pos)[1]
            state = p.prime_drafter(state, prompt[pos + 1], pos)
        self._drafter_at = len(prompt) - 1
        return p.produce(state, prompt[-1], len(prompt) - 1)

    def _draft(self, state, anchor, base, m_cap, history, draft_key, index):
        p, vocab = self.producer, self.producer.vocab_size
        q = np.zeros((MAX_BLOCK, vocab), np.float32)
        if m_cap <= 0:
            return [], jnp.asarray(q), state
        if p.drafts_block_passes():
            proposals, state = p.draft_block(state, anchor, base, m_cap)
            proposals = [int(t) for t in proposals[:m_cap]]
            for i, t in enumerate(proposals):
                q[i, t] = 1.0  # a deterministic drafter's proposal is a point mass
            return proposals, jnp.asarray(q), state
        if getattr(p, "supports_draft_bursts", lambda: False)():
            proposals, rows, state = p.draft_burst(
                state, anchor, base, m_cap, params=self._params, history=history,
                key=draft_key, index=index,
            )
            self._drafter_at = base + m_cap
            if len(proposals) < m_cap:  # non-finite drafter logits cut the burst short
                state = p.rewind_drafter(state, base)
                self._drafter_at = base
        else:
            proposals, rows, tok, hist = [], [], anchor, history
            for i in range(m_cap):
                logits, state = p.draft_step(state, tok, base + i)
                self._drafter_at = base + i + 1
                key = sampling.token_key(draft_key, index + i)
                tok = int(sampling.sample(logits, self._params, hist, key))
                hist = add_to_history(hist, tok)
                proposals.append(tok)
                rows.append(logits)
        return proposals, self._proposal_distributions(proposals, rows, history), state

    def _proposal_distributions(self, proposals, rows, history) -> jax.Array:
        """q for each proposal: the distribution it was sampled from, under the same shaping
        and history as the target's p."""
        q = np.zeros((MAX_BLOCK, self.producer.vocab_size), np.float32)
        if self._params.is_greedy:
            for i, t in enumerate(proposals):
                q[i, t] = 1.0  # greedy drafting: a point mass at the proposal
            return jnp.asarray(q)
        qs, hist = [], history
        for i, t in enumerate(proposals):
            qs.append(sampling.probabilities(rows[i], self._params, hist))
            hist = add_to_history(hist, t)
        return jnp.asarray(q).at[: len(qs)].set(jnp.stack(qs)) if qs else jnp.asarray(q)

    def _restore(self, state, point, feed, keep_rows, base):
        p = self.producer
        if p.supports_retaining_rollback():
            return p.rollback_retaining(state, point, keep_rows)
        state = p.rollback(state, point)
        return p.verify(state, feed[:keep_rows], base)[1]

    def _realign_drafter(self, state, target_count, pending):
        """Bring the drafter to ``target_count`` consumed positions: rewind it to where the
        accepted prefix ended (it may have drafted past), then prime what it lacks."""
        p = self.producer
        if self._drafter_at > target_count:
            state = p.rewind_drafter(state, target_count)
            self._drafter_at = target_count
        while self._drafter_at < target_count:
            pos = self._drafter_at
            state = p.prime_drafter(state, pending, pos)  # next token: only a head needs it
            self._drafter_at += 1
        return state


def _pad_proposals(proposals: list[int]) -> jax.Array:
    padded = np.zeros((MAX_BLOCK,), np.int32)
    padded[: len(proposals)] = proposals
    return jnp.asarray(padded)


class _Stats:
    def __init__(self, block: int) -> None:
        self.rounds = 0
        self.drafted = [0] * block
        self.accepted = [0] * block

    def record(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        for i in range(drafted):
            self.drafted[i] += 1
        for i in range(accepted):
            self.accepted[i] += 1

    def freeze(self) -> SpeculativeStats:
        return SpeculativeStats(
            rounds=self.rounds,
            drafted=sum(self.drafted),
            accepted=sum(self.accepted),
            drafted_by_position=list(self.drafted),
            accepted_by_position=list(self.accepted),
        )


def stream_raw_completion_speculative(
    producer: SpeculativeProducer,
    request: CompletionRequest,
    *,
    block_size: int = 4,
    tokenizer: Any | None = None,
    state: Any | None = None,
) -> SpeculativeStream:
    """Start a streaming speculative completion; iterate for deltas, then read ``.completion``."""
    return SpeculativeStream(producer, request, block_size=block_size, tokenizer=tokenizer,
                             state=state)


def run_raw_completion_speculative(
    producer: SpeculativeProducer,
    request: CompletionRequest,
    *,
    block_size: int = 4,
    tokenizer: Any | None = None,
    state: Any | None = None,
) -> Completion:
    """Run a speculative completion to the end.

    Args:
      producer: a :class:`~turbospark_jax.protocols.SpeculativeProducer`, usually a
        :class:`~turbospark_jax.drafters.SpeculativePair`.
      request: as for :func:`~turbospark_jax.generate.run_raw_completion`.
      block_size: proposals per round, 1..``MAX_BLOCK``.
      tokenizer, state: as for the plain loop.

    Returns:
      The completion, with ``speculative`` holding :class:`SpeculativeStats`.

    Raises:
      BadInputError: an invalid request or block size; nothing is touched.
    """
    stream = SpeculativeStream(producer, request, block_size=block_size, tokenizer=tokenizer,
                               state=state)
    for _ in stream:
        pass
    assert stream.completion is not None
    return stream.completion
