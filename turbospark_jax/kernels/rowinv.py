"""Row-invariant matrix products: a row's result never depends on how many rows the call has.

``rowinv_matmul(x [M, K], w [K, N])`` gives row ``r`` of its result bitwise the same for any
``M``, any position of the row in ``x`` and either of its kernels, so a decode step of one row,
a verify of ``k + 1`` rows and a prefill chunk of thousands can be different programs and still
agree bit for bit.

What fixes a row's arithmetic is its *schedule* (:class:`Schedule`), a function of ``K``
alone: the reduction over ``K`` runs in tiles of ``k_tile`` columns, one after another; runs of
``segment_tiles`` tiles form segments, each summed from zero, and the segments are added in
order to a total that starts at ``-0.0`` (the exact additive identity, so the first addition
changes no bit). Neither ``M`` nor any tile size over ``M`` or ``N`` enters it.

On a GPU two Pallas (Triton) kernels follow that schedule:

* ``"matmul"`` for many rows: a program per ``[bm, bn]`` output tile walks all of ``K``,
  folding each finished segment into its total;
* ``"matvec"`` for few rows (decode, verify): a program per ``[16, bn]`` output tile *and*
  segment, so a single row still spreads the weight reads over many programs; the segments'
  float32 partial sums are then added in order.

Both repeat the same tile step (:func:`_tile_step`), so a row agrees between them. On a
Hopper GPU a third kernel, ``"mosaic"`` (:mod:`~turbospark_jax.kernels.mosaic_matmul`: Pallas'
Mosaic GPU backend, TMA loads and ``wgmma`` in a warp-specialised pipeline), follows the same
schedule for many rows faster than the Triton matmul kernel, and its rows are the Triton
kernels' bitwise (checked on the GPU by the Mosaic kernel's tests); ``kernel="auto"`` runs
it from :data:`MOSAIC_MIN_ROWS` rows on where the operands fit it (:func:`mosaic_refusal`).

On other backends the product runs as XLA dots of one fixed shape,
``[XLA_ROW_TILE, K] @ [K, N]``, over the rows in tiles (:func:`_xla_tiled`). XLA's CPU dot is
not row-invariant by itself (a single row takes a matrix-vector path that sums differently;
small float32 products switch algorithm with the row count), but a dot of one fixed shape
computes each of its rows alike, whatever the row holds and wherever it sits; the kernel
tests check both facts. In the Pallas interpreter the kernels' tile products are such dots
too, so the interpreted kernels show the schedule's invariance on a CPU; the hardware's own
tile product is checked on the GPU.

On a TPU (``impl="tpu"``; ``"tpu_interpret"`` in Pallas' TPU interpreter) every product runs
on :func:`~turbospark_jax.kernels.tpu_products.tpu_matmul`, whose K order is its own (a
function of ``K``; ``schedule`` and ``tiles`` do not apply): each weight of a tuple as one
call, the results side by side; a quantized weight dequantized first, as the XLA form takes
it; ``parts`` as one finished float32 part; the gated product as the two products, then
:func:`swiglu_gating` in XLA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from turbospark_jax.core.checks import as_bool
from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import pdl as pallas_pdl
from turbospark_jax.kernels.mosaic_matmul import MosaicTiles, mosaic_gated, mosaic_matmul
from turbospark_jax.kernels.quant_tiles import QuantLayout, QuantTile, bind, fits_tiles
from turbospark_jax.kernels.tpu_products import TPU_IMPLS, tpu_matmul
from turbospark_jax.quant.weights import QuantizedWeight, dequantize

#: Rows of the matvec kernel's row tile (Triton's smallest matrix-product tile), and of the
#: interpreter's tile products.
ROW_TILE = 16
#: Rows of the fixed-shape tiles of the XLA form (:func:`row_tiled`): every row runs one dot
#: (or norm, or attention) of this many rows. Small, so that a one-row call pays for few
#: padding rows, yet enough that a wide call stays near XLA's own dot.
XLA_ROW_TILE = 4
#: :func:`row_tiled` runs at least this many tiles: XLA inlines a loop of one trip into the
#: program around it and compiles its body differently there (with full optimisation on the
#: CPU, a norm's rows came out differently from the same body in a loop).
MIN_TILES = 2
#: The same floor for the XLA form's matrix product: one tile. A dot between optimization
#: barriers computes its rows alike inlined or in a loop (checked with the CPU's default and
#: the tests' XLA flags, in float32 and bfloat16, in the model too), and a one-row decode
#: step then pays for one tile of rows, not two.
DOT_MIN_TILES = 1
#: At most this many rows go to the matvec kernel under ``kernel="auto"``.
SMALL_M = 16
#: Values of ``impl``: ``"auto"`` (Pallas on a GPU, the TPU kernel on a TPU, the XLA form
#: elsewhere), ``"pallas"``, ``"interpret"`` (the Pallas kernels in the interpreter, for CPU
#: tests), ``"tpu"`` and ``"tpu_interpret"`` (the TPU kernel, compiled or in Pallas' TPU
#: interpreter) and ``"xla"``.
IMPLS = ("auto", "pallas", "interpret", "tpu", "tpu_interpret", "xla")
#: Values of ``kernel``: which Pallas kernel runs (``"auto"`` picks by the row count and the
#: GPU).
KERNELS = ("auto", "matvec", "matmul", "mosaic")
#: From this many rows on, ``kernel="auto"`` runs the Mosaic kernel on a Hopper GPU where the
#: operands fit it (a prefill block's 2,048 rows do; a verify's few rows take the matvec
#: kernel, a short chunk's the Triton matmul kernel, whose row tile is half as tall).
MOSAIC_MIN_ROWS = 256
#: The Mosaic kernel's default tiling.
MOSAIC_TILES = MosaicTiles()
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The reduction order over ``K`` every row follows (see the module docstring).

    Attributes:
      k_tile: columns per tile (a power of two, at least 16).
      segment_tiles: tiles per segment, at most; a ``K`` of ``t`` tiles gets segments of the
        largest divisor of ``t`` not above it, so every segment has the same length. Never
        segments of one tile when ``t > 1``: where no divisor from 2 up fits (a prime ``t``,
        or ``segment_tiles=1``) ``K`` is one segment. On a GPU, Triton rewrites ``c +
        dot(a, b)`` of a dot from zero into the dot accumulating onto ``c`` in place, so the
        matrix kernel would add a one-tile segment into its total inside the tensor cores
        while the matrix-vector kernel adds the same segment's finished sum afterwards: two
        orders, and a decode that differs from a prefill. (A longer segment ends with a dot
        onto its own running sum, which that rewrite leaves alone.)
    """

    k_tile: int = 128
    segment_tiles: int = 4

    def __post_init__(self) -> None:
        if not (_power_of_two(self.k_tile) and self.k_tile >= 16):
            raise BadInputError(f"k_tile must be a power of two >= 16, got {self.k_tile}")
        if self.segment_tiles < 1:
            raise BadInputError(f"segment_tiles must be >= 1, got {self.segment_tiles}")

    def plan(self, k: int) -> tuple[int, int, int]:
        """``(padded K, tiles, tiles per segment)`` for a reduction over ``k`` columns. Zero
        columns pad ``K`` to whole tiles; they add exact zeros."""
        tiles = -(-k // self.k_tile)
        per = max(d for d in range(1, min(self.segment_tiles, tiles) + 1) if tiles % d == 0)
        if per == 1:  # see the class docstring: one segment rather than one-tile segments
            per = tiles
        return tiles * self.k_tile, tiles, per


#: From this many output columns on (a vocabulary), :func:`schedule_for` walks K in one
#: segment: the column blocks alone give the GPU thousands of programs.
WIDE_N = 32768
#: Below :data:`WIDE_N`, a product has at most about this many segments. The matvec kernel
#: runs each segment as programs of their own and leaves the segments' float32 partial sums to
#: the kernel after it (an RMSNorm, the RoPE-store), whose one program per row adds them in
#: order, one load after another: more partials cost that kernel more than they save the
#: product.
MAX_SEGMENTS = 4


def schedule_for(k: int, n: int) -> Schedule:
    """The schedule a model's ``[*, k] @ [k, n]`` product runs on: a function of the weight's
    shape alone (never of the row count), so programs of every width share it. One segment
    for a vocabulary-wide ``n`` (no partial sums to write out and add back: a head's are
    large); else segments of :class:`Schedule`'s default length, lengthened for a long ``k``
    so that there are about :data:`MAX_SEGMENTS` of them (``k`` = 8,192: 4 segments of 16
    tiles). A ``k`` whose tile count has no divisor near that length keeps shorter segments,
    or one segment where the only divisor is 1 (see :class:`Schedule`)."""
    tiles = -(-k // Schedule.k_tile)
    if n >= WIDE_N:
        return Schedule(segment_tiles=tiles)
    return Schedule(segment_tiles=max(Schedule.segment_tiles, -(-tiles // MAX_SEGMENTS)))


#: The gated matvec kernel's column tile shrinks (to 16 at least) until it has this many
#: programs: enough to keep every multiprocessor streaming weights at decode widths.
GATED_PROGRAMS = 96


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes and Triton settings of the two kernels. They change speed, never a bit of
    the result (only the :class:`Schedule` does).

    Attributes:
      bm, bn: the matmul kernel's output tile.
      warps, stages: its Triton ``num_warps`` and ``num_stages``.
      matvec_bn: the matvec kernel's output columns per program.
      matvec_warps, matvec_stages: its Triton settings.
      gated_bn: the gated matvec kernel's output columns per program (:func:`rowinv_swiglu`;
        it walks K in one segment, so its columns alone spread the weights over programs).
        ``None``: the largest power of two from 16 to 64 that gives at least
        :data:`GATED_PROGRAMS` programs.
      gated_stages: the gated matvec kernel's ``num_stages``: its loads are two weight tiles
        a step, and a deeper pipeline keeps them coming.
      flat_loop: the matmul kernel walks all K tiles in one loop, folding a segment into
        the total at its last tile (Triton pipelines one loop's loads), rather than a loop
        over segments around a loop over their tiles. Off by default until measured (it
        takes ``lax.rem`` of the loop index, since ``jnp``'s remainder lowers to boolean
        arithmetic Triton refuses); it lowers and agrees with the nested form in the
        interpreter.
      mosaic: the Mosaic kernel's tiling; ``None`` keeps ``kernel="auto"`` on the Triton
        kernels.
    """

    bm: int = 64
    bn: int = 128
    warps: int = 4
    stages: int = 3
    matvec_bn: int = 64
    matvec_warps: int = 4
    matvec_stages: int = 3
    gated_bn: int | None = None
    gated_stages: int = 4
    flat_loop: bool = False
    mosaic: MosaicTiles | None = MOSAIC_TILES

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "matvec_bn", "gated_bn"):
            value = getattr(self, name)
            if name == "gated_bn" and value is None:
                continue
            if not (_power_of_two(value) and value >= 16):
                raise BadInputError(f"{name} must be a power of two >= 16, got {value}")

    def gated_columns(self, f: int) -> int:
        """The gated matvec kernel's columns per program for ``f`` output columns."""
        if self.gated_bn is not None:
            return self.gated_bn
        bn = 64
        while bn > 16 and -(-f // bn) < GATED_PROGRAMS:
            bn //= 2
        return bn


def _ceil_to(n: int, step: int) -> int:
    return -(-n // step) * step


def _pad(a: jax.Array, rows: int, cols: int) -> jax.Array:
    if a.shape == (rows, cols):
        return a
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def _fixed_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [R, k] @ b [k, C]`` in float32 as dots of one shape, ``[16, k] @ [k, 16]``, over
    16-row, 16-column blocks (``R`` and ``C`` multiples of 16): the kernels' tile product in
    the interpreter, the same for every tile size."""
    return jnp.concatenate([
        jnp.concatenate([
            jnp.dot(a[i : i + ROW_TILE], b[:, j : j + ROW_TILE], preferred_element_type=jnp.float32)
            for j in range(0, b.shape[1], ROW_TILE)
        ], axis=1)
        for i in range(0, a.shape[0], ROW_TILE)
    ])


def _gpu_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """A tile product on the GPU; float32 operands in full float32, not TF32."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def _live_rows(shape: tuple[int, int], rows: int) -> jax.Array:
    """bool ``shape``: which rows of this program's row tile are rows of the call (its first
    ``rows``; the tile is grid axis 0)."""
    row = pl.program_id(0) * shape[0] + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return row < rows


def _tile_step(x_ref: Any, w_ref: Any, tile: Any, k_tile: int, tile_dot: Any,
               acc: jax.Array, nk: bool, live: jax.Array | None = None) -> jax.Array:
    """``acc`` plus the product of K tile ``tile``: the one step both kernels repeat, so a
    row's arithmetic is the same in either. ``nk``: the weight block is ``[bn, K]``.
    ``live``: bool ``[rows, k_tile]``, the x tile's rows the call has (:func:`_live_rows`);
    the others are not read and enter the product as zeros, as padding rows would."""
    at = pl.ds(pl.multiple_of(tile * k_tile, k_tile), k_tile)
    x = x_ref[:, at] if live is None else plgpu.load(x_ref.at[:, at], mask=live, other=0)
    if isinstance(w_ref, QuantTile):  # read at its stored width, dequantized here
        return acc + tile_dot(x, w_ref.tile(tile, k_tile), False)
    if nk:
        return acc + tile_dot(x, w_ref[:, at], True)
    return acc + tile_dot(x, w_ref[at, :], False)


def _for_each_weight(offsets: tuple[int, ...], column: Any, w_refs: tuple[Any, ...],
                     compute: Any) -> None:
    """Run ``compute(w_ref)`` for the weight whose column blocks hold block ``column`` (the
    weights' blocks follow one another: weight ``i`` owns blocks ``offsets[i]`` up to
    ``offsets[i + 1]``)."""
    if len(w_refs) == 1:
        compute(w_refs[0])
        return
    for i, w_ref in enumerate(w_refs):
        @pl.when((column >= offsets[i]) & (column < offsets[i + 1]))
        def _(w_ref: Any = w_ref) -> None:
            compute(w_ref)


def _walk_k(x_ref: Any, w_ref: Any, shape: tuple[int, int], *, tiles: int, per: int,
            k_tile: int, tile_dot: Any, flat: bool, nk: bool) -> jax.Array:
    """The matmul kernel's float32 total over all of K for its ``shape`` output tile: the
    schedule's segments, each from zero, folded in order into a total that starts at
    ``-0.0``."""
    zeros = jnp.zeros(shape, jnp.float32)
    total = jnp.full(shape, -0.0, jnp.float32)
    step = functools.partial(_tile_step, x_ref, w_ref, k_tile=k_tile, tile_dot=tile_dot, nk=nk)
    if flat:  # one loop over every tile (Triton pipelines its loads), folding at ends
        def body(i: Any, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            total, acc = carry
            acc = step(i, acc=acc)
            end = jax.lax.rem(i + 1, per) == 0  # jnp's % lowers to bool arithmetic
            return jnp.where(end, total + acc, total), jnp.where(end, zeros, acc)

        total, _ = jax.lax.fori_loop(0, tiles, body, (total, zeros))
        return total

    def segment(s: Any, total: jax.Array) -> jax.Array:  # a loop over segments' tile loops
        tile = lambda i, acc: step(s * per + i, acc=acc)  # noqa: E731
        return total + jax.lax.fori_loop(0, per, tile, zeros)

    return jax.lax.fori_loop(0, tiles // per, segment, total)


def _matmul_kernel(x_ref: Any, *refs: Any, tiles: int, per: int, k_tile: int, tile_dot: Any,
                   flat: bool, nk: bool, offsets: tuple[int, ...],
                   layouts: tuple[Any, ...]) -> None:
    *operand_refs, o_ref = refs
    w_refs = bind(layouts, tuple(operand_refs))
    walk = functools.partial(_walk_k, x_ref, shape=o_ref.shape, tiles=tiles, per=per,
                             k_tile=k_tile, tile_dot=tile_dot, flat=flat, nk=nk)

    def compute(w_ref: Any) -> None:
        o_ref[...] = walk(w_ref).astype(o_ref.dtype)

    _for_each_weight(offsets, pl.program_id(1), tuple(w_refs), compute)


def swiglu_gating(gate: jax.Array, up: jax.Array, dtype: Any) -> jax.Array:
    """SwiGLU's gating of two finished float32 products: each rounded to ``dtype`` as a
    product of ``dtype`` operands comes out, SiLU in float32 rounded once, then the product
    in ``dtype``. The same arithmetic in a kernel's epilogue and in XLA's form."""
    gate, up = gate.astype(dtype), up.astype(dtype)
    return jax.nn.silu(gate.astype(jnp.float32)).astype(dtype) * up


def _gated_matmul_kernel(x_ref: Any, *refs: Any, tiles: int, per: int, k_tile: int,
                         tile_dot: Any, flat: bool,
                         layouts: tuple[Any, ...] = (None, None)) -> None:
    """The matmul kernel over a gate and an up weight's same column block, gated in the
    epilogue (:func:`swiglu_gating`): the MLP's hidden rows without the products leaving
    the chip."""
    *operand_refs, o_ref = refs
    gate_ref, up_ref = bind(layouts, tuple(operand_refs))
    walk = functools.partial(_walk_k, x_ref, shape=o_ref.shape, tiles=tiles, per=per,
                             k_tile=k_tile, tile_dot=tile_dot, flat=flat, nk=False)
    o_ref[...] = swiglu_gating(walk(gate_ref), walk(up_ref), o_ref.dtype)


def _segment_sum(x_ref: Any, w_ref: Any, shape: tuple[int, int], *, per: int, k_tile: int,
                 tile_dot: Any, nk: bool, live: jax.Array | None) -> jax.Array:
    """A matvec program's float32 sum over its ``per`` K tiles, from zero."""
    step = functools.partial(_tile_step, x_ref, w_ref, k_tile=k_tile, tile_dot=tile_dot, nk=nk,
                             live=live)
    return jax.lax.fori_loop(0, per, lambda i, acc: step(i, acc=acc),
                             jnp.zeros(shape, jnp.float32))


def _pdl_live(x_ref: Any, live_x: jax.Array | None, *, k_tile: int,
              started: jax.Array | None) -> jax.Array | None:
    """A matvec program's x-tile mask with the wait for the kernel ahead before the rows are
    read (:mod:`~turbospark_jax.kernels.pdl`; none where ``started`` is None)."""
    gate = pallas_pdl.ready(started)
    return pallas_pdl.masked(live_x, gate, (x_ref.shape[0], k_tile))


def _live_masks(x_ref: Any, o_ref: Any, k_tile: int,
                rows: int | None) -> tuple[jax.Array | None, jax.Array | None]:
    """The matvec kernels' masks of the call's rows, for an x tile and for the output (None
    when the call fills its row tiles). Made at a kernel's top level: the interpreter reads
    the program id there."""
    if rows is None:
        return None, None
    return _live_rows((x_ref.shape[0], k_tile), rows), _live_rows(o_ref.shape, rows)


def _store_live(o_ref: Any, value: jax.Array, live: jax.Array | None) -> None:
    if live is None:
        o_ref[...] = value
    else:
        plgpu.store(o_ref, value, mask=live)


def _gated_matvec_kernel(x_ref: Any, *refs: Any, per: int, k_tile: int, tile_dot: Any,
                         rows: int | None, layouts: tuple[Any, ...] = (None, None),
                         pdl: bool = False) -> None:
    """The matvec kernel over all of K in one segment (so the sums are finished here) for a
    gate and an up weight's same column block, gated in the epilogue (:func:`swiglu_gating`). The
    one segment's sum is the matmul kernel's total bitwise (-0.0 plus it). ``layouts``: each
    weight's :class:`~turbospark_jax.kernels.quant_tiles.QuantLayout` (None: plain)."""
    *operand_refs, o_ref = refs
    gate_ref, up_ref = bind(layouts, tuple(operand_refs))
    started = pallas_pdl.start(pdl)
    live_x, live_out = _live_masks(x_ref, o_ref, k_tile, rows)
    live_x = _pdl_live(x_ref, live_x, k_tile=k_tile, started=started)
    total = functools.partial(_segment_sum, x_ref, shape=o_ref.shape, per=per, k_tile=k_tile,
                              tile_dot=tile_dot, nk=False, live=live_x)
    _store_live(o_ref, swiglu_gating(total(w_ref=gate_ref), total(w_ref=up_ref), o_ref.dtype),
                live_out)


def _matvec_kernel(x_ref: Any, *refs: Any, per: int, k_tile: int, tile_dot: Any, nk: bool,
                   offsets: tuple[int, ...], rows: int | None, layouts: tuple[Any, ...],
                   pdl: bool = False) -> None:
    # The blocks are this program's segment: x [16, per * k_tile], w [per * k_tile, bn]
    # ([bn, per * k_tile] when nk). With ``rows``, x and the output hold only that many rows:
    # the tile's other rows are neither read nor written. A quantized weight comes as its
    # operands (``layouts``), read at their stored width.
    *operand_refs, o_ref = refs
    w_refs = bind(layouts, tuple(operand_refs))
    started = pallas_pdl.start(pdl)
    live_x, live_out = _live_masks(x_ref, o_ref, k_tile, rows)

    def compute(w_ref: Any) -> None:
        live = _pdl_live(x_ref, live_x, k_tile=k_tile, started=started)
        acc = _segment_sum(x_ref, w_ref, o_ref.shape, per=per, k_tile=k_tile,
                           tile_dot=tile_dot, nk=nk, live=live)
        _store_live(o_ref, acc.astype(o_ref.dtype), live_out)

    _for_each_weight(offsets, pl.program_id(1), tuple(w_refs), compute)


def compiler_params(interpret: bool, warps: int, stages: int) -> dict[str, Any]:
    """``pallas_call``'s Triton settings as keyword arguments (none in the interpreter)."""
    if interpret:
        return {}
    return {"compiler_params": plgpu.CompilerParams(num_warps=warps, num_stages=stages)}


def tile_dot_for(interpret: bool) -> Any:
    """The kernels' tile product ``(a, b, nk) -> float32``: :func:`_fixed_dot` in the Pallas
    interpreter, the tensor cores' dot on a GPU."""
    return _interpret_dot if interpret else _hardware_dot


def _interpret_dot(a: jax.Array, b: jax.Array, nk: bool) -> jax.Array:
    return _fixed_dot(a, b.T if nk else b)


def _hardware_dot(a: jax.Array, b: jax.Array, nk: bool) -> jax.Array:
    if nk:
        precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32, precision=precision)
    return _gpu_dot(a, b)


@dataclasses.dataclass(frozen=True)
class _Columns:
    """How the weights' columns sit in the kernels' grid: each weight padded to whole column
    blocks of ``bn``, their blocks one after another."""

    widths: tuple[int, ...]  # each weight's N
    bn: int

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(-(-n // self.bn) for n in self.widths)

    @property
    def offsets(self) -> tuple[int, ...]:
        out = [0]
        for b in self.blocks:
            out.append(out[-1] + b)
        return tuple(out)

    def spec_column(self, i: int, column: Any) -> Any:
        """Weight ``i``'s block for grid column ``column`` (clamped: a program of another
        weight never reads it, but its index must stay in range)."""
        if len(self.widths) == 1:
            return column
        return jnp.clip(column - self.offsets[i], 0, self.blocks[i] - 1)

    def gather(self, out: jax.Array, m: int) -> jax.Array:
        """The result's live rows and columns (each weight's padding dropped)."""
        out = out[:m]
        if all(n % self.bn == 0 for n in self.widths):
            return out[:, : sum(self.widths)]
        return jnp.concatenate([out[:, o * self.bn : o * self.bn + n]
                                for o, n in zip(self.offsets, self.widths, strict=False)], axis=1)


def _weight_operands(ws: tuple[Any, ...], layouts: tuple[Any, ...], cols: _Columns,
                     k_rows: int, kp: int, nk: bool, k_block: Any,
                     shared_columns: bool = False) -> tuple[list[Any], list[Any]]:
    """The kernels' weight operands and their BlockSpecs: each weight's blocks of ``k_rows``
    rows (``k_block(*grid)``: which) and ``cols.bn`` columns (grid axis 1, through
    ``cols``; every weight at the grid's column with ``shared_columns``), a quantized one as
    its :class:`~turbospark_jax.kernels.quant_tiles.QuantLayout` operands, all padded to
    ``kp`` rows and whole column blocks."""
    bn = cols.bn
    specs, operands = [], []
    for w, (a, layout) in enumerate(zip(ws, layouts, strict=True)):
        def index(*grid: Any, w: int = w) -> tuple[Any, Any]:
            column = grid[1] if shared_columns else cols.spec_column(w, grid[1])
            return k_block(*grid), column

        if layout is not None:
            specs += layout.specs(k_rows, bn, index)
            operands += layout.padded(a, kp, _ceil_to(a.shape[1], bn))
        elif nk:
            specs.append(pl.BlockSpec((bn, k_rows), lambda *grid, index=index: index(*grid)[::-1]))
            operands += _weights_padded((a,), kp, bn, nk)
        else:
            specs.append(pl.BlockSpec((k_rows, bn), index))
            operands += _weights_padded((a,), kp, bn, nk)
    return specs, operands


def _weights_padded(ws: tuple[jax.Array, ...], kp: int, bn: int, nk: bool) -> list[jax.Array]:
    if nk:
        return [_pad(w, _ceil_to(w.shape[0], bn), kp) for w in ws]
    return [_pad(w, kp, _ceil_to(w.shape[1], bn)) for w in ws]


def _matmul(x: jax.Array, ws: tuple[jax.Array, ...], nk: bool, out_dtype: Any,
            schedule: Schedule, tiles: Tiles, interpret: bool, label: str = "") -> jax.Array:
    m, k = x.shape
    kp, count, per = schedule.plan(k)
    cols = _Columns(tuple(w.shape[0 if nk else 1] for w in ws), tiles.bn)
    mp = _ceil_to(m, tiles.bm)
    layouts = tuple(QuantLayout.of(w) if isinstance(w, QuantizedWeight) else None for w in ws)
    kernel = functools.partial(_matmul_kernel, tiles=count, per=per, k_tile=schedule.k_tile,
                               tile_dot=tile_dot_for(interpret),
                               flat=tiles.flat_loop, nk=nk, offsets=cols.offsets,
                               layouts=layouts)
    w_specs, operands = _weight_operands(ws, layouts, cols, kp, kp, nk, lambda i, j: 0)
    out = pl.pallas_call(
        kernel,
        grid=(mp // tiles.bm, cols.offsets[-1]),
        in_specs=[pl.BlockSpec((tiles.bm, kp), lambda i, j: (i, 0)), *w_specs],
        out_specs=pl.BlockSpec((tiles.bm, tiles.bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, cols.offsets[-1] * tiles.bn), out_dtype),
        interpret=interpret,
        name="rowinv_matmul" + (f"_{label}" if label else ""),
        **compiler_params(interpret, tiles.warps, tiles.stages),
    )(_pad(x, mp, kp), *operands)
    return cols.gather(out, m)


def _matvec(x: jax.Array, ws: tuple[jax.Array, ...], nk: bool, schedule: Schedule,
            tiles: Tiles, interpret: bool, label: str = "") -> jax.Array:
    """The matvec kernel's float32 partial products, one per segment: ``[S, M, N]``."""
    m, k = x.shape
    kp, count, per = schedule.plan(k)
    segments, seg_len = count // per, per * schedule.k_tile
    bn = tiles.matvec_bn
    cols = _Columns(tuple(w.shape[0 if nk else 1] for w in ws), bn)
    mp = _ceil_to(m, ROW_TILE)
    layouts = tuple(QuantLayout.of(w) if isinstance(w, QuantizedWeight) else None for w in ws)
    kernel = functools.partial(_matvec_kernel, per=per, k_tile=schedule.k_tile,
                               tile_dot=tile_dot_for(interpret), nk=nk,
                               offsets=cols.offsets, rows=None if m == mp else m,
                               layouts=layouts, pdl=not interpret)
    w_specs, operands = _weight_operands(ws, layouts, cols, seg_len, kp, nk,
                                         lambda i, j, s: s)
    width = cols.offsets[-1] * bn
    # x and the partial sums keep the call's own rows: a decode step's one row is neither
    # padded to the row tile before the launch nor cut out of it after (each an XLA copy
    # kernel of its own beside the product, both ends of every product).
    partials = pl.pallas_call(
        kernel,
        grid=(mp // ROW_TILE, cols.offsets[-1], segments),
        in_specs=[pl.BlockSpec((ROW_TILE, seg_len), lambda i, j, s: (i, s)), *w_specs],
        out_specs=pl.BlockSpec((None, ROW_TILE, bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((segments, m, width), jnp.float32),
        interpret=interpret,
        name="rowinv_matvec" + (f"_{label}" if label else ""),
        **compiler_params(interpret, tiles.matvec_warps, tiles.matvec_stages),
    )(_pad(x, m, kp), *operands)
    return jax.vmap(lambda p: cols.gather(p, m))(partials)


def sum_parts(parts: jax.Array, dtype: Any) -> jax.Array:
    """The product whose partial sums over K are ``parts [S, ...]`` (as
    :func:`rowinv_matmul` returns them with ``parts=True``): added in order, one after another,
    as the matmul kernel folds its segments, then rounded once to ``dtype``."""
    total = parts[0]  # == -0.0 + parts[0], as the matmul kernel starts
    for s in range(1, parts.shape[0]):
        total = total + parts[s]
    return total.astype(dtype)


def row_tiled(fn: Any, *rows: jax.Array, shared: tuple[jax.Array, ...] = (),
              min_tiles: int = MIN_TILES) -> Any:
    """``fn`` applied to the rows of ``rows`` in tiles of :data:`XLA_ROW_TILE`, as one loop over
    one compiled body of a fixed shape.

    Every array of ``rows`` shares its leading (row) axis; the last tile is padded with zero
    rows, whose results are dropped. Since the body's shape never depends on the row count, a
    row-local ``fn`` gives each row the same bits for any number of rows beside it (on the
    CPU, where XLA computes every row of one fixed-shape reduction or dot alike).

    The body sits between optimization barriers (its inputs, ``shared`` and its outputs):
    XLA drops a loop of one tile and would otherwise fuse across it, differently from program
    to program, which changes the arithmetic. A tied head's ``embed.T`` folded into the dot,
    and (with full optimisation) a residual add fused into the norm, each changed rows.

    Args:
      fn: ``(*tiles, *shared) -> pytree`` of arrays with a leading axis of
        :data:`XLA_ROW_TILE` rows.
      rows: arrays ``[M, ...]``.
      shared: arrays every tile's ``fn`` reads whole (weights, keys).
      min_tiles: the fewest tiles the loop runs (:data:`MIN_TILES`; the product's own
        floor is :data:`DOT_MIN_TILES`).

    Returns:
      ``fn``'s pytree with each leaf ``[M, ...]``.
    """
    m = rows[0].shape[0]
    mp = max(_ceil_to(m, XLA_ROW_TILE), min_tiles * XLA_ROW_TILE)
    tiles = tuple(
        jnp.pad(a, [(0, mp - m)] + [(0, 0)] * (a.ndim - 1)).reshape(
            mp // XLA_ROW_TILE, XLA_ROW_TILE, *a.shape[1:])
        for a in rows
    )
    tiles, shared = jax.lax.optimization_barrier((tiles, tuple(shared)))
    out = jax.lax.optimization_barrier(jax.lax.map(lambda t: fn(*t, *shared), tiles))
    return jax.tree.map(lambda o: o.reshape(mp, *o.shape[2:])[:m], out)


def _xla_tiled(x: jax.Array, ws: tuple[jax.Array, ...], nk: bool, out_dtype: Any) -> jax.Array:
    """The product as fixed-shape dots per ``XLA_ROW_TILE`` rows (a loop, one dot compiled
    per weight): each weight's own dot, their results side by side. (Concatenating the
    weights instead would copy them at every call: a decode step's merged q/k/v and gate/up
    weights, read twice and written once more.)"""
    dims = (((1,), (1 if nk else 0,)), ((), ()))
    # float32 operands in full float32: a GPU's default would round them to TF32, past the
    # float64 bound the tests hold products to (a CPU computes float32 either way)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None

    def tile(rows: jax.Array, *weights: jax.Array) -> jax.Array:
        out = [jax.lax.dot_general(rows, w, dims, preferred_element_type=jnp.float32,
                                   precision=precision)
               for w in weights]
        return (out[0] if len(out) == 1 else jnp.concatenate(out, axis=1)).astype(out_dtype)

    return row_tiled(tile, x, shared=tuple(ws), min_tiles=DOT_MIN_TILES)


def _unfused(x: jax.Array, ws: tuple[jax.Array, ...], nk: bool, out_dtype: Any,
             impl: str, label: str) -> jax.Array:
    """The product where no Triton kernel runs: the XLA form's row tiles (``impl="xla"``) or
    the TPU kernel, one call a weight with their results side by side."""
    if impl == "xla":
        return _xla_tiled(x, ws, nk, out_dtype)
    out = [tpu_matmul(x, w, w_layout="nk" if nk else "kn", out_dtype=out_dtype, impl=impl,
                      label=label) for w in ws]
    return out[0] if len(out) == 1 else jnp.concatenate(out, axis=1)


def _hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def mosaic_refusal(x: Any, widths: tuple[int, ...], nk: bool, tiles: Tiles) -> str | None:
    """Why the Mosaic kernel cannot run ``x @ w`` for weights of output ``widths`` (None when
    it can): it takes bfloat16 or float16 operands (``wgmma`` would round float32 ones to
    TF32), weights stored ``[K, N]``, and every weight's width a multiple of its tile's."""
    if tiles.mosaic is None:
        return "the tiles name no Mosaic tiling (Tiles(mosaic=None))"
    if jnp.dtype(x.dtype) == jnp.float32:
        return "float32 operands (the Mosaic kernel multiplies bfloat16 or float16)"
    if nk:
        return "weights stored [N, K] (the Mosaic kernel reads them [K, N])"
    bn = tiles.mosaic.block[1]
    if any(n % bn for n in widths):
        return f"a weight width not a multiple of {bn} (widths {widths})"
    return None


def _use_mosaic(kernel: str, x: jax.Array, widths: tuple[int, ...], nk: bool,
                tiles: Tiles) -> bool:
    refusal = mosaic_refusal(x, widths, nk, tiles)
    if kernel == "mosaic":
        if refusal is not None:
            raise BadInputError(f"kernel='mosaic' cannot run this product: {refusal}")
        return True
    return (kernel == "auto" and refusal is None and x.shape[0] >= MOSAIC_MIN_ROWS
            and _hopper())


def _mosaic(x: jax.Array, ws: tuple[jax.Array, ...], out_dtype: Any, schedule: Schedule,
            mosaic: MosaicTiles, label: str) -> jax.Array:
    """The product on the Mosaic kernel: rows padded to its row tile, K to whole tiles."""
    m, k = x.shape
    kp, _, per = schedule.plan(k)
    mp = _ceil_to(m, mosaic.block[0])
    out = mosaic_matmul(_pad(x, mp, kp), tuple(_pad(w, kp, w.shape[1]) for w in ws),
                        seg_cols=per * schedule.k_tile, out_dtype=out_dtype, tiles=mosaic,
                        name="rowinv_mosaic" + (f"_{label}" if label else ""))
    return out[:m]


@functools.partial(jax.jit, static_argnames=("nk", "out_dtype", "impl", "kernel", "schedule",
                                             "tiles", "parts", "label"))
def _rowinv_matmul(x: jax.Array, ws: tuple[jax.Array, ...], nk: bool, out_dtype: Any, impl: str,
                   kernel: str, schedule: Schedule, tiles: Tiles,
                   parts: bool = False, label: str = "") -> jax.Array:
    dtype = jnp.dtype(jnp.float32) if parts else out_dtype
    interpret = impl == "interpret"
    triton = impl in ("pallas", "interpret")
    matvec = triton and (kernel == "matvec" or (kernel == "auto" and x.shape[0] <= SMALL_M))
    ws = in_kernel(ws, schedule.k_tile, x.dtype) if triton and not nk else dense(ws, x.dtype)
    if impl in ("xla", *TPU_IMPLS):
        out = _unfused(x, ws, nk, dtype, impl, label)
        return out[None] if parts else out
    if matvec:
        partials = _matvec(x, ws, nk, schedule, tiles, interpret, label)
        return partials if parts else sum_parts(partials, out_dtype)
    widths = tuple(w.shape[0 if nk else 1] for w in ws)
    if not any(isinstance(w, QuantizedWeight) for w in ws) and _use_mosaic(
            kernel, x, widths, nk, tiles):
        out = _mosaic(x, ws, dtype, schedule, tiles.mosaic, label)
    else:
        out = _matmul(x, ws, nk, dtype, schedule, tiles, interpret, label)
    return out[None] if parts else out


def dense(ws: tuple[Any, ...], dtype: Any) -> tuple[jax.Array, ...]:
    """The weights with every quantized one dequantized to ``dtype``: how the XLA form and the
    wide kernels (a prefill's, whose rows share each weight tile) multiply by it."""
    return tuple(dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w for w in ws)


def in_kernel(ws: tuple[Any, ...], k_tile: int, dtype: Any) -> tuple[Any, ...]:
    """The weights as the matvec kernels take them: a quantized one in place where its
    groups fit the tiles (:func:`~turbospark_jax.kernels.quant_tiles.fits_tiles`), else
    dequantized."""
    return tuple(w if not isinstance(w, QuantizedWeight) or fits_tiles(w, k_tile)
                 else dequantize(w, dtype) for w in ws)


def gated_schedule(k: int) -> Schedule:
    """The schedule of a gated product over ``k``: all of K in one segment, so the kernel
    holds finished sums to gate (a function of ``k`` alone, as every schedule is)."""
    return Schedule(segment_tiles=-(-k // Schedule.k_tile))


def _mosaic_gated(x: jax.Array, gate: jax.Array, up: jax.Array, mosaic: MosaicTiles,
                  label: str) -> jax.Array:
    """The gated product for many rows on a Hopper GPU: the Mosaic kernel's two products under
    the gated schedule, gated in its own epilogue
    (:func:`~turbospark_jax.kernels.mosaic_matmul.mosaic_gated`) with the gated kernels' own
    gating (:func:`swiglu_gating`, the same code Triton compiles in the matvec kernel, so a
    row's bits agree with a decode step's): one launch, no round trip of the two products."""
    m, k = x.shape
    f = gate.shape[1]
    kp = gated_schedule(k).plan(k)[0]
    mp = _ceil_to(m, mosaic.block[0])
    out = mosaic_gated(_pad(x, mp, kp), _pad(gate, kp, f), _pad(up, kp, f),
                       epilogue=functools.partial(swiglu_gating, dtype=x.dtype),
                       out_dtype=x.dtype, tiles=mosaic,
                       name="rowinv_mosaic" + (f"_{label}" if label else ""))
    return out[:m]


def _gated_pallas(x: jax.Array, gate: jax.Array, up: jax.Array, kernel: str, tiles: Tiles,
                  interpret: bool, label: str) -> jax.Array:
    m, k = x.shape
    matvec = kernel == "matvec" or (kernel == "auto" and m <= SMALL_M)
    pair = in_kernel((gate, up), Schedule.k_tile, x.dtype)
    quantized = any(isinstance(w, QuantizedWeight) for w in pair)
    if not (matvec or quantized) and _use_mosaic(kernel, x, (gate.shape[1],) * 2, False, tiles):
        return _mosaic_gated(x, *pair, tiles.mosaic, label)
    kp, count, per = gated_schedule(k).plan(k)
    tile_dot = tile_dot_for(interpret)
    bn = tiles.gated_columns(gate.shape[1]) if matvec else tiles.bn
    cols = _Columns((gate.shape[1],), bn)
    layouts = tuple(QuantLayout.of(w) if isinstance(w, QuantizedWeight) else None
                    for w in pair)
    # both weights read the same column block: one weight's columns in the grid
    w_specs, ws = _weight_operands(pair, layouts, cols, kp, kp, False, lambda i, j: 0,
                                   shared_columns=True)
    name = "rowinv_" + ("matvec" if matvec else "matmul") + (f"_{label}" if label else "")
    if matvec:  # the call's own rows, as the matvec kernel reads and writes them
        mp, bm = _ceil_to(m, ROW_TILE), ROW_TILE
        kernel_fn = functools.partial(_gated_matvec_kernel, per=count,
                                      k_tile=Schedule.k_tile, tile_dot=tile_dot,
                                      rows=None if m == mp else m, layouts=layouts,
                                      pdl=not interpret)
        x_in, rows_out = _pad(x, m, kp), m
        params = compiler_params(interpret, tiles.matvec_warps, tiles.gated_stages)
    else:
        mp, bm = _ceil_to(m, tiles.bm), tiles.bm
        kernel_fn = functools.partial(_gated_matmul_kernel, tiles=count, per=per,
                                      k_tile=Schedule.k_tile, tile_dot=tile_dot,
                                      flat=tiles.flat_loop, layouts=layouts)
        x_in, rows_out = _pad(x, mp, kp), mp
        params = compiler_params(interpret, tiles.warps, tiles.stages)
    out = pl.pallas_call(
        kernel_fn,
        grid=(mp // bm, cols.offsets[-1]),
        in_specs=[pl.BlockSpec((bm, kp), lambda i, j: (i, 0)), *w_specs],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows_out, cols.offsets[-1] * bn), x.dtype),
        interpret=interpret,
        name=name,
        **params,
    )(x_in, *ws)
    return cols.gather(out, m)


@functools.partial(jax.jit, static_argnames=("impl", "kernel", "tiles", "label"))
def _rowinv_swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, impl: str, kernel: str,
                   tiles: Tiles, label: str) -> jax.Array:
    if impl in ("xla", *TPU_IMPLS):
        both = _unfused(x, dense((gate, up), x.dtype), False, x.dtype, impl, label)
        f = gate.shape[1]
        return swiglu_gating(both[:, :f], both[:, f:], x.dtype)
    return _gated_pallas(x, gate, up, kernel, tiles, impl == "interpret", label)


def rowinv_swiglu(
    x: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    *,
    impl: str = "auto",
    kernel: str = "auto",
    tiles: Tiles = Tiles(),
    label: str = "gate_up",
) -> jax.Array:
    """SwiGLU's hidden rows ``silu(x @ gate) * (x @ up)``, each row independent of the others.

    On a GPU one launch reads both weights' same column block and gates the finished sums in
    its epilogue (:func:`swiglu_gating`: each product rounded to ``x.dtype``, SiLU in float32
    rounded once, the product in ``x.dtype``), so the products never go to memory and no
    gating kernel runs after them. The reduction over K follows :func:`gated_schedule` (one
    segment) in either kernel, and the epilogue is the same code in both, so a row's bits do
    not depend on the row count. Elsewhere: the XLA form's product of both weights, then the
    same gating in XLA.

    Args:
      x: ``[M, K]``; gate, up: ``[K, F]`` each, of ``x``'s dtype (bfloat16, float16, float32).
      impl, kernel, tiles, label: as for :func:`rowinv_matmul`.

    Returns:
      ``[M, F]`` in ``x.dtype``.

    Raises:
      BadInputError: operands that are not 2-D, empty, of different or unsupported dtypes,
        or of mismatched shapes; an unknown ``impl`` or ``kernel``; ``impl="pallas"`` off a
        GPU.
    """
    for name, a in (("x", x), ("gate", gate), ("up", up)):
        if getattr(a, "ndim", None) != 2 or 0 in a.shape:
            raise BadInputError(f"{name} must be a non-empty 2-D array, got shape "
                                f"{getattr(a, 'shape', type(a).__name__)}")
    if gate.shape != up.shape or x.shape[1] != gate.shape[0]:
        raise BadInputError(f"x [M, K] with gate and up [K, F] of one shape; got x "
                            f"{tuple(x.shape)}, gate {tuple(gate.shape)}, up {tuple(up.shape)}")
    if jnp.dtype(x.dtype) not in _DTYPES or not x.dtype == gate.dtype == up.dtype:
        raise BadInputError(f"x, gate and up must share one dtype of bfloat16, float16, "
                            f"float32; got {x.dtype}, {gate.dtype}, {up.dtype}")
    impl = _resolve_call(impl, kernel, label)
    return _rowinv_swiglu(x, gate, up, impl, kernel, tiles, label)


def _resolve_call(impl: str, kernel: str, label: str) -> str:
    """The impl a product call runs on (:func:`resolve_impl`), after the checks both public
    products share: a known ``kernel``, a ``label`` fit for a kernel's name, and
    ``kernel="mosaic"`` only where its kernel runs."""
    if kernel not in KERNELS:
        raise BadInputError(f"kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
    if not isinstance(label, str) or not all(c.isalnum() or c == "_" for c in label):
        raise BadInputError(f"label must be letters, digits and underscores; got {label!r}")
    impl = resolve_impl(impl, tpu=True)
    if kernel == "mosaic" and impl != "pallas":
        raise BadInputError(f"kernel='mosaic' runs on a Hopper GPU only (impl 'pallas'); "
                            f"impl {impl!r} has no Mosaic kernel: use kernel='matmul'")
    return impl


def resolve_impl(impl: str, tpu: bool = False) -> str:
    """``impl`` with ``"auto"`` made concrete for the default backend.

    Args:
      impl: one of :data:`IMPLS`.
      tpu: the caller has a TPU kernel (the products do; the norm does not, and takes
        neither TPU impl).

    Raises:
      BadInputError: ``impl`` is not one of :data:`IMPLS`, ``"pallas"`` off a GPU, ``"tpu"``
        off a TPU, or a TPU impl where the caller has no TPU kernel.
    """
    if impl not in IMPLS:
        raise BadInputError(f"impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    backend = jax.default_backend()
    if impl == "auto":
        return {"gpu": "pallas", "tpu": "tpu" if tpu else "xla"}.get(backend, "xla")
    if impl in TPU_IMPLS and not tpu:
        raise BadInputError(f"impl={impl!r}: this kernel has no TPU form; use 'xla'")
    if impl == "tpu" and backend != "tpu":
        raise BadInputError(
            f"impl='tpu' needs a TPU (the backend is {backend!r}); use 'tpu_interpret' to "
            "run the TPU kernel in Pallas' TPU interpreter, or 'xla'")
    if impl == "pallas" and backend != "gpu":
        raise BadInputError(
            f"impl='pallas' needs a GPU (the backend is {jax.default_backend()!r}); use "
            "'interpret' to run the kernels in the Pallas interpreter, or 'xla'"
        )
    return impl


def rowinv_matmul(
    x: jax.Array,
    w: jax.Array | tuple[jax.Array, ...],
    *,
    w_layout: str = "kn",
    out_dtype: Any = None,
    impl: str = "auto",
    kernel: str = "auto",
    schedule: Schedule = Schedule(),
    tiles: Tiles = Tiles(),
    parts: bool = False,
    label: str = "",
) -> jax.Array:
    """``x @ w`` accumulated in float32, with each row's result independent of the others'.

    Row ``r`` of the result is a function of ``x[r]``, ``w`` and ``schedule`` only: bitwise
    the same for any number of rows, any position of the row, either kernel and any ``tiles``
    (see the module docstring for how, and where each part is checked).

    Args:
      x: ``[M, K]``, bfloat16, float16 or float32.
      w: ``[K, N]`` (``[N, K]`` with ``w_layout="nk"``), the same dtype as ``x``; or a tuple
        of such matrices, whose products come out side by side (``[M, N1 + N2 + ...]``) from
        one launch, without the weights ever being concatenated in memory (a merged q/k/v or
        gate/up projection).
      w_layout: ``"kn"`` or ``"nk"``: the weights stored transposed, as a tied output head's
        embedding table is (read in place, never transposed in memory).
      out_dtype: the result's dtype (one of the three); ``x.dtype`` when None.
      impl: one of :data:`IMPLS`.
      kernel: one of :data:`KERNELS` (Pallas impls only; ``"auto"``: matvec for at most
        :data:`SMALL_M` rows, matmul above).
      schedule: the reduction order over ``K`` (the GPU's Pallas impls only).
      tiles: the kernels' tile sizes and Triton settings (speed only).
      parts: return the product unfinished, as float32 partial sums over K ``[S, M, N]``
        (``S`` segments from the matvec kernel, 1 from the others) that :func:`sum_parts`
        finishes: bitwise the finished product. A consumer kernel that adds them itself
        (``pallas_row_norm``, ``pallas_rope_store``) saves the launch that would add them.
      label: appended to the kernel's name (``rowinv_matvec_<label>``), so a profile tells
        the model's products apart (letters, digits and underscores).

    Returns:
      ``[M, N]`` (or ``[M, N1 + N2 + ...]``) in ``out_dtype``; with ``parts``, float32
      ``[S, M, N]``.

    Raises:
      BadInputError: operands that are not 2-D, empty, of different or unsupported dtypes,
        or whose inner dimensions differ; an unknown ``w_layout``, ``impl``, ``kernel`` or
        ``out_dtype``; ``impl="pallas"`` off a GPU, ``impl="tpu"`` off a TPU.
    """
    if w_layout not in ("kn", "nk"):
        raise BadInputError(f"w_layout must be 'kn' or 'nk'; got {w_layout!r}")
    nk = w_layout == "nk"
    ws = tuple(w) if isinstance(w, tuple | list) else (w,)
    if not ws:
        raise BadInputError("w must be a matrix or a non-empty tuple of matrices")
    for name, a in (("x", x), *((f"w[{i}]" if len(ws) > 1 else "w", b) for i, b in enumerate(ws))):
        if getattr(a, "ndim", None) != 2 or 0 in a.shape:
            raise BadInputError(f"{name} must be a non-empty 2-D array, got shape "
                                f"{getattr(a, 'shape', type(a).__name__)}")
    for b in ws:
        inner = b.shape[1] if nk else b.shape[0]
        if x.shape[1] != inner:
            form = "[N, K]" if nk else "[K, N]"
            raise BadInputError(f"x [M, K] @ w needs equal K (w is {form}); got x "
                                f"{tuple(x.shape)} and w {tuple(b.shape)}")
        if jnp.dtype(x.dtype) not in _DTYPES or x.dtype != b.dtype:
            raise BadInputError(f"x and w must share one dtype of bfloat16, float16, float32; "
                                f"got {x.dtype} and {b.dtype}")
    out = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if out not in _DTYPES:
        raise BadInputError(f"out_dtype must be bfloat16, float16 or float32; got {out}")
    impl = _resolve_call(impl, kernel, label)
    return _rowinv_matmul(x, ws, nk, out, impl, kernel, schedule, tiles,
                          as_bool("parts", parts), label)
