"""The conformance suite every producer runs through.

Each ``check_*`` function drives a producer through two paths the protocols promise are
identical and raises :class:`ConformanceError` naming the first difference. Equality is bitwise
(``np.array_equal`` on the raw bytes), on logits and on every live state leaf
(:func:`turbospark_jax.core.state.live_equal`: dead rows past the cursor and scratch leaves aside).

Each check has a control: :func:`perturbed` wraps a producer so that one path is wrong by one
bit or one position, and the same check must then fail. A check that cannot fail proves
nothing; the controls are how we know these can.

The checks take care of donation themselves: states they need again are copied first.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from turbospark_jax.core.protocols import ChunkedPrefillRunner, LogitProducer, VerifyingTarget
from turbospark_jax.core.state import copy_state, live_equal, live_view


class ConformanceError(AssertionError):
    """A producer broke a promise of the protocols; the message says which and where."""


def _bits_equal(a: Any, b: Any) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.view(np.uint8), b.view(np.uint8)
    )


def _expect_same_logits(what: str, got: Any, want: Any) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if not _bits_equal(got, want):
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        raise ConformanceError(
            f"{what}: logits differ (max abs {np.nanmax(diff) if diff.size else 0:.3g}, "
            f"{int(np.count_nonzero(diff))} elements)"
        )


def _expect_same_state(what: str, got: Any, want: Any) -> None:
    if not live_equal(got, want):
        ga, wa = jax.tree.leaves(live_view(got)), jax.tree.leaves(live_view(want))
        where = next(
            (i for i, (x, y) in enumerate(zip(ga, wa, strict=False)) if not _bits_equal(x, y)),
            "structure",
        )
        raise ConformanceError(f"{what}: states differ (first differing leaf: {where})")


def _keep(state: Any) -> Any:
    return copy_state(state)


def sequential_prefill(producer: LogitProducer, state: Any, tokens: Sequence[int], start: int):
    """The reference path: ``produce_prefill`` for every token but the last, ``produce`` last."""
    for i, tok in enumerate(tokens[:-1]):
        state = producer.produce_prefill(state, int(tok), start + i)
    return producer.produce(state, int(tokens[-1]), start + len(tokens) - 1)


def chunked_prefill(
    producer: ChunkedPrefillRunner, state: Any, tokens: Sequence[int], cuts: Sequence[int],
    start: int = 0,
):
    """Feed ``tokens`` as chunks split at the sorted interior ``cuts``; logits of the last."""
    edges = [0, *sorted(set(c for c in cuts if 0 < c < len(tokens))), len(tokens)]
    logits = None
    for a, b in itertools.pairwise(edges):
        logits, state = producer.prefill_chunk(state, list(tokens[a:b]), start + a)
    return logits, state


def check_chunked_matches_sequential(
    producer: ChunkedPrefillRunner, prompt: Sequence[int], cuts: Sequence[int]
) -> None:
    """``prefill_chunk`` over a split of ``prompt`` leaves what token-by-token prefill leaves."""
    want_logits, want_state = sequential_prefill(producer, producer.init_state(), prompt, 0)
    got_logits, got_state = chunked_prefill(producer, producer.init_state(), prompt, cuts)
    where = f"prompt of {len(prompt)} split at {sorted(set(cuts))}"
    _expect_same_logits(f"chunked vs sequential ({where})", got_logits, want_logits)
    _expect_same_state(f"chunked vs sequential ({where})", got_state, want_state)


def check_prefill_matches_produce(producer: LogitProducer, tokens: Sequence[int]) -> None:
    """``produce_prefill`` advances the state exactly as ``produce`` does, token by token."""
    a = producer.init_state()
    b = producer.init_state()
    for i, tok in enumerate(tokens):
        a = producer.produce_prefill(a, int(tok), i)
        _, b = producer.produce(b, int(tok), i)
        _expect_same_state(f"produce_prefill vs produce at position {i}", a, b)


def check_verify_matches_decode(
    producer: VerifyingTarget, prefix: Sequence[int], feed: Sequence[int]
) -> None:
    """Row ``i`` of ``verify(feed)`` equals decoding ``feed[i]`` at the same position."""
    _, state = sequential_prefill(producer, producer.init_state(), prefix, 0)
    base = len(prefix)
    rows, verified = producer.verify(_keep(state), list(feed), base)
    for i, tok in enumerate(feed):
        logits, state = producer.produce(state, int(tok), base + i)
        _expect_same_logits(f"verify row {i} vs decode at position {base + i}", rows[i], logits)
    _expect_same_state("state after verify vs after decoding", verified, state)


def _owned_like(state: Any, like: Any) -> Any:
    """``state`` with the producer identity of ``like`` (a block state's ``fed.owner``), so
    two producers' states compare by everything else."""
    return state.replace(fed=state.fed.replace(owner=like.fed.owner))


def check_widths_agree(
    decoder: VerifyingTarget, prefiller: VerifyingTarget, prompt: Sequence[int],
    cuts: Sequence[int], feed: Sequence[int],
) -> None:
    """Two producers of one model and params whose programs differ (block widths) agree:
    ``prefiller``'s chunked prefill of ``prompt`` leaves the logits and state ``decoder``'s
    token-by-token prefill leaves, and row ``i`` of ``prefiller``'s verify of ``feed`` then
    equals ``decoder`` decoding ``feed[i]``, with the same state after. States are block
    states; their producer identities (``fed.owner``) aside, they must be bitwise equal."""
    want_logits, want_state = sequential_prefill(decoder, decoder.init_state(), prompt, 0)
    got_logits, got_state = chunked_prefill(prefiller, prefiller.init_state(), prompt, cuts)
    where = f"prompt of {len(prompt)} split at {sorted(set(cuts))}"
    _expect_same_logits(f"chunked vs token by token ({where})", got_logits, want_logits)
    _expect_same_state(f"chunked vs token by token ({where})",
                       _owned_like(got_state, want_state), want_state)
    base = len(prompt)
    rows, verified = prefiller.verify(got_state, list(feed), base)
    state = want_state
    for i, tok in enumerate(feed):
        logits, state = decoder.produce(state, int(tok), base + i)
        _expect_same_logits(f"verify row {i} vs decode at position {base + i}", rows[i], logits)
    _expect_same_state("state after verify vs after decoding", _owned_like(verified, state),
                       state)


Op = tuple[str, list[int]]


def _apply(producer: Any, state: Any, op: Op) -> Any:
    kind, toks = op
    pos = _count(producer, state)
    if kind == "produce":
        return producer.produce(state, toks[0], pos)[1]
    if kind == "prefill":
        return producer.produce_prefill(state, toks[0], pos)
    if kind == "chunk":
        return producer.prefill_chunk(state, toks, pos)[1]
    if kind == "verify":
        return producer.verify(state, toks, pos)[1]
    raise ValueError(f"unknown op {kind!r}")


def _count(producer: LogitProducer, state: Any) -> int:
    return int(producer.fed_record(state).count)


def check_rollback_restores(
    producer: VerifyingTarget, before: Sequence[Op], after: Sequence[Op], probe: int
) -> None:
    """Roll back to a checkpoint after any sequence of calls: the state is tree-equal again,
    and continuing from it gives the same logits as continuing from a kept copy."""
    state = producer.init_state()
    for op in before:
        state = _apply(producer, state, op)
    kept = _keep(state)
    point = producer.checkpoint(state)
    for op in after:
        state = _apply(producer, state, op)
    restored = producer.rollback(state, point)
    _expect_same_state("state after rollback vs at checkpoint", restored, kept)
    pos = _count(producer, kept)
    want, _ = producer.produce(kept, probe, pos)
    got, _ = producer.produce(restored, probe, pos)
    _expect_same_logits("logits after rollback vs from the checkpointed copy", got, want)


def check_rollback_retaining_matches_decode(
    producer: VerifyingTarget, prefix: Sequence[int], feed: Sequence[int], keep: int,
    probe: int,
) -> Any:
    """Verify ``feed`` after ``prefix`` and keep its first ``keep`` rows: the state equals
    decoding those rows from the checkpoint, and ``probe`` after it gives the same logits.
    Returns the retained state (for checks of a family's own leaves)."""
    _, state = producer.prefill_chunk(producer.init_state(), list(prefix), 0)
    point = producer.checkpoint(state)
    decoded = _keep(state)
    for i, tok in enumerate(feed[:keep]):
        _, decoded = producer.produce(decoded, int(tok), len(prefix) + i)
    _, verified = producer.verify(state, list(feed), len(prefix))
    retained = producer.rollback_retaining(verified, point, keep)
    what = f"keeping {keep} of {len(feed)} verified rows vs decoding them"
    _expect_same_state(what, retained, decoded)
    at = len(prefix) + keep
    got, _ = producer.produce(_keep(retained), int(probe), at)
    want, _ = producer.produce(_keep(decoded), int(probe), at)
    _expect_same_logits(f"{what}, then position {at}", got, want)
    return retained


def check_reuse_matches_fresh(
    producer: LogitProducer, first: Sequence[int], generated: Sequence[int],
    second: Sequence[int],
) -> int:
    """Serve ``first`` (+ decode ``generated``), reuse a prefix for ``second``, continue: the
    logits and state equal those of serving ``second`` from a fresh state. Returns ``n``."""
    _, state = sequential_prefill(producer, producer.init_state(), first, 0)
    for i, tok in enumerate(generated):
        _, state = producer.produce(state, int(tok), len(first) + i)
    n, state = producer.try_reuse_prefix(state, list(second))
    if not 0 <= n < len(second):
        raise ConformanceError(f"try_reuse_prefix answered {n} for a prompt of {len(second)}")
    got, got_state = sequential_prefill(producer, state, second[n:], n)
    want, want_state = sequential_prefill(producer, producer.init_state(), second, 0)
    _expect_same_logits(f"reuse of {n} tokens vs fresh", got, want)
    _expect_same_state(f"reuse of {n} tokens vs fresh", got_state, want_state)
    return n


# -- controls: producers that are wrong by one bit or one position ------------------------


def _flip_logit_bit(logits: Any) -> Any:
    arr = np.array(logits, np.float32)
    flat = arr.reshape(-1)
    flat[0:1] = (flat[0:1].view(np.uint32) ^ np.uint32(1)).view(np.float32)
    return jax.numpy.asarray(arr)


def _corrupt_last_fed(state: Any) -> Any:
    """The same state with the id recorded at the last fed position changed."""
    fed = state.fed
    if isinstance(fed, tuple):
        return dataclasses.replace(state, fed=(*fed[:-1], fed[-1] ^ 1))
    last = fed.count - 1
    return state.replace(fed=fed.replace(ids=fed.ids.at[last].set(fed.ids[last] ^ 1)))


# Each control is a mixin placed before the producer's own class, so the perturbed producer
# is still an instance of every protocol the original implements.


class _FlipChunkLogits:
    def prefill_chunk(self, state, tokens, start_position):
        logits, state = super().prefill_chunk(state, tokens, start_position)
        return _flip_logit_bit(logits), state


class _SkipChunkPosition:
    # Drops the chunk's first token and feeds its last twice: same length, one position lost.
    def prefill_chunk(self, state, tokens, start_position):
        tokens = list(tokens)
        tokens = [*tokens[1:], tokens[-1]] if len(tokens) > 1 else [tokens[0] ^ 1]
        return super().prefill_chunk(state, tokens, start_position)


class _PrefillCorruptsState:
    def produce_prefill(self, state, token, position):
        return _corrupt_last_fed(super().produce_prefill(state, token, position))


class _VerifyFlipsRow:
    def verify(self, state, feed, base):
        rows, state = super().verify(state, feed, base)
        return _flip_logit_bit(rows), state


class _RollbackOffByOne:
    def rollback(self, state, point):
        restored = super().rollback(state, point)
        return _corrupt_last_fed(restored) if _count(self, restored) else restored


class _ReuseClaimsOneMore:
    # Answers one token more than it rewound to: the continuation then skips a position.
    def try_reuse_prefix(self, state, prompt_ids, *, injected=None):
        n, state = super().try_reuse_prefix(state, prompt_ids, injected=injected)
        if n + 1 >= len(prompt_ids):
            return n, _corrupt_last_fed(state) if n else state
        return n + 1, state.replace(fed=state.fed.replace(count=state.fed.count + 1))


CONTROLS: dict[str, type] = {
    "chunk_logits_bit": _FlipChunkLogits,
    "chunk_skips_position": _SkipChunkPosition,
    "prefill_corrupts_state": _PrefillCorruptsState,
    "verify_row_bit": _VerifyFlipsRow,
    "rollback_off_by_one": _RollbackOffByOne,
    "reuse_claims_one_more": _ReuseClaimsOneMore,
}


def perturbed(producer: Any, control: str) -> Any:
    """A copy of ``producer`` whose class puts the named control from :data:`CONTROLS` first:
    the same instance data, one method wrong."""
    base = type(producer)
    cls = type(f"{CONTROLS[control].__name__.lstrip('_')}{base.__name__}",
               (CONTROLS[control], base), {})
    copy = object.__new__(cls)
    copy.__dict__.update(producer.__dict__)
    return copy
