"""Quantized weights inside the row-invariant matrix-vector kernels: each weight tile is read at
its stored width and dequantized in registers, so a decode step streams the quantized bytes
only.

The matvec kernels (:mod:`~turbospark_jax.kernels.rowinv`) read a weight as blocks of ``[K
rows of a segment, bn columns]`` and step through them a ``k_tile`` of rows at a time. A
:class:`~turbospark_jax.quant.weights.QuantizedWeight` enters them as two or three operands
(the values, the scales and, for int4 with zero points, the zero points), each with a block
that covers the same rows and columns; :class:`QuantTile` turns one ``k_tile`` of them into
the tile the product multiplies by, with the arithmetic of
:func:`~turbospark_jax.quant.weights.dequantize` (float32, one rounding to the compute
dtype). A row's product is then bitwise the product with the dequantized matrix in memory,
which is what the wide kernels (a prefill's) multiply by.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from turbospark_jax.quant.weights import QuantizedWeight


def fits_tiles(w: QuantizedWeight, k_tile: int) -> bool:
    """Whether the matvec kernels read ``w`` in place: one scale row per output channel, or
    groups that tile a ``k_tile`` evenly."""
    return w.group == w.k or (w.group <= k_tile and k_tile % w.group == 0)


@dataclasses.dataclass(frozen=True)
class QuantLayout:
    """What a kernel needs to know, statically, about one quantized operand.

    Attributes:
      scheme: ``int8``, ``int4`` or ``fp8``.
      per_channel: one scale row for all of K (else one per group of ``group`` rows).
      group: rows per scale row.
      zero: whether zero points come with the scales.
      dtype: the dtype the tile dequantizes to.
    """

    scheme: str
    per_channel: bool
    group: int
    zero: bool
    dtype: Any

    @classmethod
    def of(cls, w: QuantizedWeight) -> QuantLayout:
        return cls(w.scheme, w.group == w.k, w.group, w.zero is not None,
                   jnp.dtype(w.dtype).name)

    @property
    def operands(self) -> int:
        """Operands the weight takes in the kernel: values, scales, zero points."""
        return 3 if self.zero else 2

    def padded(self, w: QuantizedWeight, kp: int, np_: int) -> list[jax.Array]:
        """The operands padded to ``kp`` rows and ``np_`` columns (whole tiles). Padding rows
        and columns hold zero values, zero scales and zero zero points: they dequantize to
        exact zeros."""
        q = jnp.asarray(w.q)
        cols = np_ // 2 if self.scheme == "int4" else np_
        out = [_pad(q, kp, cols)]
        rows = 1 if self.per_channel else kp // self.group
        out.append(_pad(jnp.asarray(w.scale), rows, np_))
        if self.zero:
            out.append(_pad(jnp.asarray(w.zero), rows, np_))
        return out

    def specs(self, k_rows: int, bn: int, index: Any) -> list[Any]:
        """BlockSpecs of the operands for a weight block of ``k_rows`` rows and ``bn``
        columns whose block index is ``index(*grid) -> (row block, column block)``."""
        cols = bn // 2 if self.scheme == "int4" else bn
        q = pl.BlockSpec((k_rows, cols), index)
        if self.per_channel:
            scale = pl.BlockSpec((1, bn), lambda *g: (0, index(*g)[1]))
        else:
            scale = pl.BlockSpec((k_rows // self.group, bn), index)
        return [q, scale] + ([scale] if self.zero else [])


@dataclasses.dataclass(frozen=True)
class QuantTile:
    """One quantized weight's operand refs inside a kernel: :meth:`tile` reads a ``k_tile``
    of rows and dequantizes it."""

    layout: QuantLayout
    q_ref: Any
    scale_ref: Any
    zero_ref: Any = None

    def tile(self, tile: Any, k_tile: int) -> jax.Array:
        """Rows ``tile * k_tile`` up to the next ``k_tile`` of the block, dequantized:
        ``[k_tile, bn]`` in the layout's dtype."""
        layout = self.layout
        at = pl.ds(pl.multiple_of(tile * k_tile, k_tile), k_tile)
        q = self.q_ref[at, :]
        if layout.scheme == "int4":
            low, high = q & 0xF, jax.lax.shift_right_logical(q, jnp.uint8(4))
            q = jnp.stack([low, high], axis=-1).reshape(k_tile, q.shape[1] * 2)
        values = q.astype(jnp.float32)
        if layout.zero:
            values = values - self._rows(self.zero_ref, tile, k_tile).astype(jnp.float32)
        scale = self._rows(self.scale_ref, tile, k_tile)
        return (values * scale).astype(layout.dtype)

    def _rows(self, ref: Any, tile: Any, k_tile: int) -> jax.Array:
        """The scale (or zero point) rows of this tile, one per weight row it covers."""
        if self.layout.per_channel:
            return ref[0:1, :]
        per_tile = k_tile // self.layout.group
        rows = ref[pl.ds(pl.multiple_of(tile * per_tile, per_tile), per_tile), :]
        if per_tile == 1:
            return rows
        bn = rows.shape[1]
        return jnp.broadcast_to(rows[:, None, :], (per_tile, self.layout.group, bn)).reshape(
            k_tile, bn)


def bind(layouts: tuple[QuantLayout | None, ...], refs: tuple[Any, ...]) -> list[Any]:
    """The weights' kernel-side handles from the kernel's flat operand refs: a ref for a plain
    weight, a :class:`QuantTile` for a quantized one (which takes
    :attr:`QuantLayout.operands` refs)."""
    out, i = [], 0
    for layout in layouts:
        if layout is None:
            out.append(refs[i])
            i += 1
        else:
            out.append(QuantTile(layout, *refs[i : i + layout.operands]))
            i += layout.operands
    return out


def _pad(a: jax.Array, rows: int, cols: int) -> jax.Array:
    if a.shape == (rows, cols):
        return a
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))
