"""The dense decoder family (llama, mistral, qwen2, qwen3): params and the model. The config
is :mod:`~turbospark_jax.models.dense_config`.

Sliding windows are implemented, not refused: the KV cache keeps every position, and a
layer with window ``w`` masks keys at positions ``<= q - w`` (Hugging Face's rule: a row sees
itself and the ``w - 1`` positions before it). That is exact at any context length; it just
does not save the memory a ring buffer would.

Params layout (``L`` layers, ``D`` hidden, ``H`` query heads, ``KV`` key/value heads, ``hd``
head dim, ``F`` intermediate, ``V`` vocab); every matrix is ``[in, out]`` so ``x @ W`` is the
layer, and per-layer leaves are stacked on a leading ``L`` axis::

    embed_tokens              [V, D]
    norm                      [D]           final RMSNorm
    lm_head                   [D, V]        absent when tie_word_embeddings
    layers/
      input_layernorm         [L, D]
      q_proj                  [L, D, H, hd]
      k_proj, v_proj          [L, D, KV, hd]
      o_proj                  [L, H, hd, D]
      q_bias                  [L, H, hd]     when config.qkv_bias
      k_bias, v_bias          [L, KV, hd]    when config.qkv_bias
      o_bias                  [L, D]         when config.o_bias
      q_norm, k_norm          [L, hd]        qwen3 only
      post_attention_layernorm [L, D]
      gate_proj, up_proj      [L, D, F]
      down_proj               [L, F, D]
      gate_bias, up_bias      [L, F]         when mlp_bias (llama)
      down_bias               [L, D]         when mlp_bias (llama)

Two layer layouts are accepted everywhere (``block_forward``, ``forward``, ``save_folder``):

* **stacked** (above; what :func:`init_params` and ``load_folder`` return by default): the
  layers run as a ``lax.scan`` over the L axis (``scan_layers=True``) or a Python loop over
  static slices (``scan_layers=False``). Compact, and what training wants.
* **list** (:func:`unstack_layers`; ``load_folder(..., layer_layout="list")``): ``layers`` is a
  list of per-layer dicts, run by an unrolled Python loop. Use this for decoding on a GPU.

Why two: inside a jitted loop (the engine's ``fori_loop`` of blocks) XLA materialises every
slice of a stacked weight, so each decode step reads the weights about three times. Measured
on one H200, bf16, W = 1, KV capacity 4096, 32 steps per call: an 8B Llama shape took 12.0 ms
a step stacked (scan or static slices alike; 1.3 TB/s of weights) and 5.4 ms listed
(3.0 TB/s); a 1B shape 2.45 ms against 1.57 ms. W = 16 cost 6.1 ms listed (8B). The
chunk-vs-decode bitwise property held on that GPU in both layouts (W = 16, bf16).

The KV cache rides in the loop carry and is updated in place by a scatter; it is never
re-stacked as a scan output. An unrolled model keeps one buffer per layer (slicing a layer out
of a stacked buffer in the loop cost two copies per layer and step on the H200) and, on a GPU,
attends over it with the fused kernel of
:mod:`~turbospark_jax.models.pallas_attention`: with the per-layer buffers and 2-D projection
matrix products, the 1B shape went from 681 to 771 tokens/s at 128 context and from 383 to
652 at 16k (W = 16). There the cache writes go through the RoPE-and-cache-write kernel of
:mod:`~turbospark_jax.models.pallas_rope_store` instead of a scatter: it takes the merged
q/k/v product to the attention kernel's input in one launch (1B: 820 tokens/s at 128
context, 667 at 16k). Attention for blocks wider than
:data:`~turbospark_jax.models.layers.ATTENTION_QUERY_BLOCK` rows runs in query slices of that
width; a 2048-row block over a 16384-position cache of the 8B shape (stacked) ran in 387 ms with
26.5 GB peak device memory, weights included.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from turbospark_jax.errors import BadInputError
from turbospark_jax.models import pallas_attention, pallas_rope_store
from turbospark_jax.models.base import BlockModel
from turbospark_jax.models.dense_config import DenseConfig
from turbospark_jax.models.layers import (
    apply_rope,
    attend,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    swiglu_mlp,
)
from turbospark_jax.state import append_only

Params = dict[str, Any]

#: Values of :attr:`DenseModel.attention` and :attr:`DenseModel.rope_store`.
KERNEL_MODES = ("auto", "xla", "interpret")


# -- params ----------------------------------------------------------------------------------


def param_shapes(config: DenseConfig) -> Params:
    """The params tree of ``config`` with a shape tuple at every leaf (layout in the module doc)."""
    c = config
    n, d, f, v = c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    h, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    layers: dict[str, tuple[int, ...]] = {
        "input_layernorm": (n, d),
        "q_proj": (n, d, h, hd),
        "k_proj": (n, d, kv, hd),
        "v_proj": (n, d, kv, hd),
        "o_proj": (n, h, hd, d),
        "post_attention_layernorm": (n, d),
        "gate_proj": (n, d, f),
        "up_proj": (n, d, f),
        "down_proj": (n, f, d),
    }
    if c.qkv_bias:
        layers.update(q_bias=(n, h, hd), k_bias=(n, kv, hd), v_bias=(n, kv, hd))
    if c.o_bias:
        layers["o_bias"] = (n, d)
    if c.qk_norm:
        layers.update(q_norm=(n, hd), k_norm=(n, hd))
    if c.has_mlp_bias:
        layers.update(gate_bias=(n, f), up_bias=(n, f), down_bias=(n, d))
    tree: Params = {"embed_tokens": (v, d), "norm": (d,), "layers": layers}
    if not c.tie_word_embeddings:
        tree["lm_head"] = (d, v)
    return tree


def _is_norm(name: str) -> bool:
    return name.endswith("norm")


def init_params(config: DenseConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random params like Hugging Face's init: matrices ~ N(0, initializer_range), norms 1,
    biases 0.

    Args:
      config: the model config.
      key: a PRNG key.
      dtype: the dtype of every leaf.

    Returns:
      A params tree with the layout in the module docstring.
    """
    return _init_params(config, key, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params(config: DenseConfig, key: jax.Array, dtype: jnp.dtype) -> Params:
    # One compiled program instead of one dispatch per leaf.
    shapes = param_shapes(config)
    paths, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(paths))
    leaves = []
    for (path, shape), k in zip(paths, keys, strict=True):
        name = path[-1].key
        if _is_norm(name):
            leaves.append(jnp.ones(shape, dtype))
        elif name.endswith("bias"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            # Drawn flat and reshaped: XLA compiles 1-D threefry sampling much faster.
            flat = jax.random.normal(k, (int(np.prod(shape)),), jnp.float32)
            w = flat.reshape(shape) * config.initializer_range
            leaves.append(w.astype(dtype))
    return jax.tree.unflatten(treedef, leaves)


def unstack_layers(params: Params) -> Params:
    """``params`` with ``layers`` as a list of per-layer dicts (each leaf without the L axis)."""
    layers = params["layers"]
    n = len(next(iter(layers.values())))
    return {**params, "layers": [{k: v[i] for k, v in layers.items()} for i in range(n)]}


def stack_layers(params: Params) -> Params:
    """Inverse of :func:`unstack_layers`: per-layer leaves stacked on a leading L axis."""
    layers = params["layers"]
    if not isinstance(layers, list | tuple):
        return params
    return {**params, "layers": {k: jnp.stack([lp[k] for lp in layers]) for k in layers[0]}}


# -- the model ------------------------------------------------------------------------------


@struct.dataclass(kw_only=True)
class DenseCache:
    """KV cache of a dense decoder (``C`` = capacity in positions).

    Two layouts, chosen by the model (:attr:`DenseModel.scan_layers`):

    * stacked (a scanning model): ``k`` and ``v`` are each one ``[L, C, KV, hd]`` array;
    * per layer (an unrolled model): ``k`` and ``v`` are tuples of ``L`` arrays
      ``[C, KV, hd]``. Each layer then writes and reads its own buffer in place; slicing one
      layer out of a stacked buffer inside the compiled loop costs a copy per layer and step
      on a GPU.

    Either way the position axis is axis 1 of the stacked view (a tuple stacks to it), rows
    at positions ``>= fed.count`` are dead, and keys are stored rotated, in the model dtype.
    """

    k: jax.Array | tuple[jax.Array, ...] = append_only(axis=1)
    v: jax.Array | tuple[jax.Array, ...] = append_only(axis=1)

    @property
    def per_layer(self) -> bool:
        """Whether the cache holds one buffer per layer."""
        return isinstance(self.k, tuple | list)

    @property
    def capacity(self) -> int:
        """Positions the cache can hold."""
        return int(self.k[0].shape[0] if self.per_layer else self.k.shape[1])


def _project(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [W, D] @ w [D, N, hd] -> [W, N, hd]`` as one 2-D matrix product.

    Written as a plain matrix product over a free reshape of the weight: for a single row,
    XLA on a GPU lowers the 3-D einsum form to a multiply and a reduction, several times
    slower than its matrix-vector kernel.
    """
    d, n, hd = w.shape
    return (x @ w.reshape(d, n * hd)).reshape(x.shape[0], n, hd)


LayerFn = Callable[[jax.Array, Any, Params, Any, Any], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class DenseModel(BlockModel):
    """A dense decoder as pure functions over explicit params and cache.

    Frozen and hashable, so it can be a static argument under ``jit``.

    Attributes:
      config: the hyperparameters.
      dtype: the activation / cache dtype (float32, bfloat16, float16); params should match.
      scan_layers: for stacked params, run the layers as a ``lax.scan`` (default) or unroll
        them over static slices (longer compiles, same speed). Listed params (see
        :func:`unstack_layers`) are always unrolled. An unrolled model keeps one KV buffer
        per layer (see :class:`DenseCache`).
      attention: how the block program attends over a per-layer cache: ``"auto"`` (the
        fused Pallas kernel of :mod:`~turbospark_jax.models.pallas_attention` on a GPU when
        the shapes suit it, XLA otherwise), ``"xla"`` (always XLA), or ``"interpret"`` (the
        kernel in the Pallas interpreter: slow, for testing it on a CPU). Each choice is one
        program for every path, so the bitwise guarantees hold within it.
      rope_store: the same choice for the RoPE-and-cache-write kernel of
        :mod:`~turbospark_jax.models.pallas_rope_store`, which takes the q/k/v projection's
        output to the fused attention kernel's input (q/k norm, RoPE, the query layout, the
        cache writes) in one launch instead of three or four. It feeds that attention kernel,
        so it runs only where that one does.
    """

    parallel_prefill = True

    config: DenseConfig
    dtype: Any = jnp.float32
    scan_layers: bool = True
    attention: str = "auto"
    rope_store: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        for field in ("attention", "rope_store"):
            value = getattr(self, field)
            if value not in KERNEL_MODES:
                raise BadInputError(
                    f"{field} must be one of {', '.join(KERNEL_MODES)}; got {value!r}"
                )

    def _fused_attention(self, per_layer: bool, capacity: int) -> bool | str:
        """Whether attention over a per-layer cache runs as the fused kernel (``"interpret"``:
        in the Pallas interpreter, for tests on a CPU)."""
        if not per_layer or self.attention == "xla":
            return False
        if self.attention == "interpret":
            return "interpret" if capacity >= pallas_attention.KEY_TILE else False
        return jax.default_backend() == "gpu" and pallas_attention.supported(
            self.config.head_dim, capacity
        )

    def _uses_rope_store(self, fused: bool | str) -> bool | str:
        """Whether the block program runs q/k norm, RoPE and the cache writes as the
        RoPE-and-cache-write kernel of :mod:`~turbospark_jax.models.pallas_rope_store`
        (``"interpret"``: in the Pallas interpreter). It feeds the fused attention kernel, so
        it needs that one too."""
        if not fused or self.rope_store == "xla":
            return False
        if self.rope_store == "interpret":
            return "interpret"
        c = self.config
        return jax.default_backend() == "gpu" and pallas_rope_store.supported(
            c.num_attention_heads, c.num_key_value_heads, c.head_dim
        )

    @property
    def vocab_size(self) -> int:
        """Length of every logits row."""
        return self.config.vocab_size

    def init_cache(self, capacity: int) -> DenseCache:
        """A zeroed KV cache holding ``capacity`` positions: stacked for a scanning model,
        one buffer per layer for an unrolled one (see :class:`DenseCache`)."""
        c = self.config
        shape = (capacity, c.num_key_value_heads, c.head_dim)
        if self.scan_layers:
            stacked = (c.num_hidden_layers, *shape)
            return DenseCache(k=jnp.zeros(stacked, self.dtype), v=jnp.zeros(stacked, self.dtype))
        n = c.num_hidden_layers
        return DenseCache(k=tuple(jnp.zeros(shape, self.dtype) for _ in range(n)),
                          v=tuple(jnp.zeros(shape, self.dtype) for _ in range(n)))

    def init_params(self, key: jax.Array) -> Params:
        """Random params in this model's dtype (see :func:`init_params`)."""
        return init_params(self.config, key, self.dtype)

    # -- shared layer pieces --------------------------------------------------------------

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        inv_freq, scale = rope_inv_freq(
            c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
        )
        return rope_cos_sin(positions, inv_freq, scale, self.dtype)

    def _projections(self, h: jax.Array, lp: Params) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q/k/v projections of the normed rows. h [W, D] -> q [W, H, hd], k/v [W, KV, hd]."""
        q = _project(h, lp["q_proj"])
        k = _project(h, lp["k_proj"])
        v = _project(h, lp["v_proj"])
        if self.config.qkv_bias:
            q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
        return q, k, v

    def _merged_projection(self, h: jax.Array, lp: Params) -> jax.Array:
        """q/k/v as one matrix product: h [W, D] -> [W, (H + 2 KV) * hd], q heads first. (XLA
        reads the three weights straight into its matrix kernel; it makes no copy of them.)"""
        d = h.shape[-1]
        names = ("q_proj", "k_proj", "v_proj")
        w = jnp.concatenate([lp[n].reshape(d, -1) for n in names], axis=1)
        qkv = h @ w
        if self.config.qkv_bias:
            qkv = qkv + jnp.concatenate([lp[n].reshape(-1) for n in ("q_bias", "k_bias",
                                                                     "v_bias")])
        return qkv

    def _rotate(
        self, q: jax.Array, k: jax.Array, lp: Params, cos: jax.Array, sin: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Optional per-head q/k norm, then RoPE."""
        c = self.config
        if c.qk_norm:
            q = rms_norm(q, lp["q_norm"], c.rms_norm_eps)
            k = rms_norm(k, lp["k_norm"], c.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def _finish(self, x: jax.Array, attn: jax.Array, lp: Params) -> jax.Array:
        """Output projection, residual, post-norm MLP, residual. attn [W, H, hd] -> x [W, D]."""
        c = self.config
        w_o = lp["o_proj"]  # [H, hd, D], contracted as one [H * hd, D] matrix
        o = attn.reshape(attn.shape[0], -1) @ w_o.reshape(-1, w_o.shape[-1])  # [W, D]
        if c.o_bias:
            o = o + lp["o_bias"]
        x = x + o
        with jax.named_scope("mlp"):
            h = rms_norm(x, lp["post_attention_layernorm"], c.rms_norm_eps)
            bias = c.has_mlp_bias
            return x + swiglu_mlp(
                h, lp["gate_proj"], lp["up_proj"], lp["down_proj"],
                lp["gate_bias"] if bias else None,
                lp["up_bias"] if bias else None,
                lp["down_bias"] if bias else None,
            )

    def _head(self, params: Params, x: jax.Array) -> jax.Array:
        """Final norm and output head. x [W, D] -> float32 logits [W, V]."""
        h = rms_norm(x, params["norm"], self.config.rms_norm_eps)
        if self.config.tie_word_embeddings:
            return jnp.einsum(
                "wd,vd->wv", h, params["embed_tokens"], preferred_element_type=jnp.float32
            )
        return jnp.einsum("wd,dv->wv", h, params["lm_head"], preferred_element_type=jnp.float32)

    def _scans(self, layers: Params) -> bool:
        """Whether :meth:`_run_layers` runs these layers as a ``lax.scan``."""
        return self.scan_layers and not isinstance(layers, list | tuple)

    def _run_layers(self, layers: Params, x: jax.Array, carry: Any, layer_fn: LayerFn) -> Any:
        """Apply ``layer_fn(x, carry, layer_params, layer_index, window)`` over all layers."""
        windows = self.config.layer_windows
        n = self.config.num_hidden_layers
        if not self._scans(layers):
            for i in range(n):
                if isinstance(layers, list | tuple):
                    lp = layers[i]
                else:
                    lp = jax.tree.map(lambda a, i=i: a[i], layers)
                with jax.named_scope(f"layer_{i}"):
                    x, carry = layer_fn(x, carry, lp, i, windows[i])
            return x, carry
        # A layer without a window gets one wider than any position: the same mask expression
        # then serves every layer of the scan.
        any_window = any(w is not None for w in windows)
        window_array = (
            jnp.asarray([w if w is not None else 2**30 for w in windows], jnp.int32)
            if any_window else None
        )

        def body(state: tuple[jax.Array, Any], xs: tuple[Params, jax.Array, Any]) -> Any:
            x, carry = state
            lp, index, window = xs
            with jax.named_scope("layer"):
                return layer_fn(x, carry, lp, index, window), None

        (x, carry), _ = jax.lax.scan(
            body, (x, carry), (layers, jnp.arange(n, dtype=jnp.int32), window_array)
        )
        return x, carry

    # -- entry points -----------------------------------------------------------------------

    def block_forward(
        self,
        params: Params,
        cache: DenseCache,
        tokens: jax.Array,
        positions: jax.Array,
        live: jax.Array,
        need_head: jax.Array,
        *,
        key_limit: int | None = None,
        fresh: bool = False,
    ) -> tuple[jax.Array, DenseCache]:
        """Run a block of W rows against the cache: write their K/V, attend, return logits.

        Each live row's K/V is written at its position first, then every row attends to the
        cache positions ``<= its own position`` (within its layer's sliding window), so rows of
        one block see each other causally. Row ``i``'s computation depends only on row ``i``
        and the cache: the same compiled program gives row ``i`` bitwise the same result
        whether 1 or W rows are live.

        Args:
          params: the params tree.
          cache: the KV cache.
          tokens: int32 ``[W]`` token ids.
          positions: int32 ``[W]`` the position of each row (the engine passes start + i).
          live: int32 ``[]``; rows ``>= live`` are padding: they write nothing to the cache
            and their logits are don't-care.
          need_head: bool ``[]`` (traced); when false the final norm and output head are
            skipped and the logits are zeros.
          key_limit: static; attend over cache positions ``< key_limit`` only (the parallel
            prefill's fast path, which knows no row sits past it). ``None``: the whole cache.
          fresh: static; the block starts at position 0 of an empty cache, so attention runs
            over the block's own rows (cuDNN flash attention on a GPU in 16-bit dtypes).
            Parallel prefill only: a different program from the exact path.

        Returns:
          ``(logits, cache)``: float32 ``[W, V]`` and the updated cache.
        """
        width = tokens.shape[0]
        capacity = cache.capacity
        per_layer = cache.per_layer
        if per_layer and self._scans(params["layers"]):
            raise BadInputError(
                "a per-layer cache needs an unrolled model (scan_layers=False) or listed params"
            )
        # Padding rows scatter to distinct out-of-range rows, which mode="drop" discards. The
        # targets are then all different, which the scatters promise to XLA (unique_indices):
        # without the promise a GPU scatter of 16-bit values has to write with atomics.
        rows = jnp.arange(width, dtype=jnp.int32)
        write_at = jnp.where(rows < live, positions, capacity + rows)  # [W]
        scatter = {"mode": "drop", "unique_indices": True}
        key_positions = jnp.arange(capacity, dtype=jnp.int32)  # [C]
        with jax.named_scope("embed"):
            x = jnp.take(params["embed_tokens"], tokens, axis=0).astype(self.dtype)  # [W, D]
            cos, sin = self._rope(positions)

        limit = capacity if key_limit is None else min(key_limit, capacity)
        fused = self._fused_attention(per_layer, capacity)
        rope_store = self._uses_rope_store(fused)
        store = rope_store and not fresh  # a fresh block attends over its own rotated k
        c = self.config

        def layer(x: jax.Array, kv: Any, lp: Params, index: Any, window: Any) -> Any:
            k_all, v_all = kv  # stacked [L, C, KV, hd] each, or tuples of [C, KV, hd]
            h = rms_norm(x, lp["input_layernorm"], c.rms_norm_eps)
            with jax.named_scope("attention"):
                if store:  # one kernel from the projection's output to the attention's input
                    norms = (lp["q_norm"], lp["k_norm"]) if c.qk_norm else (None, None)
                    qr, k_layer, v_layer = pallas_rope_store.rope_store(
                        self._merged_projection(h, lp), cos, sin, write_at, k_all[index],
                        v_all[index], c.num_attention_heads, *norms, eps=c.rms_norm_eps,
                        interpret=rope_store == "interpret",
                    )
                else:
                    q, k, v = self._projections(h, lp)
                    q, k = self._rotate(q, k, lp, cos, sin)
                if per_layer:  # index is a python int: this layer's own buffers
                    if not store:
                        k_layer = k_all[index].at[write_at].set(k, **scatter)
                        v_layer = v_all[index].at[write_at].set(v, **scatter)
                    k_all = (*k_all[:index], k_layer, *k_all[index + 1 :])
                    v_all = (*v_all[:index], v_layer, *v_all[index + 1 :])
                else:
                    k_all = k_all.at[index, write_at].set(k, **scatter)
                    v_all = v_all.at[index, write_at].set(v, **scatter)
                    k_layer, v_layer = k_all[index], v_all[index]
                if store:
                    attn = pallas_attention.cached_attention_arranged(
                        qr, k_layer, v_layer, positions, heads=c.num_attention_heads,
                        window=window, interpret=fused == "interpret",
                    )
                elif fresh:
                    attn = self._self_attention(q, k, v, positions, window)
                elif fused:
                    attn = pallas_attention.cached_attention(
                        q, k_layer, v_layer, positions, window=window,
                        interpret=fused == "interpret",
                    )
                else:
                    attn = attend(q, k_layer[:limit], v_layer[:limit], positions,
                                  key_positions[:limit], window)
            return self._finish(x, attn, lp), (k_all, v_all)

        x, (k_all, v_all) = self._run_layers(params["layers"], x, (cache.k, cache.v), layer)
        with jax.named_scope("head"):
            logits = jax.lax.cond(
                need_head,
                lambda x: self._head(params, x),
                lambda x: jnp.zeros((width, self.vocab_size), jnp.float32),
                x,
            )
        return logits, cache.replace(k=k_all, v=v_all)

    def _self_attention(
        self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, window: Any
    ) -> jax.Array:
        """Causal attention of a block over its own rows (q [W, H, hd], k/v [W, KV, hd])."""
        flash = (
            jax.default_backend() == "gpu"
            and self.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and window is None
            and self.config.head_dim % 8 == 0
            and self.config.head_dim <= 128
        )
        if flash:
            out = jax.nn.dot_product_attention(
                q[None], k[None], v[None], is_causal=True, implementation="cudnn"
            )
            return out[0]
        return attend(q, k, v, positions, positions, window)

    def forward(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Plain causal forward over whole sequences, no cache (training, parity tests).

        Args:
          params: the params tree.
          tokens: int32 ``[B, T]``; row ``t`` of each sequence sits at position ``t``.

        Returns:
          float32 logits ``[B, T, V]``.
        """
        return jax.vmap(lambda seq: self._forward_one(params, seq))(tokens)

    def _forward_one(self, params: Params, tokens: jax.Array) -> jax.Array:
        positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)  # [T]
        with jax.named_scope("embed"):
            x = jnp.take(params["embed_tokens"], tokens, axis=0).astype(self.dtype)  # [T, D]
            cos, sin = self._rope(positions)

        c = self.config

        def layer(x: jax.Array, carry: None, lp: Params, index: Any, window: Any) -> Any:
            del index
            with jax.named_scope("attention"):
                q, k, v = self._projections(rms_norm(x, lp["input_layernorm"], c.rms_norm_eps),
                                            lp)
                q, k = self._rotate(q, k, lp, cos, sin)
                attn = attend(q, k, v, positions, positions, window)
            return self._finish(x, attn, lp), carry

        x, _ = self._run_layers(params["layers"], x, None, layer)
        with jax.named_scope("head"):
            return self._head(params, x)
