"""A separate, smaller model as the drafter: any producer with the target's vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from turbospark_jax.drafters.base import Drafter
from turbospark_jax.protocols import LogitProducer
from turbospark_jax.state import find_fed


class DraftModelDrafter(Drafter):
    """Drafts with ``producer.produce``; rewinds through ``try_reuse_prefix``.

    Rewinding keys on the drafter's own fed record: asking it to reuse ``known[:position]``
    moves its cursor back when it can, and whatever it cannot keep (a recurrent draft model
    keeps nothing partial) is fed again with ``produce_prefill``. So any producer works.
    """

    def __init__(self, producer: LogitProducer) -> None:
        self.producer = producer

    @property
    def vocab_size(self) -> int:
        return self.producer.vocab_size

    def init_state(self) -> Any:
        return self.producer.init_state()

    def consumed(self, state: Any) -> int:
        fed = find_fed(state)
        if fed is not None:
            return int(fed.count)
        return len(state.fed)

    def prime(self, state: Any, known: Sequence[int], position: int) -> Any:
        return self.producer.produce_prefill(state, int(known[position]), position)

    def step(self, state: Any, token: int, position: int) -> tuple[jax.Array, Any]:
        return self.producer.produce(state, int(token), position)

    def supports_bursts(self) -> bool:
        return callable(getattr(self.producer, "decode", None))

    def burst(
        self, state: Any, token: int, position: int, count: int, *,
        params: Any, history: Any, key: jax.Array, index: int,
    ) -> tuple[list[int], jax.Array, Any]:
        # The producer's device decode is the same block program ``step`` runs, with the
        # sampling inside the loop: one call instead of ``count``, the same bits.
        del position  # decode continues at the state's own cursor, which is ``position``
        tokens: list[int] = []
        rows = []
        while len(tokens) < count:  # more than one call only past the producer's burst cap
            steps = min(count - len(tokens), self.producer.steps_per_call)
            burst, state = self.producer.decode(
                state, int(token), steps, params=params, history=history, key=key,
                gen_index=index + len(tokens),
            )
            tokens += burst.tokens
            rows.append(burst.logits)
            if len(burst.tokens) < steps:
                break  # non-finite logits ended the burst
            token, history = burst.tokens[-1], burst.history
        logits = rows[0] if len(rows) == 1 else jnp.concatenate(rows)
        return tokens, logits, state

    def rewind(self, state: Any, known: Sequence[int], position: int) -> Any:
        have = self.consumed(state)
        if have == position:
            return state
        if position == 0:
            return self.producer.init_state()
        # Reuse asks to keep all but the one token it must leave to feed: ask for one more.
        n, state = self.producer.try_reuse_prefix(state, [*known[:position], 0])
        for p in range(n, position):
            state = self.producer.produce_prefill(state, int(known[p]), p)
        return state
