"""Row-invariant attention over a cache's absolute-position key blocks, in Pallas' TPU dialect.

``tpu_attention(q [W, H, hd], k, v [S, KV, hd], ...)`` is causal grouped-query attention
(the contract of :func:`~turbospark_jax.kernels.layers.attend`) in which a query row's bits do
not depend on ``W``: a program per query head and tile of :data:`QUERY_ROWS` rows walks the
cache in key blocks at fixed offsets (``0, B, 2B, ...``, ``B`` a function of ``S`` alone,
:func:`key_block_for`) with an online softmax in float32, as the GPU's row-invariant kernel
walks its absolute-position key tiles. The query tile has one height at every ``W``, so a
row's score and value products have one shape.

A tile skips a block none of its rows sees, and walks every other. Either is exact for each
of its rows: the probabilities of the keys a row does not see are exact zeros (selected, not
computed), so a block with no key the row sees keeps the row's running maximum (or, before
its first key, the finite ``MASK_VALUE`` it starts at), scales its sums by ``exp(0) == 1``
and adds zeros. So a row that shares a tile with rows that see more keys gets the same bits
as alone, and a row that sees no key comes out as zeros wherever it sits.

The operands are read in place: the queries, keys and values as ``[rows, heads * hd]``
views (a free reshape), each program's head a column block of ``hd``. A TPU wants ``hd`` a
multiple of 128 for that block; in the interpreter any ``hd`` runs. Nothing here has run on
a TPU: the interpreter (``impl="tpu_interpret"``) and the lowering for a TPU are what the
tests check.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.layers import MASK_VALUE
from turbospark_jax.kernels.tpu_products import TPU_IMPLS

#: Query rows of a program: one height at every ``W`` (a register's float32 sublanes).
QUERY_ROWS = 8
#: Keys of a block where the capacity is a multiple of it; a smaller or other capacity is
#: one block.
KEY_BLOCK = 128


def supported(head_dim: int, window: Any) -> bool:
    """Whether the kernel takes a model's attention: a head a whole number of lane blocks
    (a TPU's column block of the ``[rows, heads * hd]`` views) and a window that is static
    (an int or None; a window traced through a scan over layers is not)."""
    static = window is None or (isinstance(window, int) and not isinstance(window, bool))
    return head_dim % 128 == 0 and static


def key_block_for(capacity: int) -> int:
    """The keys of one block: a function of the cache's capacity alone."""
    return KEY_BLOCK if capacity % KEY_BLOCK == 0 else capacity


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                               preferred_element_type=jnp.float32, precision=precision)


def _kernel(qp_ref: Any, kp_ref: Any, q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any,
            m_ref: Any, l_ref: Any, acc_ref: Any, *, scale: float,
            window: int | None) -> None:
    block = pl.program_id(2)

    @pl.when(block == 0)
    def _() -> None:
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q_pos, k_pos = qp_ref[...], kp_ref[...]  # [T, 1], [1, B]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window

    @pl.when(jnp.any(visible))
    def _() -> None:
        scores = jnp.where(visible, _dot(q_ref[...], k_ref[...], 1) * scale, MASK_VALUE)
        m = m_ref[...]
        top = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
        fade = jnp.exp(m - top)
        probs = jnp.where(visible, jnp.exp(scores - top), 0.0)
        acc_ref[...] = acc_ref[...] * fade + _dot(probs.astype(v_ref.dtype), v_ref[...], 0)
        l_ref[...] = l_ref[...] * fade + jnp.sum(probs, axis=1, keepdims=True)
        m_ref[...] = top

    @pl.when(block == pl.num_programs(2) - 1)
    def _() -> None:
        l = l_ref[...]
        l = jnp.where(l > 0, l, 1.0)  # a row that sees no key: zeros, not NaN
        o_ref[...] = (acc_ref[...] / l).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "impl"))
