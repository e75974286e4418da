"""Mixture-of-experts layers shared by the families: a softmax top-k router (and Gemma 4's
scaled one, :func:`scaled_router`), the routed experts' gated MLPs over stacked expert
weights, and the Qwen-style block around them (with Qwen3-Next's and Qwen3.5-MoE's
sigmoid-gated shared expert).

Expert weights are stacked on a leading expert axis, ``[in, out]`` like every other matrix:
``gate`` and ``up`` ``[E, D, F]``, ``down`` ``[E, F, D]`` (a family with stacked layers puts
its layer axis in front). Any of them may be a
:class:`~turbospark_jax.quant.weights.QuantizedWeight` of the same leaf shape. Gemma 4's
checkpoints fuse gate and up and keep ``[out, in]``; :func:`fused_routed_experts` multiplies
by them as stored.

Exactness: a token's output never depends on the tokens beside it. The routed experts'
products run grouped by expert in tiles of one fixed shape
(:mod:`~turbospark_jax.kernels.grouped`): a block's selections (a row and one of its
experts) are sorted by expert into tiles that each hold one expert's selections, and every
tile multiplies by its expert's matrices in products whose shape never follows the row
count, so a selection's bits depend on its row and its expert alone, not on which other
tokens (and experts) a chunk, a verify block or a batch holds. Every width takes that path,
a one-row decode step included (``k`` tiles of one live selection, reading its ``k``
experts' matrices and no others), so decode and prefill compute a token alike. The ``k``
outputs of a row are then weighed and added in the order of their expert index. Under a
row-invariant kernel plan the rest of the block (router product, softmax, top-k, the
weighted sum, the shared expert) runs in the fixed-shape row tiles of
:func:`~turbospark_jax.kernels.rowinv.row_tiled`, so programs of different widths agree bit
for bit; under XLA's own kernels that part runs on the rows as they come (exact at one
program width, like the rest of such a model). The plan picks the grouped products' form
(:func:`~turbospark_jax.kernels.plan.grouped_impl`): the Pallas kernels where the GPU's
kernels run, the XLA loop over tiles elsewhere.

Expert parallelism (:class:`ExpertParallel`): the stacks split on their expert axis over a
mesh axis, each device holding ``E / n`` whole experts, and every routed form takes a
``placement`` that runs its per-selection products where the experts live
(:func:`expert_outputs`). The result is bitwise the one-device result; that function says
why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.kernels.grouped import expert_mlp
from turbospark_jax.kernels.layers import rms_norm
from turbospark_jax.kernels.rowinv import DOT_MIN_TILES, MIN_TILES, row_tiled
from turbospark_jax.quant.weights import as_array

Activation = Callable[[jax.Array], jax.Array]


def sparse_layers(num_experts: int, mlp_only_layers: Any, decoder_sparse_step: int,
                  num_hidden_layers: int) -> tuple[bool, ...]:
    """Whether each layer's MLP is a mixture of experts, by the rule the Qwen MoE configs
    share (transformers'): experts at all, the layer not listed as MLP-only, and a multiple of
    the sparse step."""
    return tuple(num_experts > 0 and i not in mlp_only_layers
                 and (i + 1) % decoder_sparse_step == 0 for i in range(num_hidden_layers))


def silu(x: jax.Array) -> jax.Array:
    """SiLU computed in float32 and rounded once to ``x.dtype`` (as torch does for 16-bit
    inputs)."""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU's tanh approximation in float32, rounded once to ``x.dtype``."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a router picks a token's experts. Frozen and hashable (static under ``jit``).

    Attributes:
      num_experts: experts in each MoE layer (``E``).
      top_k: experts each token runs (``k``).
      normalize: divide the ``k`` chosen probabilities by their sum (Qwen's
        ``norm_topk_prob``; Gemma 4 always does).
    """

    num_experts: int
    top_k: int
    normalize: bool

    def __post_init__(self) -> None:
        if self.num_experts <= 0:
            raise ModelLoadError(f"num_experts must be positive, got {self.num_experts}")
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok must be in 1..num_experts "
                                 f"({self.num_experts}), got {self.top_k}")


