"""How a dense layer attends, with the implementation chosen once per call.

A layer's attention takes its normed rows ``h [W, D]`` to the attention output ``[W, H, hd]``
(the output projection is the layer's): the q/k/v projections, the optional per-head q/k norm
and RoPE, the writes of the rows' k/v into the cache, and attention over the cache.
:func:`cached_attention` picks one implementation for a whole
:meth:`~turbospark_jax.models.dense.model.DenseModel.block_forward` call from static facts, so each
choice is one program for every path of the block program and the bitwise guarantees hold
within it. :func:`sequence_attention` is the cache-free form ``forward`` uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from turbospark_jax.kernels import attention as pallas_attention
from turbospark_jax.kernels import plan as row_kernels
from turbospark_jax.kernels import rope_store as pallas_rope_store
from turbospark_jax.kernels.layers import attend
from turbospark_jax.kernels.plan import KernelPlan
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.quant import kv as kv_quant

if TYPE_CHECKING:
    from turbospark_jax.models.dense.model import DenseModel

Params = dict[str, Any]

#: A layer's attention: ``(normed rows [W, D], layer params, cache carry, layer index,
#: window) -> (attention output [W, H, hd], cache carry)``. The cache carry is ``(k, v,
#: k_scale, v_scale)`` as :class:`~turbospark_jax.models.dense.model.DenseCache` holds them.
Attention = Callable[[jax.Array, Params, Any, Any, Any], tuple[jax.Array, Any]]

# Padding rows scatter to distinct out-of-range rows, which mode="drop" discards. The targets
# are then all different, which the scatters promise to XLA (unique_indices): without the
# promise a GPU scatter of 16-bit values has to write with atomics.
_SCATTER = {"mode": "drop", "unique_indices": True}


def _project(x: jax.Array, w: jax.Array, plan: KernelPlan) -> jax.Array:
    """``x [W, D] @ w [D, N, hd] -> [W, N, hd]`` as one 2-D matrix product.

    Written as a plain matrix product over a free reshape of the weight: for a single row,
    XLA on a GPU lowers the 3-D einsum form to a multiply and a reduction, several times
    slower than its matrix-vector kernel.
    """
    d, n, hd = w.shape
    return row_kernels.matmul(plan, x, w.reshape(d, n * hd),
                              label="proj").reshape(x.shape[0], n, hd)


def _projections(
    config: DenseConfig, h: jax.Array, lp: Params, plan: KernelPlan
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q/k/v projections of the normed rows. h [W, D] -> q [W, H, hd], k/v [W, KV, hd]."""
    q = _project(h, lp["q_proj"], plan)
    k = _project(h, lp["k_proj"], plan)
    v = _project(h, lp["v_proj"], plan)
    if config.qkv_bias:
        q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
    return q, k, v


def _merged_projection(config: DenseConfig, h: jax.Array, lp: Params,
                       plan: KernelPlan) -> jax.Array:
    """q/k/v as one matrix product: h [W, D] -> [W, (H + 2 KV) * hd], q heads first. (XLA
    reads the three weights straight into its matrix kernel, and the row-invariant kernel
    takes them as three operands of one launch: neither copies them.) Under a row-invariant
    plan without biases the product comes unfinished, as float32 partial sums ``[S, W, ...]``,
    which the RoPE-and-cache-write kernel adds itself."""
    d = h.shape[-1]
    ws = tuple(lp[n].reshape(d, -1) for n in ("q_proj", "k_proj", "v_proj"))
    if plan.row_invariant and not config.qkv_bias:
        return row_kernels.matmul_parts(plan, h, ws, label="qkv")
    qkv = row_kernels.matmul(plan, h, ws, label="qkv")
    if config.qkv_bias:
        qkv = qkv + jnp.concatenate([lp[n].reshape(-1) for n in ("q_bias", "k_bias", "v_bias")])
    return qkv


def _rotate(
    config: DenseConfig, q: jax.Array, k: jax.Array, lp: Params, cos: jax.Array, sin: jax.Array,
    plan: KernelPlan,
) -> tuple[jax.Array, jax.Array]:
    """Optional per-head q/k norm, then RoPE."""
    if config.qk_norm:
        q = row_kernels.rms_norm(plan, q, lp["q_norm"], config.rms_norm_eps)
        k = row_kernels.rms_norm(plan, k, lp["k_norm"], config.rms_norm_eps)
    return (row_kernels.apply_rope(plan, q, cos, sin),
            row_kernels.apply_rope(plan, k, cos, sin))


def _replace_at(buffers: Any, index: int, new: jax.Array) -> tuple[jax.Array, ...]:
    return (*buffers[:index], new, *buffers[index + 1 :])


