"""The dense decoder family (llama, mistral, qwen2, qwen3): params, the model, and the
family's declaration for loading. The config is :mod:`~turbospark_jax.models.dense.config`.

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

A ``qwen3_moe`` model (``E`` experts of width ``Fe``) has, instead of the three MLP matrices,
the router as the file keeps it and the experts stacked (:mod:`~turbospark_jax.models.moe`)::

      router                  [L, E, D]
      expert_gate, expert_up  [L, E, D, Fe]
      expert_down             [L, E, Fe, D]

Two layer layouts are accepted everywhere (``block_forward``, ``forward``, ``save_folder``):

* **stacked** (above; what :func:`init_params` and ``load_folder`` return by default): the
  layers run as a ``lax.scan`` over the L axis (``scan_layers=True``) or a Python loop over
  static slices (``scan_layers=False``, whose cache is per layer). Compact, and what
  training wants.
* **list** (:func:`unstack_layers`; ``load_folder(..., layer_layout="list")``): ``layers`` is a
  list of per-layer dicts, run by an unrolled Python loop. Use this for decoding on a GPU:
  inside a jitted loop XLA materialises every slice of a stacked weight, so a stacked model
  reads its weights several times a step.

The KV cache rides in the loop carry and is updated in place by a scatter; it is never
re-stacked as a scan output. An unrolled model keeps one buffer per layer (slicing a layer out
of a stacked buffer in the loop costs copies) and, on a GPU, attends over it with the fused
kernel of :mod:`~turbospark_jax.kernels.attention`, fed by the RoPE-and-cache-write
kernel of :mod:`~turbospark_jax.kernels.rope_store`. Blocks wider than
:data:`~turbospark_jax.kernels.layers.ATTENTION_QUERY_BLOCK` rows attend in query slices of that
width, which bounds the score tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from turbospark_jax.core.state import append_only
from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import plan as row_kernels
from turbospark_jax.kernels.layers import random_leaves, rope_inv_freq, swiglu_mlp
from turbospark_jax.kernels.plan import XLA_PLAN, KernelPlan
from turbospark_jax.models.base import BlockModel, check_tap_layers
from turbospark_jax.models.dense.attention import Attention, cached_attention, sequence_attention
from turbospark_jax.models.dense.config import ARCHITECTURES, DenseConfig
from turbospark_jax.models.family import Family, HFTensor
from turbospark_jax.models.moe import ExpertParallel, moe_block, moe_leaves
from turbospark_jax.quant import kv as kv_quant
from turbospark_jax.quant.weights import as_array, is_quantized, take_rows, tied_logits

Params = dict[str, Any]

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
    }
    if c.moe:
        e, fe = c.num_experts, c.moe_intermediate_size
        layers.update(router=(n, e, d), expert_gate=(n, e, d, fe), expert_up=(n, e, d, fe),
                      expert_down=(n, e, fe, d))
    else:
        layers.update(gate_proj=(n, d, f), up_proj=(n, d, f), down_proj=(n, f, d))
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
    return random_leaves(param_shapes(config), key, config.initializer_range, dtype,
                         lambda name: 1.0 if _is_norm(name) else
                         0.0 if name.endswith("bias") else None)


def unstack_layers(params: Params) -> Params:
    """``params`` with ``layers`` as a list of per-layer dicts (each leaf without the L axis)."""
    layers = params["layers"]
    n = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": [{k: v[i] for k, v in layers.items()} for i in range(n)]}


def stack_layers(params: Params) -> Params:
    """Inverse of :func:`unstack_layers`: per-layer leaves stacked on a leading L axis."""
    layers = params["layers"]
    if not isinstance(layers, list | tuple):
        return params
    return {**params, "layers": {k: jax.tree.map(lambda *xs: jnp.stack(xs),
                                                 *[lp[k] for lp in layers])
                                 for k in layers[0]}}



# -- Hugging Face tensors ------------------------------------------------------------------

#: Our per-layer leaf -> its name under ``model.layers.{i}.`` and whether it is an
#: ``nn.Linear`` weight (kept ``[out, in]`` in the file).
_HF_LAYER_NAMES: dict[str, tuple[str, bool]] = {
    "input_layernorm": ("input_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_bias": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "post_attention_layernorm": ("post_attention_layernorm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
    "gate_bias": ("mlp.gate_proj.bias", False),
    "up_bias": ("mlp.up_proj.bias", False),
    "down_bias": ("mlp.down_proj.bias", False),
    "router": ("mlp.gate.weight", False),  # kept [E, D] as the file has it
}
#: Expert stacks -> the name of expert ``e``'s matrix under ``model.layers.{i}.``.
_HF_EXPERT_NAMES: dict[str, str] = {
    "expert_gate": "mlp.experts.{e}.gate_proj.weight",
    "expert_up": "mlp.experts.{e}.up_proj.weight",
    "expert_down": "mlp.experts.{e}.down_proj.weight",
}


def hf_tensors(config: DenseConfig) -> list[HFTensor]:
    """Every tensor a folder of ``config`` holds, in the order a saved folder writes them,
    each with the stacked leaf it fills (``stacked`` = its layer)."""
    shapes = param_shapes(config)
    out = [HFTensor("model.embed_tokens.weight", ("embed_tokens",), shapes["embed_tokens"])]
    for i in range(config.num_hidden_layers):
        for key, shape in shapes["layers"].items():
            if key in _HF_EXPERT_NAMES:  # ours [in, out] per expert; HF [out, in]
                hf = shape[2:][::-1]
                out.extend(HFTensor(f"model.layers.{i}.{_HF_EXPERT_NAMES[key].format(e=e)}",
                                    ("layers", key), hf, transpose=True, stacked=(i, e))
                           for e in range(shape[1]))
                continue
            suffix, linear = _HF_LAYER_NAMES[key]
            ours = shape[1:]
            if linear:  # ours is [in..., out...]; HF is [prod(out), prod(in)]
                split = 2 if key == "o_proj" else 1
                hf = (math.prod(ours[split:]), math.prod(ours[:split]))
            elif key == "router":
                hf = ours
            else:
                hf = (math.prod(ours),)
            out.append(HFTensor(f"model.layers.{i}.{suffix}", ("layers", key), hf,
                                transpose=linear, stacked=i))
    out.append(HFTensor("model.norm.weight", ("norm",), shapes["norm"]))
    if not config.tie_word_embeddings:
        d, v = shapes["lm_head"]
        out.append(HFTensor("lm_head.weight", ("lm_head",), (v, d), transpose=True))
    return out


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
    at positions ``>= fed.count`` are dead, and keys are stored rotated, in the model dtype,
    or quantized (:attr:`DenseModel.kv_dtype`): then ``k_scale`` and ``v_scale`` hold each
    row's float32 scale, ``[L, C, KV]`` or tuples of ``[C, KV]`` beside the values
    (:mod:`~turbospark_jax.quant.kv`); ``()`` without quantization.
    """

    k: jax.Array | tuple[jax.Array, ...] = append_only(axis=1)
    v: jax.Array | tuple[jax.Array, ...] = append_only(axis=1)
    k_scale: jax.Array | tuple[jax.Array, ...] = kv_quant.scale_field(append_only(axis=1))
    v_scale: jax.Array | tuple[jax.Array, ...] = kv_quant.scale_field(append_only(axis=1))

    @property
    def per_layer(self) -> bool:
        """Whether the cache holds one buffer per layer."""
        return isinstance(self.k, tuple | list)

    @property
    def capacity(self) -> int:
        """Positions the cache can hold."""
        return int(self.k[0].shape[0] if self.per_layer else self.k.shape[1])


