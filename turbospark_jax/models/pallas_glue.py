"""The small steps between a layer's matrix products, fused into single GPU kernels (Pallas).

At decode widths a 1B model's layer on an H200 ran 13 kernels, and eight of them were
elementwise or scatter steps of 1.4-2.5 microseconds each (launch-bound, not bandwidth-bound):
residual add, RMSNorm, RoPE with its transpose, the K cache write, the V cache write, twice
over for the norms and adds. That was about a quarter of the layer's time. Two kernels here
replace six of them:

* :func:`add_rms_norm`: the residual add and the next RMSNorm in one pass (both results are
  needed: the sum continues as the residual stream, the normalised row feeds a projection);
* :func:`rope_store`: the optional per-head q/k RMSNorm, the rotary embedding of q and k and
  the writes of k and v into the layer's cache, in place.

Both work row by row: a row's result never depends on another row, so the block program's
bitwise guarantees (one program, different live rows) hold with them as they do without.
Each has the XLA expression it replaces beside it (:func:`add_rms_norm_xla`,
:func:`rope_store_xla`); the model uses those on a CPU and the tests compare the two.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from turbospark_jax.models.layers import apply_rope, rms_norm


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def supported(hidden: int, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernels take these shapes (Triton tiles are powers of two)."""
    return all(_power_of_two(n) for n in (hidden, heads, kv_heads, head_dim)) and head_dim >= 16


def _compiler_params(interpret: bool) -> dict[str, Any]:
    if interpret:
        return {}
    from jax.experimental.pallas import triton as plgpu

    return {"compiler_params": plgpu.CompilerParams(num_warps=4, num_stages=1)}


# -- residual add + RMSNorm -------------------------------------------------------------------


def add_rms_norm_xla(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float
) -> tuple[jax.Array, jax.Array]:
    """``(h, rms_norm(h))`` with ``h = x + delta`` (``h = x`` when ``delta`` is None)."""
    h = x if delta is None else x + delta
    return h, rms_norm(h, weight, eps)


