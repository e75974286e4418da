"""The RMSNorm arithmetic that runs inside other kernels: a product's prologue, or a kernel of
16-row tiles, with the same bits either way.

A decode step's norms are launch-bound kernels of their own (about 2 us each, two a layer).
Moving a norm into the next product needs its result to be the same whether the product runs
on one row (the matrix-vector kernel, which normalises as it loads ``x``) or on a prefill's
thousands (a separate norm before the matrix kernel, which would be wasted work inside it:
each of its column programs would normalise all of its rows again). The elementwise steps
are the same in any kernel; the sum of squares is a reduction, and a Triton reduction's tree
follows the layout of the program that runs it. So the sum here takes no reduction at all:

* the squares of a row's K tiles are added elementwise, tile after tile, into one
  ``[rows, k_tile]`` float32 tile (an order fixed by the tiles, not by any layout);
* that tile's ``k_tile`` columns are summed by the tensor cores, as a product with a ones
  matrix of a fixed ``[16, k_tile] @ [k_tile, 16]`` shape: the row-invariant kernels'
  own tile product, whose per-element order is the hardware's. The float32 tile goes in as
  three bfloat16 pieces that add up to it exactly (8 + 8 + 8 significant bits cover float32's
  24), so no bit of it is lost to the bfloat16 operands.

The squares of bfloat16 or float16 values are exact in float32, so a compiler that contracts
a square and an add into one FMA changes nothing; this arithmetic is for those dtypes only
(a float32 model keeps the separate norm kernel).

Everything else is :func:`~turbospark_jax.models.pallas_row_norm.add_parts_rms_norm`'s
arithmetic: the delta's float32 partial sums added in order and rounded once, the residual
added in float32 and rounded, the row normalised in float32 and rounded, then scaled by the
weight in one rounding. Only the sum of squares is summed in another order, so the two norms
agree closely, not bitwise; a model uses one of them for a given norm at every width.

The functions here are kernel bodies' pieces (they take refs); the kernels that call them are
:func:`~turbospark_jax.models.pallas_row_norm.add_parts_norm_tiles` and the prologue forms of
:func:`~turbospark_jax.models.rowinv.rowinv_norm_matvec` and
:func:`~turbospark_jax.models.rowinv.rowinv_norm_swiglu`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

#: Rows of every tile the arithmetic runs on (the tensor cores' smallest product tile).
ROW_TILE = 16
#: Columns of a K tile, as the row-invariant products' :class:`~turbospark_jax.models.rowinv.
#: Schedule` walks them.
K_TILE = 128
#: Columns of the ones matrix; every column of the product holds the same sum.
SUM_COLUMNS = 16
#: The activation dtypes this arithmetic takes (their squares are exact in float32).
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _columns(tile: Any) -> Any:
    return pl.ds(pl.multiple_of(tile * K_TILE, K_TILE), K_TILE)


def _load(ref: Any, index: tuple[Any, ...], live: jax.Array | None) -> jax.Array:
    if live is None:
        return ref[index]
    return plgpu.load(ref.at[index], mask=live, other=0)


def residual_tile(r_ref: Any, p_ref: Any, tile: Any, live: jax.Array | None) -> jax.Array:
    """``h = residual + delta`` on K tile ``tile`` of the row tile, in the residual's dtype:
    the delta's float32 partial sums (``p_ref`` ``[S, rows, K]``) added in order and rounded
    once, then added to the residual in float32 and rounded again (the correctly rounded
    sum). Rows outside ``live`` are not read and come out zero."""
    at = _columns(tile)
    dtype = r_ref.dtype
    # (an array index: the interpreter's masked load takes no Python int)
    part = lambda s: _load(p_ref, (jnp.int32(s), slice(None), at), live)  # noqa: E731
    total = part(0)
    for s in range(1, p_ref.shape[0]):
        total = total + part(s)
    residual = _load(r_ref, (slice(None), at), live)
    return (residual.astype(jnp.float32) + total.astype(dtype).astype(jnp.float32)).astype(dtype)


def _ones_sum(squares: jax.Array) -> jax.Array:
    """The row sums of a float32 ``[rows, K_TILE]`` tile by the tensor cores: three bfloat16
    pieces that add up to it exactly (each the rounding of what the ones before it left),
    each multiplied by a ones matrix, in that order. ``[rows]`` float32."""
    ones = jnp.ones((K_TILE, SUM_COLUMNS), jnp.bfloat16)
    first = squares.astype(jnp.bfloat16)
    rest = squares - first.astype(jnp.float32)
    second = rest.astype(jnp.bfloat16)
    third = (rest - second.astype(jnp.float32)).astype(jnp.bfloat16)
    dot = lambda piece: jnp.dot(piece, ones, preferred_element_type=jnp.float32)  # noqa: E731
    sums = dot(first) + dot(second) + dot(third)
    return jnp.max(sums, axis=1)  # its columns are equal: a maximum picks one, in any order


def inverse_rms(r_ref: Any, p_ref: Any, *, tiles: int, d: int, eps: float,
                live: jax.Array | None, store_h: Any = None) -> jax.Array:
    """``1 / sqrt(mean(h^2) + eps)`` of each row of the row tile, ``[rows, 1]`` float32, over
    its ``tiles`` K tiles (zero columns past ``d`` add nothing; the mean divides by ``d``).
    ``store_h(tile, h)``: called with each tile's ``h``, for the kernel that writes it out."""
    rows = r_ref.shape[0]

    def one(tile: Any, squares: jax.Array) -> jax.Array:
        h = residual_tile(r_ref, p_ref, tile, live)
        if store_h is not None:
            store_h(tile, h)
        h32 = h.astype(jnp.float32)
        return squares + h32 * h32

    squares = jax.lax.fori_loop(0, tiles, one, jnp.zeros((rows, K_TILE), jnp.float32))
    return jax.lax.rsqrt(_ones_sum(squares) / d + eps)[:, None]


def normed_tile(h: jax.Array, inverse: jax.Array, w_ref: Any, tile: Any) -> jax.Array:
    """The normed rows of K tile ``tile``: ``h`` times its row's ``inverse`` in float32,
    rounded to ``h``'s dtype, then times the norm's weight in one rounding (two 16-bit values
    multiply exactly in float32)."""
    dtype = h.dtype
    normed = (h.astype(jnp.float32) * inverse).astype(dtype)
    weight = w_ref[_columns(tile)].astype(jnp.float32)[None, :]
    return (weight * normed.astype(jnp.float32)).astype(dtype)


def live_rows(rows: int | None, program_axis: int = 0) -> jax.Array | None:
    """bool ``[ROW_TILE, K_TILE]``: which rows of this program's row tile (grid axis
    ``program_axis``) the call has, its first ``rows``; None when it fills every tile."""
    if rows is None:
        return None
    shape = (ROW_TILE, K_TILE)
    row = pl.program_id(program_axis) * ROW_TILE + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return row < rows


def store_tile(ref: Any, tile: Any, value: jax.Array, live: jax.Array | None) -> None:
    """Write K tile ``tile`` of a ``[rows, K]`` output block, its live rows only."""
    at = _columns(tile)
    if live is None:
        ref[:, at] = value
    else:
        plgpu.store(ref.at[:, at], value, mask=live)
