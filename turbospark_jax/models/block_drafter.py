"""A block drafter's weights and forward pass: a few decoder layers that propose a whole
block of tokens in one pass from features the target recorded.

The drafter owns no embedding and no output head: it embeds with the target's
``embed_tokens`` and scores with the target's head (``lm_head``, or the embedding when tied),
so its hidden size and vocabulary are the target's. What it reads of the target is the output
of a few evenly spaced target layers at every fed position (the target's ``tap_layers``,
:class:`~turbospark_jax.models.dense.model.TappedDenseCache`,
:class:`~turbospark_jax.models.qwen3_5.model.TappedQwen35Cache`). Those rows are concatenated,
projected to the drafter's width and normed (``fc``, ``hidden_norm``); each drafter layer
turns the projected row of position ``p`` into its context key and value at ``p``. A context
row depends on nothing but its own tap row, so the drafter's KV is append-only, computed once
per committed position and moved back with a cursor.

A pass drafts after the last committed position ``base - 1``: the block holds the anchor (the
token at ``base``, known but not yet fed to the target) and ``B - 1`` copies of
``mask_token_id`` at ``base + 1 .. base + B - 1``. Every block row attends to every context
row before ``base`` and to every row of the block (bidirectionally; ``bidirectional=False``
makes it causal, for the control that shows the difference), and row ``i >= 1`` scores the
token at ``base + i``: ``B - 1`` proposals from one pass.

Params (``L`` drafter layers, ``D`` hidden (the target's), ``K`` tap layers, ``H``/``KV``
heads, ``hd`` head dim, ``F`` intermediate); matrices are ``[in, out]``::

    fc                        [K * D, D]     hidden_norm [D]     norm [D]
    layers/
      input_layernorm, post_attention_layernorm   [L, D]
      q_proj [L, D, H, hd]   k_proj, v_proj [L, D, KV, hd]   o_proj [L, H, hd, D]
      q_norm, k_norm         [L, hd]
      gate_proj, up_proj     [L, D, F]      down_proj [L, F, D]

A saved folder holds ``config.json`` (``model_type`` :data:`MODEL_TYPE`) and
``model.safetensors`` with one tensor per leaf, named by its path (``layers.q_proj``); see
:func:`~turbospark_jax.io.drafter_folders.load_block_drafter`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from turbospark_jax.core.state import append_only
from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.kernels.layers import (
    apply_rope,
    attend,
    random_leaves,
    rms_norm,
    rope_cos_sin,
    swiglu_mlp,
)
from turbospark_jax.quant.weights import as_array, take_rows, tied_logits

Params = dict[str, Any]

#: ``config.json``'s ``model_type`` for a block drafter folder.
MODEL_TYPE = "tsj_block_drafter"

#: Where a key no query may see sits, for the causal rule of ``attend``.
_NEVER = 2**30


def evenly_spaced_layers(num_layers: int, count: int) -> tuple[int, ...]:
    """``count`` distinct target layers spread from the first to the last, both included
    (one tap: the middle layer): early layers carry the token, late ones the prediction.

    Raises:
      BadInputError: ``count`` is not in ``1 .. num_layers``.
    """
    if not 1 <= count <= num_layers:
        raise BadInputError(f"cannot tap {count} of {num_layers} target layers; ask for 1 to "
                            f"{num_layers}")
    if count == 1:
        return (num_layers // 2,)
    return tuple(round(i * (num_layers - 1) / (count - 1)) for i in range(count))


@dataclasses.dataclass(frozen=True)
class BlockDrafterConfig:
    """The drafter's hyperparameters, with their ``config.json`` names.

    ``hidden_size`` and ``vocab_size`` must be the target's (its embedding and head are
    shared); ``target_layer_ids`` are the target layers it reads, of
    ``target_num_hidden_layers``; ``block_size`` is ``B`` (the anchor and ``B - 1`` masks);
    ``mask_token_id`` is the id whose target embedding fills the masked rows.

    Raises:
      BadInputError: a value out of range (named).
    """

    model_type: ClassVar[str] = MODEL_TYPE

    hidden_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    target_num_hidden_layers: int
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 64
    block_size: int = 4
    mask_token_id: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        ints = [f.name for f in dataclasses.fields(self) if f.type == "int"]
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BadInputError(f"block drafter {name} must be an integer >= 0, got "
                                    f"{value!r}")
        for name in ("hidden_size", "vocab_size", "target_num_hidden_layers",
                     "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                raise BadInputError(f"block drafter {name} must be >= 1, got "
                                    f"{getattr(self, name)}")
        ids = self.target_layer_ids
        n = self.target_num_hidden_layers
        if (not isinstance(ids, tuple) or not ids
                or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n
                       for i in ids)
                or list(ids) != sorted(set(ids))):
            raise BadInputError(f"target_layer_ids must be increasing, distinct layers of the "
                                f"target's {n} (0..{n - 1}), got {ids!r}")
        if not 2 <= self.block_size <= 9:
            raise BadInputError(f"block_size must be 2..9 (an anchor and 1..8 masks), got "
                                f"{self.block_size}")
        if not self.mask_token_id < self.vocab_size:
            raise BadInputError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                                f"of {self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise BadInputError("num_attention_heads must be a multiple of num_key_value_heads "
                                "and head_dim even")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> BlockDrafterConfig:
        """Parse a ``config.json`` object.

        Raises:
          ModelLoadError: another ``model_type``, a missing or malformed key (named).
        """
        if not isinstance(d, Mapping) or d.get("model_type") != MODEL_TYPE:
            raise ModelLoadError(f"config.json key 'model_type' must be {MODEL_TYPE!r}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                if f.default is dataclasses.MISSING:
                    raise ModelLoadError(f"config.json key {f.name!r} is missing")
                continue
            value = d[f.name]
            if f.name == "target_layer_ids":
                value = tuple(value) if isinstance(value, list) else value
            elif f.type == "float" and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            values[f.name] = value
        try:
            return cls(**values)
        except BadInputError as e:
            raise ModelLoadError(f"config.json: {e}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` object (:meth:`from_hf_dict` reads it back)."""
        out: dict[str, Any] = {"model_type": MODEL_TYPE}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def param_shapes(config: BlockDrafterConfig) -> Params:
    """The params tree with a shape tuple at every leaf (layout in the module docstring)."""
    c = config
    n, d, f = c.num_hidden_layers, c.hidden_size, c.intermediate_size
    h, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    layers = {
        "input_layernorm": (n, d), "post_attention_layernorm": (n, d),
        "q_proj": (n, d, h, hd), "k_proj": (n, d, kv, hd), "v_proj": (n, d, kv, hd),
        "o_proj": (n, h, hd, d), "q_norm": (n, hd), "k_norm": (n, hd),
        "gate_proj": (n, d, f), "up_proj": (n, d, f), "down_proj": (n, f, d),
    }
    return {"fc": (len(c.target_layer_ids) * d, d), "hidden_norm": (d,), "norm": (d,),
            "layers": layers}


