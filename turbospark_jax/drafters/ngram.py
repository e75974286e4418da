"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the tail.

No weights and no device work. With the context ``known``, the drafter looks for the most
recent earlier place where the last ``n`` tokens occurred (trying ``n = max_n`` down to
``min_n``) and proposes the tokens that followed it. Code and chat transcripts repeat
themselves a lot, which is where this pays.
"""

from __future__ import annotations

from collections.abc import Sequence

from turbospark_jax.drafters.base import Drafter
from turbospark_jax.errors import BadInputError


class NGramDrafter(Drafter):
    """Propose the continuation of the latest earlier match of the last ``n`` tokens.

    Args:
      vocab_size: the target's vocabulary size (proposals are ids below it).
      max_n: the longest tail to match first.
      min_n: the shortest tail worth matching.
    """

    drafts_blocks = True

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise BadInputError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self._vocab = vocab_size
        self.max_n, self.min_n = max_n, min_n

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def init_state(self) -> int:
        return 0  # the state is how many positions are known; lookups read ``known``

    def prime(self, state: int, known: Sequence[int], position: int) -> int:
        return max(state, position + 1)

    def rewind(self, state: int, known: Sequence[int], position: int) -> int:
        return position

    def consumed(self, state: int) -> int:
        return state

    def block(self, state: int, known: Sequence[int], block: int) -> tuple[list[int], int]:
        return propose(known, block, self.max_n, self.min_n), state


def propose(known: Sequence[int], block: int, max_n: int, min_n: int = 1) -> list[int]:
    """The continuation of the latest earlier match of ``known``'s last n tokens."""
    seq = list(known)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        tail = seq[-n:]
        # Latest earlier occurrence: scan start positions right to left, excluding the tail.
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                follow = seq[start + n : start + n + block]
                if follow:
                    return follow
    return []
