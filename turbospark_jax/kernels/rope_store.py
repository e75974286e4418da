"""The RoPE-and-cache-write kernel: the steps between a layer's q/k/v projection and its
attention, fused into one GPU kernel (Pallas, Triton).

At decode widths those steps (RoPE with the queries' transpose into the attention kernel's
layout, the K cache write and the V cache write) are launch-bound kernels of their own.
:func:`rope_store` does all of it in one launch, reading the merged q/k/v product's output as
it comes (one ``[W, (H + 2 KV) hd]`` matrix): the optional per-head q/k RMSNorm (Qwen3), the
rotation of q and k, the queries written straight into the layout of
:func:`~turbospark_jax.kernels.attention.cached_attention_arranged`, and k and v
written into the layer's cache in place.

The kernel works row by row: a row's result never depends on another row, so the block
program's bitwise guarantees (one program, different live rows) hold with it as without.
:func:`rope_store_xla` is the XLA expression it replaces; the tests compare the two.

At a decode step even this launch is a floor of its own, whatever the little work in it.
:func:`rope_store_attention` runs the same row work inside the row-invariant attention's
first kernel instead (the folding kernel at a short context, the split kernel whose last
program folds at a long one): each program does
its KV head's rows, waits at a barrier for its own writes, then attends over the cache it
just wrote. The fused kernels call the same code for the arithmetic as the separate ones
(:func:`_rotated`; :func:`~turbospark_jax.kernels.attention.fold_splits`,
:func:`~turbospark_jax.kernels.attention.split_of`), so a row comes out the same
either way; on the GPU that is the compiler's to keep, checked there by the kernel tests.
The dense model runs it under a row-invariant plan with the Pallas kernels.

A quantized cache (:mod:`~turbospark_jax.quant.kv`) is written quantized: each new key and
value row is divided by its own scale (its largest magnitude over the stored form's) in
registers, with the scale stored beside it, by the same elementwise functions as the XLA
form (:func:`~turbospark_jax.quant.kv.quantize_with`); the attention after it dequantizes
the tiles it reads. Both kernels run that one piece of code, so a row is stored alike
whichever writes it, which is what the guarantees need: every exact path of a plan that runs
them writes through them. (Triton's float32 division may round otherwise than XLA's, so
against :func:`rope_store_xla` a compiled kernel's value may sit a step apart where the
quotient falls on a rounding boundary; in the interpreter the two agree bitwise.)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from turbospark_jax.kernels.attention import (
    arrange_queries,
    cache_refs,
    cached_attention_arranged,
    compiler_kwargs,
    fold_in_last_split,
    fold_splits,
    folds_on_chip,
    interpret_dot_rows,
    partial_splits,
    plan_keys,
    query_rows,
    split_of,
    store_rows,
    tiles_for,
)
from turbospark_jax.kernels.layers import apply_rope, rms_norm
from turbospark_jax.kernels.row_norm import parts_total
from turbospark_jax.quant import kv as kv_quant

#: Blocks of at most this many rows (a decode step, a verify) may run this module's work
#: inside the attention kernel (:func:`rope_store_attention`); wider ones launch both.
FUSED_ROWS = 16


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
    k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """The XLA form of :func:`rope_store` (same arguments and results; a finished
    projection ``[W, (H + 2 KV) * hd]`` only)."""
    capacity, kv_heads, _ = k_cache.shape
    q, k, v = _split(qkv, heads, kv_heads)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scatter = {"mode": "drop", "unique_indices": True}
    qr = arrange_queries(q, kv_heads, capacity)
    kv_dtype = None if k_scale is None else kv_quant.kv_dtype_of(k_cache.dtype)
    k_cache, k_scale = kv_quant.write(k_cache, k_scale, write_at, k, kv_dtype, **scatter)
    v_cache, v_scale = kv_quant.write(v_cache, v_scale, write_at, v, kv_dtype, **scatter)
    return (qr, k_cache, v_cache) if kv_dtype is None else (qr, k_cache, v_cache, k_scale,
                                                            v_scale)


def _heads_view(qkv: jax.Array, heads: int, kv_heads: int, head_dim: int,
                dtype: Any) -> tuple[int, jax.Array]:
    """``(parts, projection)``: the q/k/v projection by head, ``[W, H + 2 KV, hd]`` in
    ``dtype``, or its ``parts`` float32 partial sums ``[S, W, H + 2 KV, hd]`` (``parts``
    0 for a finished projection)."""
    width = qkv.shape[-2]
    if qkv.ndim == 3:
        return qkv.shape[0], qkv.reshape(qkv.shape[0], width, heads + 2 * kv_heads, head_dim)
    return 0, qkv.reshape(width, heads + 2 * kv_heads, head_dim).astype(dtype)


def _projection(ref: Any, row: tuple[Any, ...], heads_at: Any, columns: Any, parts: int,
                dtype: Any) -> jax.Array:
    """A row's q/k/v projection at these heads and columns (``ref[*row, heads_at,
    columns]``); from ``parts`` partial sums (``ref[i, *row, ...]``), added in order and
    rounded once (``rowinv.sum_parts``' arithmetic)."""
    if not parts:
        return ref[(*row, heads_at, columns)]
    return parts_total(lambda i: ref[(i, *row, heads_at, columns)], parts, dtype)


def _rotated(load: Any, start: Any, n: int, w_ref: Any, cos: jax.Array, sin: jax.Array,
             eps: float) -> tuple[jax.Array, jax.Array]:
    """Heads ``start..start+n`` of a row (``load(heads_at, columns)``), normed (with a
    per-head RMSNorm scale ``w_ref``) and rotated: the two halves ``[n, hd/2]``. The one
    piece of arithmetic both kernels of this module run, so their rows agree bit for bit."""
    half = cos.shape[-1]
    first, second = pl.ds(0, half), pl.ds(half, half)
    heads_at = pl.ds(start, n)
    x1, x2 = load(heads_at, first), load(heads_at, second)  # [n, hd/2] each
    if w_ref is not None:  # per-head RMSNorm first, rounded as rms_norm rounds it
        full = load(heads_at, slice(None)).astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(full * full, axis=1) + eps)[:, None]
        x1 = w_ref[first][None, :] * (x1.astype(jnp.float32) * inv).astype(x1.dtype)
        x2 = w_ref[second][None, :] * (x2.astype(jnp.float32) * inv).astype(x2.dtype)
    return x1 * cos + (-x2) * sin, x2 * cos + x1 * sin