def top_k_softmax(logits: jax.Array, routing: Routing) -> tuple[jax.Array, jax.Array]:
    """A router's choice from its logits ``[T, E]``: the softmax (in float32) over the
    experts, its ``k`` largest probabilities and their experts, renormalised to sum to one
    when ``routing.normalize``.

    Returns:
      ``(weights, experts)``: float32 ``[T, k]`` and int32 ``[T, k]``, largest first.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, routing.top_k)
    if routing.normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, gate: Any, up: Any,
                   down: Any, act: Activation = silu,
                   placement: ExpertParallel | None = None, *, impl: str = "xla",
                   live: jax.Array | None = None) -> jax.Array:
    """The routed experts' gated MLPs of rows ``x [T, D]``, weighted and summed:
    ``sum_j weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))`` over row ``t``'s experts
    ``e = experts[t, j]``.

    The products run grouped by expert (:func:`selection_outputs`); the ``k`` terms are then
    added in the order of their expert index, in ``x.dtype``, as the reference's loop over
    experts adds them.

    Args:
      x: ``[T, D]`` rows (already normed).
      weights: ``[T, k]`` routing weights, any float dtype (rounded to ``x.dtype`` before
        they scale the terms).
      experts: int ``[T, k]`` expert indices.
      gate, up: ``[E, D, F]``; down: ``[E, F, D]`` (plain or quantized).
      act: the gate's activation.
      placement: the stacks split over a mesh axis (expert parallelism), or None: on
        every device whole (or split as ``jit`` places them).
      impl: the grouped products' form (:func:`~turbospark_jax.kernels.grouped.expert_mlp`).
      live: bool ``[T]``, the rows that are not padding (None: all): a padding row's
        selections read no weights and its output is zeros.

    Returns:
      ``[T, D]`` in ``x.dtype``.
    """
    y = selection_outputs(x, experts, (gate, up, down), act, placement=placement, impl=impl,
                          live=live)
    return combine_terms(y, weights, experts)


def fused_routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array,
                         gate_up: jax.Array, down: jax.Array,
                         act: Activation = gelu_tanh,
                         placement: ExpertParallel | None = None, *, impl: str = "xla",
                         live: jax.Array | None = None) -> jax.Array:
    """:func:`routed_experts` over expert stacks kept as a checkpoint that fuses them stores
    them (Gemma 4): ``gate_up [E, 2F, D]`` (the gate's ``F`` outputs, then the up
    projection's) and ``down [E, D, F]``, each ``[out, in]``. The float32 routing weights
    scale each term in float32, which is rounded once to ``x.dtype``, as the reference's
    float32 weights promote the product.

    Returns:
      ``[T, D]`` in ``x.dtype``.
    """
    y = selection_outputs(x, experts, (gate_up, None, down), act, nk=True,
                          placement=placement, impl=impl, live=live)
    return combine_terms(y, weights, experts, scale_in_float32=True)


def selection_outputs(x: jax.Array, experts: jax.Array, stacks: tuple[Any, Any, Any],
                      act: Activation, *, nk: bool = False,
                      placement: ExpertParallel | None = None, impl: str = "xla",
                      live: jax.Array | None = None) -> jax.Array:
    """Each selection's expert output ``[T, k, D]`` (unweighted), grouped by expert
    (:func:`~turbospark_jax.kernels.grouped.expert_mlp`; ``stacks`` is its ``(gate, up,
    down)``, ``up`` None for a fused stack), on one device or where the experts live
    (:func:`expert_outputs`). ``live``: bool ``[T]``; a padding row's selections take no
    tile (zeros)."""
    if live is not None:
        experts = jnp.where(live[:, None], experts, -1)
    gate, up, down = stacks

    def terms(rows: jax.Array, chosen: jax.Array, g: Any, d: Any, *u: Any) -> jax.Array:
        return expert_mlp(rows, chosen, g, u[0] if u else None, d, act, nk=nk, impl=impl)

    held = (gate, down) if up is None else (gate, down, up)
    return expert_outputs(terms, x, experts, held, placement)


def combine_terms(y: jax.Array, weights: jax.Array, experts: jax.Array,
                  scale_in_float32: bool = False) -> jax.Array:
    """``sum_j weights[:, j] * y[:, j]`` over the selections of each row (``y [T, k, D]``),
    added in the order of their expert index, in ``y.dtype``. The weights are rounded to
    ``y.dtype`` before they scale (Qwen), or with ``scale_in_float32`` scale in float32 and
    each term is rounded once (Gemma 4)."""
    order = jnp.argsort(experts, axis=-1)
    weights = jnp.take_along_axis(weights, order, axis=-1)
    y = jnp.take_along_axis(y, order[..., None], axis=1)
    if scale_in_float32:
        terms = (y.astype(jnp.float32) * weights.astype(jnp.float32)[..., None]).astype(y.dtype)
        return _weighted_sum(terms, None)
    return _weighted_sum(y, weights.astype(y.dtype))


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Expert parallelism: every expert stack (leading axis ``E``, after any layer axis) is
    split over the mesh axis ``axis`` of ``mesh``, so the device at index ``i`` of that axis
    holds experts ``i * E / n`` to ``(i + 1) * E / n - 1`` whole. Frozen and hashable (a
    model field, static under ``jit``). :func:`~turbospark_jax.parallel.tp_specs.check_divisible`
    refuses a count of experts the axis does not divide.

    Raises:
      BadInputError: ``mesh`` is not a ``jax.sharding.Mesh`` or has no axis ``axis``.
    """

    mesh: Mesh
    axis: str

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh) or self.axis not in self.mesh.axis_names:
            raise BadInputError(f"expert parallelism needs a jax.sharding.Mesh with an axis "
                                f"{self.axis!r}; got {self.mesh!r}")


