"""Row-invariant RMSNorm, optionally after a residual add: a Pallas (Triton) kernel.

:func:`row_rms_norm` computes :func:`~turbospark_jax.kernels.layers.rms_norm` (its default
rounding: normalise in float32, round to the activation dtype, scale in that dtype) over the
last axis, and with ``residual`` first forms ``h = residual + x`` and returns ``h`` as well,
the step that opens every pre-norm block (``h = x + attention(norm(x))``; the next norm reads
``h``).

The kernel runs one program per row (grid ``(M,)``), and each program loads its whole row as a
single block of ``Dp`` columns (``D`` rounded up to a power of two, the padding zeros, which add
nothing to the sum of squares; the mean divides by the true ``D``). The program, its block and
its Triton settings are functions of ``D`` alone, so every row runs the same instructions
whatever ``M`` is and wherever the row sits: a row's bits depend on that row, the weight and
``eps`` only, as the block program's bitwise guarantees ask of the norms. Its steps are
functions a kernel that norms a row among other work can share (:func:`inverse_rms`, whose
sum of squares may instead be a fixed halving tree, :func:`halving_sum`, for a kernel whose
layout differs: the last program of a product). In the Pallas interpreter the norm's tests
check that on a CPU; the compiled kernel is checked on the GPU.

``impl="xla"`` (the default off a GPU) is the plain XLA expression, ``residual + x`` and
``layers.rms_norm``. On a CPU its rows are *not* claimed to be independent of ``M``: XLA's
reductions may sum a row differently at other row counts. Callers that need invariance on
the CPU run the norm in fixed-shape tiles with
:func:`~turbospark_jax.kernels.rowinv.row_tiled`.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import layers
from turbospark_jax.kernels import pdl as pallas_pdl
from turbospark_jax.kernels.rowinv import resolve_impl, sum_parts

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
#: Rows of at most this many (padded) columns run with 4 warps, wider ones with 8.
NARROW_ROW = 1024


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def halving_sum(v: jax.Array) -> jax.Array:
    """The sum of ``v [n]`` (``n`` a power of two) as a fixed tree: the first half added to
    the second elementwise, again and again, down to one value. Every addition pairs two
    named elements, so the order is the tree's whatever layout a compiler gives ``v``
    (``jnp.sum``'s order in a Triton kernel follows the layout, which follows the kernel
    around it): the norm kernel and a kernel that norms rows among other work (the last
    program of a product) get one sum from the same row."""
    while v.shape[0] > 1:
        # halves as a split, not a reduction over a [2, n] view: XLA merges a chain of
        # reductions into one of its own order
        first, second = jnp.split(v, 2)
        v = first + second
    return v.reshape(())


def finished_rows(residual: jax.Array, *deltas: jax.Array, dtype: Any) -> jax.Array:
    """``residual`` plus each delta in turn, each sum rounded to ``dtype`` (float32 has more
    than twice the bits of bfloat16 or float16, so rounding the float32 sum gives the
    correctly rounded sum: XLA's ``residual + delta``)."""
    h = residual
    for delta in deltas:
        h = (h.astype(jnp.float32) + delta.astype(jnp.float32)).astype(dtype)
    return h


def parts_total(load: Any, parts: int, dtype: Any) -> jax.Array:
    """Partial sums ``load(0) .. load(parts - 1)`` added in order, rounded once to ``dtype``
    (:func:`~turbospark_jax.kernels.rowinv.sum_parts`' arithmetic)."""
    total = load(0)
    for i in range(1, parts):
        total = total + load(i)
    return total.astype(dtype)


def inverse_rms(h: jax.Array, d: int, eps: float, tree: bool = True) -> jax.Array:
    """``1 / sqrt(mean(h ** 2) + eps)`` of a row ``h [Dp]`` (zeros past the true ``d``), its
    sum of squares a :func:`halving_sum` (``tree``) or ``jnp.sum`` (Triton's order)."""
    x32 = h.astype(jnp.float32)
    squares = x32 * x32
    return jax.lax.rsqrt((halving_sum(squares) if tree else jnp.sum(squares)) / d + eps)


def scaled_rows(h: jax.Array, inv: jax.Array, weight: jax.Array | None, dtype: Any) -> jax.Array:
    """``h`` normed by ``inv`` and rounded to ``dtype``, then times ``weight`` (two bfloat16 or
    float16 values multiply exactly in float32), as ``layers.rms_norm`` rounds."""
    normed = (h.astype(jnp.float32) * inv).astype(dtype)
    if weight is None:
        return normed
    return (weight.astype(jnp.float32) * normed.astype(jnp.float32)).astype(dtype)


def _norm_kernel(*refs: Any, eps: float, d: int, has_weight: bool, has_residual: bool,
                 parts: int, pdl: bool = False) -> None:
    # Refs in order: x, [weight], [residual], then outputs [h], normed; the row blocks are
    # [Dp] (x's is [parts, Dp] when it comes as float32 partial sums).
    refs = list(refs)
    x_ref = refs.pop(0)
    w_ref = refs.pop(0) if has_weight else None
    r_ref = refs.pop(0) if has_residual else None
    h_out = refs.pop(0) if has_residual else None
    (o_ref,) = refs
    dtype = o_ref.dtype
    gate = pallas_pdl.ready(pallas_pdl.start(pdl))  # (None in the interpreter)

    def read(ref: Any) -> jax.Array:  # a row the kernel ahead wrote: after its wait
        if gate is None:
            return ref[...]
        from jax.experimental.pallas import triton as plgpu

        return plgpu.load(ref, mask=pallas_pdl.masked(None, gate, ref.shape), other=0)

    x = parts_total(lambda i: read(x_ref.at[i, :]), parts, dtype) if parts else read(x_ref)
    if r_ref is not None:
        x = finished_rows(read(r_ref), x, dtype=dtype)
        h_out[...] = x
    o_ref[...] = scaled_rows(x, inverse_rms(x, d, eps, tree=False),
                             None if w_ref is None else w_ref[...], dtype)


def _pallas(x: jax.Array, weight: jax.Array | None, residual: jax.Array | None, eps: float,
            interpret: bool, dtype: Any) -> Any:
    parts = x.shape[0] if x.ndim == 3 else 0  # [S, M, D]: float32 partial sums
    m, d = x.shape[-2:]
    dp = _next_power_of_two(d)
    if dp != d:
        pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, dp - d)])  # noqa: E731
        x, weight, residual = (None if a is None else pad(a) for a in (x, weight, residual))
    row = pl.BlockSpec((None, dp), lambda i: (i, 0))
    first = pl.BlockSpec((parts, None, dp), lambda i: (0, i, 0)) if parts else row
    operands, specs = [x], [first]
    if weight is not None:
        operands.append(weight)
        specs.append(pl.BlockSpec((dp,), lambda i: (0,)))
    if residual is not None:
        operands.append(residual)
        specs.append(row)
    outs = 2 if residual is not None else 1
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        warps = 4 if dp <= NARROW_ROW else 8  # from D alone, never from M
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=warps, num_stages=1)
    kernel = functools.partial(_norm_kernel, eps=eps, d=d, has_weight=weight is not None,
                               has_residual=residual is not None, parts=parts,
                               pdl=not interpret)
    out = pl.pallas_call(
        kernel,
        grid=(m,),
        in_specs=specs,
        out_specs=[row] * outs,
        out_shape=[jax.ShapeDtypeStruct((m, dp), dtype)] * outs,
        interpret=interpret,
        name="row_rms_norm",
        **kwargs,
    )(*operands)
    out = [o[:, :d] for o in out]
    return tuple(out) if residual is not None else out[0]