def _tpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                   k_positions: jax.Array, window: int | None, impl: str) -> jax.Array:
    rows, heads, head_dim = q.shape
    capacity, kv_heads, _ = k.shape
    groups = heads // kv_heads
    kb = key_block_for(capacity)
    rp = -(-rows // QUERY_ROWS) * QUERY_ROWS
    q2 = jnp.pad(q.reshape(rows, heads * head_dim), ((0, rp - rows), (0, 0)))
    # padding rows sit before every key: they see none, and no tile walks a block for them
    qp = jnp.pad(q_positions.astype(jnp.int32), (0, rp - rows),
                 constant_values=jnp.iinfo(jnp.int32).min)[:, None]
    kp = k_positions.astype(jnp.int32)[None, :]
    interpret = impl == "tpu_interpret"

    def kv_column(h: Any, i: Any, b: Any) -> tuple[Any, Any]:
        # lax.div, not //: jnp's floor division lowers through sign, which Mosaic's lowering
        # resolves by asking the TPU's generation (no TPU at export time)
        return b, jax.lax.div(h, groups)

    params = {"interpret": pltpu.InterpretParams()} if interpret else {
        "compiler_params": pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"))}
    out = pl.pallas_call(
        functools.partial(_kernel, scale=head_dim**-0.5, window=window),
        grid=(heads, rp // QUERY_ROWS, capacity // kb),
        in_specs=[
            pl.BlockSpec((QUERY_ROWS, 1), lambda h, i, b: (i, 0)),
            pl.BlockSpec((1, kb), lambda h, i, b: (0, b)),
            pl.BlockSpec((QUERY_ROWS, head_dim), lambda h, i, b: (i, h)),
            pl.BlockSpec((kb, head_dim), kv_column),
            pl.BlockSpec((kb, head_dim), kv_column),
        ],
        out_specs=pl.BlockSpec((QUERY_ROWS, head_dim), lambda h, i, b: (i, h)),
        out_shape=jax.ShapeDtypeStruct((rp, heads * head_dim), v.dtype),
        scratch_shapes=[pltpu.VMEM((QUERY_ROWS, 1), jnp.float32),
                        pltpu.VMEM((QUERY_ROWS, 1), jnp.float32),
                        pltpu.VMEM((QUERY_ROWS, head_dim), jnp.float32)],
        name="tpu_attention",
        **params,
    )(qp, kp, q2, k.reshape(capacity, kv_heads * head_dim),
      v.reshape(capacity, kv_heads * head_dim))
    return out[:rows].reshape(rows, heads, head_dim)


def tpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                  k_positions: jax.Array, window: int | None = None, *,
                  impl: str = "tpu") -> jax.Array:
    """Causal grouped-query attention of ``q [W, H, hd]`` over ``k, v [S, KV, hd]`` with a
    query row's bits independent of ``W`` (see the module docstring).

    Args:
      q, k, v: queries (rotated), keys and values; ``H`` a multiple of ``KV``, one dtype.
      q_positions: ``[W]`` int; k_positions: ``[S]`` int (a row sees key ``s`` iff
        ``k_positions[s] <= q_positions[w]``).
      window: a sliding window (a static int: the row and ``window - 1`` earlier positions),
        or None.
      impl: ``"tpu"`` (compiled by Mosaic) or ``"tpu_interpret"`` (Pallas' TPU interpreter).

    Returns:
      ``[W, H, hd]`` in ``v.dtype``.

    Raises:
      BadInputError: mismatched shapes or dtypes, a window that is not a positive int, an
        unknown ``impl``.
    """
    if impl not in TPU_IMPLS:
        raise BadInputError(f"impl must be one of {', '.join(TPU_IMPLS)}; got {impl!r}")
    if (q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]
            or q.shape[1] % k.shape[1] or q_positions.shape != q.shape[:1]
            or k_positions.shape != k.shape[:1]):
        raise BadInputError(
            f"tpu_attention takes q [W, H, hd], k and v [S, KV, hd] (H a multiple of KV), "
            f"q_positions [W], k_positions [S]; got q {q.shape}, k {k.shape}, v {v.shape}, "
            f"q_positions {q_positions.shape}, k_positions {k_positions.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise BadInputError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, "
                            f"{v.dtype}")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                               or window < 1):
        raise BadInputError(f"window must be a positive int or None; got {window!r}")
    return _tpu_attention(q, k, v, q_positions, k_positions, window, impl)