def _amax(x: jax.Array) -> jax.Array:
    """The largest magnitude of each row of ``x [n, m]``, in float32: ``[n]``."""
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1)


def _write_row(load: Any, cos: jax.Array, sin: jax.Array, at: Any, h: Any, *, q_rows: Any,
               q_out: Any, k_out: Any, v_out: Any, qn_ref: Any, kn_ref: Any, heads: int,
               kv_heads: int, capacity: int, eps: float, head_index: bool,
               ks_out: Any = None, vs_out: Any = None, interpret: bool = False) -> None:
    """One row's work for KV head ``h``: its query heads rotated into ``q_out[*q_rows]``,
    its key rotated and its value copied into cache row ``at`` (none when ``at >=
    capacity``). ``head_index``: the caches are whole ``[C, KV, hd]`` refs; else the head's
    own ``[C, hd]`` block. With scale refs (``ks_out``, ``vs_out``: ``[C, KV]`` or the
    head's ``[C]``) the cache is quantized: the key and value are stored quantized by their
    own rows' scales (:mod:`~turbospark_jax.quant.kv`), and the scales beside them
    (``interpret``: the rows rounded to their dtype first, as the interpreter's XLA may
    not have: :func:`~turbospark_jax.quant.kv.rounded`)."""
    groups = heads // kv_heads
    half = cos.shape[-1]
    first, second = pl.ds(0, half), pl.ds(half, half)
    q1, q2 = _rotated(load, h * groups, groups, qn_ref, cos, sin, eps)
    q_out[(*q_rows, first)] = q1
    q_out[(*q_rows, second)] = q2
    # [1, hd/2] and [1, hd] either way: a whole cache's row at one head, or the block's row
    row = (at, pl.ds(h, 1)) if head_index else (pl.ds(at, 1),)

    @pl.when(at < capacity)
    def _():
        k1, k2 = _rotated(load, heads + h, 1, kn_ref, cos, sin, eps)
        v = load(pl.ds(heads + kv_heads + h, 1), slice(None))  # [1, hd]
        if ks_out is not None:  # quantized: each row by its own scale (over both halves)
            kv_dtype = kv_quant.kv_dtype_of(k_out.dtype)
            if interpret:
                k1, k2, v = (kv_quant.rounded(x) for x in (k1, k2, v))
            k_scale = kv_quant.row_scale(jnp.maximum(_amax(k1), _amax(k2)), kv_dtype)
            v_scale = kv_quant.row_scale(_amax(v), kv_dtype)
            k1, k2 = (kv_quant.quantize_with(x, k_scale[:, None], kv_dtype) for x in (k1, k2))
            v = kv_quant.quantize_with(v, v_scale[:, None], kv_dtype)
            ks_out[row] = k_scale
            vs_out[row] = v_scale
        k_out[(*row, first)] = k1
        k_out[(*row, second)] = k2
        v_out[(*row, slice(None))] = v


