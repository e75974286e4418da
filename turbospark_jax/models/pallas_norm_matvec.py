"""A decode step's RMSNorm inside the product after it: the norm as the product's prologue.

At one row a norm kernel is almost all launch and latency (an H100 traced 2.3 us a norm, two
a layer, against the microseconds of weights the products after it stream). Here the
products that read a normed row norm it themselves: every program of the row-invariant
matvec kernel (:mod:`~turbospark_jax.models.rowinv`) loads the whole row's pieces (the
residual and the unfinished products still to be added to it, as float32 partial sums),
finishes the row, takes its inverse RMS, and then norms each K tile of its own segment as
its loop reaches it, instead of loading a normed tile. The row is a few kilobytes that every
program reads from the L2 cache; no program waits for another. A tile's pieces are loaded one
loop step ahead (carried to the next step): session 36's form of this fusion loaded them in
the step that used them, outside Triton's pipelining of the weight tiles, and each of its
tiles waited a round trip to L2 (the 1B decode fell to 400 tokens/s on an H100;
``benchmarks/results/NOTES.md``, "The norm inside the product").

* :func:`norm_matvec_parts`: the normed row times one or more weights, as the matvec kernel's
  float32 partial sums (the q/k/v product after the input norm);
* :func:`norm_swiglu`: the gated product of the MLP after the post-attention norm, which also
  writes the finished residual row for the layer after it.

A row comes out bitwise as the norm kernel followed by the plain kernel would give it: the
finishing adds, the rounding and the scaling are :mod:`~turbospark_jax.models.pallas_row_norm`'s
own functions, its sum of squares a fixed tree (:func:`~turbospark_jax.models.pallas_row_norm.
halving_sum`) rather than a reduction whose order would follow each kernel's layout, and the
K loop is the matvec kernel's (:func:`~turbospark_jax.models.rowinv.segment_sum`) with the
same tiles in the same order. ``tests/test_pallas_norm_matvec.py`` checks that in the Pallas
interpreter; on the GPU the kernel tests and the benchmarks' exact part check it compiled.

Only a single row of a 16-bit dtype whose width is a power of two takes this path
(:func:`refusal` says why another does not): the square of a bfloat16 or float16 value is
exact in float32, so a compiler that fuses a square into the next addition (an FMA) changes
no bit, and a power-of-two width is one tree with no padding. Wider calls (a verify, a
prefill chunk) run the norm kernel and the plain products, which give the same rows.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from turbospark_jax.errors import BadInputError
from turbospark_jax.models import rowinv
from turbospark_jax.models.pallas_row_norm import (
    finished_rows,
    inverse_rms,
    parts_total,
    scaled_rows,
)

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TILES = rowinv.Tiles()


def refusal(residual: Any, weight: Any) -> str | None:
    """Why a norm of ``residual [M, D]`` cannot run inside the product after it (None when
    it can): one row, a 16-bit dtype, a power-of-two width of at least one K tile, and a
    norm weight of that width and dtype."""
    shape = getattr(residual, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] != 1:
        return f"the norm in a product's prologue takes one row [1, D]; got shape {shape}"
    if jnp.dtype(residual.dtype) not in _DTYPES:
        return f"a bfloat16 or float16 row (exact squares); got {residual.dtype}"
    d = shape[1]
    if d < rowinv.Schedule.k_tile or d & (d - 1):
        return f"a width that is a power of two of at least {rowinv.Schedule.k_tile}; got {d}"
    if weight is None or getattr(weight, "shape", None) != (d,) or weight.dtype != residual.dtype:
        return (f"a norm weight [D] = [{d}] in the row's dtype; got "
                f"{getattr(weight, 'shape', None)}, {getattr(weight, 'dtype', None)}")
    return None


class _Row:
    """A program's view of the row it norms: the residual ``[D]``, each delta's float32
    partial sums ``[S_i, D]`` and the norm weight ``[D]`` (refs), with the arithmetic the norm
    kernel runs on them."""

    def __init__(self, residual_ref: Any, delta_refs: tuple[Any, ...], weight_ref: Any,
                 eps: float) -> None:
        self.residual_ref, self.delta_refs = residual_ref, delta_refs
        self.weight_ref, self.eps = weight_ref, eps
        self.dtype = residual_ref.dtype

    def pieces(self, at: Any) -> tuple[jax.Array, ...]:
        """The loads columns ``at`` of the normed row need: the residual's, each delta's
        partial sums', the norm weight's."""
        parts = tuple(ref[i, at] for ref in self.delta_refs for i in range(ref.shape[0]))
        return (self.residual_ref[at], *parts, self.weight_ref[at])

    def finished(self, pieces: tuple[jax.Array, ...]) -> jax.Array:
        """The row's columns with every delta added, in order (from :meth:`pieces`)."""
        residual, *parts, _ = pieces
        deltas, i = [], 0
        for ref in self.delta_refs:
            n = ref.shape[0]
            deltas.append(parts_total(lambda j, i=i: parts[i + j], n, self.dtype))
            i += n
        return finished_rows(residual, *deltas, dtype=self.dtype)

    def whole(self) -> jax.Array:
        """The whole row with every delta added."""
        return self.finished(self.pieces(slice(None)))

    def inverse(self, h: jax.Array) -> jax.Array:
        """The inverse RMS of the finished row ``h`` (:meth:`whole`)."""
        return inverse_rms(h, self.residual_ref.shape[0], self.eps)

    def x_tile(self, pieces: tuple[jax.Array, ...], inv: jax.Array, rows: int) -> jax.Array:
        """``[rows, k_tile]``: the normed columns in row 0, zeros below it (the matvec
        kernel's x tile of a one-row call, whose padding rows read as zeros too)."""
        normed = scaled_rows(self.finished(pieces), inv, pieces[-1], self.dtype)
        first = jax.lax.broadcasted_iota(jnp.int32, (rows, normed.shape[0]), 0) == 0
        return jnp.where(first, normed[None, :], jnp.zeros((), self.dtype))

    def products(self, w_refs: tuple[Any, ...], inv: jax.Array, offset: Any,
                 shape: tuple[int, int], *, per: int, k_tile: int,
                 tile_dot: Any) -> tuple[jax.Array, ...]:
        """Each weight block's float32 sum over ``per`` K tiles of the row normed by ``inv``
        from column ``offset``: the matvec kernel's loop (:func:`~turbospark_jax.models.
        rowinv.tile_step`, the tiles in order from zero), with each tile's pieces loaded one
        step ahead, so their round trip to the L2 cache overlaps the tile before."""

        def cols(i: Any) -> Any:
            start = offset + i * k_tile
            if not isinstance(start, int):  # a traced start: say it is tile-aligned
                start = pl.multiple_of(start, k_tile)
            return pl.ds(start, k_tile)

        def body(i: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
            accs, pieces = carry
            ahead = self.pieces(cols(jnp.minimum(i + 1, per - 1)))
            x = self.x_tile(pieces, inv, shape[0])
            accs = tuple(rowinv.tile_step(lambda _: x, w_ref, i, k_tile=k_tile,
                                          tile_dot=tile_dot, acc=acc, nk=False)
                         for w_ref, acc in zip(w_refs, accs, strict=True))
            return accs, ahead

        zeros = tuple(jnp.zeros(shape, jnp.float32) for _ in w_refs)
        accs, _ = jax.lax.fori_loop(0, per, body, (zeros, self.pieces(cols(0))))
        return accs


def _row_refs(refs: list[Any], deltas: int, eps: float) -> _Row:
    residual_ref, *rest = refs[:deltas + 2]
    return _Row(residual_ref, tuple(rest[:deltas]), rest[deltas], eps)


def _norm_matvec_kernel(*refs: Any, deltas: int, eps: float, per: int, k_tile: int,
                        tile_dot: Any, offsets: tuple[int, ...]) -> None:
    # refs: residual [D], the deltas [S_i, D], the norm weight [D], the weights' blocks of
    # this program's segment, then the output block [16, bn] of partial sums.
    refs = list(refs)
    row = _row_refs(refs, deltas, eps)
    *w_refs, o_ref = refs[deltas + 2:]
    live = rowinv.live_masks(o_ref, o_ref, k_tile, 1)[1]
    offset = pl.program_id(2) * per * k_tile

    def compute(w_ref: Any) -> None:
        (acc,) = row.products((w_ref,), row.inverse(row.whole()), offset, o_ref.shape,
                              per=per, k_tile=k_tile, tile_dot=tile_dot)
        rowinv.store_live(o_ref, acc, live)

    rowinv.for_each_weight(offsets, pl.program_id(1), tuple(w_refs), compute)


def _norm_gated_kernel(*refs: Any, deltas: int, eps: float, per: int, k_tile: int,
                       tile_dot: Any) -> None:
    # refs: residual, deltas, norm weight, the gate and up blocks [D, bn], then the outputs:
    # the gated block [16, bn] and the finished row [D] (program 0 writes it).
    refs = list(refs)
    row = _row_refs(refs, deltas, eps)
    gate_ref, up_ref, o_ref, h_ref = refs[deltas + 2:]
    live = rowinv.live_masks(o_ref, o_ref, k_tile, 1)[1]
    h = row.whole()
    gate, up = row.products((gate_ref, up_ref), row.inverse(h), 0, o_ref.shape, per=per,
                            k_tile=k_tile, tile_dot=tile_dot)
    rowinv.store_live(o_ref, rowinv.swiglu_gating(gate, up, o_ref.dtype), live)

    @pl.when(pl.program_id(1) == 0)
    def _():
        h_ref[...] = h


def _row_operands(residual: jax.Array, deltas: tuple[jax.Array, ...],
                  weight: jax.Array) -> tuple[list[jax.Array], list[Any]]:
    d = residual.shape[1]
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    operands = [residual.reshape(d), *(p.reshape(p.shape[0], d) for p in deltas), weight]
    return operands, [whole(a.shape) for a in operands]


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "tiles", "label"))
def _norm_matvec_parts(residual: jax.Array, deltas: tuple[jax.Array, ...], weight: jax.Array,
                       ws: tuple[jax.Array, ...], eps: float, interpret: bool,
                       tiles: rowinv.Tiles, label: str) -> jax.Array:
    d = residual.shape[1]
    schedule = rowinv.schedule_for(d, sum(w.shape[1] for w in ws))
    kp, count, per = schedule.plan(d)
    segments, seg_len = count // per, per * schedule.k_tile
    bn = tiles.matvec_bn
    cols = rowinv.Columns(tuple(w.shape[1] for w in ws), bn)
    row_operands, row_specs = _row_operands(residual, deltas, weight)
    w_specs = [pl.BlockSpec((seg_len, bn), lambda i, j, s, w=w: (s, cols.spec_column(w, j)))
               for w in range(len(ws))]
    kernel = functools.partial(_norm_matvec_kernel, deltas=len(deltas), eps=eps, per=per,
                               k_tile=schedule.k_tile, tile_dot=rowinv.tile_dot_for(interpret),
                               offsets=cols.offsets)
    partials = pl.pallas_call(
        kernel,
        grid=(1, cols.offsets[-1], segments),
        in_specs=[*row_specs, *w_specs],
        out_specs=pl.BlockSpec((None, rowinv.ROW_TILE, bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((segments, 1, cols.offsets[-1] * bn), jnp.float32),
        interpret=interpret,
        name="rowinv_norm_matvec" + (f"_{label}" if label else ""),
        **rowinv.compiler_params(interpret, tiles.matvec_warps, tiles.matvec_stages),
    )(*row_operands, *rowinv.weights_padded(ws, kp, bn, False))
    return jax.vmap(lambda p: cols.gather(p, 1))(partials)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "tiles", "label"))
