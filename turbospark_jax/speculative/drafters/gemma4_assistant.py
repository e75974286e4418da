"""The Gemma 4 assistant as a drafter: greedy proposals from its target's cache, on the device
and on the host.

The target keeps every fed row's hidden state (``Gemma4Model(keep_hidden_rows=True)``) and its
ring must still hold the window, which the engine's rewind floor guarantees. The assistant's
own math is :mod:`turbospark_jax.models.gemma4.assistant`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from turbospark_jax.core.state import FedRecord
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.engine.program import BlockState
from turbospark_jax.errors import BadInputError
from turbospark_jax.models.family import Params
from turbospark_jax.models.gemma4 import model as gemma4
from turbospark_jax.models.gemma4.assistant import AssistantConfig, draft_step
from turbospark_jax.speculative.drafters.base import (
    MAX_DRAFT,
    DeviceDrafter,
    Drafter,
    draft_loop,
    propose_compiled,
)


class Gemma4AssistantDrafter(Drafter):
    """The assistant paired with its target as a drafter: greedy proposals from the target's
    cache and the hidden state of its last fed row, no state of its own.

    Args:
      target: a :class:`~turbospark_jax.engine.producer.BlockProducer` over a
        :class:`~turbospark_jax.models.gemma4.model.Gemma4Model` built with
        ``keep_hidden_rows=True`` (the assistant starts each round from the hidden state of
        the target's last fed row).
      config, params: the assistant's (:meth:`AssistantConfig.from_hf_dict`, :func:`init_params`
        or loaded through :func:`hf_tensors`).

    Raises:
      BadInputError: the target is not such a producer, or the assistant was made for another
        target (its widths or head dims).
    """

    stateless = True
    drafts_blocks = True

    def __init__(self, target: BlockProducer, config: AssistantConfig, params: Params) -> None:
        model = target.model if isinstance(target, BlockProducer) else None
        if not isinstance(model, gemma4.Gemma4Model) or not model.keep_hidden_rows:
            raise BadInputError(
                "the Gemma 4 assistant drafts over a BlockProducer of a Gemma4Model built with "
                "keep_hidden_rows=True (it reads the hidden state of the target's last row)"
            )
        if config.text.vocab_size != model.vocab_size:
            raise BadInputError(
                f"the assistant's vocabulary ({config.text.vocab_size}) is not the target's "
                f"({model.vocab_size})"
            )
        self.target = target
        self._device = AssistantDevice(config=config, target_model=model)
        self._params = (params, target.params)
        # Checks the pairing (widths, head dims) now rather than at the first round.
        jax.eval_shape(lambda p, c: self._device.propose(
            p, (), c, jnp.int32(0), jnp.int32(1), None), self._params,
            BlockState(cache=model.init_cache(8), fed=FedRecord.empty(8)))

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    def block(self, state: Any, known: Any, count: int, *,
              target: Any = None) -> tuple[list[int], Any]:
        if target is None:
            raise BadInputError("the assistant reads the target's state; pass target=")
        proposals, n, _ = propose_compiled(self._device, self._params, (), target,
                                           jnp.int32(int(known[-1])), jnp.int32(count))
        return [int(t) for t in jax.device_get(proposals)[: int(n)]], state

    def on_device(self) -> tuple[DeviceDrafter, Any]:
        return self._device, self._params


@dataclasses.dataclass(frozen=True)
class AssistantDevice(DeviceDrafter):
    """The assistant's greedy chain inside the device loop: every step at the pending token's
    position, over the target's cache as the round found it."""

    loop_free = True

    config: AssistantConfig
    target_model: gemma4.Gemma4Model

    def propose(self, params: Any, state: Any, target: Any, pending: jax.Array, m: jax.Array,
                sampler: Any) -> tuple[jax.Array, None, jax.Array, Any]:
        assistant, target_params = params  # greedy drafting: a point-mass proposal
        base = target.fed.count
        hidden = target.cache.hidden_rows[jnp.maximum(base - 1, 0)]
        count = jnp.clip(m, 0, MAX_DRAFT)

        def step(c):
            i, tok, h, proposals = c
            logits, h = draft_step(self.config, assistant, self.target_model, target_params,
                                   target.cache, tok, h, base)
            tok = jnp.argmax(logits).astype(jnp.int32)
            return i + 1, tok, h, proposals.at[i].set(tok)

        _, _, _, proposals = draft_loop(  # at most MAX_DRAFT steps
            lambda c: c[0] < count, step,
            (jnp.int32(0), pending.astype(jnp.int32), hidden,
             jnp.zeros((MAX_DRAFT,), jnp.int32)), sampler)
        return proposals, None, count, state