def _rope_store_kernel(*refs: Any, eps: float, qk_norm: bool, quantized: bool, capacity: int,
                       heads: int, kv_heads: int, parts: int, interpret: bool) -> None:
    at_ref, qkv_ref, cos_ref, sin_ref, *refs = refs
    qn_ref, kn_ref = refs[:2] if qk_norm else (None, None)
    refs = refs[2:] if qk_norm else refs
    # the caches' inputs (and their scales') are read and written through the outputs
    q_out, k_out, v_out, *scales = refs[4:] if quantized else refs[2:]
    ks_out, vs_out = scales if quantized else (None, None)
    row, h = pl.program_id(0), pl.program_id(1)  # a row of the block, one of its KV heads
    groups = heads // kv_heads
    half = qkv_ref.shape[-1] // 2
    cos, sin = cos_ref[pl.ds(0, half)][None, :], sin_ref[pl.ds(0, half)][None, :]  # halves equal
    load = functools.partial(_projection, qkv_ref, (), parts=parts, dtype=q_out.dtype)
    # The row's query heads of KV head h go to rows row*G.. of that head's arranged queries.
    _write_row(load, cos, sin, at_ref[0], h, q_rows=(h, pl.ds(row * groups, groups)),
               q_out=q_out, k_out=k_out, v_out=v_out, qn_ref=qn_ref, kn_ref=kn_ref,
               heads=heads, kv_heads=kv_heads, capacity=capacity, eps=eps, head_index=True,
               ks_out=ks_out, vs_out=vs_out, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("heads", "eps", "interpret"))
def rope_store(
    qkv: jax.Array, cos: jax.Array, sin: jax.Array, write_at: jax.Array,
    k_cache: jax.Array, v_cache: jax.Array, heads: int,
    q_norm: jax.Array | None = None, k_norm: jax.Array | None = None, eps: float = 1e-6,
    interpret: bool = False, k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """Norm and rotate a block's queries and keys, and write its keys and values to the cache.

    One program per row and KV head (the head's queries, its key and its value); the caches
    are updated in place (the outputs alias them).

    Args:
      qkv: ``[W, (H + 2 KV) * hd]``: each row's q heads, then k heads, then v heads; or that
        product unfinished, float32 partial sums ``[S, W, (H + 2 KV) * hd]``
        (:func:`~turbospark_jax.kernels.rowinv.rowinv_matmul` with ``parts=True``), which the
        kernel adds in order and rounds to the cache's dtype as
        :func:`~turbospark_jax.kernels.rowinv.sum_parts` does (bitwise the same as passing
        the finished product, one launch fewer).
      cos, sin: ``[W, hd]`` rotary tables.
      write_at: int32 ``[W]`` the cache row each block row writes (``>= C``: none; the live
        targets must be distinct).
      k_cache, v_cache: ``[C, KV, hd]``.
      heads: ``H``.
      q_norm, k_norm: ``[hd]`` per-head RMSNorm scales (Qwen3), or None.
      eps: the q/k norm's epsilon.
      interpret: run in the Pallas interpreter (CPU tests).
      k_scale, v_scale: float32 ``[C, KV]``, the row scales of a quantized cache
        (:mod:`~turbospark_jax.quant.kv`; ``k_cache``, ``v_cache`` then hold int8 or float8
        values, and the queries come out in ``cos``' dtype), else ``None``.

    Returns:
      ``(qr, k_cache, v_cache)``: the rotated queries in the attention kernel's layout
      ``[KV, R, hd]`` (see :func:`~turbospark_jax.kernels.attention.arrange_queries`;
      its padding rows are left unwritten), and the caches with the live rows written; and
      after them ``k_scale``, ``v_scale`` with the live rows' scales for a quantized cache.
    """
    width = qkv.shape[-2]
    capacity, kv_heads, head_dim = k_cache.shape
    quantized = k_scale is not None
    dtype = cos.dtype if quantized else k_cache.dtype
    rows = query_rows(width, heads, kv_heads, capacity, head_dim=head_dim)
    qk_norm = q_norm is not None
    whole = lambda shape: pl.BlockSpec(shape, lambda r, h: (0,) * len(shape))  # noqa: E731
    parts, projection = _heads_view(qkv, heads, kv_heads, head_dim, dtype)
    if parts:
        projection_spec = pl.BlockSpec((parts, None, heads + 2 * kv_heads, head_dim),
                                       lambda r, h: (0, r, 0, 0))
    else:
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
    caches = [k_cache, v_cache] + ([k_scale, v_scale] if quantized else [])
    cache_specs = [whole(c.shape) for c in caches]
    kernel = functools.partial(_rope_store_kernel, eps=eps, qk_norm=qk_norm, quantized=quantized,
                               capacity=capacity, heads=heads, kv_heads=kv_heads, parts=parts,
                               interpret=interpret)
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=1)
    return tuple(pl.pallas_call(
        kernel,
        grid=(width, kv_heads),
        in_specs=[*specs, *cache_specs],
        out_specs=[whole((kv_heads, rows, head_dim)), *cache_specs],
        out_shape=[jax.ShapeDtypeStruct((kv_heads, rows, head_dim), dtype),
                   *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)],
        input_output_aliases={len(operands) + i: 1 + i for i in range(len(caches))},
        interpret=interpret,
        name="rope_store",
        **kwargs,
    )(*operands, *caches))