def _norm_swiglu(residual: jax.Array, deltas: tuple[jax.Array, ...], weight: jax.Array,
                 gate: jax.Array, up: jax.Array, eps: float, interpret: bool,
                 tiles: rowinv.Tiles, label: str) -> tuple[jax.Array, jax.Array]:
    d, f = residual.shape[1], gate.shape[1]
    kp, count, _ = rowinv.gated_schedule(d).plan(d)
    bn = tiles.gated_columns(f)
    cols = rowinv.Columns((f,), bn)
    row_operands, row_specs = _row_operands(residual, deltas, weight)
    kernel = functools.partial(_norm_gated_kernel, deltas=len(deltas), eps=eps, per=count,
                               k_tile=rowinv.Schedule.k_tile,
                               tile_dot=rowinv.tile_dot_for(interpret))
    gated, h = pl.pallas_call(
        kernel,
        grid=(1, cols.offsets[-1]),
        in_specs=[*row_specs, *[pl.BlockSpec((kp, bn), lambda i, j: (0, j))] * 2],
        out_specs=[pl.BlockSpec((rowinv.ROW_TILE, bn), lambda i, j: (i, j)),
                   pl.BlockSpec((d,), lambda i, j: (0,))],
        out_shape=[jax.ShapeDtypeStruct((1, cols.offsets[-1] * bn), residual.dtype),
                   jax.ShapeDtypeStruct((d,), residual.dtype)],
        interpret=interpret,
        name="rowinv_norm_matvec" + (f"_{label}" if label else ""),
        **rowinv.compiler_params(interpret, tiles.matvec_warps, tiles.gated_stages),
    )(*row_operands, *rowinv.weights_padded((gate, up), kp, bn, False))
    return h.reshape(1, d), cols.gather(gated, 1)