def _shard_map(fn: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any) -> Any:
    """``shard_map`` under its public name (``jax.shard_map``) or, on a JAX without it,
    the experimental one."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map  # pragma: no cover (older JAX)

    return shard_map(fn, mesh, in_specs=in_specs, out_specs=out_specs)  # pragma: no cover


def expert_outputs(terms: Callable[..., jax.Array], x: jax.Array, experts: jax.Array,
                   stacks: tuple[Any, ...], placement: ExpertParallel | None) -> jax.Array:
    """``terms(x, experts, *stacks)``: each selection's expert output ``[T, k, D]``, computed
    on one device (``placement`` None) or where each expert lives.

    Under ``placement`` the rows ``x``, the choices ``experts`` and the result are replicated
    over the mesh and the stacks split on their expert axis. Each device runs ``terms`` on
    its local stacks, with every selection's expert index shifted to its local one (a
    selection of an expert held elsewhere gets index ``-1``, which ``terms`` skips: it takes
    no tile and reads nothing), keeps the selections whose expert it holds, writes zeros
    elsewhere, and one all-reduce over the axis adds the devices' ``[T, k, D]``.

    Why the result is bitwise the one-device result:

    * a kept selection's arithmetic is the one-device arithmetic: the same row times the same
      expert's matrices (the local stack holds them unchanged) in tiles of the same fixed
      shape, whose rows do not depend on their tile-mates
      (:mod:`~turbospark_jax.kernels.grouped`), so grouping fewer selections a device
      changes no bit;
    * each selection is kept on exactly one device, and the all-reduce adds the bit patterns
      as unsigned integers: one pattern plus zeros is that pattern, in any order the
      collective adds them (a float sum would turn an expert's ``-0.0`` into ``+0.0``);
    * the caller then weighs and adds the ``k`` outputs of a row as on one device.

    Each device groups only the selections of the experts it holds, so its tiles, its
    weight reads and its compute are its share; the weights split ``n`` ways and the
    activations that move are ``[T, k, D]`` a layer, never a weight.
    """
    if placement is None:
        return terms(x, experts, *stacks)

    def local(rows: jax.Array, chosen: jax.Array, *parts: Any) -> jax.Array:
        held = jax.tree.leaves(parts[0])[0].shape[0]  # experts on this device
        first = jax.lax.axis_index(placement.axis) * held
        index = chosen - first
        owned = (index >= 0) & (index < held)
        y = terms(rows, jnp.where(owned, index, -1), *parts)
        return _owner_sum(y, owned, placement.axis)

    split = PartitionSpec(placement.axis)
    whole = PartitionSpec()
    run = _shard_map(local, placement.mesh, (whole, whole, *(split,) * len(stacks)), whole)
    return run(x, experts, *stacks)


def _owner_sum(y: jax.Array, owned: jax.Array, axis: str) -> jax.Array:
    """The all-reduce over ``axis`` of ``y [T, k, D]`` where ``owned [T, k]`` and zero
    elsewhere, adding bit patterns as unsigned integers (exact: one operand a selection is
    nonzero). Two 16-bit values travel as one 32-bit word, so a bfloat16 ``y`` moves as many
    bytes as it holds (an odd width widens each to 32 bits)."""
    shape, dtype = y.shape, y.dtype
    if dtype.itemsize == 2 and shape[-1] % 2 == 0:
        bits = jax.lax.bitcast_convert_type(y.reshape(*shape[:-1], -1, 2), jnp.uint32)
    elif dtype.itemsize == 2:
        bits = jax.lax.bitcast_convert_type(y, jnp.uint16).astype(jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(y, np.dtype(f"uint{8 * dtype.itemsize}"))
    bits = jax.lax.psum(jnp.where(owned[..., None], bits, jnp.zeros((), bits.dtype)), axis)
    if dtype.itemsize == 2 and shape[-1] % 2 == 0:
        return jax.lax.bitcast_convert_type(bits, dtype).reshape(shape)
    if dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), dtype)
    return jax.lax.bitcast_convert_type(bits, dtype)


def _weighted_sum(y: jax.Array, weights: jax.Array | None) -> jax.Array:
    """``sum_j y[:, j] * weights[:, j]`` (``y [T, k, D]``), added left to right in
    ``y.dtype``; ``weights`` None when the terms are weighted already."""
    def term(j: int) -> jax.Array:
        return y[:, j] if weights is None else y[:, j] * weights[:, j:j + 1]

    out = term(0)
    for j in range(1, y.shape[1]):
        out = out + term(j)
    return out


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """``x [T, D]`` times a router stored as the file keeps it, ``[E, D]``: ``[T, E]`` in
    ``x.dtype`` (float32 sums)."""
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jax.lax.dot_general(x, as_array(router, x.dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32,
                               precision=precision).astype(x.dtype)


def scaled_router(x: jax.Array, scale: jax.Array, proj: jax.Array, per_expert_scale: jax.Array,
                  routing: Routing, eps: float) -> tuple[jax.Array, jax.Array]:
    """Gemma 4's router of rows ``x [T, D]`` (the layer's residual stream, not normed): a
    scale-free RMSNorm, times ``scale [D]`` and ``D ** -0.5``, the logits over ``proj [E,
    D]``, the softmax top-k renormalised, then each chosen weight times its expert's
    ``per_expert_scale [E]``.

    Returns:
      ``(weights, experts)``: float32 ``[T, k]`` and int32 ``[T, k]``.
    """
    h = rms_norm(x, None, eps) * scale
    # a Python scalar multiplies in float32 and rounds once, as torch's does
    h = (h.astype(jnp.float32) * jnp.float32(x.shape[-1] ** -0.5)).astype(x.dtype)
    weights, experts = top_k_softmax(router_logits(h, proj), routing)
    return weights * per_expert_scale[experts].astype(jnp.float32), experts


def _dense_dot(a: jax.Array, w: Any) -> jax.Array:
    """``a [T, K] @ w [K, N]`` (plain or quantized) with float32 sums, rounded to
    ``a.dtype``."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.matmul(a, as_array(w, a.dtype), preferred_element_type=jnp.float32,
                      precision=precision).astype(a.dtype)