@struct.dataclass(kw_only=True)
class TappedDenseCache(DenseCache):
    """A :class:`DenseCache` that also records the output rows of the model's tap layers
    (:attr:`DenseModel.tap_layers`) for every fed position, for a block drafter to read.

    Fields (besides ``k`` and ``v``):
      taps: ``[C, K, D]``: row ``p`` holds the output of each of the ``K`` tap layers (in
        ``tap_layers`` order) at position ``p``, in the model dtype; rows at positions
        ``>= fed.count`` are dead. Append-only like the KV rows, so it rolls back with the
        cursor and a chunked prefill writes bitwise the rows token-by-token feeding writes.
    """

    taps: jax.Array = append_only(axis=0)


#: One decoder layer: ``(x [W, D], cache carry, layer params, layer index, window) ->
#: (x, cache carry)``.
LayerFn = Callable[[jax.Array, Any, Params, Any, Any], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class DenseModel(BlockModel):
    """A dense decoder as pure functions over explicit params and cache.

    Frozen and hashable, so it can be a static argument under ``jit``.

    Attributes:
      config: the hyperparameters.
      dtype: the activation / cache dtype (float32, bfloat16, float16); params should match.
      scan_layers: for stacked params, run the layers as a ``lax.scan`` (compact: the
        compile does not grow with the depth; what training wants) rather than unrolled over
        static slices. It also picks the cache layout: a scanning model keeps one stacked KV
        buffer, an unrolled one a buffer per layer (see :class:`DenseCache`), which the fused
        attention kernels need. Listed params (see :func:`unstack_layers`) are always
        unrolled; :func:`~turbospark_jax.io.loading.load_folder`'s ``layer_layout`` sets
        it.
      plan: the kernels the per-row work runs on
        (:class:`~turbospark_jax.kernels.plan.KernelPlan`): XLA's own by default (exact at
        one program width only); a row-invariant plan makes block programs of different
        widths agree bitwise row for row. Loading resolves it once from the backend and
        ``exact`` (:func:`~turbospark_jax.kernels.plan.kernel_plan`).
      tap_layers: see :class:`~turbospark_jax.models.base.BlockModel`.
      kv_dtype: the KV cache's stored form: ``None`` (the model dtype), ``"int8"`` or
        ``"fp8"`` (one byte a value and a float32 scale a row and KV head, quantized on
        write and dequantized on read: :mod:`~turbospark_jax.quant.kv`).
        :func:`~turbospark_jax.io.loading.load_folder`'s ``kv_dtype`` sets it.
      expert_parallel: a mixture of experts' stacks split over a mesh axis
        (:class:`~turbospark_jax.models.moe.ExpertParallel`; set by
        :class:`~turbospark_jax.parallel.sharding.ShardedProducer` on a mesh with an expert
        axis), or None.
    """

    parallel_prefill = True
    parallel_head = True
    can_tap = True
    row_invariant_kernels = True

    @property
    def widths_agree(self) -> bool:
        return self.plan.widths_agree

    @property
    def bounds_keys(self) -> bool:
        # The row-invariant fused attention is what a bound speeds up; elsewhere a bound
        # would only compile programs that compute the same way.
        return self.plan.row_invariant and self.plan.uses_pallas

    config: DenseConfig
    dtype: Any = jnp.float32
    scan_layers: bool = True
    tap_layers: tuple[int, ...] = ()
    plan: KernelPlan = XLA_PLAN
    kv_dtype: str | None = None
    expert_parallel: ExpertParallel | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        kv_quant.check_kv_dtype(self.kv_dtype)
        check_tap_layers(self.tap_layers, self.config.num_hidden_layers)
        if not isinstance(self.plan, KernelPlan):
            raise BadInputError(f"plan must be a KernelPlan (turbospark_jax.kernels.plan); "
                                f"got {self.plan!r}")

    def for_mesh(self) -> DenseModel:
        """This model with its plan's Pallas kernels off (XLA's operations, in the plan's
        row-invariant form where it has one), which a tensor-parallel mesh splits: the
        kernels are single-device custom calls the compiler cannot split."""
        return dataclasses.replace(self, plan=dataclasses.replace(self.plan, pallas="off"))

    @property
    def vocab_size(self) -> int:
        """Length of every logits row."""
        return self.config.vocab_size

    def init_cache(self, capacity: int) -> DenseCache:
        """A zeroed KV cache holding ``capacity`` positions: stacked for a scanning model,
        one buffer per layer for an unrolled one (see :class:`DenseCache`), with the tap rows
        when the model has tap layers (:class:`TappedDenseCache`)."""
        c = self.config
        shape = (capacity, c.num_key_value_heads, c.head_dim)
        if self.scan_layers:
            (k, k_scale), (v, v_scale) = (
                kv_quant.zeros((c.num_hidden_layers, *shape), self.kv_dtype, self.dtype)
                for _ in range(2))
        else:
            k, k_scale, v, v_scale = self._layer_buffers(shape)
        buffers = {"k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale}
        if not self.tap_layers:
            return DenseCache(**buffers)
        taps = jnp.zeros((capacity, len(self.tap_layers), c.hidden_size), self.dtype)
        return TappedDenseCache(**buffers, taps=taps)

    def _layer_buffers(self, shape: tuple[int, ...]) -> tuple[Any, ...]:
        """Per-layer zeroed ``(k, k_scale, v, v_scale)`` tuples (the scales ``()`` without
        quantization)."""
        n = self.config.num_hidden_layers
        k = [kv_quant.zeros(shape, self.kv_dtype, self.dtype) for _ in range(n)]
        v = [kv_quant.zeros(shape, self.kv_dtype, self.dtype) for _ in range(n)]
        scales = self.kv_dtype is not None
        return (tuple(b for b, _ in k), tuple(s for _, s in k) if scales else (),
                tuple(b for b, _ in v), tuple(s for _, s in v) if scales else ())

    def init_params(self, key: jax.Array) -> Params:
        """Random params in this model's dtype (see :func:`init_params`)."""
        return init_params(self.config, key, self.dtype)

    # -- one layer ----------------------------------------------------------------------------

    def _layer(self, attention: Attention, live: jax.Array | None = None) -> LayerFn:
        """One pre-norm decoder layer around ``attention``:
        ``h = x + o_proj(attention(norm(x))); out = h + mlp(norm(h))``. ``live``: bool
        ``[W]``, the block's rows that are not padding (the experts skip the others)."""
        eps = self.config.rms_norm_eps
        norm = functools.partial(row_kernels.rms_norm, self.plan, eps=eps)

        def layer(x: jax.Array, kv: Any, lp: Params, index: Any, window: Any) -> Any:
            with jax.named_scope("attention"):
                attn, kv = attention(norm(x, lp["input_layernorm"]), lp, kv, index, window)
            h = x + self._output_projection(attn, lp)
            with jax.named_scope("mlp"):
                out = h + self._mlp(norm(h, lp["post_attention_layernorm"]), lp, live)
            return out, kv

        return layer

    def defers_sums(self, layers: Params) -> bool:
        """Whether the layers hand their residual deltas on unfinished (a row-invariant plan,
        unrolled layers, no biases after a product, no tap layers, no experts): each output
        projection and MLP gives float32 partial sums over K, which the next norm's kernel
        adds to the residual itself (:func:`~turbospark_jax.kernels.plan.add_norm`), and the
        q/k/v product's partial sums go to the RoPE-and-cache-write kernel. Bitwise the same
        arithmetic as finishing every product first, with the launches that would finish
        them saved (two or three a layer at decode widths)."""
        c = self.config
        return (self.plan.row_invariant and not self._scans(layers) and not self.tap_layers
                and not c.o_bias and not c.has_mlp_bias and not c.moe)

    def _deferring_layer(self, attention: Attention) -> LayerFn:
        """:meth:`_layer` over a hidden state carried as ``(h, pending)``: the rows are
        ``h`` plus the previous layer's MLP output, still as partial sums (``pending``;
        None before the first layer). See :meth:`defers_sums`."""
        eps = self.config.rms_norm_eps
        plan = self.plan

        def layer(x: Any, kv: Any, lp: Params, index: Any, window: Any) -> Any:
            h, pending = x
            with jax.named_scope("attention"):
                if pending is None:
                    normed = row_kernels.rms_norm(plan, h, lp["input_layernorm"], eps)
                else:
                    h, normed = row_kernels.add_norm(plan, h, pending,
                                                     lp["input_layernorm"], eps)
                attn, kv = attention(normed, lp, kv, index, window)
                w_o = lp["o_proj"]
                o = row_kernels.matmul_parts(plan, attn.reshape(attn.shape[0], -1),
                                             w_o.reshape(-1, w_o.shape[-1]), label="o")
            with jax.named_scope("mlp"):
                h, normed = row_kernels.add_norm(plan, h, o, lp["post_attention_layernorm"], eps)
                pending = row_kernels.matmul_parts(plan, self._gated(normed, lp),
                                                   lp["down_proj"], label="down")
            return (h, pending), kv

        return layer

    def _layers_in(self, layers: Params, x: jax.Array, attention: Attention,
                   live: jax.Array | None = None) -> tuple[Any, Any]:
        """The hidden state and layer function :meth:`_run_layers` starts from."""
        if self.defers_sums(layers):
            return (x, None), self._deferring_layer(attention)
        return x, self._layer(attention, live)

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        inv_freq, scale = rope_inv_freq(
            c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
        )
        return row_kernels.rope_cos_sin(self.plan, positions, inv_freq, scale, self.dtype)

    def _output_projection(self, attn: jax.Array, lp: Params) -> jax.Array:
        """attn [W, H, hd] -> [W, D]: ``o_proj`` [H, hd, D] contracted as one [H * hd, D]
        matrix, plus its bias."""
        w_o = lp["o_proj"]
        o = row_kernels.matmul(self.plan, attn.reshape(attn.shape[0], -1),
                               w_o.reshape(-1, w_o.shape[-1]), label="o")
        if self.config.o_bias:
            o = o + lp["o_bias"]
        return o

    def _mlp(self, h: jax.Array, lp: Params, live: jax.Array | None = None) -> jax.Array:
        """SwiGLU (or the mixture of experts) of the normed rows, h [W, D] -> [W, D]."""
        if self.config.moe:
            return moe_block(h, moe_leaves(lp), self.config.routing,
                             row_invariant=self.plan.row_invariant,
                             placement=self.expert_parallel,
                             impl=row_kernels.grouped_impl(self.plan), live=live)
        bias = self.config.has_mlp_bias
        if self.plan.row_invariant and not bias:
            return row_kernels.matmul(self.plan, self._gated(h, lp), lp["down_proj"],
                                      label="down")
        return swiglu_mlp(
            h, lp["gate_proj"], lp["up_proj"], lp["down_proj"],
            lp["gate_bias"] if bias else None,
            lp["up_bias"] if bias else None,
            lp["down_bias"] if bias else None,
            matmul=functools.partial(row_kernels.matmul, self.plan)
            if self.plan.row_invariant else None,
        )

    def _gated(self, h: jax.Array, lp: Params) -> jax.Array:
        """SwiGLU's gated rows ``silu(gate(h)) * up(h)`` under a row-invariant plan (no
        biases): one
        launch on a GPU, gated in its epilogue; SiLU in float32, rounded once, as
        :func:`swiglu_mlp` does."""
        return row_kernels.swiglu(self.plan, h, lp["gate_proj"], lp["up_proj"])

    def _head(self, params: Params, x: Any) -> jax.Array:
        """Final norm and output head. x [W, D] (or ``(h, pending)``, see
        :meth:`defers_sums`) -> float32 logits [W, V]."""
        eps = self.config.rms_norm_eps
        if isinstance(x, tuple):
            _, h = row_kernels.add_norm(self.plan, x[0], x[1], params["norm"], eps)
        else:
            h = row_kernels.rms_norm(self.plan, x, params["norm"], eps)
        if self.plan.row_invariant:  # a tied table [V, D] is read in place, not transposed
            if self.config.tie_word_embeddings:
                table = params["embed_tokens"]  # a quantized one is [D, V] already
                return row_kernels.matmul(self.plan, h, table, jnp.float32,
                                          w_layout="kn" if is_quantized(table) else "nk",
                                          label="head")
            return row_kernels.matmul(self.plan, h, params["lm_head"], jnp.float32,
                                      label="head")
        if self.config.tie_word_embeddings:
            return tied_logits(h, params["embed_tokens"])
        return jnp.einsum("wd,dv->wv", h, as_array(params["lm_head"], h.dtype),
                          preferred_element_type=jnp.float32)

    def _scans(self, layers: Params) -> bool:
        """Whether :meth:`_run_layers` runs these layers as a ``lax.scan``."""
        return self.scan_layers and not isinstance(layers, list | tuple)

    def _run_layers(self, layers: Params, x: jax.Array, carry: Any, layer_fn: LayerFn,
                    keep: tuple[int, ...] = ()) -> Any:
        """Apply ``layer_fn(x, carry, layer_params, layer_index, window)`` over all layers.

        Returns ``(x, carry)``, and with ``keep`` (layer indices) also the output rows of
        those layers, ``[len(keep), *x.shape]``."""
        windows = self.config.layer_windows
        n = self.config.num_hidden_layers
        if not self._scans(layers):
            kept = []
            for i in range(n):
                if isinstance(layers, list | tuple):
                    lp = layers[i]
                else:
                    lp = jax.tree.map(lambda a, i=i: a[i], layers)
                with jax.named_scope(f"layer_{i}"):
                    x, carry = layer_fn(x, carry, lp, i, windows[i])
                if i in keep:
                    kept.append(x)
            return (x, carry, jnp.stack(kept)) if keep else (x, carry)
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
                x, carry = layer_fn(x, carry, lp, index, window)
            # Every layer's rows come out only when some are kept: otherwise the same scan.
            return (x, carry), (x if keep else None)

        (x, carry), outs = jax.lax.scan(
            body, (x, carry), (layers, jnp.arange(n, dtype=jnp.int32), window_array)
        )
        return (x, carry, outs[jnp.asarray(keep)]) if keep else (x, carry)

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
        last_row_head: bool = False,
        max_keys: int | None = None,
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
            skipped and the logits are zeros. The constant ``True`` runs them with no
            ``lax.cond`` (on a GPU a conditional waits for its predicate on the host).
          key_limit: static; attend over cache positions ``< key_limit`` only (the parallel
            prefill's fast path, which knows no row sits past it). ``None``: the whole cache.
          fresh: static; the block starts at position 0 of an empty cache, so attention runs
            over the block's own rows (cuDNN flash attention on a GPU in 16-bit dtypes).
            Parallel prefill only: a different program from the exact path.
          max_keys: static; the caller's bound on every row's position + 1 (see
            :attr:`bounds_keys`): the row-invariant attention kernel may then fold a short
            context's splits in one launch. Speed only; ``None``: no bound.

        The parallel prefill's passes (``key_limit`` or ``fresh``) stand outside every bitwise
        guarantee, so under a row-invariant plan they run on the plan's non-invariant forms
        (:meth:`~turbospark_jax.kernels.plan.KernelPlan.parallel`: XLA's products, and
        cuDNN's attention on a GPU), which are faster there.

        Returns:
          ``(logits, cache)``: float32 ``[W, V]`` and the updated cache.

        Raises:
          BadInputError: a per-layer cache with stacked params run as a scan;
            ``last_row_head`` where the widths do not agree, outside a parallel pass.
        """
        if self.plan.row_invariant and (fresh or key_limit is not None):
            fast = dataclasses.replace(self, plan=self.plan.parallel())
            return fast.block_forward(params, cache, tokens, positions, live, need_head,
                                      key_limit=key_limit, fresh=fresh,
                                      last_row_head=last_row_head)
        width = tokens.shape[0]
        capacity = cache.capacity
        parallel = fresh or key_limit is not None  # no bitwise claim to keep (parallel_head)
        if last_row_head and not self.widths_agree and not parallel:
            raise BadInputError(
                "last_row_head needs a row-invariant kernel plan: with XLA's kernels a one-row "
                "head rounds unlike the same row of a W-row head"
            )
        if cache.per_layer and self._scans(params["layers"]):
            raise BadInputError(
                "a per-layer cache needs an unrolled model (scan_layers=False) or listed params"
            )
        # Padding rows write to distinct rows past the cache, which the scatters drop.
        rows = jnp.arange(width, dtype=jnp.int32)
        write_at = jnp.where(rows < live, positions, capacity + rows)  # [W]
        key_positions = jnp.arange(capacity, dtype=jnp.int32)  # [C]
        with jax.named_scope("embed"):
            x = take_rows(params["embed_tokens"], tokens, self.dtype)  # [W, D]
            cos, sin = self._rope(positions)

        limit = capacity if key_limit is None else min(key_limit, capacity)
        attention = cached_attention(
            self, per_layer=cache.per_layer, capacity=capacity, fresh=fresh, positions=positions,
            write_at=write_at, cos=cos, sin=sin, key_positions=key_positions, limit=limit,
            max_keys=max_keys,
        )
        x, layer = self._layers_in(params["layers"], x, attention, rows < live)
        ran = self._run_layers(params["layers"], x,
                               (cache.k, cache.v, cache.k_scale, cache.v_scale), layer,
                               self.tap_layers)
        x, (k_all, v_all, k_scale, v_scale) = ran[:2]
        if self.tap_layers:  # [K, W, D] -> rows [W, K, D] at each live row's position
            taps = jnp.swapaxes(ran[2], 0, 1)
            cache = cache.replace(taps=cache.taps.at[write_at].set(
                taps.astype(cache.taps.dtype), mode="drop", unique_indices=True))
        rows_out = width
        if last_row_head:  # the head on row live - 1 alone: [1, ...]
            pick = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=live - 1,
                                     slice_size=1)
            x = ((pick(x[0], axis=0), pick(x[1], axis=1))  # (h, pending [S, W, D])
                 if isinstance(x, tuple) else pick(x, axis=0))
            rows_out = 1
        with jax.named_scope("head"):
            if need_head is True:
                logits = self._head(params, x)
            else:
                logits = jax.lax.cond(
                    need_head,
                    lambda x: self._head(params, x),
                    lambda x: jnp.zeros((rows_out, self.vocab_size), jnp.float32),
                    x,
                )
        return logits, cache.replace(k=k_all, v=v_all, k_scale=k_scale, v_scale=v_scale)

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
            x = take_rows(params["embed_tokens"], tokens, self.dtype)  # [T, D]
            cos, sin = self._rope(positions)

        attention = sequence_attention(self.config, positions, cos, sin, self.plan)
        x, layer = self._layers_in(params["layers"], x, attention)
        x, _ = self._run_layers(params["layers"], x, None, layer)
        with jax.named_scope("head"):
            return self._head(params, x)

    def forward_taps(self, params: Params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """:meth:`forward` that also returns the tap layers' output rows (training a block
        drafter against this model).

        Args:
          params: the params tree.
          tokens: int32 ``[B, T]``.

        Returns:
          float32 logits ``[B, T, V]`` and the tap rows ``[B, T, K, D]`` (model dtype).

        Raises:
          BadInputError: the model has no tap layers.
        """
        if not self.tap_layers:
            raise BadInputError("forward_taps needs a model built with tap_layers=(...)")

        def one(seq: jax.Array) -> tuple[jax.Array, jax.Array]:
            positions = jnp.arange(seq.shape[0], dtype=jnp.int32)
            x = take_rows(params["embed_tokens"], seq, self.dtype)
            cos, sin = self._rope(positions)
            attention = sequence_attention(self.config, positions, cos, sin, self.plan)
            x, _, taps = self._run_layers(params["layers"], x, None, self._layer(attention),
                                          self.tap_layers)
            return self._head(params, x), jnp.swapaxes(taps, 0, 1)

        return jax.vmap(one)(tokens)


def _tied_copies(config: DenseConfig) -> dict[str, str]:
    # A tied model may still have saved its head; it must then equal the embeddings.
    return {"lm_head.weight": "model.embed_tokens.weight"} if config.tie_word_embeddings else {}


def _to_layer_layout(params: Params, layer_layout: str) -> Params:
    stacked = stack_layers(params)
    return unstack_layers(stacked) if layer_layout == "list" else stacked


def _build(config: DenseConfig, dtype: Any, layer_layout: str) -> DenseModel:
    return DenseModel(config, dtype, scan_layers=layer_layout != "list")


#: The dense family's declaration for :mod:`turbospark_jax.io.loading`.
FAMILY = Family(
    name="dense",
    architectures=ARCHITECTURES,
    parse_config=DenseConfig.from_hf_dict,
    config_type=DenseConfig,
    param_shapes=param_shapes,
    hf_tensors=hf_tensors,
    build=_build,
    tolerated=lambda name: name.endswith("rotary_emb.inv_freq"),  # recomputed, never read
    tied_copies=_tied_copies,
    to_layer_layout=_to_layer_layout,
)