@functools.partial(jax.jit, static_argnames=("eps", "impl"))
def _row_rms_norm(x: jax.Array, weight: jax.Array | None, residual: jax.Array | None,
                  eps: float, impl: str) -> Any:
    return _norm(x, weight, residual, eps, impl, parts=False)


@functools.partial(jax.jit, static_argnames=("eps", "impl"))
def _add_parts_rms_norm(residual: jax.Array, parts: jax.Array, weight: jax.Array | None,
                        eps: float, impl: str) -> Any:
    return _norm(parts, weight, residual, eps, impl, parts=True)


def _norm(x: jax.Array, weight: jax.Array | None, residual: jax.Array | None, eps: float,
          impl: str, parts: bool) -> Any:
    dtype = residual.dtype if parts else x.dtype
    if impl == "xla":
        delta = sum_parts(x, dtype) if parts else x
        h = delta if residual is None else residual + delta
        normed = layers.rms_norm(h, weight, eps)
        return normed if residual is None else (h, normed)
    shape = residual.shape if parts else x.shape
    rows = lambda a: None if a is None else a.reshape(-1, shape[-1])  # noqa: E731
    first = x.reshape(x.shape[0], -1, shape[-1]) if parts else rows(x)
    out = _pallas(first, weight, rows(residual), eps, impl == "interpret", dtype)
    if residual is None:
        return out.reshape(shape)
    return tuple(o.reshape(shape) for o in out)


def _shape(a: Any) -> Any:
    return tuple(a.shape) if hasattr(a, "shape") else type(a).__name__