def _add_norm_kernel(*refs: Any, eps: float, has_delta: bool) -> None:
    if has_delta:
        x_ref, d_ref, w_ref, h_ref, n_ref = refs
        h = x_ref[...] + d_ref[...]
        h_ref[...] = h
    else:
        x_ref, w_ref, n_ref = refs
        h = x_ref[...]
    h32 = h.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(h32 * h32) + eps)
    n_ref[...] = w_ref[...] * (h32 * inv).astype(h.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """:func:`add_rms_norm_xla` as one kernel, one program per row.

    Args:
      x: ``[W, D]`` the residual stream.
      delta: ``[W, D]`` what the last sublayer adds to it, or None (a plain norm).
      weight: ``[D]`` the norm's scale.
      eps: added to the mean square.
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      ``(h, normed)``, both ``[W, D]`` in ``x.dtype``.
    """
    width, hidden = x.shape
    row = pl.BlockSpec((None, hidden), lambda r: (r, 0))
    whole = pl.BlockSpec((hidden,), lambda r: (0,))
    has_delta = delta is not None
    kernel = functools.partial(_add_norm_kernel, eps=eps, has_delta=has_delta)
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if has_delta:
        h, normed = pl.pallas_call(
            kernel, grid=(width,), in_specs=[row, row, whole], out_specs=[row, row],
            out_shape=[shape, shape], interpret=interpret, name="add_rms_norm",
            **_compiler_params(interpret),
        )(x, delta.astype(x.dtype), weight.astype(x.dtype))
        return h, normed
    normed = pl.pallas_call(
        kernel, grid=(width,), in_specs=[row, whole], out_specs=row,
        out_shape=shape, interpret=interpret, name="rms_norm",
        **_compiler_params(interpret),
    )(x, weight.astype(x.dtype))
    return x, normed


# -- q/k norm, RoPE and the cache writes --------------------------------------------------------


def rope_store_xla(
    q: jax.Array, k: jax.Array, v: jax.Array, cos: jax.Array, sin: jax.Array,
    write_at: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
    q_norm: jax.Array | None = None, k_norm: jax.Array | None = None, eps: float = 1e-6,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(rotated q, k_cache, v_cache)`` with row ``i``'s rotated k and its v written at cache
    row ``write_at[i]``; rows with ``write_at[i] >= C`` write nothing (they must be distinct)."""
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scatter = {"mode": "drop", "unique_indices": True}
    return q, k_cache.at[write_at].set(k, **scatter), v_cache.at[write_at].set(v, **scatter)


def _rope_store_kernel(*refs: Any, eps: float, qk_norm: bool, capacity: int) -> None:
    if qk_norm:
        (at_ref, q_ref, k_ref, v_ref, cos_ref, sin_ref, qn_ref, kn_ref,
         _, _, q_out, k_out, v_out) = refs
    else:
        (at_ref, q_ref, k_ref, v_ref, cos_ref, sin_ref,
         _, _, q_out, k_out, v_out) = refs
        qn_ref = kn_ref = None
    half = q_ref.shape[-1] // 2
    first, second = slice(0, half), slice(half, 2 * half)
    cos, sin = cos_ref[first], sin_ref[first]  # the two halves of the tables are equal

    def rotate(x_ref, w_ref):
        x1, x2 = x_ref[:, first], x_ref[:, second]  # [N, hd/2] each
        if w_ref is not None:  # per-head RMSNorm before the rotation, as rms_norm does it
            full = x_ref[...].astype(jnp.float32)
            inv = jax.lax.rsqrt(jnp.mean(full * full, axis=1) + eps)[:, None]
            x1 = w_ref[first][None, :] * (x1.astype(jnp.float32) * inv).astype(x1.dtype)
            x2 = w_ref[second][None, :] * (x2.astype(jnp.float32) * inv).astype(x2.dtype)
        c, s = cos[None, :], sin[None, :]
        return x1 * c + (-x2) * s, x2 * c + x1 * s

    q1, q2 = rotate(q_ref, qn_ref)
    q_out[:, first] = q1
    q_out[:, second] = q2
    at = at_ref[0]

    @pl.when(at < capacity)
    def _():
        k1, k2 = rotate(k_ref, kn_ref)
        k_out[at, :, first] = k1
        k_out[at, :, second] = k2
        v_out[at, :, :] = v_ref[...]


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rope_store(
    q: jax.Array, k: jax.Array, v: jax.Array, cos: jax.Array, sin: jax.Array,
    write_at: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
    q_norm: jax.Array | None = None, k_norm: jax.Array | None = None, eps: float = 1e-6,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`rope_store_xla` as one kernel, one program per row; the caches are updated in
    place (the outputs alias them).

    Args:
      q: ``[W, H, hd]``, k and v ``[W, KV, hd]``: the projections of the block's rows.
      cos, sin: ``[W, hd]`` rotary tables.
      write_at: int32 ``[W]`` the cache row each block row writes (``>= C``: none).
      k_cache, v_cache: ``[C, KV, hd]``.
      q_norm, k_norm: ``[hd]`` per-head RMSNorm scales (Qwen3), or None.
      eps: the q/k norm's epsilon.
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      ``(q, k_cache, v_cache)``: q rotated, the caches with the live rows written.
    """
    width, heads, head_dim = q.shape
    capacity, kv_heads, _ = k_cache.shape
    qk_norm = q_norm is not None
    dtype = k_cache.dtype
    at = pl.BlockSpec((1,), lambda r: (r,))
    rows = lambda n: pl.BlockSpec((None, n, head_dim), lambda r: (r, 0, 0))  # noqa: E731
    table = pl.BlockSpec((None, head_dim), lambda r: (r, 0))
    vector = pl.BlockSpec((head_dim,), lambda r: (0,))
    cache = pl.BlockSpec((capacity, kv_heads, head_dim), lambda r: (0, 0, 0))
    operands = [write_at.astype(jnp.int32), q.astype(dtype), k.astype(dtype), v.astype(dtype),
                cos.astype(dtype), sin.astype(dtype)]
    specs = [at, rows(heads), rows(kv_heads), rows(kv_heads), table, table]
    if qk_norm:
        operands += [q_norm.astype(dtype), k_norm.astype(dtype)]
        specs += [vector, vector]
    n_in = len(operands)
    kernel = functools.partial(_rope_store_kernel, eps=eps, qk_norm=qk_norm, capacity=capacity)
    return pl.pallas_call(
        kernel,
        grid=(width,),
        in_specs=[*specs, cache, cache],
        out_specs=[rows(heads), cache, cache],
        out_shape=[jax.ShapeDtypeStruct(q.shape, dtype),
                   jax.ShapeDtypeStruct(k_cache.shape, dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, dtype)],
        input_output_aliases={n_in: 1, n_in + 1: 2},
        interpret=interpret,
        name="rope_store",
        **_compiler_params(interpret),
    )(*operands, k_cache, v_cache)