def _write(buffers: Any, index: Any, rows: jax.Array, write_at: jax.Array,
           per_layer: bool) -> tuple[Any, jax.Array]:
    """``rows [W, ...]`` written into layer ``index`` of ``buffers`` (stacked ``[L, C, ...]``
    or a tuple of ``[C, ...]``) at ``write_at``: the buffers and that layer's buffer."""
    if per_layer:  # index is a python int: this layer's own buffer
        layer = buffers[index].at[write_at].set(rows, **_SCATTER)
        return _replace_at(buffers, index, layer), layer
    buffers = buffers.at[index, write_at].set(rows, **_SCATTER)
    return buffers, buffers[index]


def _write_rows(
    kv: Any, index: Any, k: jax.Array, v: jax.Array, write_at: jax.Array, per_layer: bool,
    kv_dtype: str | None,
) -> tuple[Any, tuple[Any, ...]]:
    """Write a block's ``k``/``v`` ``[W, KV, hd]`` into layer ``index`` of the cache carry at
    rows ``write_at``, quantized when ``kv_dtype`` is set; returns the carry and that layer's
    ``(k [C, KV, hd], v, k_scale [C, KV] or None, v_scale)``."""
    k_all, v_all, ks_all, vs_all = kv
    if kv_dtype is None:
        rows = (k, v)
    else:
        (k, ks), (v, vs) = kv_quant.quantize(k, kv_dtype), kv_quant.quantize(v, kv_dtype)
        rows = (k, v, ks, vs)
    written = [_write(b, index, r, write_at, per_layer)
               for b, r in zip((k_all, v_all, ks_all, vs_all), rows, strict=False)]
    carry = tuple(b for b, _ in written)
    layer = tuple(one for _, one in written)
    if kv_dtype is None:
        return (*carry, ks_all, vs_all), (*layer, None, None)
    return carry, layer


def _read(layer: tuple[Any, ...], dtype: Any, limit: int | None = None) -> tuple[jax.Array, ...]:
    """A layer's ``(k, v, k_scale, v_scale)`` (from :func:`_write_rows`) as k and v in the
    compute ``dtype`` (dequantized where quantized), over the first ``limit`` rows."""
    k, v, ks, vs = (None if b is None else b[:limit] for b in layer)
    return kv_quant.read(k, ks, dtype), kv_quant.read(v, vs, dtype)


def _own_rows(
    model: DenseModel, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
    window: Any,
) -> jax.Array:
    """Causal attention of a block over its own rows (q [W, H, hd], k/v [W, KV, hd])."""
    flash = (
        model.plan.pallas == "compiled"  # on a GPU, beside the compiled kernels
        and model.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and window is None
        and model.config.head_dim % 8 == 0
        and model.config.head_dim <= 128
    )
    if flash:
        out = jax.nn.dot_product_attention(
            q[None], k[None], v[None], is_causal=True, implementation="cudnn"
        )
        return out[0]
    return attend(q, k, v, positions, positions, window)


def _fused_attention(model: DenseModel, per_layer: bool, capacity: int) -> bool:
    """Whether attention over a per-layer cache runs as the fused kernel: where the plan
    runs the Pallas kernels and the shapes suit it."""
    return (per_layer and model.plan.uses_pallas
            and pallas_attention.supported(model.config.head_dim, capacity))


def _uses_rope_store(model: DenseModel, fused: bool) -> bool:
    """Whether q/k norm, RoPE and the cache writes run as the RoPE-and-cache-write kernel.
    It feeds the fused attention kernel, so it needs that one too."""
    c = model.config
    return fused and pallas_rope_store.supported(
        c.num_attention_heads, c.num_key_value_heads, c.head_dim)