def _check(x: Any, weight: Any, residual: Any, eps: Any, name: str = "x") -> None:
    if getattr(x, "ndim", 0) < 1 or x.size == 0:
        raise BadInputError(f"{name} must be a non-empty array [..., D] of at least one axis; "
                            f"got shape {_shape(x)}")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise BadInputError(f"{name} must be bfloat16, float16 or float32; got {x.dtype}")
    d = x.shape[-1]
    if weight is not None and (getattr(weight, "shape", None) != (d,)
                               or weight.dtype != x.dtype):
        raise BadInputError(
            f"weight must be [D] = [{d}] in {name}'s dtype {x.dtype} (or None for a scale-free "
            f"norm); got shape {_shape(weight)}, dtype {getattr(weight, 'dtype', None)}")
    if residual is not None and (getattr(residual, "shape", None) != x.shape
                                 or residual.dtype != x.dtype):
        raise BadInputError(
            f"residual must match x: shape {tuple(x.shape)}, dtype {x.dtype}; got shape "
            f"{_shape(residual)}, dtype {getattr(residual, 'dtype', None)}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise BadInputError(f"eps must be a Python number (it is static); got {eps!r}")


def row_rms_norm(
    x: jax.Array,
    weight: jax.Array | None,
    eps: float,
    *,
    residual: jax.Array | None = None,
    impl: str = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """RMSNorm over the last axis of ``x``, each row's bits independent of the other rows.

    Under a Pallas impl row ``r`` of every result is a function of ``x[r]`` (and
    ``residual[r]``), ``weight`` and ``eps`` only: the same bits for any number of rows and
    any position of the row (see the module docstring).

    Args:
      x: ``[..., D]`` activations, bfloat16, float16 or float32; every leading index is a row
        (``[W, D]`` hidden states, ``[W, H, hd]`` heads for a per-head q/k norm).
      weight: ``[D]`` scale in ``x``'s dtype, or None for a scale-free norm.
      eps: added to the mean square before the reciprocal square root (static: a new value
        compiles anew).
      residual: ``[..., D]`` like ``x``, or None. When given, the norm reads
        ``h = residual + x`` (rounded once to ``x``'s dtype).
      impl: one of ``"auto"`` (the kernel on a GPU, the XLA expression elsewhere),
        ``"pallas"``, ``"interpret"`` (the kernel in the Pallas interpreter) or ``"xla"``.

    Returns:
      Without ``residual``, the normed ``[..., D]`` in ``x``'s dtype; with it, ``(h, normed)``.

    Raises:
      BadInputError: ``x`` not an array of at least one axis or with no elements; an
        unsupported dtype; ``weight`` not ``[D]`` in ``x``'s dtype; ``residual`` not of ``x``'s
        shape and dtype; ``eps`` not a real number; an unknown ``impl``, or ``"pallas"`` off a
        GPU.
    """
    _check(x, weight, residual, eps)
    return _row_rms_norm(x, weight, residual, float(eps), resolve_impl(impl))


def add_parts_rms_norm(
    residual: jax.Array,
    parts: jax.Array,
    weight: jax.Array | None,
    eps: float,
    *,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """:func:`row_rms_norm` of ``h = residual + delta``, where ``delta`` comes unfinished: the
    float32 partial sums over K of a row-invariant product
    (:func:`~turbospark_jax.kernels.rowinv.rowinv_matmul` with ``parts=True``), which the
    kernel adds in order and rounds to ``residual``'s dtype itself
    (:func:`~turbospark_jax.kernels.rowinv.sum_parts`' arithmetic). Bitwise the same as
    ``row_rms_norm(sum_parts(parts, residual.dtype), weight, eps, residual=residual)``, in one
    launch instead of two.

    Args:
      residual: ``[..., D]``, bfloat16, float16 or float32.
      parts: float32 ``[S, ..., D]``: ``S`` partial sums of the rows ``residual`` has.
      weight, eps, impl: as for :func:`row_rms_norm`.

    Returns:
      ``(h, normed)``, both ``[..., D]`` in ``residual``'s dtype.

    Raises:
      BadInputError: ``parts`` not float32 of ``residual``'s shape behind a leading axis;
        the rest as :func:`row_rms_norm` raises for ``x``.
    """
    _check(residual, weight, None, eps, name="residual")
    if (getattr(parts, "dtype", None) != jnp.float32 or getattr(parts, "ndim", 0) < 2
            or tuple(parts.shape[1:]) != tuple(residual.shape) or parts.shape[0] < 1):
        raise BadInputError(
            f"parts must be float32 [S, *residual.shape] = [S, "
            f"{', '.join(map(str, residual.shape))}] with S >= 1; got shape {_shape(parts)}, "
            f"dtype {getattr(parts, 'dtype', None)}")
    return _add_parts_rms_norm(residual, parts, weight, float(eps), resolve_impl(impl))
