"""Grouped expert products: the routed experts' gated MLPs of a block's rows, the selections
that share an expert multiplied by its weights together.

A block of ``T`` rows choosing ``k`` of ``E`` experts each makes ``T * k`` selections (a row
and one of its experts). Multiplying each selection by its own gathered matrices reads
``T * k`` expert matrices; grouping reads each chosen expert about once per ``tile_rows``
selections of it.

Layout (:func:`group`): the selections are sorted by expert (stably) and laid out in tiles of
``tile_rows`` slots, each tile holding one expert's selections only (an expert's run is padded
to whole tiles with empty slots). The tile count has a static bound,
``ceil(T * k / tile_rows) + min(E, T * k)``; the tiles past the used count are skipped and
read no weights. A selection whose expert is outside ``0..E-1`` (a padding row's, or one of
an expert another device holds) takes no slot and comes out as zeros.

Exactness: every tile runs the same products of one shape, ``[tile_rows, D] @ [D, F]`` for
gate and up, the activation, ``[tile_rows, F] @ [F, D]`` for down, with float32 sums over
``K`` in one fixed order. A fixed-shape product computes each of its rows alike, whatever the
other rows hold and wherever the row sits (the fact the row tiles of
:func:`~turbospark_jax.kernels.rowinv.row_tiled` rest on; the tests check it for these
tiles), so a selection's bits depend on its row and its expert alone: never on its tile-mates,
the tile count or the block's width. A one-row decode step is ``k`` tiles of one live
selection each, reading the same expert matrices as a gather of its ``k`` experts would.

Forms:

* :func:`expert_mlp` with ``impl="xla"``: a loop over the used tiles, each a fixed-shape dot
  per weight between optimization barriers (so XLA compiles the tile body alike in every
  program). Quantized stacks dequantize the tile's expert only. This is what the CPU runs.
* ``impl="pallas"`` (``"interpret"`` in the Pallas interpreter, for CPU tests): two Triton
  kernels over a grid of tiles by output column blocks, the tile's expert read from an int
  array, the unused tiles' programs exiting before any load. The first computes the gated
  hidden rows, the second the down product. Block sizes (:class:`GroupedTiles`) are fixed,
  so the K order never follows ``T``. Quantized stacks, and widths the blocks do not divide,
  take the XLA form (dequantizing in the kernel's tiles, as the row-invariant products do, is
  left for when the grouped kernel has GPU figures).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.rowinv import compiler_params, tile_dot_for
from turbospark_jax.quant.weights import QuantizedWeight, as_array

Activation = Callable[[jax.Array], jax.Array]

#: Selections per tile of the XLA form.
XLA_TILE_ROWS = 8
#: Values of ``impl``.
IMPLS = ("xla", "pallas", "interpret")


def _power_of_two(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """Block sizes and Triton settings of the Pallas form. They fix each selection's
    arithmetic (``bk`` the K order, ``rows`` the tile's product shape), so they are constants
    of a model's program, never chosen by the row count.

    Attributes:
      rows: selections per tile (Triton's smallest product tile is 16).
      bn: output columns per program.
      bk: K columns per step of the float32 sum.
      warps, stages: Triton's ``num_warps`` and ``num_stages``.
    """

    rows: int = 16
    bn: int = 64
    bk: int = 64
    warps: int = 4
    stages: int = 3

    def __post_init__(self) -> None:
        for name in ("rows", "bn", "bk"):
            if not _power_of_two(getattr(self, name)):
                raise BadInputError(f"{name} must be a power of two >= 16, "
                                    f"got {getattr(self, name)}")

    def fits(self, *widths: int) -> bool:
        """Whether every width (``D``, ``F``) is a whole number of ``bn`` and ``bk``
        blocks."""
        return all(w % self.bn == 0 and w % self.bk == 0 for w in widths)


#: The Pallas form's default blocks.
GROUPED_TILES = GroupedTiles()


class Grouping(NamedTuple):
    """Where each selection sits among the tiles (:func:`group`).

    Attributes:
      slot: int32 ``[T * k]``, each selection's slot (tile * rows + position), or the slot
        count for a selection that takes none.
      source: int32 ``[tiles * rows]``, the row each slot reads (``T``, a zero row, where
        empty).
      tile_expert: int32 ``[tiles]``, each tile's expert (an unused tile's is in range and
        never read).
      used: int32 ``[]``, the tiles in use, the first ``used`` of them.
    """

    slot: jax.Array
    source: jax.Array
    tile_expert: jax.Array
    used: jax.Array


def tile_bound(selections: int, num_experts: int, tile_rows: int) -> int:
    """The most tiles ``selections`` selections over ``num_experts`` experts can fill: each
    expert's last tile may be partly empty."""
    return -(-selections // tile_rows) + min(num_experts, selections)


def group(experts: jax.Array, num_experts: int, tile_rows: int) -> Grouping:
    """The tile layout of the selections ``experts [T, k]`` (see the module docstring): an
    expert outside ``0..num_experts-1`` marks a selection that takes no slot."""
    t, k = experts.shape
    count = t * k
    tiles = tile_bound(count, num_experts, tile_rows)
    flat = experts.reshape(-1).astype(jnp.int32)
    key = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # sorted position -> selection
    sizes = jnp.zeros(num_experts + 1, jnp.int32).at[key].add(1)[:num_experts]
    per = -(-sizes // tile_rows)  # tiles of each expert
    ends = jnp.cumsum(per)
    first_tile = ends - per
    first_sorted = jnp.cumsum(sizes) - sizes
    ranked = key[order]
    taken = ranked < num_experts
    expert = jnp.minimum(ranked, num_experts - 1)
    rank = jnp.arange(count, dtype=jnp.int32) - first_sorted[expert]
    sorted_slot = jnp.where(taken, first_tile[expert] * tile_rows + rank, tiles * tile_rows)
    slot = jnp.zeros(count, jnp.int32).at[order].set(sorted_slot)
    source = jnp.full(tiles * tile_rows, t, jnp.int32).at[sorted_slot].set(
        order // k, mode="drop")
    tile_expert = jnp.minimum(
        jnp.searchsorted(ends, jnp.arange(tiles, dtype=jnp.int32), side="right"),
        num_experts - 1).astype(jnp.int32)
    return Grouping(slot, source, tile_expert, ends[-1].astype(jnp.int32))


def _dot(a: jax.Array, w: jax.Array, nk: bool) -> jax.Array:
    """``a [R, K]`` times ``w [K, N]`` (``[N, K]`` when ``nk``), float32 sums rounded to
    ``a.dtype``."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (1 if nk else 0,)), ((), ()))
    return jax.lax.dot_general(a, w, dims, preferred_element_type=jnp.float32,
                               precision=precision).astype(a.dtype)


def _tile_mlp(x: jax.Array, gate: jax.Array, up: jax.Array | None, down: jax.Array,
              act: Activation, nk: bool) -> jax.Array:
    """One tile's gated MLP. ``up`` None: ``gate`` holds the gate's ``F`` outputs then the
    up projection's (``[2F, D]``, a fused checkpoint's layout), multiplied as one."""
    if up is None:
        gu = _dot(x, gate, nk)
        half = gu.shape[-1] // 2
        hidden = act(gu[:, :half]) * gu[:, half:]
    else:
        hidden = act(_dot(x, gate, nk)) * _dot(x, up, nk)
    return _dot(hidden, down, nk)


def _expert(w: Any, e: jax.Array, dtype: Any) -> jax.Array:
    """Expert ``e``'s matrix of a stack (plain or quantized) in ``dtype``: one expert read,
    dequantized alone."""
    if isinstance(w, QuantizedWeight):
        return as_array(w[e], dtype)
    return jax.lax.dynamic_index_in_dim(w, e, axis=0, keepdims=False).astype(dtype)


def _tiles_in(x: jax.Array, grouping: Grouping, tile_rows: int) -> jax.Array:
    """The slots' rows, ``[tiles, tile_rows, D]`` (empty slots zero)."""
    padded = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    return padded[grouping.source].reshape(-1, tile_rows, x.shape[1])


def _scatter_back(out: jax.Array, grouping: Grouping, k: int) -> jax.Array:
    """Each selection's result out of the tiles' ``[tiles * rows, D]``: ``[T, k, D]``, zeros
    for a selection without a slot."""
    y = jnp.take(out, grouping.slot, axis=0, mode="fill", fill_value=0)
    return y.reshape(-1, k, out.shape[-1])


def _xla(x: jax.Array, grouping: Grouping, gate: Any, up: Any, down: Any, act: Activation,
         nk: bool, tile_rows: int) -> jax.Array:
    """The XLA form's tiles: ``[tiles * tile_rows, D]``."""
    tiles_x = _tiles_in(x, grouping, tile_rows)
    width = down.shape[-2] if nk else down.shape[-1]

    def body(i: jax.Array, out: jax.Array) -> jax.Array:
        e = grouping.tile_expert[i]
        ws = tuple(None if w is None else _expert(w, e, x.dtype) for w in (gate, up, down))
        # the tile body alike in every program: no fusion reaches into or out of it
        rows, ws = jax.lax.optimization_barrier((tiles_x[i], ws))
        y = jax.lax.optimization_barrier(_tile_mlp(rows, *ws, act=act, nk=nk))
        return jax.lax.dynamic_update_index_in_dim(out, y, i, axis=0)

    start = _varying_like(jnp.zeros((tiles_x.shape[0], tile_rows, width), x.dtype),
                          (tiles_x, gate, up, down))
    out = jax.lax.fori_loop(0, grouping.used, body, start)
    return out.reshape(-1, width)


def _varying_like(a: jax.Array, operands: Any) -> jax.Array:
    """``a`` marked as varying over every manual mesh axis any of ``operands`` varies over
    (inside ``shard_map``, where a loop's carry must keep one type: the tiles' results vary
    as the local expert stacks do). Unchanged elsewhere."""
    axes: set[str] = set()
    for leaf in jax.tree.leaves(operands):
        aval = jax.typeof(leaf)
        manual = getattr(aval, "manual_axis_type", None)  # jax 0.10; older: ``vma``
        axes |= set(manual.varying if manual is not None else getattr(aval, "vma", ()))
    if not axes:
        return a
    return jax.lax.pcast(a, tuple(sorted(axes)), to="varying")


def expert_mlp(x: jax.Array, experts: jax.Array, gate: Any, up: Any, down: Any,
               act: Activation, *, nk: bool = False, impl: str = "xla",
               tiles: GroupedTiles = GROUPED_TILES) -> jax.Array:
    """Each selection's expert MLP, ``down_e(act(gate_e(x_t)) * up_e(x_t))``, grouped by
    expert (see the module docstring).

    Args:
      x: ``[T, D]`` rows.
      experts: int ``[T, k]``; an expert outside ``0..E-1`` marks a selection to skip (its
        result is zeros and it reads nothing).
      gate, up: ``[E, D, F]``; down: ``[E, F, D]`` (plain or quantized). With ``nk`` each is
        ``[E, out, in]`` as a checkpoint stores it, and ``up`` may be None where ``gate``
        holds gate and up fused (``[E, 2F, D]``: the gate's ``F`` outputs first).
      act: the gate's activation (float32 inside, rounded to ``x.dtype``).
      nk: the stacks are ``[E, out, in]``.
      impl: ``"xla"``, ``"pallas"`` or ``"interpret"`` (module docstring).
      tiles: the Pallas form's blocks.

    Returns:
      ``[T, k, D]`` in ``x.dtype``.

    Raises:
      BadInputError: ``impl`` unknown.
    """
    if impl not in IMPLS:
        raise BadInputError(f"impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    num_experts = jax.tree.leaves(gate)[0].shape[0]
    k = experts.shape[1]
    stacks = (gate, up, down)
    if impl != "xla" and _pallas_takes(x, stacks, nk, tiles):
        grouping = group(experts, num_experts, tiles.rows)
        out = _pallas(x, grouping, gate, up, down, act, nk, tiles, impl == "interpret")
    else:
        grouping = group(experts, num_experts, XLA_TILE_ROWS)
        out = _xla(x, grouping, gate, up, down, act, nk, XLA_TILE_ROWS)
    return _scatter_back(out, grouping, k)


def _pallas_takes(x: jax.Array, stacks: tuple[Any, ...], nk: bool, tiles: GroupedTiles) -> bool:
    """Whether the Pallas form takes these operands: plain stacks whose widths the blocks
    divide (a fused gate and up stack too)."""
    if any(isinstance(w, QuantizedWeight) for w in stacks):
        return False
    f = stacks[2].shape[-1] if nk else stacks[2].shape[-2]
    return tiles.fits(x.shape[1], f)


def _gated_kernel(used_ref: Any, expert_ref: Any, x_ref: Any, gate_ref: Any, up_ref: Any,
                  o_ref: Any, *, steps: int, bk: int, nk: bool, act: Activation,
                  tile_dot: Any, up_offset: int) -> None:
    """One tile's ``[rows, bn]`` block of ``act(x @ gate) * (x @ up)``: float32 sums over K
    in ``bk`` steps from zero, each product rounded to the rows' dtype, then gated.
    ``up_offset``: where the up projection's outputs start in its stack (a fused one's)."""
    tile = pl.program_id(0)
    bn = o_ref.shape[1]
    start = pl.multiple_of(pl.program_id(1) * bn, bn)
    columns, up_columns = pl.ds(start, bn), pl.ds(start + up_offset, bn)

    @pl.when(tile < used_ref[()])
    def _() -> None:
        e = expert_ref[tile]

        def step(i: Any, acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            at = pl.ds(pl.multiple_of(i * bk, bk), bk)
            rows = x_ref[:, at]
            g = gate_ref[e, columns, at] if nk else gate_ref[e, at, columns]
            u = up_ref[e, up_columns, at] if nk else up_ref[e, at, up_columns]
            return acc[0] + tile_dot(rows, g, nk), acc[1] + tile_dot(rows, u, nk)

        zeros = jnp.zeros(o_ref.shape, jnp.float32)
        g, u = jax.lax.fori_loop(0, steps, step, (zeros, zeros))
        dtype = o_ref.dtype
        o_ref[...] = act(g.astype(dtype)) * u.astype(dtype)


def _down_kernel(used_ref: Any, expert_ref: Any, h_ref: Any, down_ref: Any, o_ref: Any, *,
                 steps: int, bk: int, nk: bool, tile_dot: Any) -> None:
    """One tile's ``[rows, bn]`` block of ``hidden @ down``, summed as the gated kernel
    sums."""
    tile = pl.program_id(0)
    columns = pl.ds(pl.multiple_of(pl.program_id(1) * o_ref.shape[1], o_ref.shape[1]),
                    o_ref.shape[1])

    @pl.when(tile < used_ref[()])
    def _() -> None:
        e = expert_ref[tile]

        def step(i: Any, acc: jax.Array) -> jax.Array:
            at = pl.ds(pl.multiple_of(i * bk, bk), bk)
            w = down_ref[e, columns, at] if nk else down_ref[e, at, columns]
            return acc + tile_dot(h_ref[:, at], w, nk)

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


def _pallas(x: jax.Array, grouping: Grouping, gate: jax.Array, up: jax.Array,
            down: jax.Array, act: Activation, nk: bool, tiles: GroupedTiles,
            interpret: bool) -> jax.Array:
    """The Pallas form's tiles: ``[tiles * rows, D]``. An unused tile's rows are never
    written (nothing reads them)."""
    d = x.shape[1]
    f = down.shape[-1] if nk else down.shape[-2]
    rows = tiles.rows
    slots = grouping.source.shape[0]
    count = slots // rows
    tiles_x = _tiles_in(x, grouping, rows).reshape(slots, d)
    tile_dot = tile_dot_for(interpret)
    settings = compiler_params(interpret, tiles.warps, tiles.stages)
    whole = pl.BlockSpec()  # the stacks and the tile table, indexed in the kernel

    def call(kernel: Any, width: int, k_width: int, operand: jax.Array,
             stacks: tuple[jax.Array, ...], name: str) -> jax.Array:
        return pl.pallas_call(
            kernel,
            grid=(count, width // tiles.bn),
            in_specs=[whole, whole, pl.BlockSpec((rows, k_width), lambda t, j: (t, 0)),
                      *(whole,) * len(stacks)],
            out_specs=pl.BlockSpec((rows, tiles.bn), lambda t, j: (t, j)),
            out_shape=jax.ShapeDtypeStruct((slots, width), x.dtype),
            interpret=interpret,
            name=name,
            **settings,
        )(grouping.used, grouping.tile_expert, operand, *stacks)

    # a fused [E, 2F, D] stack is read twice, its up projection's rows from F on
    fused = up is None
    gated = functools.partial(_gated_kernel, steps=d // tiles.bk, bk=tiles.bk, nk=nk, act=act,
                              tile_dot=tile_dot, up_offset=f if fused else 0)
    hidden = call(gated, f, d, tiles_x, (gate, gate if fused else up), "grouped_gate_up")
    downed = functools.partial(_down_kernel, steps=f // tiles.bk, bk=tiles.bk, nk=nk,
                               tile_dot=tile_dot)
    return call(downed, d, f, hidden, (down,), "grouped_down")
