"""A drafter of known quality, for measuring the speculative loop apart from any drafter.

Given the sequence the target will produce (its greedy continuation, computed beforehand),
the oracle proposes each next token correctly with probability ``alpha`` and a wrong token
otherwise, independently per round and position. With greedy decoding the committed sequence
always follows the reference (speculation is lossless), so a round keeps ``i`` proposals with
probability ``alpha**i * (1 - alpha)``: the acceptance of an ideal drafter of quality
``alpha`` at no drafting cost. The benchmark compares the loop against that ideal.

:class:`CostedOracleDrafter` keeps that quality but pays a real drafter's cost: it runs the
drafter every round and then overrules its proposals, so a drafter with random weights (whose
own proposals would all be rejected) can be timed at the acceptance a trained one would reach.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.core.checks import as_int, as_real, as_token_ids
from turbospark_jax.errors import BadInputError
from turbospark_jax.speculative.drafters.base import (
    MAX_DRAFT,
    DeviceDrafter,
    Drafter,
    LookupDrafter,
)


class OracleDrafter(LookupDrafter):
    """Propose ``reference[p]`` at position ``p`` with probability ``alpha``.

    Args:
      vocab_size: the target's vocabulary size.
      reference: the full sequence the target produces (prompt, then its continuation).
      alpha: the chance that each proposal is right, in [0, 1].
      seed: seeds the per-round, per-position draws.

    Raises:
      BadInputError: ``alpha`` not a number in [0, 1], a reference that is not a non-empty
        sequence of ids inside the vocabulary, or a ``vocab_size`` or ``seed`` that is not a
        non-negative integer.
    """

    def __init__(
        self, vocab_size: int, reference: Sequence[int], alpha: float, seed: int = 0
    ) -> None:
        super().__init__(vocab_size)
        self.alpha = as_real("alpha", alpha, low=0.0, high=1.0)
        self.reference = np.asarray(as_token_ids("reference", reference, self._vocab), np.int32)
        self.seed = as_int("seed", seed, low=0, high=2**32 - 1)

    def block(self, state: Any, known: Sequence[int], count: int, *,
              target: Any = None) -> tuple[list[int], Any]:
        del target
        base = len(known) - 1  # the anchor's position; proposals go to base + 1 ...
        proposals, n = _oracle(
            jnp.asarray(self.reference), jnp.float32(self.alpha), jnp.int32(base),
            jnp.int32(count), self._vocab, self.seed,
        )
        return [int(t) for t in np.asarray(proposals)[: int(n)]], state

    def on_device(self) -> tuple[DeviceDrafter, Any]:
        # alpha travels as data, so oracles of every quality share one compiled program.
        params = {"reference": jnp.asarray(self.reference), "alpha": jnp.float32(self.alpha)}
        return OracleDevice(vocab_size=self._vocab, seed=self.seed), params


def _draws(
    reference: jax.Array, alpha: jax.Array, base: jax.Array, m: jax.Array, seed: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For positions ``base + 1 ..``: the reference tokens (int32[MAX_DRAFT]), whether each
    proposal is to be right (bool[MAX_DRAFT]) and how many positions the reference covers."""
    positions = base + 1 + jnp.arange(MAX_DRAFT, dtype=jnp.int32)
    key = jax.random.fold_in(jax.random.key(seed), base)
    draws = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(
        jnp.arange(MAX_DRAFT)
    )
    right = jnp.take(reference, positions, mode="clip")
    count = jnp.clip(jnp.minimum(m, reference.shape[0] - base - 1), 0, MAX_DRAFT)
    return right, draws < alpha, count


@functools.partial(jax.jit, static_argnums=(4, 5))
def _oracle(
    reference: jax.Array, alpha: jax.Array, base: jax.Array, m: jax.Array, vocab: int, seed: int
) -> tuple[jax.Array, jax.Array]:
    """Proposals for positions ``base + 1 ..`` (int32[MAX_DRAFT]) and how many are real."""
    right, hit, count = _draws(reference, alpha, base, m, seed)
    proposals = jnp.where(hit, right, (right + 1) % vocab)
    return jnp.where(jnp.arange(MAX_DRAFT) < count, proposals, 0), count


@dataclasses.dataclass(frozen=True)
class OracleDevice(DeviceDrafter):
    """The oracle on the device; its params are the reference sequence and alpha."""

    loop_free = True
    sampled_loop_free = True

    vocab_size: int
    seed: int

    def propose(
        self, params: Any, state: Any, target: Any, pending: jax.Array,
        m: jax.Array, sampler: Any,
    ) -> tuple[jax.Array, None, jax.Array, Any]:
        del pending, sampler
        proposals, count = _oracle(
            params["reference"], params["alpha"], target.fed.count, m, self.vocab_size,
            self.seed,
        )
        return proposals, None, count, state


