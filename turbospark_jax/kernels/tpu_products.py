"""The row-invariant matrix product in Pallas' TPU dialect (Mosaic TPU).

``tpu_matmul(x [M, K], w [K, N])`` gives row ``r`` of its result bitwise the same for any
``M`` and any position of the row in ``x``, the contract of
:func:`~turbospark_jax.kernels.rowinv.rowinv_matmul`, on a TPU's own kernel.

What fixes a row's arithmetic is the K order, a function of ``K`` alone
(:func:`k_block_for`): ``K`` is cut into blocks of ``k_block`` columns (zero columns pad it
to whole lanes; they add exact zeros), and a program per ``[bm, 128]`` output tile walks
them in order, the grid's last axis, adding each block's float32 product onto an accumulator
in VMEM that starts at ``-0.0`` (the exact additive identity), then rounds the total once to
the output's dtype. The row tile ``bm`` (a power of two from the dtype's sublane count, see
:func:`row_tile_for`) grows with the row count, but a row of the matrix unit's product is a
function of that row and the weight block alone, so the tile's height changes no bit of it.

In Pallas' TPU interpreter (``impl="tpu_interpret"``, the form the tests run on a CPU) a
block's product is a CPU dot, whose arithmetic may follow the number of rows: there it runs
as dots of one shape, :data:`INTERPRET_ROWS` rows at a time (:func:`_block_dot`), so the
interpreted kernel shows the K order's invariance on a CPU. The matrix unit's own product
is the hardware's to keep; nothing here has run on a TPU.

Float32 operands multiply at full float32 precision (``Precision.HIGHEST``: the matrix
unit's default would round them to bfloat16 passes).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from turbospark_jax.errors import BadInputError

#: Output columns per program: one vector register's lanes.
LANES = 128
#: The largest row tile (a wide call's rows share each weight block over this many rows).
MAX_ROW_TILE = 256
#: The most K columns one grid step multiplies.
MAX_K_BLOCK = 512
#: Rows of the interpreter's block products (:func:`_block_dot`): the smallest row tile.
INTERPRET_ROWS = 8
#: Values of ``impl`` of :func:`tpu_matmul`.
TPU_IMPLS = ("tpu", "tpu_interpret")


def _ceil_to(n: int, step: int) -> int:
    return -(-n // step) * step


def sublanes(dtype: Any) -> int:
    """Rows of one vector register of ``dtype``: 8 for 32-bit values, 16 for 16-bit ones
    (two to a sublane)."""
    return 32 // (8 * jnp.dtype(dtype).itemsize) * 8


def row_tile_for(m: int, dtype: Any) -> int:
    """The row tile of an ``m``-row call: the least power of two that holds ``m`` rows, from
    one register's rows (:func:`sublanes`) to :data:`MAX_ROW_TILE`. Speed only: no bit of a
    row follows it."""
    tile = sublanes(dtype)
    while tile < min(m, MAX_ROW_TILE):
        tile *= 2
    return tile


def k_block_for(k: int) -> int:
    """The K columns of one grid step: a function of ``k`` alone, so every row count walks
    ``K`` in the same blocks. The largest multiple of the lanes, at most
    :data:`MAX_K_BLOCK`, that divides ``k`` rounded up to lanes: a weight whose ``K`` is a
    whole number of lanes is then read in place, never padded by a copy at each call."""
    lanes = _ceil_to(k, LANES) // LANES
    return LANES * max(d for d in range(1, MAX_K_BLOCK // LANES + 1) if lanes % d == 0)


def _block_dot(a: jax.Array, b: jax.Array, nk: bool, interpret: bool) -> jax.Array:
    """``a [bm, kb] @ b [kb, bn]`` (``b [bn, kb]`` with ``nk``) in float32: the matrix unit's
    product on a TPU, and in the interpreter dots of one shape, :data:`INTERPRET_ROWS` rows at
    a time."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (1 if nk else 0,)), ((), ()))
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=dims,
                            preferred_element_type=jnp.float32, precision=precision)
    if not interpret:
        return dot(a, b)
    return jnp.concatenate([dot(a[i : i + INTERPRET_ROWS], b)
                            for i in range(0, a.shape[0], INTERPRET_ROWS)])


