"""Tensor parallelism over a ``jax.sharding`` device mesh, for every model family.

The mesh has one axis, :data:`TP`. Each params leaf and each state leaf gets a
``PartitionSpec`` on it (:mod:`turbospark_jax.parallel.tp_specs` says which, family by family), and
the
unchanged block program runs over the sharded arrays; XLA's sharding propagation (GSPMD)
inserts the collectives. For the dense family:

* attention: ``q_proj`` split on its query heads, ``k_proj``/``v_proj`` on their KV heads
  (column-parallel), ``o_proj`` on its input heads (row-parallel: one all-reduce a layer);
  a device holds whole heads, so RoPE, the q/k norms and attention run locally;
* MLP: ``gate_proj``/``up_proj`` split on the intermediate axis (column-parallel),
  ``down_proj`` on its input (row-parallel: the second all-reduce);
* the vocabulary: ``embed_tokens`` and ``lm_head`` split on it (when the vocabulary divides
  the mesh; otherwise they stay whole on every device), so each device computes a slice of
  the logits and the sampler gathers them;
* the KV cache on its KV-head axis, beside the ``k_proj``/``v_proj`` columns that write it:
  a device reads and writes only its own heads' rows;
* norms, biases of row-parallel layers and the fed record: replicated;
* mixture-of-experts stacks: on each expert's width, like an MLP; or, on a mesh with an
  :data:`EP` axis (``tp_mesh(devices, ep=n)``), whole experts split over that axis (expert
  parallelism, below).

Qwen3.5 adds its DeltaNet layers (conv channels, value heads, the recurrent state and its
tape on them) and Gemma 4 its ring and per-layer inputs; see
:mod:`~turbospark_jax.parallel.tp_specs`.

:class:`ShardedProducer` is a :class:`~turbospark_jax.engine.producer.BlockProducer` whose
params and states live on the mesh and whose program keeps every state leaf on its sharding.
Every path (decode, chunked prefill, verify, bursts) still runs the one program, so the
bitwise guarantees hold on a given mesh exactly as on one device. A sharded run is *not*
bitwise equal to a one-device run: the row-parallel layers sum partial products across
devices, in another order than one device's matrix product does, and even a column slice of a
product can round differently from the whole product (the tolerance is measured in
``tests/parallel/test_sharding.py``; docs/decisions/0013-sharded-tolerance.md).

Expert parallelism: a mesh of two axes, :data:`TP` and :data:`EP`, splits every other leaf
over :data:`TP` as above (replicated along :data:`EP`) and the expert stacks on their expert
axis over :data:`EP` (whole along :data:`TP`). The routed experts then run in a
``shard_map`` (:func:`~turbospark_jax.models.moe.expert_outputs`): each device computes the
selections of the experts it holds and one all-reduce of ``[T, k, D]`` a layer brings them
together. That step is bitwise the one-device one, so a mesh whose :data:`TP` axis has one
device (``tp_mesh(devices, ep=len(devices))``) runs bitwise the one-device model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from turbospark_jax.core.state import (
    FedRecord,
    buffers_only,
    by_value,
    merge_parts,
    with_auxiliary,
    without_auxiliary,
)
from turbospark_jax.engine.producer import (
    STEPS_PER_CALL,
    BlockProducer,
    program_statics,
    program_steps,
)
from turbospark_jax.engine.program import BlockState, StepOutput, pinned_program
from turbospark_jax.errors import BadInputError, UnsupportedCapabilityError
from turbospark_jax.models.base import BlockModel
from turbospark_jax.models.dense.model import DenseModel, unstack_layers
from turbospark_jax.models.gemma4.model import Gemma4Model
from turbospark_jax.models.moe import ExpertParallel
from turbospark_jax.models.qwen3_5.model import Qwen35Model, split_projections
from turbospark_jax.parallel.tp_specs import EP, TP, cache_specs, check_divisible, param_specs
from turbospark_jax.quant.weights import is_quantized

__all__ = ["EP", "TP", "ShardedProducer", "check_divisible", "ep_size",
           "init_sharded_params", "param_shardings", "param_specs", "shard_params",
           "state_shardings", "tp_mesh", "tp_size"]

#: The families :class:`ShardedProducer` serves.
_SHARDABLE = (DenseModel, Qwen35Model, Gemma4Model)

Params = dict[str, Any]


def tp_mesh(devices: Sequence[jax.Device] | None = None, *, ep: int = 1) -> Mesh:
    """A one-axis mesh named :data:`TP` over ``devices`` (default: every device of every
    process, which is the global mesh of a multi-host run); with ``ep > 1``, a mesh of
    ``len(devices) // ep`` by ``ep`` devices named :data:`TP` and :data:`EP`, whose
    :data:`EP` axis the expert stacks split over (expert parallelism; consecutive devices
    share a :data:`TP` index).

    Raises:
      BadInputError: no devices, or ``ep`` is not a positive divisor of their count.
    """
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise BadInputError("a mesh needs at least one device")
    if not isinstance(ep, int) or ep < 1 or len(devices) % ep:
        raise BadInputError(f"ep must be a positive divisor of the {len(devices)} devices; "
                            f"got {ep!r}")
    if ep == 1:
        return Mesh(np.asarray(devices), (TP,))
    return Mesh(np.asarray(devices).reshape(len(devices) // ep, ep), (TP, EP))


def tp_size(mesh: Mesh) -> int:
    """The number of devices the :data:`TP` axis splits over.

    Raises:
      BadInputError: ``mesh`` is not a ``jax.sharding.Mesh`` with a :data:`TP` axis.
    """
    if not isinstance(mesh, Mesh) or TP not in mesh.axis_names:
        raise BadInputError(
            f"expected a jax.sharding.Mesh with a {TP!r} axis (see tp_mesh), got {mesh!r}"
        )
    return int(mesh.shape[TP])


def ep_size(mesh: Mesh) -> int:
    """The number of devices the :data:`EP` axis splits the experts over (1: no such axis,
    each expert's width splits over :data:`TP` instead)."""
    return int(mesh.shape[EP]) if EP in mesh.axis_names else 1


def _check_mesh(mesh: Mesh, config: Any) -> None:
    check_divisible(config, tp_size(mesh), ep_size(mesh))


def param_shardings(mesh: Mesh, config: Any, params: Params) -> Params:
    """:func:`~turbospark_jax.parallel.tp_specs.param_specs` as ``NamedSharding`` s on ``mesh``
    (the expert stacks over its :data:`EP` axis when it has one)."""
    specs = param_specs(config, params, tp_size(mesh), ep_size(mesh))
    return _named(mesh, specs)


def _named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_params(params: Params, mesh: Mesh, config: Any) -> Params:
    """``params`` placed on ``mesh`` with the tensor-parallel layout (a no-op for leaves
    already there).

    Raises:
      BadInputError: ``mesh`` has no :data:`TP` axis; its size does not divide the query
        heads or the MLP width (or the dense family's KV heads), or the model is of a family
        without a layout; the mesh has an :data:`EP` axis and the model no experts, or
        their count is not a multiple of its size.
      UnsupportedCapabilityError: quantized params (tensor parallelism lays out plain
        weights only).
    """
    _check_mesh(mesh, config)
    if any(is_quantized(w) for w in jax.tree.leaves(params, is_leaf=is_quantized)):
        raise UnsupportedCapabilityError(
            "tensor parallelism shards plain weights only; load the model without quantize= "
            "to shard it, or serve the quantized model on one device")
    return jax.device_put(params, param_shardings(mesh, config, params))


def _mesh_layout(model: BlockModel, params: Params, mesh: Mesh) -> Params:
    """``params`` as the mesh lays them out: under tensor parallelism a Qwen3.5 model's joined
    DeltaNet projections are parted again, so each splits on its own heads and channels; a
    mesh that splits no heads (experts only) keeps them joined, so its products are the
    one-device model's."""
    if isinstance(model, Qwen35Model) and tp_size(mesh) > 1:
        return split_projections(model.config, params)
    return params


def init_sharded_params(
    model: BlockModel, key: jax.Array, mesh: Mesh, layer_layout: str = "stacked"
) -> Params:
    """Random params (the model's own ``init_params``) made directly in their shards: no
    device ever holds the whole model. Works on a multi-host mesh (every process calls it
    with the same ``key``).

    Args:
      model: a model of a family :mod:`~turbospark_jax.parallel.tp_specs` has a layout for.
      key: the PRNG key.
      mesh: a mesh with a :data:`TP` axis.
      layer_layout: the dense family's ``"stacked"`` or ``"list"`` layers (the other
        families' layers are always a list).

    Raises:
      BadInputError: as :func:`shard_params`; or ``layer_layout`` is neither layout.
    """
    if layer_layout not in ("stacked", "list"):
        raise BadInputError(f"layer_layout must be 'stacked' or 'list', got {layer_layout!r}")
    config = model.config
    _check_mesh(mesh, config)

    def make(k: jax.Array) -> Params:
        params = model.init_params(k)
        dense_list = isinstance(model, DenseModel) and layer_layout == "list"
        return unstack_layers(params) if dense_list else _mesh_layout(model, params, mesh)

    shapes = jax.eval_shape(make, key)
    shardings = param_shardings(mesh, config, shapes)
    return jax.jit(make, out_shardings=shardings)(key)


def state_shardings(mesh: Mesh, config: Any, layout: BlockState) -> BlockState:
    """A ``NamedSharding`` for every leaf of a producer's state: the cache as
    :func:`~turbospark_jax.parallel.tp_specs.cache_specs` says (KV buffers on their KV heads, a
    DeltaNet's states on their channels and heads), the fed record replicated."""
    cache = _named(mesh, cache_specs(config, layout.cache, tp_size(mesh)))
    replicated = NamedSharding(mesh, PartitionSpec())
    return BlockState(cache=cache, fed=jax.tree.map(lambda _: replicated, layout.fed))


class ShardedProducer(BlockProducer):
    """A model served through the one block program, tensor-parallel over ``mesh``.

    The same protocols and guarantees as :class:`BlockProducer`; params and every state live
    on the mesh (:func:`~turbospark_jax.parallel.tp_specs.param_specs`, :func:`state_shardings`),
    and
    every call puts its state on those shardings before it runs, so each path is the one
    compiled program.

    Args:
      model: a dense model (stacked or list layout), a Qwen3.5 / Qwen3-Next model or a Gemma 4
        model. The dense family's Pallas kernels are single-device custom calls the compiler
        cannot split, so an ``"auto"`` attention or RoPE-store mode runs as ``"xla"`` here;
        so does Qwen3.5's delta-rule kernel, whose rows walk as the XLA loop here
        (:meth:`~turbospark_jax.models.qwen3_5.model.Qwen35Model.for_mesh`), and the grouped
        experts of every family run XLA's loop over tiles.
      params: its params, anywhere: they are placed on the mesh (a no-op for params already
        sharded, as :func:`init_sharded_params` and
        :func:`~turbospark_jax.parallel.loading.load_sharded` make them).
      mesh: a mesh with a :data:`TP` axis (:func:`tp_mesh`); with an :data:`EP` axis too
        (``tp_mesh(devices, ep=n)``), the experts of a mixture-of-experts model split over
        it whole, each device computing its own experts' selections (expert parallelism),
        and the model runs with
        :class:`~turbospark_jax.models.moe.ExpertParallel` on that axis.
      capacity, width, steps_per_call, donate: as :class:`BlockProducer`.

    Raises:
      UnsupportedCapabilityError: ``model`` is of another family.
      BadInputError: ``mesh`` has no :data:`TP` axis, or its size does not divide the query
        heads and MLP width (the dense family: and KV heads; the message lists the sizes
        that do); the mesh has an :data:`EP` axis and the model has no experts or a count
        of them its size does not divide; and as :class:`BlockProducer`.
    """

    def __init__(
        self,
        model: BlockModel,
        params: Params,
        *,
        mesh: Mesh,
        capacity: int,
        width: int = 8,
        steps_per_call: int = STEPS_PER_CALL,
        donate: bool = True,
    ) -> None:
        if not isinstance(model, _SHARDABLE):
            raise UnsupportedCapabilityError(
                f"tensor parallelism is implemented for the dense, Qwen3.5 and Gemma 4 "
                f"families; got {type(model).__name__}. Serve it on one device with "
                f"BlockProducer"
            )
        model = model.for_mesh()  # the Pallas kernels are single-device custom calls
        self.mesh = mesh
        params = shard_params(_mesh_layout(model, params, mesh), mesh, model.config)
        if ep_size(mesh) > 1:
            model = dataclasses.replace(model, expert_parallel=ExpertParallel(mesh, EP))
        super().__init__(model, params, capacity=capacity, width=width,
                         steps_per_call=steps_per_call, donate=donate)
        # Every process of a multi-host run must stamp the same identity into its states.
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            self.identity = int(multihost_utils.broadcast_one_to_all(np.uint32(self.identity)))
        layout = jax.eval_shape(
            lambda: BlockState(cache=model.init_cache(capacity), fed=FedRecord.empty(capacity))
        )
        self._shardings = state_shardings(mesh, model.config, layout)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._program = pinned_program(
            model, donate,
            (buffers_only(self._shardings), by_value(self._shardings), self._replicated),
        )
        self._init = jax.jit(
            lambda owner: BlockState(cache=model.init_cache(capacity),
                                     fed=FedRecord.empty(capacity, owner)),
            out_shardings=self._shardings,
        )
        self._idle = self._on_mesh(self._idle)

    @property
    def tp(self) -> int:
        """Devices the model is split over."""
        return tp_size(self.mesh)

    def init_state(self) -> BlockState:
        return self._init(self._on_mesh(jnp.uint32(self.identity)))

    def _on_mesh(self, tree: Any) -> Any:
        """``tree`` replicated on the mesh. In a multi-host run every input of a program must
        be a global array; the host copy each process holds is the same everywhere."""
        if jax.process_count() == 1:
            return jax.device_put(tree, self._replicated)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._replicated, np.asarray(x))
            if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            else jax.random.wrap_key_data(self._on_mesh(jax.random.key_data(x)),
                                          impl=jax.random.key_impl(x)),
            tree,
        )

    def _call(
        self, state: BlockState, plan: Any, control: Any, n_steps: int,
        last_row_head: bool = False, draw: str = "any", max_keys: int | None = None,
    ) -> tuple[StepOutput, BlockState]:
        bare, held = without_auxiliary(state)
        # A state moved on the host (rewind, rollback) may come back on other shardings; the
        # program must see the ones it was compiled for.
        bare = jax.device_put(bare, self._shardings)
        plan, control, steps = self._on_mesh((plan, control, program_steps(n_steps)))
        buffers, values, out = self._program(
            self.params, buffers_only(bare), by_value(bare), plan, control, steps,
            **program_statics(last_row_head, draw, max_keys),
        )
        return out, with_auxiliary(merge_parts(buffers, values), held)
