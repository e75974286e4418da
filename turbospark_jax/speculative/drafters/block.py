"""A block drafter (DFlash-style) paired with its target: ``B - 1`` proposals from one pass of
a few layers over the target's tapped rows.

The target (any family that declares
:attr:`~turbospark_jax.models.base.BlockModel.can_tap`: dense, Qwen3.5) records the output of
its tap layers for every fed row (its ``tap_layers``); the drafter keeps its own
context KV made from those rows (:class:`~turbospark_jax.models.block_drafter.BlockDrafterModel`)
with its own fed record. A round:

* drops the drafter's rows whose lineage is no longer the target's (the two records' prefix
  digests must agree: keyed on what was fed, not on a count kept elsewhere);
* catches up over the positions the target committed since, ``W`` rows a step;
* runs one pass over ``[pending, mask x (B - 1)]`` at the target's cursor and proposes the
  argmax of rows ``1 .. B - 1``.

Proposals are deterministic (a point mass), so sampled decoding stays lossless through the
rejection sampler. At the commit the drafter keeps only rows the target still holds; a
rewind moves its cursor back (its rows are append-only). The host rounds draft with the same
compiled function the device rounds run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from turbospark_jax.core.state import FedRecord
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.models.base import BlockModel
from turbospark_jax.models.block_drafter import (
    BlockDrafterCache,
    BlockDrafterConfig,
    BlockDrafterModel,
    Params,
    param_shapes,
    shared_weights,
)
from turbospark_jax.speculative.drafters.base import (
    MAX_DRAFT,
    CatchUpDevice,
    CatchUpDrafter,
    DeviceDrafter,
    propose_compiled,
)


def _can_tap(model: Any) -> bool:
    return isinstance(model, BlockModel) and model.can_tap


def tapped_target(model: BlockModel, config: BlockDrafterConfig) -> BlockModel:
    """``model`` set to tap the layers the drafter ``config`` reads (what a loader does before
    it builds the target's producer).

    Raises:
      BadInputError: ``model``'s family cannot record tap rows (it does not declare
        ``can_tap``), or it has another layer count than the drafter was trained on.
    """
    if not _can_tap(model):
        raise BadInputError(f"a block drafter needs a target that records tap rows (the dense "
                            f"and Qwen3.5 families); this one is a {type(model).__name__}")
    if model.config.num_hidden_layers != config.target_num_hidden_layers:
        raise BadInputError(
            f"the block drafter was made for a target of {config.target_num_hidden_layers} "
            f"layers; this one has {model.config.num_hidden_layers}"
        )
    return dataclasses.replace(model, tap_layers=config.target_layer_ids)


@struct.dataclass(kw_only=True)
class BlockDrafterState:
    """Fields:
      cache: the drafter's context KV (row ``p`` from the target's tap row at ``p``).
      fed: the target ids at the positions whose rows the cache holds (``fed.count`` rows).
    """

    cache: BlockDrafterCache
    fed: FedRecord


class BlockDrafter(CatchUpDrafter):
    """Draft a block per pass with a block drafter over its target's tap rows.

    Args:
      target: a :class:`~turbospark_jax.engine.producer.BlockProducer` over a model whose
        family declares ``can_tap``, built with ``tap_layers=config.target_layer_ids``
        (:func:`tapped_target`).
      config, params: the drafter's (:func:`~turbospark_jax.models.block_drafter.init_params`
        or :func:`~turbospark_jax.io.drafter_folders.load_block_drafter`).
      bidirectional: see :class:`~turbospark_jax.models.block_drafter.BlockDrafterModel`
        (``False`` only for the control).

    Raises:
      BadInputError: the target is not such a producer, or the drafter was made for another
        target (hidden size, vocabulary, layer count, tap layers) or its params do not have
        the config's shapes.
    """

    def __init__(self, target: BlockProducer, config: BlockDrafterConfig, params: Params, *,
                 bidirectional: bool = True) -> None:
        model = target.model if isinstance(target, BlockProducer) else None
        if not _can_tap(model):
            raise BadInputError("a block drafter drafts over a BlockProducer of a model that "
                                "records tap rows (dense or Qwen3.5) built with tap_layers")
        if not isinstance(config, BlockDrafterConfig):
            raise BadInputError(f"config must be a BlockDrafterConfig, got "
                                f"{type(config).__name__}")
        tc = model.config
        for name, mine, theirs in (
            ("hidden_size", config.hidden_size, tc.hidden_size),
            ("vocab_size", config.vocab_size, tc.vocab_size),
            ("target_num_hidden_layers", config.target_num_hidden_layers, tc.num_hidden_layers),
        ):
            if mine != theirs:
                raise BadInputError(f"the block drafter's {name} is {mine} but its target's is "
                                    f"{theirs}; it shares the target's embedding and head, so "
                                    "train it for this target")
        if model.tap_layers != config.target_layer_ids:
            raise BadInputError(
                f"the block drafter reads target layers {list(config.target_layer_ids)} but the "
                f"target taps {list(model.tap_layers)}; build the target with "
                f"tapped_target(model, config) (tap_layers={config.target_layer_ids})"
            )
        want = param_shapes(config)
        got = jax.tree.map(lambda a: tuple(a.shape), params)
        if jax.tree.structure(want, is_leaf=lambda x: isinstance(x, tuple)) != \
                jax.tree.structure(got, is_leaf=lambda x: isinstance(x, tuple)) or \
                jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, tuple)) != \
                jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, tuple)):
            raise BadInputError("the block drafter's params do not have the shapes its config "
                                "implies (see block_drafter.param_shapes)")
        self.target = target
        self.config = config
        self._device = BlockDevice(
            model=BlockDrafterModel(config, model.dtype, bidirectional=bidirectional),
            width=target.width)
        # The drafter computes in the target's dtype (its activations mix with the target's).
        params = jax.tree.map(lambda a: jnp.asarray(a, model.dtype), params)
        self._params = (params, shared_weights(target.params, tc.tie_word_embeddings))

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def max_positions(self) -> int:
        return self.target.capacity

    def init_state(self) -> BlockDrafterState:
        capacity = self.target.capacity
        return BlockDrafterState(cache=self._device.model.init_cache(capacity),
                                 fed=FedRecord.empty(capacity))

    def check_state(self, state: Any) -> None:
        if not isinstance(state, BlockDrafterState) or \
                state.fed.capacity != self.target.capacity:
            raise BadInputError(
                f"expected a BlockDrafterState from this drafter's init_state(), got "
                f"{type(state).__name__}"
            )

    def block(self, state: BlockDrafterState, known: Sequence[int], count: int, *,
              target: Any = None) -> tuple[list[int], BlockDrafterState]:
        if target is None:
            raise BadInputError("the block drafter reads the target's state; pass target=")
        proposals, n, state = propose_compiled(self._device, self._params, state, target,
                                               jnp.int32(int(known[-1])), jnp.int32(count))
        return [int(t) for t in jax.device_get(proposals)[: int(n)]], state

    def on_device(self) -> tuple[DeviceDrafter, Any]:
        return dataclasses.replace(self._device, caught_up=True), self._params


@dataclasses.dataclass(frozen=True)
class BlockDevice(CatchUpDevice):
    """The drafter's catch-up and pass inside the device loop (see the module docstring;
    ``caught_up``: :class:`~turbospark_jax.speculative.drafters.base.CatchUpDevice`)."""

    model: BlockDrafterModel
    width: int
    caught_up: bool = False

    def _agreeing(self, state: BlockDrafterState, target: Any) -> Any:
        """The drafter's record cut to the rows whose lineage (prefix digest) is the
        target's up to there."""
        fed = state.fed
        slots = jnp.arange(fed.capacity, dtype=jnp.int32)
        agree = (fed.prefix == target.fed.prefix) & (
            slots < jnp.minimum(fed.count, target.fed.count))
        return fed.moved_to(jnp.sum(jnp.cumprod(agree.astype(jnp.int32))))

    def _catch_up_block(self, own: Any, c: tuple, target: Any) -> tuple:
        """The context rows of up to ``width`` positions after ``fed.count`` (below the
        pending token's)."""
        cache, fed = c
        rows_w = jnp.arange(self.width, dtype=jnp.int32)
        positions = fed.count + rows_w
        live = jnp.minimum(target.fed.count - fed.count, self.width)
        taps = jnp.take(target.cache.taps, positions, axis=0, mode="clip")
        cache = self.model.write_context(own, cache, taps, positions, live)
        return cache, fed.append(jnp.take(target.fed.ids, positions, mode="clip"), live)

    def catch_up(self, params: Any, state: BlockDrafterState, target: Any) -> BlockDrafterState:
        own, _ = params
        cache, fed = self._whole_blocks(
            target.fed.count, lambda c: self._catch_up_block(own, c, target),
            (state.cache, self._agreeing(state, target)))
        return BlockDrafterState(cache=cache, fed=fed)

    def propose(
        self, params: Any, state: BlockDrafterState, target: Any, pending: jax.Array,
        m: jax.Array, sampler: Any,
    ) -> tuple[jax.Array, None, jax.Array, BlockDrafterState]:
        del sampler  # argmax: a point-mass proposal
        own, shared = params
        base = target.fed.count  # the pending token's position

        def catch_up(c):
            return self._catch_up_block(own, c, target)

        cache, fed = self._round_catch_up(base, catch_up,
                                          (state.cache, self._agreeing(state, target)))
        logits = self.model.block_logits(own, shared, cache.k, cache.v, base, pending)
        drafts = self.model.config.block_size - 1
        proposals = jnp.zeros((MAX_DRAFT,), jnp.int32).at[:drafts].set(
            jnp.argmax(logits[1:], axis=-1).astype(jnp.int32))
        count = jnp.clip(m, 0, drafts)
        return proposals, None, count, BlockDrafterState(cache=cache, fed=fed)

    def commit(self, state: BlockDrafterState, keep: jax.Array) -> BlockDrafterState:
        return state.replace(fed=state.fed.moved_to(jnp.minimum(state.fed.count, keep)))
