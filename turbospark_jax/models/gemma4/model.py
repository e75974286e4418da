"""The Gemma 4 text family: ``gemma4_text`` folders and the text decoder of ``gemma4`` folders.
Params, the model, and the family's declaration for loading; the config is
:mod:`~turbospark_jax.models.gemma4.config`.

A Gemma 4 decoder mixes two kinds of layer (``layer_types``): sliding layers attend to their
last ``sliding_window`` positions with ``head_dim``-wide heads and plain RoPE; full layers attend
to everything with ``global_head_dim``-wide heads, their own KV head count and a partial
("proportional") RoPE. Around that: per-head q/k norms and a scale-free value norm (so the
attention scale is 1), norms before and after both attention and MLP (GELU-tanh), optional
per-layer input embeddings (PLE), a per-layer output scalar, KV sharing for the last
``num_kv_shared_layers`` layers (they read the K/V of the last earlier layer of their kind, and
may have a double-wide MLP), keys doubling as values in full layers (``attention_k_eq_v``), and
final logit softcapping. Where the config enables it (``enable_moe_block``), a mixture of
experts runs beside the MLP, its grouped products in the form the model's kernel plan picks
(:func:`~turbospark_jax.kernels.plan.grouped_impl`).

Cache: full layers keep every row (``append_only``); sliding layers keep a RING of
``sliding_window + ring_margin`` rows (memory bounded by the window, not the context); shared
layers keep nothing. Position ``p`` sits in ring slot ``p % slots``, with the slot's position
kept beside it, so a row attends by absolute position. A block of ``W`` rows writes all its
rows first, so ``W <= ring_margin + 1`` keeps every row's window intact; a cursor moved back
by up to ``ring_margin + 1`` positions from the furthest position the ring was written to
still finds its window (:meth:`Gemma4Model.oldest_rewind`). At long contexts the rings make
the cache a fraction of what keeping every row of every KV-owning layer would take.

Parallel prefill (:meth:`Gemma4Model.pass_hidden`): a wide headless pass attends before it
writes, so it has no width limit. Its rows attend over their own k/v (a sliding layer over
the band its window reaches) and over the rows cached before it (the ring's rows before the
pass, the full layers' rows up to the pass's key limit); a shared layer reads its source
layer's pass. Then it leaves the cache as the exact path would: every row in the full
layers, the last ``ring_slots`` rows in their ring slots.

Params (``D`` hidden, ``H`` heads, ``hd``/``KV`` the layer's head dim and KV heads, ``F`` its
MLP width, ``L`` layers, ``P`` PLE width); matrices are ``[in, out]``; ``layers`` is a list::

    embed_tokens [V, D]   norm [D]   lm_head [D, V] (untied only)
    embed_tokens_per_layer [Vp, L*P]  per_layer_model_projection [D, L*P]
    per_layer_projection_norm [P]                                   (PLE only)
    layers[i]: input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
               post_feedforward_layernorm [D]; layer_scalar [1]
               q_proj [D, H, hd]  q_norm [hd]  o_proj [H, hd, D]
               k_proj [D, KV, hd]  k_norm [hd]  v_proj [D, KV, hd]  (KV owners; no v_proj
               in k_eq_v full layers)   q/k/v_bias [N, hd], o_bias [D] (attention_bias)
               gate_proj, up_proj [D, F]  down_proj [F, D]
               per_layer_input_gate [D, P]  per_layer_projection [P, D]
               post_per_layer_input_norm [D]                        (PLE only)
               router_proj [E, D]  router_scale [D]  per_expert_scale [E]
               experts_gate_up [E, 2*Fe, D]  experts_down [E, D, Fe]  (as the file keeps them)
               pre_feedforward_layernorm_2, post_feedforward_layernorm_1,
               post_feedforward_layernorm_2 [D]                     (enable_moe_block only)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from turbospark_jax.core.state import append_only, ring
from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.kernels.layers import (
    ATTENTION_QUERY_BLOCK,
    NO_KEY,
    apply_rope,
    attend,
    random_leaves,
    rms_norm,
    rope_cos_sin,
    wide_attend,
)
from turbospark_jax.kernels.plan import XLA_PLAN, KernelPlan, check_backend_plan, grouped_impl
from turbospark_jax.models.base import BlockModel
from turbospark_jax.models.family import Family, HFTensor, Params
from turbospark_jax.models.gemma4.config import ARCHITECTURES, FULL, SLIDING, Gemma4Config
from turbospark_jax.models.moe import ExpertParallel, fused_routed_experts, scaled_router
from turbospark_jax.quant import kv as kv_quant
from turbospark_jax.quant.weights import as_array, take_rows, tied_logits

#: Where a ring slot holds no position: below any window, so attention never sees it.
EMPTY_SLOT = -(2**30)


# -- params ----------------------------------------------------------------------------------


def param_shapes(config: Gemma4Config) -> Params:
    """The params tree with a shape tuple at every leaf (layout in the module docstring)."""
    c = config
    d, h, p, n = c.hidden_size, c.num_attention_heads, c.hidden_size_per_layer_input, \
        c.num_hidden_layers
    tree: Params = {"embed_tokens": (c.vocab_size, d), "norm": (d,)}
    if not c.tie_word_embeddings:
        tree["lm_head"] = (d, c.vocab_size)
    if c.ple:
        tree.update(embed_tokens_per_layer=(c.vocab_size_per_layer_input, n * p),
                    per_layer_model_projection=(d, n * p), per_layer_projection_norm=(p,))
    layers = []
    for i in range(n):
        hd, kv = c.dims(i)
        f = c.mlp_width(i)
        lp: dict[str, tuple[int, ...]] = {
            "input_layernorm": (d,), "post_attention_layernorm": (d,),
            "pre_feedforward_layernorm": (d,), "post_feedforward_layernorm": (d,),
            "layer_scalar": (1,), "q_proj": (d, h, hd), "q_norm": (hd,), "o_proj": (h, hd, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d),
        }
        if c.attention_bias:
            lp.update(q_bias=(h, hd), o_bias=(d,))
        if c.owns_kv(i):
            lp.update(k_proj=(d, kv, hd), k_norm=(hd,))
            if not c.k_eq_v(i):
                lp["v_proj"] = (d, kv, hd)
            if c.attention_bias:
                lp.update(k_bias=(kv, hd), **({} if c.k_eq_v(i) else {"v_bias": (kv, hd)}))
        if c.ple:
            lp.update(per_layer_input_gate=(d, p), per_layer_projection=(p, d),
                      post_per_layer_input_norm=(d,))
        if c.enable_moe_block:
            e, fe = c.num_experts, c.moe_intermediate_size
            lp.update(router_proj=(e, d), router_scale=(d,), per_expert_scale=(e,),
                      experts_gate_up=(e, 2 * fe, d), experts_down=(e, d, fe),
                      pre_feedforward_layernorm_2=(d,), post_feedforward_layernorm_1=(d,),
                      post_feedforward_layernorm_2=(d,))
        layers.append(lp)
    tree["layers"] = layers
    return tree


def hf_tensors(config: Gemma4Config) -> list[HFTensor]:
    """Every text tensor a folder of ``config`` holds, and the leaf it fills."""
    c = config
    top = "model.language_model." if c.model_type == "gemma4" else "model."
    shapes = param_shapes(c)
    out: list[HFTensor] = []

    def add(name: str, key: tuple[str | int, ...], shape: tuple[int, ...], linear: bool) -> None:
        # nn.Linear keeps [out, in]; ours is [in, ...out] (or [...in, out] for o_proj/down);
        # a projection's bias is flat in the file.
        hf = (math.prod(shape),) if str(key[-1]).endswith("bias") else shape
        if linear:
            hf = (math.prod(shape[1:]), shape[0])
            if key[-1] in ("o_proj", "down_proj", "per_layer_projection"):
                hf = (shape[-1], math.prod(shape[:-1]))
        out.append(HFTensor(name, key, hf, transpose=linear))

    hf_names = {"embed_tokens": "embed_tokens.weight", "norm": "norm.weight",
                "embed_tokens_per_layer": "embed_tokens_per_layer.weight",
                "per_layer_model_projection": "per_layer_model_projection.weight",
                "per_layer_projection_norm": "per_layer_projection_norm.weight"}
    for key, shape in shapes.items():
        if key == "lm_head":
            add("lm_head.weight", ("lm_head",), shape, True)
        elif key != "layers":
            add(top + hf_names[key], (key,), shape, key == "per_layer_model_projection")
    for i, lp in enumerate(shapes["layers"]):
        for key, shape in lp.items():
            name, linear = _layer_tensor_name(key)
            add(f"{top}layers.{i}.{name}", ("layers", i, key), shape, linear)
    return out


def _layer_tensor_name(key: str) -> tuple[str, bool]:
    """Our per-layer leaf name -> (its name under ``layers.{i}.``, whether it is a Linear)."""
    if key.endswith("_bias"):
        return f"self_attn.{key[:-5]}_proj.bias", False
    if key in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return f"self_attn.{key}.weight", True
    if key in ("q_norm", "k_norm"):
        return f"self_attn.{key}.weight", False
    if key in ("gate_proj", "up_proj", "down_proj"):
        return f"mlp.{key}.weight", True
    if key == "layer_scalar":
        return key, False
    if key in _MOE_NAMES:  # kept as the file stores them
        return _MOE_NAMES[key], False
    return f"{key}.weight", key in ("per_layer_input_gate", "per_layer_projection")


_MOE_NAMES = {"router_proj": "router.proj.weight", "router_scale": "router.scale",
              "per_expert_scale": "router.per_expert_scale",
              "experts_gate_up": "experts.gate_up_proj", "experts_down": "experts.down_proj"}

_TOLERATED = re.compile(
    r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio)\."  # other modalities
    r"|\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.(weight|bias)$"  # K/V a shared layer ignores
)


def tolerated(name: str) -> bool:
    """Tensors a folder may carry that the text decoder ignores: the vision and audio towers
    of a ``gemma4`` folder and K/V weights that KV-shared layers (or a ``k_eq_v`` layer's
    value projection) never use, as the reference ignores them."""
    return bool(_TOLERATED.search(name))


def init_params(config: Gemma4Config, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random params: matrices ~ N(0, initializer_range), norms and layer scalars 1, biases 0."""
    return _init_params(config, key, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params(config: Gemma4Config, key: jax.Array, dtype: jnp.dtype) -> Params:
    return random_leaves(param_shapes(config), key, config.initializer_range, dtype,
                         lambda name: 1.0 if "norm" in name or name in (
                             "layer_scalar", "router_scale", "per_expert_scale")
                         else 0.0 if name.endswith("bias") else None)


# -- the model -------------------------------------------------------------------------------


@struct.dataclass(kw_only=True)
class Gemma4Cache:
    """KV cache (``C`` positions, ``R`` ring slots); keys stored normed and rotated.

    Fields:
      k_full, v_full: per KV-owning full layer, ``[C, KVg, global_head_dim]``.
      k_ring, v_ring: per KV-owning sliding layer, ``[R, KV, head_dim]``; position ``p`` in
        slot ``p % R``.
      ring_positions: int32 ``[R]``, the position each slot holds (``EMPTY_SLOT`` if none).
      hidden_rows: ``[C, D]`` (``[0, D]`` unless the model keeps them), each fed row's
        final-normed hidden state: what the assistant drafter starts a round from.
      window_rows: static, ``sliding_window - 1``: the positions before the cursor a row
        still reads, i.e. the live part of the ring.
      k_full_scale, v_full_scale, k_ring_scale, v_ring_scale: for a quantized cache
        (:attr:`Gemma4Model.kv_dtype`), each stored row's float32 scale, ``[C, KVg]`` or
        ``[R, KV]`` per layer beside its values (:mod:`~turbospark_jax.quant.kv`); ``()``
        otherwise.
    """

    k_full: tuple[jax.Array, ...] = append_only(axis=1)
    v_full: tuple[jax.Array, ...] = append_only(axis=1)
    k_ring: tuple[jax.Array, ...] = ring(axis=1, live="window_rows")
    v_ring: tuple[jax.Array, ...] = ring(axis=1, live="window_rows")
    ring_positions: jax.Array = ring(axis=0, live="window_rows")
    hidden_rows: jax.Array = append_only(axis=0)
    window_rows: int = struct.field(pytree_node=False)
    k_full_scale: tuple[jax.Array, ...] = kv_quant.scale_field(append_only(axis=1))
    v_full_scale: tuple[jax.Array, ...] = kv_quant.scale_field(append_only(axis=1))
    k_ring_scale: tuple[jax.Array, ...] = kv_quant.scale_field(ring(axis=1, live="window_rows"))
    v_ring_scale: tuple[jax.Array, ...] = kv_quant.scale_field(ring(axis=1, live="window_rows"))


def _linear(x: jax.Array, w: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``x [W, in] @ w [in, *out] -> [W, *out]`` as one 2-D product (a 3-D einsum of one row
    is a multiply and a reduce on a GPU, several times slower)."""
    y = (x @ w.reshape(w.shape[0], -1)).reshape(x.shape[0], *w.shape[1:])
    return y if bias is None else y + bias


def _gelu(x: jax.Array) -> jax.Array:
    # float32 and one rounding, as torch's tanh GELU does for 16-bit inputs.
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


#: ``kv_fn(layer, k [N, KV, hd], v)``: store a KV owner's new rows and return what its kind's
#: layers attend over (for the exact path, ``(keys [S, KV, hd], values, key_positions [S])``).
KVFn = Callable[[int, jax.Array, jax.Array], Any]
#: ``attention(q [N, H, hd], keys, window)``: attend over what a :data:`KVFn` returned.
AttentionFn = Callable[[jax.Array, Any, int | None], jax.Array]


@dataclasses.dataclass(frozen=True)
class Gemma4Model(BlockModel):
    """Gemma 4 text decoder as pure functions over explicit params and cache.

    Attributes:
      config: the hyperparameters.
      dtype: activation / cache dtype; params should match.
      ring_margin: ring slots beyond the window. Blocks may be up to ``ring_margin + 1`` rows
        wide, and the cursor may move back up to ``ring_margin + 1`` positions from the
        furthest position fed (:meth:`oldest_rewind`). 256 covers the engine's blocks, a
        verify rollback, a decode burst's overshoot and a chat turn's re-rendered tail; each
        slot costs ``2 * KV * head_dim`` values per sliding layer.
      keep_hidden_rows: record every fed row's final hidden state in the cache
        (``hidden_rows``, ``C * hidden_size`` values), which the assistant drafter reads.
      pass_block: query rows a parallel-prefill pass attends at a time. Its float32 scores
        are ``[heads, pass_block, keys]``, so a smaller block bounds a long prompt's memory,
        and a larger one runs fewer, wider products.
      kv_dtype: the stored form of the full layers' and the rings' K/V rows: ``None`` (the
        model dtype), ``"int8"`` or ``"fp8"`` (:mod:`~turbospark_jax.quant.kv`; set by
        :func:`~turbospark_jax.io.loading.load_folder`'s ``kv_dtype``).
      expert_parallel: the MoE block's fused expert stacks split over a mesh axis
        (:class:`~turbospark_jax.models.moe.ExpertParallel`; set by
        :class:`~turbospark_jax.parallel.sharding.ShardedProducer` on a mesh with an expert
        axis), or None.
      plan: the backend's kernels (:class:`~turbospark_jax.kernels.plan.KernelPlan`, never
        row-invariant here): the MoE block's grouped expert products take its form
        (:func:`~turbospark_jax.kernels.plan.grouped_impl`). XLA's by default; loading
        resolves the backend's (:func:`~turbospark_jax.io.loading.serving_plan`).
    """

    parallel_prefill = True  # wide headless passes (pass_hidden)
    backend_kernels = True

    config: Gemma4Config
    dtype: Any = jnp.float32
    ring_margin: int = 256
    keep_hidden_rows: bool = False
    pass_block: int = ATTENTION_QUERY_BLOCK
    kv_dtype: str | None = None
    expert_parallel: ExpertParallel | None = None
    plan: KernelPlan = XLA_PLAN

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        kv_quant.check_kv_dtype(self.kv_dtype)
        check_backend_plan(self.plan, "Gemma 4")
        if self.ring_margin < 0:
            raise BadInputError(f"ring_margin must be >= 0, got {self.ring_margin}")
        if self.pass_block < 1:
            raise BadInputError(f"pass_block must be >= 1, got {self.pass_block}")

    def for_mesh(self) -> Gemma4Model:
        """This model with its plan's Pallas kernels off (the grouped experts on XLA's loop),
        which a tensor-parallel mesh splits: a kernel is a single-device custom call the
        compiler cannot split."""
        return dataclasses.replace(self, plan=dataclasses.replace(self.plan, pallas="off"))

    @property
    def accepts_embeddings(self) -> bool:  # type: ignore[override]
        """Images go in through injected embeddings, except where the config lets image
        tokens attend bidirectionally (``use_bidirectional_attention``), which a causal block
        program cannot run."""
        return self.config.use_bidirectional_attention is None

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def embedding_size(self) -> int:
        return self.config.hidden_size

    @property
    def embedding_dtype(self) -> Any:
        return self.dtype

    @property
    def ring_slots(self) -> int:
        """``R``: sliding-window rows plus the margin (0 without sliding layers)."""
        return self.config.sliding_window + self.ring_margin if self.config.owners(SLIDING) \
            else 0

    def oldest_rewind(self, count: int) -> int:
        """The earliest position the cursor may be moved back to (rollback, prefix reuse).

        ``count`` is the cache's :meth:`reach`: the furthest position its ring was written
        to, which is the cursor unless the state was already moved back (rows written past
        the cursor have overwritten older slots). The window of the first row fed after the
        move must still be in the ring: 0 without sliding layers, else
        ``count - ring_margin - 1``.
        """
        return 0 if not self.ring_slots else max(0, count - self.ring_margin - 1)

    def rewind_reach(self) -> int | None:
        return self.ring_margin + 1 if self.ring_slots else None

    def rewind_floor(self, cache: Gemma4Cache) -> int:
        return self.oldest_rewind(self.reach(cache))

    def reach(self, cache: Gemma4Cache) -> int:
        """One past the furthest position the ring has been written to (host sync)."""
        if not self.ring_slots:
            return 0
        return max(0, int(jnp.max(cache.ring_positions)) + 1)

    def init_params(self, key: jax.Array) -> Params:
        return init_params(self.config, key, self.dtype)

    def init_cache(self, capacity: int) -> Gemma4Cache:
        """An empty cache: ``capacity`` rows per full layer, the ring per sliding layer.

        Raises:
          BadInputError: the config's layers all read shared K/V (a drafter's), so none
            keeps a cache.
        """
        c, r = self.config, self.ring_slots
        if c.reads_target_kv:
            raise BadInputError("every layer of this config reads shared K/V; it runs only as "
                                "a drafter over its target's cache (drafters.gemma4_assistant)")

        def zeros(kind: str, rows: int) -> tuple[tuple[jax.Array, ...], Any]:
            made = [kv_quant.zeros((rows, *c.dims(i)[::-1]), self.kv_dtype, self.dtype)
                    for i in c.owners(kind)]
            scales = () if self.kv_dtype is None else tuple(s for _, s in made)
            return tuple(b for b, _ in made), scales

        (k_full, k_full_scale), (v_full, v_full_scale) = (zeros(FULL, capacity)
                                                          for _ in range(2))
        (k_ring, k_ring_scale), (v_ring, v_ring_scale) = (zeros(SLIDING, r) for _ in range(2))
        return Gemma4Cache(
            k_full=k_full, v_full=v_full, k_ring=k_ring, v_ring=v_ring,
            k_full_scale=k_full_scale, v_full_scale=v_full_scale,
            k_ring_scale=k_ring_scale, v_ring_scale=v_ring_scale,
            ring_positions=jnp.full((r,), EMPTY_SLOT, jnp.int32),
            hidden_rows=jnp.zeros((capacity if self.keep_hidden_rows else 0, c.hidden_size),
                                  self.dtype),
            window_rows=c.sliding_window - 1,
        )

    def last_owner_kv(self, cache: Gemma4Cache, kind: str) -> tuple[jax.Array, jax.Array]:
        """The K/V rows of the last layer of ``kind`` that keeps them (the rows KV-shared
        layers read), in the model dtype (dequantized from a quantized cache)."""
        full = kind == FULL
        k, v = (cache.k_full, cache.v_full) if full else (cache.k_ring, cache.v_ring)
        ks, vs = ((cache.k_full_scale, cache.v_full_scale) if full
                  else (cache.k_ring_scale, cache.v_ring_scale))
        return (kv_quant.read(k[-1], ks[-1] if ks else (), self.dtype),
                kv_quant.read(v[-1], vs[-1] if vs else (), self.dtype))

    # -- layer pieces -------------------------------------------------------------------------

    def _norm(self, x: jax.Array, weight: jax.Array | None) -> jax.Array:
        return rms_norm(x, weight, self.config.rms_norm_eps, weight_in_float32=True)

    def embed_tokens(self, params: Params, tokens: jax.Array) -> jax.Array:
        """tokens [N] -> scaled input embeddings [N, D] (what the assistant drafter reads)."""
        # The scale is rounded to the weight dtype before the product, as the reference does.
        x = take_rows(params["embed_tokens"], tokens, self.dtype)
        return x * jnp.asarray(self.config.hidden_size**0.5, self.dtype)

    def _embed(self, params: Params, tokens: jax.Array, embeds: jax.Array | None = None,
               embed_rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """tokens [N] -> scaled embeddings [N, D] and the per-layer inputs [N, L, P].

        Rows where ``embed_rows`` is true take ``embeds`` (an image's soft tokens, already
        in the embedding space, so not scaled) instead; their per-layer inputs mix that
        embedding with the pad token's own per-layer row, as the reference does for
        multimodal placeholders."""
        c, dt = self.config, self.dtype
        x = self.embed_tokens(params, tokens)
        if embeds is not None:
            x = jnp.where(embed_rows[:, None], embeds.astype(dt), x)
            tokens = jnp.where(embed_rows, jnp.int32(c.pad_token_id or 0), tokens)
        if not c.ple:
            return x, None
        n, p = c.num_hidden_layers, c.hidden_size_per_layer_input
        with jax.named_scope("ple"):
            own = jnp.take(params["embed_tokens_per_layer"], tokens, axis=0).astype(dt)
            own = (own * jnp.asarray(p**0.5, dt)).reshape(-1, n, p)
            mixed = (x @ params["per_layer_model_projection"]) * c.hidden_size**-0.5
            mixed = self._norm(mixed.reshape(-1, n, p), params["per_layer_projection_norm"])
            return x, (mixed + own) * 2.0**-0.5

    def _ropes(self, positions: jax.Array) -> dict[str, tuple[jax.Array, jax.Array]]:
        c = self.config
        tables = {SLIDING: (c.sliding_rope, c.head_dim), FULL: (c.full_rope, c.global_head_dim)}
        return {kind: rope_cos_sin(positions, spec.inv_freq(hd), 1.0, self.dtype)
                for kind, (spec, hd) in tables.items() if kind in c.layer_types}

    def decoder(self, params: Params, x: jax.Array, ple: jax.Array | None,
                positions: jax.Array, kv_fn: KVFn | None,
                keys: Mapping[str, Any] | None = None,
                attention: AttentionFn | None = None,
                live: jax.Array | None = None) -> jax.Array:
        """Every layer over rows ``x [N, D]`` at ``positions [N]`` (pre-norm output);
        ``live``: bool ``[N]``, the rows that are not padding (None: all), whose experts
        alone take tiles in the MoE block.

        A KV owner hands its new k/v rows to ``kv_fn(layer, k, v)``, which stores them and
        returns what that layer's kind attends over; a shared layer attends over what the
        last owner of its kind got (the reference's KV sharing), or over ``keys[kind]`` when
        no layer owns any (a drafter reading its target's cache). ``attention(q, keys,
        window)`` attends; by default ``keys`` is ``(keys [S, KV, hd], values,
        key_positions [S])``, attended causally by position."""
        c = self.config
        ropes = self._ropes(positions)
        keys = dict(keys or {})
        if attention is None:
            def attention(q: jax.Array, kv: Any, window: int | None) -> jax.Array:
                return attend(q, kv[0], kv[1], positions, kv[2], window, scale=1.0)
        bias = c.attention_bias
        for i, lp in enumerate(params["layers"]):
            kind = c.layer_types[i]
            cos, sin = ropes[kind]
            with jax.named_scope(f"layer_{i}"):
                with jax.named_scope("attention"):
                    h = self._norm(x, lp["input_layernorm"])
                    q = self._norm(_linear(h, lp["q_proj"], lp["q_bias"] if bias else None),
                                   lp["q_norm"])
                    q = apply_rope(q, cos, sin)
                    if c.owns_kv(i):
                        k = _linear(h, lp["k_proj"], lp["k_bias"] if bias else None)
                        v = k if c.k_eq_v(i) else _linear(h, lp["v_proj"],
                                                          lp["v_bias"] if bias else None)
                        k = apply_rope(self._norm(k, lp["k_norm"]), cos, sin)
                        assert kv_fn is not None
                        keys[kind] = kv_fn(i, k, self._norm(v, None))
                    if kind not in keys:
                        raise BadInputError(
                            f"layer {i} reads shared {kind} K/V and none was given")
                    attn = attention(q, keys[kind], c.window(i))
                x = self._tail(x, attn, lp, None if ple is None else ple[:, i], live)
        return x

    def _tail(self, x: jax.Array, attn: jax.Array, lp: Params,
              ple: jax.Array | None, live: jax.Array | None = None) -> jax.Array:
        """Output projection and the sandwich-normed residuals: attention, MLP, PLE, scalar."""
        with jax.named_scope("attention"):
            o = _linear(attn.reshape(attn.shape[0], -1), lp["o_proj"].reshape(-1, x.shape[-1]),
                        lp["o_bias"] if self.config.attention_bias else None)
            x = x + self._norm(o, lp["post_attention_layernorm"])
        with jax.named_scope("mlp"):
            h = self._norm(x, lp["pre_feedforward_layernorm"])
            m = (_gelu(h @ lp["gate_proj"]) * (h @ lp["up_proj"])) @ lp["down_proj"]
            if self.config.enable_moe_block:
                m = (self._norm(m, lp["post_feedforward_layernorm_1"])
                     + self._norm(self._experts(x, lp, live),
                                  lp["post_feedforward_layernorm_2"]))
            x = x + self._norm(m, lp["post_feedforward_layernorm"])
        if ple is not None:
            with jax.named_scope("ple"):
                g = (_gelu(x @ lp["per_layer_input_gate"]) * ple) @ lp["per_layer_projection"]
                x = x + self._norm(g, lp["post_per_layer_input_norm"])
        return x * lp["layer_scalar"]

    def _experts(self, x: jax.Array, lp: Params, live: jax.Array | None = None) -> jax.Array:
        """The MoE block beside the MLP: routed by the residual rows ``x`` themselves, run
        on their own pre-norm (:mod:`~turbospark_jax.models.moe`) in the plan's grouped form;
        a padding row (``live`` false) takes no tile."""
        weights, experts = scaled_router(x, lp["router_scale"], lp["router_proj"],
                                         lp["per_expert_scale"], self.config.routing,
                                         self.config.rms_norm_eps)
        return fused_routed_experts(self._norm(x, lp["pre_feedforward_layernorm_2"]), weights,
                                    experts, lp["experts_gate_up"], lp["experts_down"],
                                    placement=self.expert_parallel,
                                    impl=grouped_impl(self.plan), live=live)

    def _head(self, params: Params, h: jax.Array) -> jax.Array:
        """Output head and softcap: final-normed h [N, D] -> float32 logits [N, V]."""
        c = self.config
        if c.tie_word_embeddings:
            logits = tied_logits(h, params["embed_tokens"])
        else:
            logits = jnp.einsum("nd,dv->nv", h, as_array(params["lm_head"], h.dtype),
                                preferred_element_type=jnp.float32)
        cap = c.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    # -- entry points -------------------------------------------------------------------------

    def block_forward(
        self,
        params: Params,
        cache: Gemma4Cache,
        tokens: jax.Array,
        positions: jax.Array,
        live: jax.Array,
        need_head: jax.Array,
        *,
        key_limit: int | None = None,
        fresh: bool = False,
        embeds: jax.Array | None = None,
        embed_rows: jax.Array | None = None,
    ) -> tuple[jax.Array, Gemma4Cache]:
        """Run ``W`` rows against the cache (see :meth:`BlockModel.block_forward`).

        The exact path (neither hint given) is :meth:`block_hidden` and the head. A
        parallel-prefill pass (either hint given) is :meth:`pass_hidden`, of any width and
        headless: its logits are zeros whatever ``need_head`` says (the producer feeds the
        last prompt token through the exact path).

        Raises:
          BadInputError: ``W > ring_margin + 1`` on the exact path (the block would overwrite
            ring rows that its own first rows still read).
        """
        if fresh or key_limit is not None:
            h, cache = self.pass_hidden(params, cache, tokens, positions, live,
                                        key_limit=key_limit, fresh=fresh, embeds=embeds,
                                        embed_rows=embed_rows)
            return jnp.zeros((h.shape[0], self.vocab_size), jnp.float32), cache
        h, cache = self.block_hidden(params, cache, tokens, positions, live, embeds, embed_rows)
        with jax.named_scope("head"):
            logits = jax.lax.cond(
                need_head, lambda h: self._head(params, h),
                lambda h: jnp.zeros((h.shape[0], self.vocab_size), jnp.float32), h)
        return logits, cache

    def block_hidden(self, params: Params, cache: Gemma4Cache, tokens: jax.Array,
                     positions: jax.Array, live: jax.Array, embeds: jax.Array | None = None,
                     embed_rows: jax.Array | None = None) -> tuple[jax.Array, Gemma4Cache]:
        """The exact path up to the final norm: ``(h [W, D], cache)``. ``h`` is what the
        output head reads, and what the assistant drafter takes from its target.

        Every live row's K/V (and ring slot position) is written first, then each row attends
        causally, within its window, by absolute position; padding rows write nothing.

        Raises:
          BadInputError: ``W > ring_margin + 1``.
        """
        width = tokens.shape[0]
        if self.ring_slots and width > self.ring_margin + 1:
            raise BadInputError(f"a block of {width} rows needs ring_margin >= {width - 1}; "
                                f"this model has {self.ring_margin}")
        rows = jnp.arange(width, dtype=jnp.int32)
        return self._run(params, cache, tokens, positions, rows < live, embeds, embed_rows,
                         lambda kind, new, before, stored: stored, None)

    def pass_hidden(self, params: Params, cache: Gemma4Cache, tokens: jax.Array,
                    positions: jax.Array, live: jax.Array, *, key_limit: int | None = None,
                    fresh: bool = False, embeds: jax.Array | None = None,
                    embed_rows: jax.Array | None = None) -> tuple[jax.Array, Gemma4Cache]:
        """A parallel-prefill pass of any width ``W``: ``(h [W, D], cache)``, within rounding
        of the exact path's (a different program, so not bitwise).

        Rows attend before anything is written, in blocks of ``pass_block`` query rows
        (:func:`~turbospark_jax.kernels.layers.wide_attend`): a sliding layer over the ring's
        rows before the pass and the band of the pass's own rows its window reaches; a full
        layer over its cache rows ``< key_limit`` (the pass's own rows written in), or with
        ``fresh`` over the pass's own rows only. Then the cache is left as the exact path
        leaves it: every live row in the full layers, and the last ``ring_slots`` live rows
        in their ring slots (the rows a window still reads, and the margin).

        A ring row at or after the pass's first position (left by a cursor moved back) is one
        the pass replaces, so the pass does not read it; rows before it must be the ones its
        window reads, which the engine's rewind floor guarantees as for the exact path.

        Args:
          params, cache, tokens, positions, live, embeds, embed_rows: as
            :meth:`block_forward`'s; ``positions`` is ``start + arange(W)``.
          key_limit: static; full layers attend over cache rows ``< key_limit``, which must
            include every live row's position. ``None``: the whole cache.
          fresh: static; the pass starts at position 0, so nothing cached is read.
        """
        width = tokens.shape[0]
        slots = self.ring_slots
        rows = jnp.arange(width, dtype=jnp.int32)
        start = positions[0]

        def keys(kind: str, new: Any, before: Any, stored: Any) -> Any:
            if kind == FULL:
                return (new if fresh else tuple(a[:key_limit] for a in stored)), None
            k, v, key_positions = before
            earlier = (k, v, jnp.where(key_positions < start, key_positions, NO_KEY))
            return (None if fresh else earlier), new

        def attention(q: jax.Array, kv: Any, window: int | None) -> jax.Array:
            return wide_attend(q, positions, *kv, window, block=self.pass_block, scale=1.0)

        # Rows past the last ring_slots would only be overwritten by later ones: writing the
        # last ones alone keeps every slot's target distinct.
        to_ring = (rows < live) & (rows >= live - slots)
        return self._run(params, cache, tokens, positions, rows < live, embeds, embed_rows,
                         keys, attention, to_ring)

    def _run(self, params: Params, cache: Gemma4Cache, tokens: jax.Array, positions: jax.Array,
             written: jax.Array, embeds: jax.Array | None, embed_rows: jax.Array | None,
             keys: Callable[[str, Any, Any, Any], Any], attention: AttentionFn | None,
             to_ring: jax.Array | None = None) -> tuple[jax.Array, Gemma4Cache]:
        """Both paths: embed, every layer, final norm; ``(h [W, D], cache)``.

        A KV owner's rows go into the cache: the rows ``written`` (bool ``[W]``) into the full
        layers and ``hidden_rows`` at their positions, the rows ``to_ring`` (default:
        ``written``) into their ring slots. Its kind's layers then attend with ``attention``
        over ``keys(kind, new, before, stored)``, each argument a ``(k, v, key_positions)``:
        the owner's new rows, its cache buffers before the write and after it."""
        c, slots = self.config, self.ring_slots
        width = tokens.shape[0]
        capacity = cache.k_full[0].shape[0]
        rows = jnp.arange(width, dtype=jnp.int32)
        to_ring = written if to_ring is None else to_ring
        # Rows not written go to distinct out-of-range rows, which mode="drop" discards; every
        # target then differs, which unique_indices tells XLA (no atomics on a GPU).
        scatter = {"mode": "drop", "unique_indices": True}
        at_full = jnp.where(written, positions, capacity + rows)  # [W]
        before_positions = ring_positions = cache.ring_positions
        if slots:
            at_ring = jnp.where(to_ring, positions % slots, slots + rows)  # [W]
            ring_positions = ring_positions.at[at_ring].set(positions, **scatter)
        full_positions = jnp.arange(capacity, dtype=jnp.int32)
        full_index = {layer: j for j, layer in enumerate(c.owners(FULL))}
        ring_index = {layer: j for j, layer in enumerate(c.owners(SLIDING))}
        kv_dtype = self.kv_dtype
        # per kind: [k, v, k_scale, v_scale], each a list over the kind's owners (the scales
        # empty lists without quantization)
        stored = {FULL: [list(b) for b in (cache.k_full, cache.v_full, cache.k_full_scale,
                                           cache.v_full_scale)],
                  SLIDING: [list(b) for b in (cache.k_ring, cache.v_ring, cache.k_ring_scale,
                                              cache.v_ring_scale)]}

        def read(kind: str, j: int) -> tuple[jax.Array, jax.Array]:
            k, v, ks, vs = stored[kind]
            return (kv_quant.read(k[j], ks[j] if ks else (), self.dtype),
                    kv_quant.read(v[j], vs[j] if vs else (), self.dtype))

        def store(i: int, k: jax.Array, v: jax.Array) -> Any:
            kind = FULL if i in full_index else SLIDING
            j = full_index[i] if kind == FULL else ring_index[i]
            at = at_full if kind == FULL else at_ring
            key_positions = full_positions if kind == FULL else before_positions
            before = (*read(kind, j), key_positions)
            bufs = stored[kind]
            for n, rows in ((0, k), (1, v)):
                bufs[n][j], scale = kv_quant.write(bufs[n][j], bufs[n + 2][j] if bufs[n + 2]
                                                   else (), at, rows, kv_dtype, **scatter)
                if kv_dtype is not None:
                    bufs[n + 2][j] = scale
            # the new rows as the cache gives them back, as every later block reads them
            new = (kv_quant.round_trip(k, kv_dtype), kv_quant.round_trip(v, kv_dtype),
                   positions)
            after = (*read(kind, j), full_positions if kind == FULL else ring_positions)
            return keys(kind, new, before, after)

        with jax.named_scope("embed"):
            x, ple = self._embed(params, tokens, embeds, embed_rows)
        x = self.decoder(params, x, ple, positions, store, attention=attention, live=written)
        h = self._norm(x, params["norm"])
        (k_full, v_full, k_full_scale, v_full_scale), rings = stored[FULL], stored[SLIDING]
        return h, cache.replace(
            k_full=tuple(k_full), v_full=tuple(v_full), k_ring=tuple(rings[0]),
            v_ring=tuple(rings[1]), ring_positions=ring_positions,
            k_full_scale=tuple(k_full_scale), v_full_scale=tuple(v_full_scale),
            k_ring_scale=tuple(rings[2]), v_ring_scale=tuple(rings[3]),
            hidden_rows=cache.hidden_rows.at[at_full].set(h, **scatter))

    def forward(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Plain causal pass over whole sequences, no cache: int32 ``[B, T]`` -> float32
        logits ``[B, T, V]`` (row ``t`` at position ``t``)."""

        def one(seq: jax.Array) -> jax.Array:
            positions = jnp.arange(seq.shape[0], dtype=jnp.int32)
            x, ple = self._embed(params, seq)
            x = self.decoder(params, x, ple, positions, lambda i, k, v: (k, v, positions))
            return self._head(params, self._norm(x, params["norm"]))

        return jax.vmap(one)(tokens)


def _build(config: Gemma4Config, dtype: Any, layer_layout: str) -> Gemma4Model:
    if layer_layout != "list":
        raise ModelLoadError(f"Gemma 4 layers differ in shape, so its params are a list of "
                             f"per-layer dicts; layer_layout must be 'list', got {layer_layout!r}")
    if config.reads_target_kv:
        raise ModelLoadError("num_kv_shared_layers equals num_hidden_layers: no layer keeps K/V, "
                             "so this model cannot run alone (a gemma4_assistant drafter's text "
                             "config)")
    return Gemma4Model(config, dtype)


FAMILY = Family(
    name="gemma4",
    architectures=ARCHITECTURES,
    parse_config=Gemma4Config.from_hf_dict,
    config_type=Gemma4Config,
    param_shapes=param_shapes,
    hf_tensors=hf_tensors,
    build=_build,
    tolerated=tolerated,
    list_layout_only=True,
)