def _rope_attention_kernel(*refs: Any, eps: float, qk_norm: bool, quantized: bool,
                           capacity: int, heads: int, kv_heads: int, parts: int, width: int,
                           scale: float, split_len: int, window: int | None, rows: int | None,
                           split: bool, barrier: bool, fold_last: int = 0,
                           dot_rows: int | None = None, interpret: bool = False) -> None:
    """One program per (KV head, query tile[, split]): every row's work of
    :func:`rope_store` for this KV head (the same code, :func:`_write_row`), a barrier so
    the program's own writes are visible to all of its threads, then the attention over
    the rotated queries read back and the cache with the new rows in it: the folding
    kernel's body (:func:`~turbospark_jax.kernels.attention.fold_splits`), or with
    ``split`` the split kernel's (:func:`~turbospark_jax.kernels.attention.split_of`,
    partials for the fold kernel; with ``fold_last``, the number of splits, each tile's
    last split program folds them itself:
    :func:`~turbospark_jax.kernels.attention.fold_in_last_split`). The programs of one
    KV head write the same values to the same places (each needs every new key of the
    block). ``quantized``: the caches come with their row scales (written quantized, read
    dequantized: :mod:`~turbospark_jax.quant.kv`)."""
    at_ref, proj_ref, cos_ref, sin_ref, *refs = refs
    qn_ref, kn_ref = refs[:2] if qk_norm else (None, None)
    # the caches' inputs (the two after pos, and their scales') and the fold's counters
    # (after them): read and written through their outputs
    bound_ref, pos_ref, *outs = refs[2:] if qk_norm else refs
    caches = 4 if quantized else 2
    outs = outs[caches + (1 if fold_last else 0):]
    *results, q_out, k_out, v_out = outs[:-2] if quantized else outs
    ks_out, vs_out = outs[-2:] if quantized else (None, None)
    h, t = pl.program_id(0), pl.program_id(1)
    s = pl.program_id(2) if split else None
    groups = heads // kv_heads
    half = proj_ref.shape[-1] // 2

    for w in range(width):
        cos = cos_ref[w, pl.ds(0, half)][None, :]  # both halves are equal
        sin = sin_ref[w, pl.ds(0, half)][None, :]
        load = functools.partial(_projection, proj_ref, (w,), parts=parts, dtype=q_out.dtype)
        _write_row(load, cos, sin, at_ref[w], h, q_rows=(pl.ds(w * groups, groups),),
                   q_out=q_out, k_out=k_out, v_out=v_out, qn_ref=qn_ref, kn_ref=kn_ref,
                   heads=heads, kv_heads=kv_heads, capacity=capacity, eps=eps,
                   head_index=False, ks_out=ks_out, vs_out=vs_out, interpret=interpret)
    if barrier:  # a CTA barrier orders the program's global writes before its reads
        from jax.experimental.pallas import triton as plgpu

        plgpu.debug_barrier()
    tile = pos_ref.shape[0]
    q, pos = q_out[pl.ds(t * tile, tile), :], pos_ref[...]
    k_out, v_out = cache_refs(k_out, v_out, ks_out, vs_out, q_out.dtype)
    kw = dict(scale=scale, capacity=capacity, split_len=split_len, window=window,
              mma_sums=True, dot_rows=dot_rows)
    if split and fold_last:
        acc_ref, m_ref, l_ref, o_ref, count_ref = results
        part = split_of(q, pos, bound_ref[()], k_out, v_out, split=s, **kw)
        fold_in_last_split(bound_ref[()], part, s, acc_ref, m_ref, l_ref, o_ref, count_ref,
                           h * pl.num_programs(1) + t, t, splits=fold_last, scale=scale,
                           capacity=capacity, split_len=split_len, rows=rows,
                           barrier=barrier)
    elif split:
        acc_ref, m_ref, l_ref = results
        acc_ref[...], m_ref[...], l_ref[...] = split_of(q, pos, bound_ref[()], k_out, v_out,
                                                        split=s, **kw)
    else:
        (o_ref,) = results
        acc, l = fold_splits(q, pos, bound_ref[()], k_out, v_out, **kw)
        store_rows(o_ref, (acc / l[:, None]).astype(o_ref.dtype), rows, tile=t)