def _dense_swiglu(x: jax.Array, gate: Any, up: Any, down: Any, act: Activation) -> jax.Array:
    return _dense_dot(act(_dense_dot(x, gate)) * _dense_dot(x, up), down)


def moe_block(x: jax.Array, weights: Mapping[str, Any], routing: Routing, *,
              row_invariant: bool, act: Activation = silu,
              placement: ExpertParallel | None = None, impl: str = "xla",
              live: jax.Array | None = None) -> jax.Array:
    """The Qwen-style sparse MLP of rows ``x [T, D]`` (normed): the router's softmax top-k
    over ``weights["router"]`` (``[E, D]``), the routed experts (``expert_gate``,
    ``expert_up`` ``[E, D, F]``, ``expert_down`` ``[E, F, D]``), and, when ``weights`` holds
    ``shared_gate`` (``[D, S]``), ``shared_up``, ``shared_down`` and ``shared_expert_gate``
    (``[D, 1]``), a shared expert that every row runs, scaled by the sigmoid of its gate.

    Args:
      x: ``[T, D]``.
      weights: the layer's MoE leaves (above).
      routing: the router's rule.
      row_invariant: run the router, the weighted sum and the shared expert in fixed-shape
        row tiles, so a row's bits do not depend on the number of rows in the call (the
        routed experts' grouped tiles are of a fixed shape under any plan).
      act: the experts' activation.
      placement: the expert stacks split over a mesh axis (:func:`expert_outputs`), or
        None.
      impl: the grouped products' form (:func:`~turbospark_jax.kernels.plan.grouped_impl`
        gives a plan's).
      live: bool ``[T]``, the rows that are not padding (None: all); a padding row's
        selections read no expert weights.

    Returns:
      ``[T, D]`` in ``x.dtype``.
    """
    def route(rows: jax.Array, router: jax.Array) -> tuple[jax.Array, jax.Array]:
        return top_k_softmax(router_logits(rows, router), routing)

    def finish(rows: jax.Array, probs: jax.Array, experts: jax.Array, y: jax.Array,
               w: Mapping[str, Any]) -> jax.Array:
        out = combine_terms(y, probs, experts)
        if "shared_gate" in w:
            shared = _dense_swiglu(rows, w["shared_gate"], w["shared_up"], w["shared_down"],
                                   act)
            gate = jax.nn.sigmoid(_dense_dot(rows, w["shared_expert_gate"]).astype(
                jnp.float32)).astype(rows.dtype)
            out = out + gate * shared
        return out

    probs, experts = per_row(route, x, shared=weights["router"], row_invariant=row_invariant)
    y = selection_outputs(x, experts, (weights["expert_gate"], weights["expert_up"],
                                       weights["expert_down"]), act, placement=placement,
                          impl=impl, live=live)
    # Products and elementwise work only: a one-row call runs one tile (see per_row)
    return per_row(finish, x, probs, experts, y, row_invariant=row_invariant,
                   products_only=True,
                   shared={k: v for k, v in weights.items() if k in SHARED_LEAVES})


