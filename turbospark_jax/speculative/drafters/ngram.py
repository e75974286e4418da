"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the tail.

No weights. With the committed sequence (the target's fed ids plus the pending token), the
drafter looks for the most recent earlier place where the last ``n`` tokens occurred (trying
``n = max_n`` down to ``min_n``) and proposes the tokens that followed it. Code and chat
transcripts repeat themselves a lot, which is where this pays.

:func:`propose` is the host form (the reference); :class:`NGramDevice` does the same lookup
over the fed record on the device, with the same answer, so the whole speculative round stays
on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from turbospark_jax.core.checks import as_int
from turbospark_jax.errors import BadInputError
from turbospark_jax.speculative.drafters.base import MAX_DRAFT, DeviceDrafter, LookupDrafter


class NGramDrafter(LookupDrafter):
    """Propose the continuation of the latest earlier match of the last ``n`` tokens.

    Args:
      vocab_size: the target's vocabulary size (proposals are ids below it).
      max_n: the longest tail to match first.
      min_n: the shortest tail worth matching.

    Raises:
      BadInputError: unless ``1 <= min_n <= max_n`` are integers and ``vocab_size`` a
        positive integer.
    """

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1) -> None:
        for name, value in (("max_n", max_n), ("min_n", min_n)):
            as_int(name, value)
        if not 1 <= min_n <= max_n:
            raise BadInputError(
                f"n-gram lengths need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}"
            )
        super().__init__(vocab_size)
        self.max_n, self.min_n = int(max_n), int(min_n)

    def block(self, state: Any, known: Sequence[int], count: int, *,
              target: Any = None) -> tuple[list[int], Any]:
        del target
        return propose(known, count, self.max_n, self.min_n), state

    def on_device(self) -> tuple[DeviceDrafter, Any]:
        return NGramDevice(max_n=self.max_n, min_n=self.min_n), ()


def propose(known: Sequence[int], count: int, max_n: int, min_n: int = 1) -> list[int]:
    """The continuation (at most ``count`` ids) of the latest earlier match of ``known``'s
    last n tokens, for the largest ``n`` in ``max_n .. min_n`` that has one."""
    seq = list(known)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        tail = seq[-n:]
        # Latest earlier occurrence: scan start positions right to left, excluding the tail.
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                follow = seq[start + n : start + n + count]
                if follow:
                    return follow
    return []


@dataclasses.dataclass(frozen=True)
class NGramDevice(DeviceDrafter):
    """:func:`propose` over the target's fed record, as array operations."""

    loop_free = True
    sampled_loop_free = True

    max_n: int
    min_n: int

    def propose(
        self, params: Any, state: Any, target: Any, pending: jax.Array,
        m: jax.Array, sampler: Any,
    ) -> tuple[jax.Array, None, jax.Array, Any]:
        del params, sampler
        capacity = target.fed.ids.shape[0]
        length = target.fed.count + 1  # the committed ids plus the pending token
        # seq[j] for every candidate start j and offset < max_n, plus the longest follow.
        seq = jnp.concatenate(
            [target.fed.ids, jnp.zeros((self.max_n + MAX_DRAFT + 1,), jnp.int32)]
        ).at[target.fed.count].set(pending)
        starts = jnp.arange(capacity, dtype=jnp.int32)
        best_start, best_n = jnp.int32(-1), jnp.int32(0)
        for n in range(self.max_n, self.min_n - 1, -1):
            tail = jax.lax.dynamic_slice(seq, (jnp.maximum(length - n, 0),), (n,))
            match = (starts < length - n) & (n <= length - 1)
            for i in range(n):
                match &= seq[i : i + capacity] == tail[i]
            latest = jnp.max(jnp.where(match, starts, -1))
            take = (best_n == 0) & (latest >= 0)
            best_start = jnp.where(take, latest, best_start)
            best_n = jnp.where(take, n, best_n)
        follow = best_start + best_n
        proposals = jax.lax.dynamic_slice(seq, (jnp.maximum(follow, 0),), (MAX_DRAFT,))
        count = jnp.where(best_n > 0, jnp.minimum(m, length - follow), 0).astype(jnp.int32)
        proposals = jnp.where(jnp.arange(MAX_DRAFT) < count, proposals, 0)
        return proposals, None, count, state