def _check(residual: Any, deltas: Any, weight: Any, eps: Any, ws: tuple[Any, ...],
           label: str) -> tuple[jax.Array, ...]:
    why = refusal(residual, weight)
    if why is not None:
        raise BadInputError(f"norm_matvec: {why}")
    deltas = tuple(deltas)
    d = residual.shape[1]
    for p in deltas:
        if (getattr(p, "dtype", None) != jnp.float32 or getattr(p, "ndim", 0) != 3
                or tuple(p.shape[1:]) != (1, d) or p.shape[0] < 1):
            raise BadInputError(
                f"each delta must be float32 partial sums [S, 1, {d}] with S >= 1; got shape "
                f"{getattr(p, 'shape', type(p).__name__)}, dtype {getattr(p, 'dtype', None)}")
    for w in ws:
        if getattr(w, "ndim", None) != 2 or w.shape[0] != d or w.dtype != residual.dtype \
                or w.shape[1] == 0:
            raise BadInputError(
                f"each weight must be [{d}, N] in {residual.dtype}; got shape "
                f"{getattr(w, 'shape', type(w).__name__)}, dtype {getattr(w, 'dtype', None)}")
    if isinstance(eps, bool) or not isinstance(eps, int | float):
        raise BadInputError(f"eps must be a Python number (it is static); got {eps!r}")
    rowinv.check_label(label)
    return deltas