class CostedOracleDrafter(Drafter):
    """The oracle's quality at ``inner``'s cost: each round runs ``inner``'s proposal in full,
    then puts the reference token where the oracle's draw says right, and where it says wrong
    ``inner``'s own token (``reference + 1`` where that one happens to be right).

    The wrong tokens are ``inner``'s, so its work feeds the output and the compiler cannot
    drop it. A round proposes as many tokens as ``inner`` does, at most as many as the
    reference still covers. The proposals are a point mass (``inner``'s ``q`` is dropped):
    judging any proposal against a point mass keeps the target's output distribution.

    Args:
      inner: a drafter that keeps no state and drafts blocks (``stateless`` and
        ``drafts_blocks``: the n-gram drafter, the Gemma 4 assistant). A drafter with state
        is primed and rewound by the loop, which this wrapper does not forward.
      reference, alpha, seed: as for :class:`OracleDrafter` (the vocabulary is ``inner``'s).

    Raises:
      BadInputError: ``inner`` is not such a drafter, or an argument :class:`OracleDrafter`
        refuses.
    """

    stateless = True
    drafts_blocks = True

    def __init__(
        self, inner: Drafter, reference: Sequence[int], alpha: float, seed: int = 0
    ) -> None:
        if not isinstance(inner, Drafter) or not (inner.stateless and inner.drafts_blocks):
            raise BadInputError(
                f"the costed oracle wraps a drafter that keeps no state and drafts blocks, "
                f"got {type(inner).__name__}"
            )
        self.inner = inner
        self.oracle = OracleDrafter(inner.vocab_size, reference, alpha, seed)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def block(self, state: Any, known: Sequence[int], count: int, *,
              target: Any = None) -> tuple[list[int], Any]:
        drafted, state = self.inner.block(state, known, count, target=target)
        drafted = drafted[:MAX_DRAFT]
        padded = np.zeros((MAX_DRAFT,), np.int32)
        padded[: len(drafted)] = drafted
        o = self.oracle
        proposals, n = _costed(
            jnp.asarray(padded), jnp.int32(len(drafted)), jnp.asarray(o.reference),
            jnp.float32(o.alpha), jnp.int32(len(known) - 1), jnp.int32(count), o.vocab_size,
            o.seed,
        )
        return [int(t) for t in np.asarray(proposals)[: int(n)]], state

    def on_device(self) -> tuple[DeviceDrafter, Any] | None:
        inner = self.inner.on_device()
        if inner is None:
            return None
        device, params = inner
        _, oracle_params = self.oracle.on_device()
        costed = CostedOracleDevice(inner=device, vocab_size=self.oracle.vocab_size,
                                    seed=self.oracle.seed)
        return costed, (params, oracle_params)


@functools.partial(jax.jit, static_argnums=(6, 7))
def _costed(
    drafted: jax.Array, drafted_count: jax.Array, reference: jax.Array, alpha: jax.Array,
    base: jax.Array, m: jax.Array, vocab: int, seed: int,
) -> tuple[jax.Array, jax.Array]:
    """``drafted`` (int32[MAX_DRAFT], ``drafted_count`` real) overruled by the oracle's draws
    for positions ``base + 1 ..``: the proposals (int32[MAX_DRAFT]) and how many are real."""
    right, hit, count = _draws(reference, alpha, base, m, seed)
    wrong = jnp.where(drafted != right, drafted, (right + 1) % vocab)
    proposals = jnp.where(hit, right, wrong)
    count = jnp.minimum(count, drafted_count)
    return jnp.where(jnp.arange(MAX_DRAFT) < count, proposals, 0), count


@dataclasses.dataclass(frozen=True)
class CostedOracleDevice(DeviceDrafter):
    """The costed oracle on the device; its params are ``(inner's params, the oracle's)`` and
    its state is ``inner``'s, advanced by ``inner`` alone."""

    inner: DeviceDrafter
    vocab_size: int
    seed: int

    @property
    def loop_free(self) -> bool:  # type: ignore[override]
        return self.inner.loop_free

    @property
    def sampled_loop_free(self) -> bool:  # type: ignore[override]
        return self.inner.sampled_loop_free

    def propose(
        self, params: Any, state: Any, target: Any, pending: jax.Array,
        m: jax.Array, sampler: Any,
    ) -> tuple[jax.Array, None, jax.Array, Any]:
        inner_params, oracle = params
        drafted, _, n, state = self.inner.propose(inner_params, state, target, pending, m,
                                                  sampler)
        proposals, count = _costed(drafted, n, oracle["reference"], oracle["alpha"],
                                   target.fed.count, m, self.vocab_size, self.seed)
        return proposals, None, count, state

    def commit(self, state: Any, keep: jax.Array) -> Any:
        return self.inner.commit(state, keep)