def per_row(fn: Callable[..., Any], *rows: jax.Array, shared: Any = None,
            row_invariant: bool, products_only: bool = False) -> Any:
    """``fn(*rows, shared)`` of row-local ``fn``: in the fixed-shape tiles of
    :func:`~turbospark_jax.kernels.rowinv.row_tiled` when ``row_invariant``, else on the
    rows as they come. ``products_only``: ``fn`` holds matrix products and elementwise work,
    no reduction of its own, so one tile suffices, as for a product
    (:data:`~turbospark_jax.kernels.rowinv.DOT_MIN_TILES`): a decode step then weighs its
    experts' outputs and runs the shared expert in one tile, not two."""
    if row_invariant:
        return row_tiled(fn, *rows, shared=(shared,),
                         min_tiles=DOT_MIN_TILES if products_only else MIN_TILES)
    return fn(*rows, shared)


#: The leaves :func:`moe_block` reads, by whether the block has a shared expert.
ROUTED_LEAVES = ("router", "expert_gate", "expert_up", "expert_down")
SHARED_LEAVES = ("shared_gate", "shared_up", "shared_down", "shared_expert_gate")


def moe_leaves(layer_params: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE leaves of one layer's params (those :func:`moe_block` reads)."""
    return {k: v for k, v in layer_params.items() if k in ROUTED_LEAVES + SHARED_LEAVES}