def _kernel(x_ref: Any, w_ref: Any, o_ref: Any, acc_ref: Any, *, nk: bool,
            interpret: bool) -> None:
    step = pl.program_id(2)

    @pl.when(step == 0)
    def _() -> None:
        acc_ref[...] = jnp.full(acc_ref.shape, -0.0, jnp.float32)

    acc_ref[...] += _block_dot(x_ref[...], w_ref[...], nk, interpret)

    @pl.when(step == pl.num_programs(2) - 1)
    def _() -> None:
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _pad(a: jax.Array, rows: int, cols: int) -> jax.Array:
    if a.shape == (rows, cols):
        return a
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


@functools.partial(jax.jit, static_argnames=("nk", "out_dtype", "impl", "label"))
def _tpu_matmul(x: jax.Array, w: jax.Array, nk: bool, out_dtype: Any, impl: str,
                label: str = "") -> jax.Array:
    m, k = x.shape
    n = w.shape[0 if nk else 1]
    interpret = impl == "tpu_interpret"
    bm, kb = row_tile_for(m, x.dtype), k_block_for(k)
    mp, kp, np_ = _ceil_to(m, bm), _ceil_to(k, kb), _ceil_to(n, LANES)
    params = {"interpret": pltpu.InterpretParams()} if interpret else {
        "compiler_params": pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"))}
    if nk:  # a tied head's [N, K] table, read in place
        w_spec = pl.BlockSpec((LANES, kb), lambda i, j, s: (j, s))
        w = _pad(w, np_, kp)
    else:
        w_spec = pl.BlockSpec((kb, LANES), lambda i, j, s: (s, j))
        w = _pad(w, kp, np_)
    out = pl.pallas_call(
        functools.partial(_kernel, nk=nk, interpret=interpret),
        grid=(mp // bm, np_ // LANES, kp // kb),
        in_specs=[pl.BlockSpec((bm, kb), lambda i, j, s: (i, s)), w_spec],
        out_specs=pl.BlockSpec((bm, LANES), lambda i, j, s: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        scratch_shapes=[pltpu.VMEM((bm, LANES), jnp.float32)],
        name="tpu_rowinv_matmul" + (f"_{label}" if label else ""),
        **params,
    )(_pad(x, mp, kp), w)
    return out[:m, :n]


def tpu_matmul(x: jax.Array, w: jax.Array, *, w_layout: str = "kn", out_dtype: Any = None,
               impl: str = "tpu", label: str = "") -> jax.Array:
    """``x [M, K] @ w [K, N]`` accumulated in float32 on a TPU, each row's bits independent of
    the row count (see the module docstring).

    Args:
      x: ``[M, K]``; w: ``[K, N]`` of ``x``'s dtype (bfloat16, float16 or float32).
      w_layout: ``"kn"``, or ``"nk"`` for a weight stored ``[N, K]`` (a tied head).
      out_dtype: the result's dtype; ``x.dtype`` when None.
      impl: ``"tpu"`` (compiled by Mosaic for a TPU) or ``"tpu_interpret"`` (Pallas' TPU
        interpreter, on any backend).
      label: appended to the kernel's name, for profiles (letters, digits, underscores).

    Raises:
      BadInputError: operands that are not non-empty 2-D arrays of one supported dtype, an
        inner dimension that differs, an unknown ``w_layout`` or ``impl``, a bad ``label``.
    """
    if w_layout not in ("kn", "nk"):
        raise BadInputError(f"w_layout must be 'kn' or 'nk'; got {w_layout!r}")
    nk = w_layout == "nk"
    if impl not in TPU_IMPLS:
        raise BadInputError(f"impl must be one of {', '.join(TPU_IMPLS)}; got {impl!r}")
    if not isinstance(label, str) or not all(c.isalnum() or c == "_" for c in label):
        raise BadInputError(f"label must be letters, digits and underscores; got {label!r}")
    for name, a in (("x", x), ("w", w)):
        if getattr(a, "ndim", None) != 2 or 0 in a.shape:
            raise BadInputError(f"{name} must be a non-empty 2-D array, got shape "
                                f"{getattr(a, 'shape', type(a).__name__)}")
    if x.shape[1] != w.shape[1 if nk else 0]:
        raise BadInputError(f"x [M, K] @ w needs equal K (w is {'[N, K]' if nk else '[K, N]'}); "
                            f"got x {tuple(x.shape)} and w {tuple(w.shape)}")
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
    out = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if jnp.dtype(x.dtype) not in dtypes or x.dtype != w.dtype or out not in dtypes:
        raise BadInputError(f"x, w and out_dtype must be bfloat16, float16 or float32, x and w "
                            f"alike; got {x.dtype}, {w.dtype} and {out}")
    return _tpu_matmul(x, w, nk, out, impl, label)
