"""A few rows times quantized weights on the GPU's CUDA cores: the decode product of a model
loaded with ``exact=False``.

The row-invariant kernels (:mod:`~turbospark_jax.kernels.rowinv`) dequantize each weight
tile in registers and hand it to the tensor cores, which take a tile only in their own
layout; that conversion, not the bytes read, bounds them, so a quantized weight decodes no
faster there than a bfloat16 one (docs/decisions/0020-quantized-products.md). For one row
(or a few) the tensor cores have nothing to gain: this kernel reads each stored weight once,
turns it into float32 in registers, multiplies it by the row's inputs and accumulates
elementwise, reducing over K once at the end of its share of K. No tensor-core layout is ever
built.

Its order of summation is its own (a function of the weight's shape and the tiles of
:func:`tiles_for`, never of the row count: every row runs the same code on its own
accumulators), so it agrees bitwise with itself at any row count up to :data:`MAX_ROWS`
(a decode step and a verify of a few rows), and with no other kernel. A prefill's rows, which
run the tensor-core kernels, then differ from a decode step's by rounding: the kernel belongs
to the non-exact plan (:attr:`~turbospark_jax.kernels.plan.KernelPlan.quant_matvec`).

The arithmetic, per scheme (:class:`~turbospark_jax.quant.weights.QuantizedWeight`):

* the stored value becomes float32 by bit arithmetic on the CUDA cores' integer and float
  units rather than their conversion instructions, which run at a fraction of the rate (an
  integer ``v`` in ``[0, 2**23)`` put into the low bits of ``2**23`` reads as ``2**23 + v``;
  a subtraction then leaves ``v``, or ``v - zero`` with the zero point in the same
  subtraction; an e4m3 value's exponent and mantissa move into a float32's and the bias
  difference is added), exactly the value :func:`~turbospark_jax.quant.weights.dequantize`
  starts from. ``QuantMatvecTiles.native_convert`` takes the conversion instructions
  instead, until the GPU has timed both;
* a scale per output channel multiplies the finished sum (one multiply a column); scales per
  group of rows multiply each value first, as :func:`~turbospark_jax.quant.weights.dequantize`
  does, but the value is never rounded to the model's dtype, so the product is closer to the
  exact one than a product with the dequantized matrix;
* int4's two nibbles of a byte (columns ``2j`` and ``2j + 1``) stay in two accumulators of
  half width, interleaved only in the finished ``[bn]`` sums.

Compiled, it takes part in programmatic dependent launch as the row-invariant decode kernels
do (:mod:`~turbospark_jax.kernels.pdl`): the next kernel is scheduled while it streams, and it
waits for the kernel ahead before reading ``x``.

A product's K may split into segments (grid axis 1) whose float32 partial sums come out
``[S, M, N]``, as the row-invariant matvec kernel's do, for the kernels that add them
(:func:`~turbospark_jax.kernels.rowinv.sum_parts`, the norm and the RoPE-store).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import pdl as pallas_pdl
from turbospark_jax.kernels.quant_tiles import QuantLayout
from turbospark_jax.kernels.rowinv import (
    _ceil_to,
    _Columns,
    _for_each_weight,
    _pad,
    _power_of_two,
    compiler_params,
    resolve_impl,
    sum_parts,
    swiglu_gating,
)
from turbospark_jax.quant.weights import QuantizedWeight

#: The most rows the kernel takes: a decode step and a verify of up to ``MAX_ROWS - 1``
#: proposals. Each row keeps accumulators as large as a weight tile, so more rows would
#: spill registers; wider calls run the row-invariant kernels.
MAX_ROWS = 8
#: :func:`tiles_for` splits K until the grid has about this many programs (enough to keep
#: every multiprocessor's loads in flight), at most :data:`MAX_SPLITS` segments.
TARGET_PROGRAMS = 256
MAX_SPLITS = 8
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
#: ``2**23`` as float32 bits, and the same number as a float.
_MAGIC_BITS = 0x4B000000
_MAGIC = 8388608.0
#: e4m3's exponent bias is 7, float32's 127.
_FP8_BIAS_BITS = (127 - 7) << 23


@dataclasses.dataclass(frozen=True)
class QuantMatvecTiles:
    """The kernel's tiles and Triton settings: they change speed and, within a row, the
    order of summation (so a model keeps the tiles :func:`tiles_for` picks from the weight's
    shape alone).

    Attributes:
      block_k: rows of K a step reads (a power of two, at least 16; a grouped weight's steps
        hold at most one group).
      block_n: output columns a program owns (a power of two, at least 16).
      splits: K segments, each a program of its own whose partial sums come out; ``None``:
        :func:`tiles_for`'s choice. A gated product always runs one segment.
      warps, stages: Triton's ``num_warps`` and ``num_stages``.
      native_convert: convert the stored values with the GPU's conversion instructions
        rather than the bit arithmetic (the same values); until the GPU has measured both.
    """

    block_k: int = 128
    block_n: int = 64
    splits: int | None = None
    warps: int = 4
    stages: int = 3
    native_convert: bool = False

    def __post_init__(self) -> None:
        for name in ("block_k", "block_n"):
            value = getattr(self, name)
            if not (isinstance(value, int) and _power_of_two(value) and value >= 16):
                raise BadInputError(f"{name} must be a power of two >= 16, got {value!r}")
        if self.splits is not None and not (isinstance(self.splits, int)
                                            and 1 <= self.splits <= MAX_SPLITS):
            raise BadInputError(f"splits must be None or 1..{MAX_SPLITS}, got {self.splits!r}")
        for name in ("warps", "stages"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise BadInputError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.native_convert, bool):
            raise BadInputError(f"native_convert must be a bool, got {self.native_convert!r}")


def tiles_for(k: int, n: int, gated: bool = False) -> QuantMatvecTiles:
    """The tiles a ``[k, n]`` product (``n``: all its weights' columns) runs on: the default
    blocks, K split into the fewest segments (a power of two, at most :data:`MAX_SPLITS`)
    that give about :data:`TARGET_PROGRAMS` programs. A function of the shape alone, so
    every row count shares it; a gated product runs one segment."""
    base = QuantMatvecTiles()
    if gated:
        return dataclasses.replace(base, splits=1)
    columns = -(-n // base.block_n)
    splits = 1
    while splits < MAX_SPLITS and columns * splits < TARGET_PROGRAMS and k >= (
            2 * splits * base.block_k):
        splits *= 2
    return dataclasses.replace(base, splits=splits)


def refusal(w: Any) -> str | None:
    """Why the kernel cannot multiply by ``w`` (None when it can): it takes a
    :class:`~turbospark_jax.quant.weights.QuantizedWeight` of one matrix (not a stack of
    layers) with one scale row for all of K or groups of a power of two (every scheme
    :func:`~turbospark_jax.quant.weights.quantize` makes)."""
    if not isinstance(w, QuantizedWeight):
        return f"a {type(w).__name__} is not a quantized weight"
    if w.lead:
        return f"a stacked quantized weight {w.shape} (index its layer first)"
    if w.group != w.k and not (_power_of_two(w.group) and w.group >= 16):
        return (f"groups of {w.group} rows (the kernel steps through whole groups of a power "
                "of two, at least 16)")
    return None


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A call's static geometry: padded K, its segments and the rows a step reads."""

    kp: int
    splits: int
    block_k: int

    @property
    def seg(self) -> int:
        return self.kp // self.splits


def _geometry(ws: tuple[QuantizedWeight, ...], k: int, tiles: QuantMatvecTiles,
              splits: int) -> _Plan:
    """Steps of ``block_k`` rows that never cross a group, and segments of whole steps
    (and whole groups); K is padded to whole steps only where one scale row covers all of it
    (a grouped weight's K is whole groups already)."""
    grouped = [w.group for w in ws if w.group != w.k]
    block_k = min([tiles.block_k, *grouped])
    unit = max([block_k, *grouped])
    kp = _ceil_to(k, unit)
    units = kp // unit
    while units % splits:
        splits //= 2
    return _Plan(kp, splits, block_k)


def _bits_to_float(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _nibbles(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 packed bytes -> their low and high nibbles (columns ``2j`` and ``2j + 1``)."""
    return q & jnp.uint8(0xF), jax.lax.shift_right_logical(q, jnp.uint8(4))


def _small_int(v: jax.Array, offset: jax.Array, native: bool) -> jax.Array:
    """float32 ``v - offset`` of a uint8 ``v`` in ``[0, 256)``; ``offset`` float32 (a zero
    point, or 0), exact."""
    if native:
        return v.astype(jnp.float32) - offset
    return _bits_to_float(v.astype(jnp.uint32) | jnp.uint32(_MAGIC_BITS)) - (offset + _MAGIC)


def _int8(q: jax.Array, native: bool) -> jax.Array:
    if native:
        return q.astype(jnp.float32)
    # q + 128, in [0, 256), added into 2**23's bits, then 2**23 + 128 taken off
    return _bits_to_float(q.astype(jnp.int32) + (_MAGIC_BITS + 128)) - (_MAGIC + 128.0)


def _fp8(q: jax.Array, native: bool) -> jax.Array:
    """float8 e4m3 -> float32. The bit form moves the exponent and mantissa into a float32's
    (adding the bias difference), then corrects the subnormals (exponent 0: the bits read as
    ``2**-7 * (1 + m/8)``, the value is ``m * 2**-9``, twice the first less ``2**-6``), and
    sets the sign bit last."""
    if native:
        return q.astype(jnp.float32)
    b = jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.uint32)
    mag = _bits_to_float(((b & jnp.uint32(0x7F)) << 20) + jnp.uint32(_FP8_BIAS_BITS))
    mag = jnp.where((b & jnp.uint32(0x78)) == 0, mag * 2.0 - 2.0**-6, mag)
    sign = (b & jnp.uint32(0x80)) << 24
    return _bits_to_float(jax.lax.bitcast_convert_type(mag, jnp.uint32) | sign)


def _halves(row: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[1, bn]`` -> its even and odd columns, ``[1, bn / 2]`` each (int4's two nibbles)."""
    half = row.shape[1] // 2
    even, odd = jax.lax.split(row.reshape(1, half, 2), (1, 1), axis=2)
    return even.reshape(1, half), odd.reshape(1, half)


@dataclasses.dataclass(frozen=True)
class _Weight:
    """One quantized weight's operand refs inside the kernel."""

    layout: QuantLayout
    q_ref: Any
    scale_ref: Any
    zero_ref: Any = None

    def _scale_rows(self, ref: Any, step: Any, block_k: int) -> jax.Array:
        """The scale (or zero point) row of this step, ``[1, bn]``."""
        if self.layout.per_channel:
            return ref[0:1, :]
        # lax.div: the rows are never negative, and jnp's floor division adds a sign fix-up
        row = jax.lax.div(step * block_k, self.layout.group)
        return ref[pl.ds(row, 1), :]

    def sums(self, x_ref: Any, rows: int, block_k: int, steps: int, native: bool,
             gate: jax.Array | None) -> list[jax.Array]:
        """Each row's float32 sum over this program's segment, ``[bn]``: a ``[block_k,
        bn]`` accumulator per row (per nibble plane for int4), reduced over K once at the
        end. ``gate``: :func:`~turbospark_jax.kernels.pdl.ready`'s, masking the reads of
        ``x`` (the kernel ahead's output); None without PDL."""
        layout = self.layout
        int4 = layout.scheme == "int4"
        planes = 2 if int4 else 1
        width = self.q_ref.shape[1]  # bn, or bn / 2 packed

        def values(step: Any) -> list[jax.Array]:
            q = self.q_ref[pl.ds(pl.multiple_of(step * block_k, block_k), block_k), :]
            if layout.zero:
                zero = self._scale_rows(self.zero_ref, step, block_k).astype(jnp.float32)
            if int4:
                offsets = _halves(zero) if layout.zero else (jnp.float32(0),) * 2
                out = [_small_int(v, o, native) for v, o in zip(_nibbles(q), offsets,
                                                                 strict=True)]
            elif layout.scheme == "int8":
                out = [_int8(q, native)]
            else:
                out = [_fp8(q, native)]
            if not layout.per_channel:  # a scale per group: on the values, as dequantize
                scale = self._scale_rows(self.scale_ref, step, block_k)
                out = [v * s for v, s in zip(out, _halves(scale) if int4 else (scale,),
                                             strict=True)]
            return out

        def body(step: Any, accs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            at = pl.ds(pl.multiple_of(step * block_k, block_k), block_k)
            vs = values(step)
            new = []
            for r in range(rows):
                if gate is None:
                    x = x_ref[r, at]
                else:
                    x = plgpu.load(x_ref.at[r, at],
                                   mask=pallas_pdl.masked(None, gate, (block_k,)), other=0)
                x = x.astype(jnp.float32)[:, None]
                new += [accs[r * planes + p] + x * vs[p] for p in range(planes)]
            return tuple(new)

        zeros = tuple(jnp.zeros((block_k, width), jnp.float32) for _ in range(rows * planes))
        accs = jax.lax.fori_loop(0, steps, body, zeros)
        if layout.per_channel:  # one scale a column: on the finished sums
            scale = self.scale_ref[0:1, :]
            scales = [c.reshape(width) for c in (_halves(scale) if int4 else (scale,))]
        out = []
        for r in range(rows):
            sums = [jnp.sum(a, axis=0) for a in accs[r * planes : (r + 1) * planes]]
            if layout.per_channel:
                sums = [s * c for s, c in zip(sums, scales, strict=True)]
            if int4:  # columns 2j and 2j + 1 side by side again
                sums = [jnp.stack(sums, axis=-1).reshape(2 * width)]
            out.append(sums[0])
        return out


def _bind(layouts: tuple[QuantLayout, ...], refs: tuple[Any, ...]) -> list[_Weight]:
    out, i = [], 0
    for layout in layouts:
        out.append(_Weight(layout, *refs[i : i + layout.operands]))
        i += layout.operands
    return out


def _pdl_gate(pdl: bool) -> jax.Array | None:
    """Let the next kernel be scheduled now and wait for the one ahead (whose output ``x``
    is) before ``x`` is read (:mod:`~turbospark_jax.kernels.pdl`); None in the
    interpreter."""
    return pallas_pdl.ready(pallas_pdl.start(pdl))


def _matvec_kernel(x_ref: Any, *refs: Any, layouts: tuple[QuantLayout, ...],
                   offsets: tuple[int, ...], rows: int, block_k: int, steps: int,
                   native: bool, pdl: bool) -> None:
    # x [M, segment]; each weight's blocks [segment, bn] (packed: bn / 2) with their scale
    # and zero-point rows; the output block [M, bn] of this segment's partial sums.
    *operand_refs, o_ref = refs
    weights = _bind(layouts, tuple(operand_refs))
    gate = _pdl_gate(pdl)

    def compute(w: _Weight) -> None:
        for r, total in enumerate(w.sums(x_ref, rows, block_k, steps, native, gate)):
            o_ref[r, :] = total

    _for_each_weight(offsets, pl.program_id(0), tuple(weights), compute)


def _gated_kernel(x_ref: Any, *refs: Any, layouts: tuple[QuantLayout, ...], rows: int,
                  block_k: int, steps: int, native: bool, pdl: bool) -> None:
    *operand_refs, o_ref = refs
    gate_w, up_w = _bind(layouts, tuple(operand_refs))
    gate = _pdl_gate(pdl)
    g = gate_w.sums(x_ref, rows, block_k, steps, native, gate)
    u = up_w.sums(x_ref, rows, block_k, steps, native, gate)
    for r in range(rows):
        o_ref[r, :] = swiglu_gating(g[r], u[r], o_ref.dtype)


def _operands(ws: tuple[QuantizedWeight, ...], cols: _Columns, geo: _Plan,
              shared_columns: bool) -> tuple[list[Any], list[Any]]:
    """Each weight's operands (values, scales, zero points), padded to ``geo.kp`` rows and
    whole column blocks, with BlockSpecs over the grid ``(column block, segment)``."""
    specs, operands = [], []
    for i, w in enumerate(ws):
        layout = QuantLayout.of(w)

        def index(j: Any, s: Any, i: int = i) -> tuple[Any, Any]:
            return s, (j if shared_columns else cols.spec_column(i, j))

        specs += layout.specs(geo.seg, cols.bn, index)
        operands += layout.padded(w, geo.kp, _ceil_to(w.n, cols.bn))
    return specs, operands


def _checked(x: Any, ws: tuple[Any, ...], impl: str) -> str:
    if getattr(x, "ndim", None) != 2 or 0 in x.shape:
        raise BadInputError(f"x must be a non-empty 2-D array, got shape "
                            f"{getattr(x, 'shape', type(x).__name__)}")
    if x.shape[0] > MAX_ROWS:
        raise BadInputError(f"the quantized matvec kernel takes at most {MAX_ROWS} rows; got "
                            f"{x.shape[0]} (wider calls run the row-invariant kernels)")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise BadInputError(f"x must be bfloat16, float16 or float32; got {x.dtype}")
    for w in ws:
        why = refusal(w)
        if why is not None:
            raise BadInputError(f"the quantized matvec kernel cannot take this weight: {why}")
        if w.k != x.shape[1]:
            raise BadInputError(f"x [M, K] @ w [K, N] needs equal K; got x {tuple(x.shape)} "
                                f"and w [{w.k}, {w.n}]")
        if jnp.dtype(w.dtype) != jnp.dtype(x.dtype):
            raise BadInputError(f"x and w must share one dtype; got {x.dtype} and the weight's "
                                f"{jnp.dtype(w.dtype)}")
    impl = resolve_impl(impl)
    if impl not in ("pallas", "interpret"):
        raise BadInputError(f"the quantized matvec kernel runs on a GPU (impl 'pallas') or "
                            f"in the Pallas interpreter ('interpret'); got impl {impl!r}")
    return impl


def quant_matmul(x: jax.Array, w: Any, *, out_dtype: Any = None, parts: bool = False,
                 impl: str = "auto", tiles: QuantMatvecTiles | None = None,
                 label: str = "") -> jax.Array:
    """``x [M, K] @ w [K, N]`` for a few rows and quantized weights, on the CUDA cores.

    Args:
      x: ``[M, K]``, ``M`` at most :data:`MAX_ROWS`; bfloat16, float16 or float32.
      w: a :class:`~turbospark_jax.quant.weights.QuantizedWeight` ``[K, N]`` of ``x``'s
        dtype, or a tuple of them whose products come out side by side from one launch.
      out_dtype: the result's dtype; ``x.dtype`` when None.
      parts: return the float32 partial sums of the K segments, ``[S, M, N]``
        (:func:`~turbospark_jax.kernels.rowinv.sum_parts` finishes them).
      impl: ``"pallas"`` (a GPU), ``"interpret"`` (the Pallas interpreter) or ``"auto"``.
      tiles: the kernel's tiles; None: :func:`tiles_for` of the weights' shape.
      label: appended to the kernel's name (``quant_matvec_<label>``).

    Raises:
      BadInputError: more than :data:`MAX_ROWS` rows, a plain or stacked weight, mismatched
        K or dtypes, an impl other than the two above (or ``"auto"`` off a GPU).
    """
    ws = tuple(w) if isinstance(w, tuple | list) else (w,)
    if not ws:
        raise BadInputError("w must be a quantized weight or a non-empty tuple of them")
    impl = _checked(x, ws, impl)
    out = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if out not in _DTYPES:
        raise BadInputError(f"out_dtype must be bfloat16, float16 or float32; got {out}")
    chosen = tiles_for(x.shape[1], sum(a.n for a in ws))
    if tiles is None or tiles.splits is None:
        tiles = dataclasses.replace(tiles or chosen, splits=chosen.splits)
    result = _quant_matmul(x, tuple(a.matrix() for a in ws), tiles, impl == "interpret",
                           label)
    return result if parts else sum_parts(result, out)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "label"))
def _quant_matmul(x: jax.Array, ws: tuple[QuantizedWeight, ...], tiles: QuantMatvecTiles,
                  interpret: bool, label: str) -> jax.Array:
    m, k = x.shape
    geo = _geometry(ws, k, tiles, tiles.splits or 1)
    cols = _Columns(tuple(w.n for w in ws), tiles.block_n)
    specs, operands = _operands(ws, cols, geo, shared_columns=False)
    kernel = functools.partial(
        _matvec_kernel, layouts=tuple(QuantLayout.of(w) for w in ws), offsets=cols.offsets,
        rows=m, block_k=geo.block_k, steps=geo.seg // geo.block_k,
        native=tiles.native_convert, pdl=not interpret)
    width = cols.offsets[-1] * cols.bn
    partials = pl.pallas_call(
        kernel,
        grid=(cols.offsets[-1], geo.splits),
        in_specs=[pl.BlockSpec((m, geo.seg), lambda j, s: (0, s)), *specs],
        out_specs=pl.BlockSpec((None, m, cols.bn), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((geo.splits, m, width), jnp.float32),
        interpret=interpret,
        name="quant_matvec" + (f"_{label}" if label else ""),
        **compiler_params(interpret, tiles.warps, tiles.stages),
    )(_pad(x, m, geo.kp), *operands)
    return jax.vmap(lambda p: cols.gather(p, m))(partials)


def quant_swiglu(x: jax.Array, gate: Any, up: Any, *, impl: str = "auto",
                 tiles: QuantMatvecTiles | None = None, label: str = "gate_up") -> jax.Array:
    """SwiGLU's hidden rows ``silu(x @ gate) * (x @ up)`` for a few rows and quantized
    weights: one launch reads both weights' same column block and gates the finished sums
    (:func:`~turbospark_jax.kernels.rowinv.swiglu_gating`), all of K in one segment.

    Args:
      x: ``[M, K]`` as for :func:`quant_matmul`; gate, up: quantized ``[K, F]`` each.
      impl, tiles, label: as for :func:`quant_matmul` (``tiles.splits`` is ignored).

    Returns:
      ``[M, F]`` in ``x.dtype``.

    Raises:
      BadInputError: as :func:`quant_matmul`, or gate and up of different shapes.
    """
    impl = _checked(x, (gate, up), impl)
    if (gate.k, gate.n) != (up.k, up.n):
        raise BadInputError(f"gate and up must have one shape; got [{gate.k}, {gate.n}] and "
                            f"[{up.k}, {up.n}]")
    tiles = dataclasses.replace(tiles or tiles_for(gate.k, gate.n, gated=True), splits=1)
    return _quant_swiglu(x, gate.matrix(), up.matrix(), tiles, impl == "interpret", label)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "label"))
def _quant_swiglu(x: jax.Array, gate: QuantizedWeight, up: QuantizedWeight,
                  tiles: QuantMatvecTiles, interpret: bool, label: str) -> jax.Array:
    m, k = x.shape
    geo = _geometry((gate, up), k, tiles, 1)
    cols = _Columns((gate.n,), tiles.block_n)
    specs, operands = _operands((gate, up), cols, geo, shared_columns=True)
    kernel = functools.partial(
        _gated_kernel, layouts=(QuantLayout.of(gate), QuantLayout.of(up)), rows=m,
        block_k=geo.block_k, steps=geo.seg // geo.block_k, native=tiles.native_convert,
        pdl=not interpret)
    out = pl.pallas_call(
        kernel,
        grid=(cols.offsets[-1], 1),
        in_specs=[pl.BlockSpec((m, geo.seg), lambda j, s: (0, s)), *specs],
        out_specs=pl.BlockSpec((m, cols.bn), lambda j, s: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, cols.offsets[-1] * cols.bn), x.dtype),
        interpret=interpret,
        name="quant_matvec" + (f"_{label}" if label else ""),
        **compiler_params(interpret, tiles.warps, tiles.stages),
    )(_pad(x, m, geo.kp), *operands)
    return cols.gather(out, m)