def cached_attention(
    model: DenseModel, *, per_layer: bool, capacity: int, fresh: bool, positions: jax.Array,
    write_at: jax.Array, cos: jax.Array, sin: jax.Array, key_positions: jax.Array, limit: int,
    max_keys: int | None = None,
) -> Attention:
    """The attention every layer of one ``block_forward`` call runs, chosen once.

    Each layer writes its rows' k/v into the cache (quantized where the model's
    ``kv_dtype`` says: :mod:`~turbospark_jax.quant.kv`), then attends with one of (each
    dequantizing what it reads from a quantized cache: the kernels a tile at a time in
    registers, XLA's form the layer's rows it attends over):

    * the RoPE-and-cache-write kernel (which does the writes) feeding the fused attention
      kernel: a per-layer cache where both kernels run, and a block that is not ``fresh``;
    * ``fresh``: attention over the block's own rows (the cache was empty before it);
    * the fused attention kernel over the layer's cache, where it runs;
    * :func:`~turbospark_jax.kernels.plan.attend` (XLA's, under the model's plan) over the
      first ``limit`` positions.

    Args:
      model: the model (its config, dtype and kernel plan).
      per_layer, capacity: the cache's layout and size.
      fresh: the block starts at position 0 of an empty cache.
      positions: int32 ``[W]``, each row's position.
      write_at: int32 ``[W]``, the cache row each row writes (``>= capacity``: none).
      cos, sin: ``[W, hd]`` rotary tables.
      key_positions: int32 ``[C]``, the cache rows' positions.
      limit: static; the XLA form attends over cache rows ``< limit`` only.
      max_keys: static; the caller's bound on every row's position + 1, handed to the fused
        kernel (:func:`~turbospark_jax.kernels.attention.cached_attention`: speed
        only).

    Returns:
      The :data:`Attention`.
    """
    c = model.config
    fused = _fused_attention(model, per_layer, capacity)
    rope_store = _uses_rope_store(model, fused)
    plan = model.plan
    row_invariant = plan.row_invariant
    interpret = plan.pallas == "interpret"

    kv_dtype = model.kv_dtype

    def rope_store_kernels(h: jax.Array, lp: Params, kv: Any, index: Any, window: Any) -> Any:
        k_all, v_all, ks_all, vs_all = kv  # tuples of [C, KV, hd]: a per-layer cache
        norms = (lp["q_norm"], lp["k_norm"]) if c.qk_norm else (None, None)
        rows = (_merged_projection(c, h, lp, plan), cos, sin, write_at, k_all[index],
                v_all[index])
        scales = ({} if kv_dtype is None else
                  {"k_scale": ks_all[index], "v_scale": vs_all[index]})
        if row_invariant:
            # the RoPE-store's work inside the attention's first kernel (a decode, a verify)
            attn, *layer = pallas_rope_store.rope_store_attention(
                *rows, positions, c.num_attention_heads, *norms, eps=c.rms_norm_eps,
                window=window, interpret=interpret, max_keys=max_keys, **scales,
            )
        else:
            qr, *layer = pallas_rope_store.rope_store(
                *rows, c.num_attention_heads, *norms, eps=c.rms_norm_eps, interpret=interpret,
                **scales,
            )
            attn = pallas_attention.cached_attention_arranged(
                qr, layer[0], layer[1], positions, heads=c.num_attention_heads, window=window,
                interpret=interpret, row_invariant=False, max_keys=max_keys,
                **dict(zip(scales, layer[2:], strict=True)),
            )
        carry = tuple(_replace_at(b, index, new) for b, new in zip(kv, layer, strict=False))
        return attn, (*carry, *kv[len(carry):])

    def rotated(h: jax.Array, lp: Params) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, k, v = _projections(c, h, lp, plan)
        q, k = _rotate(c, q, k, lp, cos, sin, plan)
        return q, k, v

    def own_rows(h: jax.Array, lp: Params, kv: Any, index: Any, window: Any) -> Any:
        q, k, v = rotated(h, lp)
        kv, _ = _write_rows(kv, index, k, v, write_at, per_layer, kv_dtype)
        # the rows as the cache gives them back, as every later block reads them
        k, v = kv_quant.round_trip(k, kv_dtype), kv_quant.round_trip(v, kv_dtype)
        return _own_rows(model, q, k, v, positions, window), kv

    def attention_kernel(h: jax.Array, lp: Params, kv: Any, index: Any, window: Any) -> Any:
        q, k, v = rotated(h, lp)
        kv, (k_layer, v_layer, k_scale, v_scale) = _write_rows(kv, index, k, v, write_at,
                                                               per_layer, kv_dtype)
        attn = pallas_attention.cached_attention(
            q, k_layer, v_layer, positions, window=window, interpret=interpret,
            row_invariant=row_invariant, max_keys=max_keys, k_scale=k_scale, v_scale=v_scale,
        )
        return attn, kv

    def xla(h: jax.Array, lp: Params, kv: Any, index: Any, window: Any) -> Any:
        q, k, v = rotated(h, lp)
        kv, layer = _write_rows(kv, index, k, v, write_at, per_layer, kv_dtype)
        k_layer, v_layer = _read(layer, model.dtype, limit)
        attn = row_kernels.attend(plan, q, k_layer, v_layer, positions,
                                  key_positions[:limit], window)
        return attn, kv

    if rope_store and not fresh:
        return rope_store_kernels
    if fresh:
        return own_rows
    return attention_kernel if fused else xla


def sequence_attention(
    config: DenseConfig, positions: jax.Array, cos: jax.Array, sin: jax.Array,
    plan: KernelPlan,
) -> Attention:
    """Causal attention of a whole sequence over itself, no cache (the carry passes through).

    Args:
      config: the model config.
      positions: int32 ``[T]``, ``0..T-1``.
      cos, sin: ``[T, hd]`` rotary tables.
      plan: the model's kernel plan (:mod:`~turbospark_jax.kernels.plan`).
    """

    def attention(h: jax.Array, lp: Params, carry: Any, index: Any, window: Any) -> Any:
        del index
        q, k, v = _projections(config, h, lp, plan)
        q, k = _rotate(config, q, k, lp, cos, sin, plan)
        return row_kernels.attend(plan, q, k, v, positions, positions, window), carry

    return attention
