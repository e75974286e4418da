"""The Gemma 4 vision tower (``gemma4_vision``, the ``vision_config`` of a ``gemma4`` folder)
and the projection of its output into the text model's embedding space (``embed_vision``).

One image arrives as ``P`` flattened ``patch_size x patch_size`` RGB patches in ``[0, 1]`` with
their ``(x, y)`` grid coordinates, padded to a fixed ``P`` (coordinates ``-1``), so every image
size runs through one compiled program. The tower:

1. maps pixels to ``2 * (p - 0.5)``, projects each patch to ``D`` and adds a learned 2-D position
   embedding (one table per axis, summed); padding patches get no position embedding;
2. runs ``L`` bidirectional encoder layers (padding keys masked): per-head q/k norms with a
   scale, a scale-free value norm (so the attention scale is 1), a 2-D RoPE that rotates the
   first half of each head by ``x`` and the second half by ``y``, sandwich norms around
   attention and a GELU-tanh gated MLP; linears may clamp their inputs and outputs;
3. averages each ``k x k`` block of patches (``k = pooling_kernel_size``) into one soft token,
   scales by ``sqrt(D)`` in float32 and optionally standardises (``std_bias``, ``std_scale``);
4. ``embed_vision``: a scale-free RMSNorm and a ``[D, D_text]`` projection.

The first ``n`` of the ``P / k**2`` pooled rows are the image's soft tokens (``n`` from
:mod:`turbospark_jax.io.images`); the rest come from padding and are dropped by the caller.

Params (``D`` hidden, ``H`` heads, ``KV`` KV heads, ``hd`` head dim, ``F`` MLP width, ``L``
layers, ``S`` position table size, ``C = 3 * patch_size**2``); matrices are ``[in, out]``;
per-layer leaves are stacked on a leading ``L`` axis::

    input_proj [C, D]   position_embedding_table [2, S, D]
    std_bias, std_scale [D]                     (standardize only)
    embedding_projection [D, D_text]
    layers: input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
            post_feedforward_layernorm [L, D]; q_norm, k_norm [L, hd]
            q_proj [L, D, H, hd]  k_proj, v_proj [L, D, KV, hd]  o_proj [L, H, hd, D]
            gate_proj, up_proj [L, D, F]  down_proj [L, F, D]
            <linear>_input_min, _input_max, _output_min, _output_max [L]: clamp bounds
            (use_clipped_linears only)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from turbospark_jax.errors import ModelLoadError
from turbospark_jax.kernels.layers import MASK_VALUE, apply_rope, random_leaves, rms_norm
from turbospark_jax.models.family import Family, HFTensor, Params

#: Where a ``gemma4`` folder keeps the tower's tensors.
PREFIXES = ("model.vision_tower.", "model.embed_vision.")

#: The linears of an encoder layer, each optionally clamped.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The clamp bounds of a clipped linear (buffers of the reference's ClippableLinear).
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm")


@dataclasses.dataclass(frozen=True)
class Gemma4VisionConfig:
    """``Gemma4VisionConfig`` hyperparameters (field names and defaults are its keys) plus the
    text model's ``hidden_size`` that ``embed_vision`` projects to. Build with
    :meth:`from_hf_dict` from a ``gemma4`` config.json."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    initializer_range: float = 0.02
    text_hidden_size: int = 1536

    def __post_init__(self) -> None:
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim",
                    "pooling_kernel_size", "patch_size", "position_embedding_size",
                    "text_hidden_size"):
            if getattr(self, key) <= 0:
                raise ModelLoadError(f"invalid Gemma 4 vision config: {key!r} must be positive, "
                                     f"got {getattr(self, key)}")
        if self.head_dim % 4:
            raise ModelLoadError(f"invalid Gemma 4 vision config: 'head_dim' must be a multiple "
                                 f"of 4 for the 2-D rotary embedding, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("invalid Gemma 4 vision config: 'num_key_value_heads' must "
                                 "divide 'num_attention_heads'")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Gemma4VisionConfig | None:
        """The vision config of a ``gemma4`` config.json, ``None`` when it has none.

        Raises:
          ModelLoadError: naming the key, for a malformed value or an unsupported feature
            (another activation or RoPE type).
        """
        vision = d.get("vision_config")
        if vision is None:
            return None
        if not isinstance(vision, Mapping):
            raise ModelLoadError(f"config.json key 'vision_config' must be an object, got "
                                 f"{vision!r}")
        act = vision.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ModelLoadError(f"invalid Gemma 4 vision config: 'hidden_activation' {act!r} "
                                 "is not supported (only 'gelu_pytorch_tanh')")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(f"invalid Gemma 4 vision config: rope_type "
                                 f"{rope.get('rope_type')!r} is not supported (only 'axial')")
        text = d.get("text_config") or {}
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "text_hidden_size"}
        kwargs: dict[str, Any] = {k: vision[k] for k in fields if vision.get(k) is not None}
        for key, value in kwargs.items():
            want = type(getattr(cls, key))
            if isinstance(value, bool) != (want is bool) or not isinstance(
                    value, int | float if want is float else want):
                raise ModelLoadError(f"invalid Gemma 4 vision config: {key!r} must be "
                                     f"{want.__name__}, got {value!r}")
        kwargs["rope_theta"] = float(rope.get("rope_theta", cls.rope_theta))
        kwargs["text_hidden_size"] = int(text.get("hidden_size", cls.text_hidden_size))
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``vision_config`` object of a config.json."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("rope_theta", "text_hidden_size")}
        out.update(model_type="gemma4_vision", hidden_activation="gelu_pytorch_tanh",
                   rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta})
        return out

    @property
    def patch_pixels(self) -> int:
        """``C``: values in one flattened patch."""
        return 3 * self.patch_size**2