@functools.partial(jax.jit, static_argnames=("heads", "eps", "window", "interpret", "max_keys"))
def rope_store_attention(
    qkv: jax.Array, cos: jax.Array, sin: jax.Array, write_at: jax.Array,
    k_cache: jax.Array, v_cache: jax.Array, q_positions: jax.Array, heads: int,
    q_norm: jax.Array | None = None, k_norm: jax.Array | None = None, eps: float = 1e-6,
    window: int | None = None, interpret: bool = False, max_keys: int | None = None,
    k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """:func:`rope_store` followed by the row-invariant attention over the cache it wrote
    (:func:`~turbospark_jax.kernels.attention.cached_attention_arranged` with
    ``row_invariant=True``), the RoPE-store's work done inside the attention's first kernel
    for a block of at most :data:`FUSED_ROWS` rows: one launch where the attention folds on
    chip (a short context under ``max_keys``, a cache of one split); elsewhere the split
    kernel, whose last program to finish a query tile folds that tile's partials
    (:func:`~turbospark_jax.kernels.attention.fold_in_last_split`: an atomic counter a tile,
    the fold kernel's own code), so again one launch. Wider blocks launch the RoPE-store and
    the attention apart. Either way a row gets the same bits: the fused kernels run both
    kernels' code.

    Args:
      qkv, cos, sin, write_at, k_cache, v_cache, heads, q_norm, k_norm, eps, k_scale,
        v_scale: as for :func:`rope_store`.
      q_positions: int32 ``[W]``, each row's position.
      window, max_keys: as for the attention.
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      ``(out [W, H, hd], k_cache, v_cache)``: the attention's rows and the caches with the
      live rows written; and after them the scales, for a quantized cache.
    """
    width = q_positions.shape[0]
    capacity, kv_heads, head_dim = k_cache.shape
    groups = heads // kv_heads
    rows = width * groups
    tiles = tiles_for(rows, head_dim)
    quantized = k_scale is not None
    if width > FUSED_ROWS:
        qr, *caches = rope_store(qkv, cos, sin, write_at, k_cache, v_cache, heads, q_norm,
                                 k_norm, eps=eps, interpret=interpret, k_scale=k_scale,
                                 v_scale=v_scale)
        scales = dict(zip(("k_scale", "v_scale"), caches[2:], strict=False))
        out = cached_attention_arranged(qr, caches[0], caches[1], q_positions, heads=heads,
                                        window=window, interpret=interpret,
                                        row_invariant=True, max_keys=max_keys, **scales)
        return (out, *caches)
    folding = folds_on_chip(rows, capacity, tiles, max_keys)
    dtype = cos.dtype if quantized else k_cache.dtype
    tile, count, splits, split_len = plan_keys(rows, capacity, tiles.max_row_tile)
    padded = tile * count
    parts, projection = _heads_view(qkv, heads, kv_heads, head_dim, dtype)
    pos = jnp.repeat(q_positions.astype(jnp.int32), groups)
    pos = jnp.pad(pos, (0, padded - rows), constant_values=-1)  # padding rows see nothing
    bound = jnp.max(q_positions).astype(jnp.int32) + 1
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    head_block = pl.BlockSpec((capacity, None, head_dim), lambda h, *_: (0, h, 0))
    operands = [write_at.astype(jnp.int32), projection, cos.astype(dtype), sin.astype(dtype)]
    specs = [whole((width,)), whole(projection.shape), whole((width, head_dim)),
             whole((width, head_dim))]
    if q_norm is not None:
        operands += [q_norm.astype(dtype), k_norm.astype(dtype)]
        specs += [whole((head_dim,)), whole((head_dim,))]
    operands += [bound, pos]
    specs += [pl.BlockSpec((), lambda *_: ()), pl.BlockSpec((tile,), lambda h, t, *_: (t,))]
    caches = [k_cache, v_cache] + ([k_scale, v_scale] if quantized else [])
    scale_block = pl.BlockSpec((capacity, None), lambda h, *_: (0, h))
    cache_specs = [head_block, head_block] + ([scale_block] * 2 if quantized else [])
    scratch_specs = [pl.BlockSpec((None, padded, head_dim), lambda h, *_: (h, 0, 0)),
                     *cache_specs]
    scratch_shapes = [jax.ShapeDtypeStruct((kv_heads, padded, head_dim), dtype),
                      *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)]
    if folding:
        grid = (kv_heads, count)
        result_specs = [pl.BlockSpec((None, tile, head_dim), lambda h, t: (h, t, 0))]
        result_shapes = [jax.ShapeDtypeStruct((kv_heads, rows, head_dim), dtype)]
    else:
        splits = partial_splits(splits)  # whole groups for the fold kernel's loads
        grid = (kv_heads, count, splits)
        # every split's partials of a tile, for its last split program to fold
        result_specs = [
            pl.BlockSpec((splits, None, tile, head_dim), lambda h, t, s: (0, h, t, 0)),
            pl.BlockSpec((splits, None, tile), lambda h, t, s: (0, h, t)),
            pl.BlockSpec((splits, None, tile), lambda h, t, s: (0, h, t)),
        ]
        result_shapes = [
            jax.ShapeDtypeStruct((splits, kv_heads, padded, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, kv_heads, padded), jnp.float32),
            jax.ShapeDtypeStruct((splits, kv_heads, padded), jnp.float32),
        ]
        # the finished rows, and a counter a tile (zeros, left at zero)
        result_specs += [pl.BlockSpec((None, tile, head_dim), lambda h, t, s: (h, t, 0)),
                         whole((kv_heads * count,))]
        result_shapes += [jax.ShapeDtypeStruct((kv_heads, rows, head_dim), dtype),
                          jax.ShapeDtypeStruct((kv_heads * count,), jnp.int32)]
    fold_last = 0 if folding else splits
    kernel = functools.partial(
        _rope_attention_kernel, eps=eps, qk_norm=q_norm is not None, quantized=quantized,
        capacity=capacity,
        heads=heads, kv_heads=kv_heads, parts=parts, width=width,
        scale=1.0 / math.sqrt(head_dim), split_len=split_len, window=window,
        rows=None if rows == padded else rows, split=not folding, barrier=not interpret,
        interpret=interpret,
        fold_last=fold_last, dot_rows=interpret_dot_rows(interpret))
    # each cache (and scale) input is written through its output after the queries' scratch
    aliases = {len(operands) + i: len(result_shapes) + 1 + i for i in range(len(caches))}
    counters = []
    if fold_last:
        counters = [jnp.zeros((kv_heads * count,), jnp.int32)]
        aliases[len(operands) + len(caches)] = len(result_shapes) - 1
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[*specs, *cache_specs, *(whole(c.shape) for c in counters)],
        out_specs=[*result_specs, *scratch_specs],
        out_shape=[*result_shapes, *scratch_shapes],
        input_output_aliases=aliases,
        interpret=interpret,
        name="rope_store_attention" if folding else "rope_store_attention_split_folding",
        **compiler_kwargs(tiles, interpret),
    )(*operands, *caches, *counters)
    results, caches = outs[:len(result_shapes)], outs[len(result_shapes) + 1:]
    out = results[0] if folding else results[3]
    out = out.reshape(kv_heads, width, groups, head_dim).transpose(1, 0, 2, 3)
    return (out.reshape(width, heads, head_dim), *caches)
