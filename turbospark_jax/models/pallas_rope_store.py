"""The RoPE-and-cache-write kernel: the steps between a layer's q/k/v projection and its
attention, fused into one GPU kernel (Pallas, Triton).

At decode widths those steps (RoPE with the queries' transpose into the attention kernel's
layout, the K cache write and the V cache write) are launch-bound kernels of their own.
:func:`rope_store` does all of it in one launch, reading the merged q/k/v product's output as
it comes (one ``[W, (H + 2 KV) hd]`` matrix): the optional per-head q/k RMSNorm (Qwen3), the
rotation of q and k, the queries written straight into the layout of
:func:`~turbospark_jax.models.pallas_attention.cached_attention_arranged`, and k and v
written into the layer's cache in place. (Figures, and the variant that was dropped:
``benchmarks/results/NOTES.md``.)

The kernel works row by row: a row's result never depends on another row, so the block
program's bitwise guarantees (one program, different live rows) hold with it as without.
:func:`rope_store_xla` is the XLA expression it replaces; the tests compare the two.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from turbospark_jax.models.layers import apply_rope, rms_norm
from turbospark_jax.models.pallas_attention import arrange_queries, query_rows


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def supported(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes these shapes (Triton tiles are powers of two)."""
    return all(_power_of_two(n) for n in (heads, kv_heads, head_dim)) and head_dim >= 16


def _split(qkv: jax.Array, heads: int, kv_heads: int) -> tuple[jax.Array, ...]:
    width = qkv.shape[0]
    x = qkv.reshape(width, heads + 2 * kv_heads, -1)
    return x[:, :heads], x[:, heads : heads + kv_heads], x[:, heads + kv_heads :]