# -- params ----------------------------------------------------------------------------------


def param_shapes(config: Gemma4VisionConfig) -> Params:
    """The params tree with a shape tuple at every leaf (layout in the module docstring)."""
    c = config
    d, h, kv, hd, f, n = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                          c.head_dim, c.intermediate_size, c.num_hidden_layers)
    layer: dict[str, tuple[int, ...]] = {name: (n, d) for name in _NORMS}
    layer.update(q_norm=(n, hd), k_norm=(n, hd), q_proj=(n, d, h, hd), k_proj=(n, d, kv, hd),
                 v_proj=(n, d, kv, hd), o_proj=(n, h, hd, d), gate_proj=(n, d, f),
                 up_proj=(n, d, f), down_proj=(n, f, d))
    if c.use_clipped_linears:
        layer.update({f"{name}_{bound}": (n,) for name in LINEARS for bound in CLIP_BOUNDS})
    tree: Params = {"input_proj": (c.patch_pixels, d),
                    "position_embedding_table": (2, c.position_embedding_size, d),
                    "embedding_projection": (d, c.text_hidden_size), "layers": layer}
    if c.standardize:
        tree.update(std_bias=(d,), std_scale=(d,))
    return tree


def hf_tensors(config: Gemma4VisionConfig) -> list[HFTensor]:
    """Every vision tensor of a ``gemma4`` folder, and the leaf (or stacked slice) it fills."""
    shapes = param_shapes(config)
    top = "model.vision_tower."
    out = [
        HFTensor(top + "patch_embedder.input_proj.weight", ("input_proj",),
                 shapes["input_proj"][::-1], transpose=True),
        HFTensor(top + "patch_embedder.position_embedding_table",
                 ("position_embedding_table",), shapes["position_embedding_table"]),
        HFTensor("model.embed_vision.embedding_projection.weight", ("embedding_projection",),
                 shapes["embedding_projection"][::-1], transpose=True),
    ]
    if config.standardize:
        out += [HFTensor(top + name, (name,), shapes[name]) for name in ("std_bias", "std_scale")]
    for i in range(config.num_hidden_layers):
        pre = f"{top}encoder.layers.{i}."
        for key, shape in shapes["layers"].items():
            one = shape[1:]
            if key in _NORMS:
                out.append(HFTensor(f"{pre}{key}.weight", ("layers", key), one, stacked=i))
            elif key in ("q_norm", "k_norm"):
                out.append(HFTensor(f"{pre}self_attn.{key}.weight", ("layers", key), one,
                                    stacked=i))
            elif key in LINEARS:
                out.append(HFTensor(f"{pre}{_module(key)}.linear.weight", ("layers", key),
                                    _linear_hf_shape(key, one), transpose=True, stacked=i))
            elif key.endswith(CLIP_BOUNDS):
                linear, bound = key.split("_proj_")
                out.append(HFTensor(f"{pre}{_module(linear + '_proj')}.{bound}",
                                    ("layers", key), (), stacked=i))
    return out


