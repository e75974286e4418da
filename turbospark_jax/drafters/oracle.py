"""A drafter of known quality, for measuring the speculative loop apart from any drafter.

Given the sequence the target will produce (its greedy continuation, computed beforehand),
the oracle proposes each next token correctly with probability ``alpha`` and a wrong token
otherwise, independently per round and position. With greedy decoding the committed sequence
always follows the reference (speculation is lossless), so a round keeps ``i`` proposals with
probability ``alpha**i * (1 - alpha)``: the acceptance of an ideal drafter of quality
``alpha`` at no drafting cost. The benchmark compares the loop against that ideal.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.checks import as_int, as_real, as_token_ids
from turbospark_jax.drafters.base import MAX_DRAFT, DeviceDrafter, Drafter


class OracleDrafter(Drafter):
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

    stateless = True
    drafts_blocks = True

    def __init__(
        self, vocab_size: int, reference: Sequence[int], alpha: float, seed: int = 0
    ) -> None:
        self._vocab = as_int("vocab_size", vocab_size, low=1)
        self.alpha = as_real("alpha", alpha, low=0.0, high=1.0)
        self.reference = np.asarray(as_token_ids("reference", reference, self._vocab), np.int32)
        self.seed = as_int("seed", seed, low=0, high=2**32 - 1)

    @property
    def vocab_size(self) -> int:
        return self._vocab

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


@functools.partial(jax.jit, static_argnums=(4, 5))
def _oracle(
    reference: jax.Array, alpha: jax.Array, base: jax.Array, m: jax.Array, vocab: int, seed: int
) -> tuple[jax.Array, jax.Array]:
    """Proposals for positions ``base + 1 ..`` (int32[MAX_DRAFT]) and how many are real."""
    positions = base + 1 + jnp.arange(MAX_DRAFT, dtype=jnp.int32)
    key = jax.random.fold_in(jax.random.key(seed), base)
    draws = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(
        jnp.arange(MAX_DRAFT)
    )
    right = jnp.take(reference, positions, mode="clip")
    proposals = jnp.where(draws < alpha, right, (right + 1) % vocab)
    count = jnp.clip(jnp.minimum(m, reference.shape[0] - base - 1), 0, MAX_DRAFT)
    return jnp.where(jnp.arange(MAX_DRAFT) < count, proposals, 0), count


@dataclasses.dataclass(frozen=True)
class OracleDevice(DeviceDrafter):
    """The oracle on the device; its params are the reference sequence and alpha."""

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
