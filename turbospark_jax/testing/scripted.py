"""A producer that replays scripted logit vectors: the generation loop's test fixture.

It decouples the loop's control flow (stop handling, detokenizer ordering, history
bookkeeping) from any model. Its state is a small immutable value: how many scripted steps
have been used and the fed record of which ids were consumed (the same
:class:`~turbospark_jax.core.state.FedRecord` every producer keeps).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from turbospark_jax.core.protocols import ChunkedPrefillRunner
from turbospark_jax.core.state import FedRecord
from turbospark_jax.errors import BadInputError, ContextOverflowError, ProducerExhaustedError


@struct.dataclass
class ScriptedState:
    """Fields: cursor: scripted steps consumed; fed: the ids fed so far, by position."""

    fed: FedRecord
    cursor: int = struct.field(pytree_node=False, default=0)


class ScriptedLogitProducer(ChunkedPrefillRunner[ScriptedState]):
    """Replays ``steps[0], steps[1], ...``: one vector per ``produce`` or ``prefill_chunk``.

    Args:
      steps: the scripted logit vectors, in the order they are handed out.
      vocab_size: the logits size every step must have; defaults to the first step's length.
        A step of another length is reported when it is reached, as the seed fixture does.
      capacity: positions the fed record holds.

    ``produce_prefill`` keeps the protocol default (it consumes a step, like ``produce``);
    ``prefill_chunk`` consumes exactly one step whatever the chunk length, the scripted
    analogue of one dispatch writing one logits vector.
    """

    def __init__(
        self, steps: Sequence[Sequence[float]], vocab_size: int | None = None,
        capacity: int = 4096,
    ) -> None:
        self._steps = [np.asarray(s, np.float32).reshape(-1) for s in steps]
        if vocab_size is None:
            if not self._steps:
                raise BadInputError("an empty script needs an explicit vocab_size")
            vocab_size = int(self._steps[0].shape[0])
        self._vocab = int(vocab_size)
        self.capacity = capacity

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_positions(self) -> int:
        return self.capacity

    def init_state(self) -> ScriptedState:
        return ScriptedState(fed=FedRecord.empty(self.capacity))

    def fed_record(self, state: ScriptedState) -> FedRecord:
        return state.fed

    def produce(
        self, state: ScriptedState, token: int, position: int
    ) -> tuple[jax.Array, ScriptedState]:
        del position
        if state.cursor >= len(self._steps):
            raise ProducerExhaustedError(
                f"ScriptedLogitProducer has used all {len(self._steps)} scripted steps"
            )
        step = self._steps[state.cursor]
        if step.shape[0] != self._vocab:
            raise BadInputError(
                f"scripted step {state.cursor} has {step.shape[0]} logits, expected {self._vocab}"
            )
        return jnp.asarray(step), ScriptedState(
            cursor=state.cursor + 1, fed=_appended(state.fed, [int(token)])
        )

    def prefill_chunk(
        self, state: ScriptedState, tokens: Sequence[int], start_position: int
    ) -> tuple[jax.Array, ScriptedState]:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise BadInputError("prefill_chunk called with an empty chunk")
        logits, new = self.produce(state, tokens[-1], start_position + len(tokens) - 1)
        return logits, ScriptedState(cursor=new.cursor, fed=_appended(state.fed, tokens))


def _appended(fed: FedRecord, tokens: list[int]) -> FedRecord:
    if int(fed.count) + len(tokens) > fed.capacity:
        raise ContextOverflowError(
            f"{len(tokens)} more tokens overflow the scripted producer's {fed.capacity} positions"
        )
    return fed.append(jnp.asarray(tokens, jnp.int32), jnp.int32(len(tokens)))