def _module(key: str) -> str:
    return f"self_attn.{key}" if key in LINEARS[:4] else f"mlp.{key}"


def _linear_hf_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    # nn.Linear keeps [out, in]; o_proj and down_proj have their input first in our layout.
    if key == "o_proj":
        return shape[-1], math.prod(shape[:-1])
    return math.prod(shape[1:]), shape[0]


def init_params(config: Gemma4VisionConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random params: matrices ~ N(0, initializer_range), norms 1, no clamping, standardising
    to zero mean and unit scale."""
    return _init_params(config, key, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params(config: Gemma4VisionConfig, key: jax.Array, dtype: jnp.dtype) -> Params:
    def constant(name: str) -> float | None:
        if name.endswith("norm") or name == "std_scale":
            return 1.0
        if name == "std_bias":
            return 0.0
        if name.endswith(CLIP_BOUNDS):  # no clamping
            return -math.inf if name.endswith("min") else math.inf
        return None

    return random_leaves(param_shapes(config), key, config.initializer_range, dtype, constant)


def _no_decoder(config: Any, dtype: Any, layer_layout: str) -> Any:
    raise ModelLoadError("the Gemma 4 vision tower is not a decoder; load the folder's text "
                         "model with load_folder, which loads the tower beside it")


#: The tower's tensors in the loader's terms: what ``load_folder`` reads from a ``gemma4``
#: folder beside the text model (every other tensor is the text model's business).
TENSORS = Family(
    name="gemma4 vision",
    architectures={},
    parse_config=Gemma4VisionConfig.from_hf_dict,
    param_shapes=param_shapes,
    hf_tensors=hf_tensors,
    build=_no_decoder,
    tolerated=lambda name: not name.startswith(PREFIXES),
    config_type=Gemma4VisionConfig,
)


# -- the tower -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Gemma4Vision:
    """The vision tower and ``embed_vision`` as pure functions over params.

    Attributes:
      config: the hyperparameters.
      dtype: activation dtype; params should match. Pooling, scaling and standardising run
        in float32 as the reference does.
    """

    config: Gemma4VisionConfig
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    def init_params(self, key: jax.Array) -> Params:
        return init_params(self.config, key, self.dtype)

    def _norm(self, x: jax.Array, weight: jax.Array | None) -> jax.Array:
        return rms_norm(x, weight, self.config.rms_norm_eps, weight_in_float32=True)

    def _linear(self, x: jax.Array, lp: Params, name: str) -> jax.Array:
        """``x [P, in] @ lp[name]`` (flattened to 2-D), clamped when the config asks."""
        w = lp[name]
        clipped = self.config.use_clipped_linears
        if clipped:
            x = jnp.clip(x, lp[f"{name}_input_min"].astype(x.dtype),
                         lp[f"{name}_input_max"].astype(x.dtype))
        if name == "o_proj":
            y = x.reshape(x.shape[0], -1) @ w.reshape(-1, w.shape[-1])
        else:
            y = (x.reshape(x.shape[0], -1) @ w.reshape(w.shape[0], -1)).reshape(
                x.shape[0], *w.shape[1:])
        if clipped:
            y = jnp.clip(y, lp[f"{name}_output_min"].astype(y.dtype),
                         lp[f"{name}_output_max"].astype(y.dtype))
        return y

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``positions [P, 2]`` -> cos, sin ``[P, hd / 2]`` per axis, stacked ``[2, P, hd/2]``:
        each half of a head is rotated by one coordinate with the same frequencies."""
        hd = self.config.head_dim
        half = hd // 2
        inv = 1.0 / (self.config.rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))
        angles = positions.T.astype(jnp.float32)[:, :, None] * inv  # [2, P, hd/4]
        angles = jnp.concatenate([angles, angles], axis=-1)  # [2, P, hd/2]
        return jnp.cos(angles).astype(self.dtype), jnp.sin(angles).astype(self.dtype)

    def _rotate(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        half = x.shape[-1] // 2
        return jnp.concatenate([apply_rope(x[..., :half], cos[0], sin[0]),
                                apply_rope(x[..., half:], cos[1], sin[1])], axis=-1)

    def _layer(self, x: jax.Array, lp: Params, rope: tuple[jax.Array, jax.Array],
               valid: jax.Array) -> jax.Array:
        c = self.config
        cos, sin = rope
        h = self._norm(x, lp["input_layernorm"])
        q = self._rotate(self._norm(self._linear(h, lp, "q_proj"), lp["q_norm"]), cos, sin)
        k = self._rotate(self._norm(self._linear(h, lp, "k_proj"), lp["k_norm"]), cos, sin)
        v = self._norm(self._linear(h, lp, "v_proj"), None)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(valid[None, None, :], scores, MASK_VALUE)  # padding keys
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        attn = jnp.einsum("hqk,khd->qhd", probs, v)
        x = x + self._norm(self._linear(attn, lp, "o_proj"), lp["post_attention_layernorm"])
        h = self._norm(x, lp["pre_feedforward_layernorm"])
        gate = jax.nn.gelu(self._linear(h, lp, "gate_proj").astype(jnp.float32),
                           approximate=True).astype(self.dtype)
        m = self._linear(gate * self._linear(h, lp, "up_proj"), lp, "down_proj")
        return x + self._norm(m, lp["post_feedforward_layernorm"])

    def encode(self, params: Params, patches: jax.Array, positions: jax.Array) -> jax.Array:
        """One image's patches -> its pooled soft tokens in the text embedding space.

        Args:
          params: the tower's params.
          patches: float ``[P, C]`` pixel values in ``[0, 1]``, padding rows anywhere.
          positions: int32 ``[P, 2]`` each patch's ``(x, y)``; ``(-1, -1)`` marks padding.
            ``P`` must be a multiple of ``pooling_kernel_size**2``.

        Returns:
          ``[P / k**2, D_text]`` in the model dtype; the image's ``n`` soft tokens are the first
          ``n`` rows (the rest pooled only padding).
        """
        c = self.config
        valid = jnp.any(positions != -1, axis=-1)  # [P]
        clamped = jnp.maximum(positions, 0)
        x = (2.0 * (patches.astype(jnp.float32) - 0.5)).astype(self.dtype) @ params["input_proj"]
        table = params["position_embedding_table"]
        pos = table[0][clamped[:, 0]] + table[1][clamped[:, 1]]
        x = x + jnp.where(valid[:, None], pos, 0.0).astype(self.dtype)
        rope = self._rope(positions)

        def step(x: jax.Array, lp: Params) -> tuple[jax.Array, None]:
            return self._layer(x, lp, rope, valid), None

        x, _ = jax.lax.scan(step, x, params["layers"])
        pooled = self._pool(jnp.where(valid[:, None], x, 0.0), clamped)
        pooled = pooled * jnp.float32(c.hidden_size**0.5)
        if c.standardize:
            pooled = (pooled - params["std_bias"].astype(jnp.float32)) * \
                params["std_scale"].astype(jnp.float32)
        soft = self._norm(pooled.astype(self.dtype), None)
        return soft @ params["embedding_projection"]

    def _pool(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Average each ``k x k`` block of patches: ``[P, D]`` -> float32 ``[P / k**2, D]``.

        Block ``(bx, by)`` lands in row ``bx + by * (width / k)``, so the real blocks fill
        the first rows in reading order; padding rows are zero and add nothing (they fall
        into row 0 with zero weight)."""
        k = self.config.pooling_kernel_size
        out_len = x.shape[0] // (k * k)
        if out_len == x.shape[0]:
            return x.astype(jnp.float32)
        width = jnp.max(positions[:, 0]) + 1
        block = positions // k
        row = block[:, 0] + (width // k) * block[:, 1]
        weights = jax.nn.one_hot(row, out_len, dtype=jnp.float32) / (k * k)  # [P, out]
        return jnp.einsum("po,pd->od", weights, x.astype(jnp.float32))

    @property
    def compiled_encode(self) -> Any:
        """:meth:`encode` jitted (one program per patch count ``P``), shared by equal towers."""
        return _compiled_encode(self)


@functools.cache
def _compiled_encode(tower: Gemma4Vision) -> Any:
    return jax.jit(tower.encode)