def init_params(config: BlockDrafterConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random params: matrices ~ N(0, initializer_range), norm scales 1."""
    return _init_params(config, key, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params(config: BlockDrafterConfig, key: jax.Array, dtype: jnp.dtype) -> Params:
    return random_leaves(param_shapes(config), key, config.initializer_range, dtype,
                         lambda name: 1.0 if name.endswith("norm") else None)


def flat_tensors(params: Params) -> dict[str, jax.Array]:
    """Every leaf by its dotted path (``layers.q_proj``): what a saved folder holds."""
    flat = jax.tree.flatten_with_path(params)[0]
    return {".".join(p.key for p in path): leaf for path, leaf in flat}


def unflatten_tensors(config: BlockDrafterConfig, tensors: Mapping[str, np.ndarray]) -> Params:
    """The params tree from :func:`flat_tensors`' names, every shape checked.

    Raises:
      ModelLoadError: a tensor missing, unexpected or of the wrong shape (named).
    """
    shapes = flat_tensors(jax.tree.map(np.zeros, param_shapes(config),
                                       is_leaf=lambda x: isinstance(x, tuple)))
    for name in tensors:
        if name not in shapes:
            raise ModelLoadError(f"unexpected tensor {name} in a block drafter folder")
    tree: Params = {}
    for name, want in shapes.items():
        if name not in tensors:
            raise ModelLoadError(f"tensor {name} is missing from the block drafter folder")
        got = tensors[name]
        if tuple(got.shape) != want.shape:
            raise ModelLoadError(f"tensor {name} has shape {list(got.shape)}, expected "
                                 f"{list(want.shape)}")
        node = tree
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = got
    return tree


@struct.dataclass(kw_only=True)
class BlockDrafterCache:
    """The drafter's context KV (``C`` positions): row ``p`` of layer ``l`` is made from the
    target's tap row at ``p`` alone.

    Fields:
      k, v: ``[L, C, KV, hd]``, keys stored rotated; rows at or past the owner's cursor are
        dead.
    """

    k: jax.Array = append_only(axis=1)
    v: jax.Array = append_only(axis=1)


@dataclasses.dataclass(frozen=True)
class BlockDrafterModel:
    """The drafter's pure functions (frozen, hashable: static under ``jit``).

    Attributes:
      config: the hyperparameters.
      dtype: activations and cache dtype (params should match).
      bidirectional: the block's rows see each other both ways (the design); ``False`` is a
        causal block, kept only as the control that shows the difference.
    """

    config: BlockDrafterConfig
    dtype: Any = jnp.float32
    bidirectional: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    def init_cache(self, capacity: int) -> BlockDrafterCache:
        """A zeroed context KV of ``capacity`` positions."""
        c = self.config
        shape = (c.num_hidden_layers, capacity, c.num_key_value_heads, c.head_dim)
        return BlockDrafterCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype))

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float32)
                                           / c.head_dim))
        return rope_cos_sin(positions, inv_freq, 1.0, self.dtype)

    def context_kv(self, params: Params, taps: jax.Array,
                   positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Context keys and values of every layer from tap rows.

        Args:
          params: the drafter's params.
          taps: ``[N, K, D]`` the target's tap rows.
          positions: int32 ``[N]``, their positions.

        Returns:
          ``k, v``: ``[L, N, KV, hd]`` (keys rotated).
        """
        c, lp = self.config, params["layers"]
        n = taps.shape[0]
        feats = taps.astype(self.dtype).reshape(n, -1) @ params["fc"]
        feats = rms_norm(feats, params["hidden_norm"], c.rms_norm_eps)  # [N, D]
        k = jnp.einsum("nd,ldgh->lngh", feats, lp["k_proj"])
        v = jnp.einsum("nd,ldgh->lngh", feats, lp["v_proj"])
        k = rms_norm(k, lp["k_norm"][:, None, None, :], c.rms_norm_eps)
        cos, sin = self._rope(positions)
        k = jax.vmap(lambda x: apply_rope(x, cos, sin))(k)
        return k, v

    def write_context(self, params: Params, cache: BlockDrafterCache, taps: jax.Array,
                      positions: jax.Array, live: jax.Array) -> BlockDrafterCache:
        """``cache`` with the context rows of ``taps[:live]`` (``[W, K, D]``) written at
        ``positions`` (int32 ``[W]``); rows past ``live`` write nothing."""
        k, v = self.context_kv(params, taps, positions)
        rows = jnp.arange(taps.shape[0], dtype=jnp.int32)
        capacity = cache.k.shape[1]
        at = jnp.where(rows < live, positions, capacity + rows)
        scatter = {"mode": "drop", "unique_indices": True}
        return cache.replace(k=cache.k.at[:, at].set(k, **scatter),
                             v=cache.v.at[:, at].set(v, **scatter))

    def block_logits(self, params: Params, shared: Params, ctx_k: jax.Array,
                     ctx_v: jax.Array, base: jax.Array, anchor: jax.Array) -> jax.Array:
        """One drafting pass: float32 logits ``[B, V]``; row ``i >= 1`` scores the token at
        ``base + i`` (row 0, the anchor's, is not a proposal).

        Args:
          params: the drafter's params.
          shared: the target's ``embed_tokens`` ``[V, D]`` and, when untied, ``lm_head``
            ``[D, V]`` (:func:`shared_weights`).
          ctx_k, ctx_v: ``[L, S, KV, hd]`` context rows; row ``s`` sits at position ``s`` and
            is seen only when ``s < base``.
          base: int32 ``[]``, the anchor's position.
          anchor: int32 ``[]``, the token at ``base``.
        """
        c, b = self.config, self.config.block_size
        rows = jnp.arange(b, dtype=jnp.int32)
        tokens = jnp.full((b,), c.mask_token_id, jnp.int32).at[0].set(anchor)
        positions = base + rows
        x = take_rows(shared["embed_tokens"], tokens, self.dtype)  # [B, D]
        cos, sin = self._rope(positions)
        slots = jnp.arange(ctx_k.shape[1], dtype=jnp.int32)
        # ``attend`` is causal on the positions it is given: context rows before ``base`` keep
        # theirs, dead ones move out of reach, and for a bidirectional block every block row
        # and query stands at ``base``, so all block rows see each other.
        seen = jnp.where(slots < base, slots, _NEVER)
        in_block = jnp.full((b,), base) if self.bidirectional else positions
        key_positions = jnp.concatenate([seen, in_block])

        def layer(x: jax.Array, xs: tuple[Params, jax.Array, jax.Array]) -> Any:
            lp, k_ctx, v_ctx = xs
            h = rms_norm(x, lp["input_layernorm"], c.rms_norm_eps)
            q = jnp.einsum("bd,dgh->bgh", h, lp["q_proj"])
            k = jnp.einsum("bd,dgh->bgh", h, lp["k_proj"])
            v = jnp.einsum("bd,dgh->bgh", h, lp["v_proj"])
            q = apply_rope(rms_norm(q, lp["q_norm"], c.rms_norm_eps), cos, sin)
            k = apply_rope(rms_norm(k, lp["k_norm"], c.rms_norm_eps), cos, sin)
            attn = attend(q, jnp.concatenate([k_ctx, k]), jnp.concatenate([v_ctx, v]),
                          in_block, key_positions)
            x = x + jnp.einsum("bgh,ghd->bd", attn, lp["o_proj"])
            h = rms_norm(x, lp["post_attention_layernorm"], c.rms_norm_eps)
            return x + swiglu_mlp(h, lp["gate_proj"], lp["up_proj"], lp["down_proj"]), None

        x, _ = jax.lax.scan(layer, x, (params["layers"], ctx_k.astype(self.dtype),
                                       ctx_v.astype(self.dtype)))
        h = rms_norm(x, params["norm"], c.rms_norm_eps)
        if "lm_head" in shared:
            return jnp.einsum("bd,dv->bv", h, as_array(shared["lm_head"], h.dtype),
                              preferred_element_type=jnp.float32)
        return tied_logits(h, shared["embed_tokens"])


def shared_weights(target_params: Params, tied: bool) -> Params:
    """What the drafter borrows of a target's params: ``embed_tokens`` and, when the
    target is untied, ``lm_head``."""
    shared = {"embed_tokens": target_params["embed_tokens"]}
    if not tied:
        shared["lm_head"] = target_params["lm_head"]
    return shared


@functools.partial(jax.jit, static_argnums=0)
def sequence_block_logits(model: BlockDrafterModel, params: Params, shared: Params,
                          taps: jax.Array, tokens: jax.Array, anchors: jax.Array) -> jax.Array:
    """Drafting passes at several anchors of one sequence whose tap rows are all known
    (training, and tests that check the drafter apart from the speculative loop).

    Args:
      taps: ``[T, K, D]`` the target's tap rows of the sequence; tokens: int32 ``[T]``.
      anchors: int32 ``[A]`` anchor positions (context: the rows before each).

    Returns:
      float32 ``[A, B, V]``.
    """
    k, v = model.context_kv(params, taps, jnp.arange(taps.shape[0], dtype=jnp.int32))
    return jax.vmap(lambda a: model.block_logits(params, shared, k, v, a, tokens[a]))(anchors)