def _impl(impl: str) -> bool:
    """Whether ``impl`` runs the interpreter (the kernels have no XLA form)."""
    impl = rowinv.resolve_impl(impl)
    if impl == "xla":
        raise BadInputError("the norm inside a product is a Pallas kernel: impl 'pallas' on "
                            "a GPU or 'interpret'; XLA's form is the norm, then the product")
    return impl == "interpret"


def norm_matvec_parts(
    residual: jax.Array,
    deltas: tuple[jax.Array, ...],
    weight: jax.Array,
    eps: float,
    ws: jax.Array | tuple[jax.Array, ...],
    *,
    impl: str = "auto",
    tiles: rowinv.Tiles = _TILES,
    label: str = "",
) -> jax.Array:
    """``rms_norm(residual + deltas) @ ws`` for one row, as float32 partial sums over K.

    Bitwise ``rowinv_matmul(normed, ws, parts=True, schedule=schedule_for(D, N))`` where
    ``normed`` is the norm kernel's (:func:`~turbospark_jax.models.pallas_row_norm.
    add_parts_rms_norm` of the deltas in turn), in one launch.

    Args:
      residual: ``[1, D]``, bfloat16 or float16, ``D`` a power of two (:func:`refusal`).
      deltas: float32 partial sums ``[S_i, 1, D]`` to add to it, in order (unfinished
        products, as :func:`~turbospark_jax.models.rowinv.rowinv_matmul` gives them with
        ``parts=True``); may be empty.
      weight: the norm's ``[D]`` scale; eps: its epsilon (static).
      ws: ``[D, N]`` or a tuple of such weights, their products side by side.
      impl: ``"auto"``/``"pallas"`` on a GPU, or ``"interpret"``.
      tiles: the matvec kernel's tile settings (speed only).
      label: appended to the kernel's name.

    Returns:
      float32 ``[S, 1, N1 + N2 + ...]``.

    Raises:
      BadInputError: any operand out of the shapes and dtypes above, or ``impl`` ``"xla"``.
    """
    ws = tuple(ws) if isinstance(ws, tuple | list) else (ws,)
    deltas = _check(residual, deltas, weight, eps, ws, label)
    if not ws:
        raise BadInputError("ws must be a matrix or a non-empty tuple of matrices")
    return _norm_matvec_parts(residual, deltas, weight, ws, float(eps), _impl(impl), tiles,
                              label)


def norm_swiglu(
    residual: jax.Array,
    deltas: tuple[jax.Array, ...],
    weight: jax.Array,
    eps: float,
    gate: jax.Array,
    up: jax.Array,
    *,
    impl: str = "auto",
    tiles: rowinv.Tiles = _TILES,
    label: str = "gate_up",
) -> tuple[jax.Array, jax.Array]:
    """``(h, rowinv_swiglu(rms_norm(h), gate, up))`` with ``h = residual + deltas`` (each
    delta's partial sums added in order and rounded, then added to the row and rounded, as
    the norm kernel does), for one row, in one launch: bitwise the norm kernel then the
    gated kernel.

    Args:
      residual, deltas, weight, eps, impl, tiles, label: as for :func:`norm_matvec_parts`.
      gate, up: ``[D, F]`` each, in ``residual``'s dtype.

    Returns:
      ``(h [1, D], gated [1, F])`` in ``residual``'s dtype.

    Raises:
      BadInputError: as :func:`norm_matvec_parts`; ``gate`` and ``up`` of different shapes.
    """
    deltas = _check(residual, deltas, weight, eps, (gate, up), label)
    if gate.shape != up.shape:
        raise BadInputError(f"gate and up must share one shape; got {tuple(gate.shape)} and "
                            f"{tuple(up.shape)}")
    return _norm_swiglu(residual, deltas, weight, gate, up, float(eps), _impl(impl), tiles,
                        label)