def rope_store_xla(
    qkv: jax.Array, cos: jax.Array, sin: jax.Array, write_at: jax.Array,
    k_cache: jax.Array, v_cache: jax.Array, heads: int,
    q_norm: jax.Array | None = None, k_norm: jax.Array | None = None, eps: float = 1e-6,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The XLA form of :func:`rope_store` (same arguments and results)."""
    capacity, kv_heads, _ = k_cache.shape
    q, k, v = _split(qkv, heads, kv_heads)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scatter = {"mode": "drop", "unique_indices": True}
    return (arrange_queries(q, kv_heads, capacity),
            k_cache.at[write_at].set(k, **scatter), v_cache.at[write_at].set(v, **scatter))


def _rope_store_kernel(*refs: Any, eps: float, qk_norm: bool, capacity: int, heads: int,
                       kv_heads: int, parts: int) -> None:
    if qk_norm:
        at_ref, qkv_ref, cos_ref, sin_ref, qn_ref, kn_ref, _, _, q_out, k_out, v_out = refs
    else:
        at_ref, qkv_ref, cos_ref, sin_ref, _, _, q_out, k_out, v_out = refs
        qn_ref = kn_ref = None
    row, h = pl.program_id(0), pl.program_id(1)  # a row of the block, one of its KV heads
    groups = heads // kv_heads
    half = qkv_ref.shape[-1] // 2
    first, second = pl.ds(0, half), pl.ds(half, half)
    cos, sin = cos_ref[first][None, :], sin_ref[first][None, :]  # both halves are equal

    def load(heads_at: Any, columns: Any) -> jax.Array:
        """The projection's values at these heads and columns; from partial sums, added in
        order and rounded once (``rowinv.sum_parts``' arithmetic)."""
        if not parts:
            return qkv_ref[heads_at, columns]
        total = qkv_ref[0, heads_at, columns]
        for i in range(1, parts):
            total = total + qkv_ref[i, heads_at, columns]
        return total.astype(q_out.dtype)

    def rotate(start: Any, n: int, w_ref: Any) -> tuple[jax.Array, jax.Array]:
        """Heads ``start..start+n`` of this row, normed (optionally) and rotated: halves."""
        heads_at = pl.ds(start, n)
        x1, x2 = load(heads_at, first), load(heads_at, second)  # [n, hd/2] each
        if w_ref is not None:  # per-head RMSNorm first, rounded as rms_norm rounds it
            full = load(heads_at, slice(None)).astype(jnp.float32)
            inv = jax.lax.rsqrt(jnp.mean(full * full, axis=1) + eps)[:, None]
            x1 = w_ref[first][None, :] * (x1.astype(jnp.float32) * inv).astype(x1.dtype)
            x2 = w_ref[second][None, :] * (x2.astype(jnp.float32) * inv).astype(x2.dtype)
        return x1 * cos + (-x2) * sin, x2 * cos + x1 * sin

    # The row's query heads of KV head h go to rows row*G.. of that head's arranged queries.
    q1, q2 = rotate(h * groups, groups, qn_ref)
    q_out[h, pl.ds(row * groups, groups), first] = q1
    q_out[h, pl.ds(row * groups, groups), second] = q2
    at = at_ref[0]

    @pl.when(at < capacity)
    def _():
        k1, k2 = rotate(heads + h, 1, kn_ref)
        k_out[at, pl.ds(h, 1), first] = k1
        k_out[at, pl.ds(h, 1), second] = k2
        v_out[at, pl.ds(h, 1), :] = load(pl.ds(heads + kv_heads + h, 1), slice(None))


@functools.partial(jax.jit, static_argnames=("heads", "eps", "interpret"))
def rope_store(
    qkv: jax.Array, cos: jax.Array, sin: jax.Array, write_at: jax.Array,
    k_cache: jax.Array, v_cache: jax.Array, heads: int,
    q_norm: jax.Array | None = None, k_norm: jax.Array | None = None, eps: float = 1e-6,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Norm and rotate a block's queries and keys, and write its keys and values to the cache.

    One program per row and KV head (the head's queries, its key and its value); the caches
    are updated in place (the outputs alias them).

    Args:
      qkv: ``[W, (H + 2 KV) * hd]``: each row's q heads, then k heads, then v heads; or that
        product unfinished, float32 partial sums ``[S, W, (H + 2 KV) * hd]``
        (:func:`~turbospark_jax.models.rowinv.rowinv_matmul` with ``parts=True``), which the
        kernel adds in order and rounds to the cache's dtype as
        :func:`~turbospark_jax.models.rowinv.sum_parts` does (bitwise the same as passing
        the finished product, one launch fewer).
      cos, sin: ``[W, hd]`` rotary tables.
      write_at: int32 ``[W]`` the cache row each block row writes (``>= C``: none; the live
        targets must be distinct).
      k_cache, v_cache: ``[C, KV, hd]``.
      heads: ``H``.
      q_norm, k_norm: ``[hd]`` per-head RMSNorm scales (Qwen3), or None.
      eps: the q/k norm's epsilon.
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      ``(qr, k_cache, v_cache)``: the rotated queries in the attention kernel's layout
      ``[KV, R, hd]`` (see :func:`~turbospark_jax.models.pallas_attention.arrange_queries`;
      its padding rows are left unwritten), and the caches with the live rows written.
    """
    parts = qkv.shape[0] if qkv.ndim == 3 else 0
    width = qkv.shape[-2]
    capacity, kv_heads, head_dim = k_cache.shape
    dtype = k_cache.dtype
    rows = query_rows(width, heads, kv_heads, capacity, head_dim=head_dim)
    qk_norm = q_norm is not None
    whole = lambda shape: pl.BlockSpec(shape, lambda r, h: (0,) * len(shape))  # noqa: E731
    if parts:
        projection = qkv.reshape(parts, width, heads + 2 * kv_heads, head_dim)
        projection_spec = pl.BlockSpec((parts, None, heads + 2 * kv_heads, head_dim),
                                       lambda r, h: (0, r, 0, 0))
    else:
        projection = qkv.reshape(width, heads + 2 * kv_heads, head_dim).astype(dtype)
        projection_spec = pl.BlockSpec((None, heads + 2 * kv_heads, head_dim),
                                       lambda r, h: (r, 0, 0))
    operands = [write_at.astype(jnp.int32), projection, cos.astype(dtype), sin.astype(dtype)]
    specs = [pl.BlockSpec((1,), lambda r, h: (r,)),
             projection_spec,
             pl.BlockSpec((None, head_dim), lambda r, h: (r, 0)),
             pl.BlockSpec((None, head_dim), lambda r, h: (r, 0))]
    if qk_norm:
        operands += [q_norm.astype(dtype), k_norm.astype(dtype)]
        specs += [whole((head_dim,)), whole((head_dim,))]
    cache = whole((capacity, kv_heads, head_dim))
    kernel = functools.partial(_rope_store_kernel, eps=eps, qk_norm=qk_norm, capacity=capacity,
                               heads=heads, kv_heads=kv_heads, parts=parts)
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=1)
    return pl.pallas_call(
        kernel,
        grid=(width, kv_heads),
        in_specs=[*specs, cache, cache],
        out_specs=[whole((kv_heads, rows, head_dim)), cache, cache],
        out_shape=[jax.ShapeDtypeStruct((kv_heads, rows, head_dim), dtype),
                   jax.ShapeDtypeStruct(k_cache.shape, dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, dtype)],
        input_output_aliases={len(operands): 1, len(operands) + 1: 2},
        interpret=interpret,
        name="rope_store",
        **kwargs,
    )(*operands, k_cache, v_cache)
