"""The Gemma 4 text family's config: :class:`Gemma4Config`, parsed from and written back to a
Hugging Face ``config.json`` (a ``gemma4_text`` one, or a ``gemma4`` one's ``text_config``).

Besides the hyperparameters it derives the switches the model reads per layer: the layer's kind
(``layer_types``), its head shape and KV head count, whether it owns its K/V or reads a shared
one, whether its keys double as values, its MLP width and window, and each layer type's RoPE
(:class:`Rope`). Two spellings of the full layers' head shape are read (``global_head_dim`` /
``num_global_key_value_heads`` and transformers' ``per_layer_config``); keys left out take
``Gemma4TextConfig``'s defaults; a malformed value or an unsupported feature (bidirectional
attention, another activation or RoPE type) is a :class:`ModelLoadError` naming the key.

``enable_moe_block`` adds a mixture of experts beside every layer's MLP
(:mod:`~turbospark_jax.models.moe`): ``num_experts`` experts of width ``moe_intermediate_size``,
``top_k_experts`` of them a token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from turbospark_jax.errors import ModelLoadError
from turbospark_jax.kernels.layers import rope_inv_freq
from turbospark_jax.models.family import (
    checkpoint_dtype,
    eos_ids,
    eos_to_json,
    hf_model_type,
    text_config,
    token_ids,
    typed_value,
)
from turbospark_jax.models.moe import Routing

FULL, SLIDING = "full_attention", "sliding_attention"
ARCHITECTURES = {"gemma4_text": "Gemma4ForCausalLM", "gemma4": "Gemma4ForConditionalGeneration"}


@dataclasses.dataclass(frozen=True)
class Rope:
    """One layer type's RoPE (``rope_parameters[layer_type]``): ``default`` rotates all of the
    head; ``proportional`` rotates the first ``partial_rotary_factor`` of each half with
    frequencies spaced over the whole head dim, divided by ``factor``."""

    rope_type: str
    rope_theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """float32 ``[head_dim // 2]`` inverse frequencies (zeros where nothing rotates)."""
        if self.rope_type == "default":
            return rope_inv_freq(head_dim, self.rope_theta, None, 0)[0]
        f32 = np.float32
        angles = int(self.partial_rotary_factor * head_dim // 2)
        exponents = np.arange(0, 2 * angles, 2, dtype=np.int64).astype(f32) / f32(head_dim)
        rotated = f32(1.0) / (f32(self.rope_theta) ** exponents)
        padded = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, f32)])
        return (padded / f32(self.factor)).astype(f32)

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "proportional":
            out["partial_rotary_factor"] = self.partial_rotary_factor
            if self.factor != 1.0:  # transformers reads it but warns about it as unknown
                out["factor"] = self.factor
        return out


_DEFAULT_ROPE = {SLIDING: Rope("default", 10_000.0),
                 FULL: Rope("proportional", 1_000_000.0, partial_rotary_factor=0.25)}


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """Gemma 4 text hyperparameters; field names and defaults are ``Gemma4TextConfig``'s.

    ``model_type`` is ``"gemma4_text"`` or ``"gemma4"`` (the text decoder of a multimodal
    folder, whose tensors sit under ``model.language_model.``). ``num_global_key_value_heads``
    is resolved: the full layers' KV head count (``None``: ``num_key_value_heads``).
    ``hidden_size_per_layer_input`` 0 switches PLE off. Build with :meth:`from_hf_dict`.
    """

    model_type: str = "gemma4_text"
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: tuple[str, ...] = ()
    sliding_rope: Rope = _DEFAULT_ROPE[SLIDING]
    full_rope: Rope = _DEFAULT_ROPE[FULL]
    final_logit_softcapping: float | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    bos_token_id: int | None = 2
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = 0
    dtype: str | None = None
    use_bidirectional_attention: str | None = None
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        types = list(self.layer_types) or [  # the reference's default: 5 sliding, 1 full
            SLIDING if (i + 1) % 6 else FULL for i in range(max(n, 0))
        ]
        if types:
            types[-1] = FULL  # the reference forces the last layer to full attention
        object.__setattr__(self, "layer_types", tuple(types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._check()

    def _check(self) -> None:
        def bad(key: str, msg: str) -> ModelLoadError:
            return ModelLoadError(f"invalid Gemma 4 config: {key!r} {msg}")

        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
                    "sliding_window"):
            if getattr(self, key) <= 0:
                raise bad(key, f"must be positive, got {getattr(self, key)}")
        if self.model_type not in ARCHITECTURES:
            raise bad("model_type", f"must be one of {', '.join(ARCHITECTURES)}")
        if self.num_global_key_value_heads is not None and self.num_global_key_value_heads <= 0:
            raise bad("num_global_key_value_heads", "must be positive or null")
        for key, value in (("head_dim", self.head_dim), ("global_head_dim", self.global_head_dim)):
            if value % 2:
                raise bad(key, f"must be even for rotary embeddings, got {value}")
        for key, kv in (("num_key_value_heads", self.num_key_value_heads),
                        ("num_global_key_value_heads", self.full_kv_heads)):
            if kv <= 0 or self.num_attention_heads % kv:
                raise bad(key, f"({kv}) must divide num_attention_heads "
                               f"({self.num_attention_heads})")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise bad("hidden_activation", f"{self.hidden_activation!r} is not supported "
                                           "(only 'gelu_pytorch_tanh')")
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", f"has {len(self.layer_types)} entries for "
                                     f"{self.num_hidden_layers} layers")
        if set(self.layer_types) - {FULL, SLIDING}:
            raise bad("layer_types", f"holds {sorted(set(self.layer_types) - {FULL, SLIDING})}; "
                                     f"only {FULL!r} and {SLIDING!r} are known")
        shared = self.num_kv_shared_layers
        if not 0 <= shared <= self.num_hidden_layers:
            raise bad("num_kv_shared_layers", f"must be in [0, num_hidden_layers], got {shared}")
        owners = set(self.layer_types[: self.num_hidden_layers - shared])
        if owners != set(self.layer_types) and not self.reads_target_kv:
            raise bad("num_kv_shared_layers", f"({shared}) leaves no earlier layer of kind "
                                              f"{sorted(set(self.layer_types) - owners)} to share")
        if self.hidden_size_per_layer_input < 0:
            raise bad("hidden_size_per_layer_input", "must be >= 0")
        if self.ple and self.vocab_size_per_layer_input < self.vocab_size:
            raise bad("vocab_size_per_layer_input", f"({self.vocab_size_per_layer_input}) is "
                      f"smaller than vocab_size ({self.vocab_size}); some ids would have no PLE")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise bad("final_logit_softcapping", "must be positive or null")
        if self.enable_moe_block:
            for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                if not getattr(self, key) or getattr(self, key) <= 0:
                    raise bad(key, f"must be positive with enable_moe_block, got "
                                   f"{getattr(self, key)}")
            if self.top_k_experts > self.num_experts:
                raise bad("top_k_experts", f"({self.top_k_experts}) must be at most "
                                           f"num_experts ({self.num_experts})")

    # -- derived switches -------------------------------------------------------------------

    @property
    def routing(self) -> Routing:
        """The MoE block's router rule (always renormalised)."""
        return Routing(self.num_experts, self.top_k_experts, True)

    @property
    def ple(self) -> bool:
        """Whether per-layer input embeddings are on."""
        return self.hidden_size_per_layer_input > 0

    @property
    def reads_target_kv(self) -> bool:
        """Every layer shares K/V: a drafter's config (``gemma4_assistant``), which reads its
        target's; such a config cannot run alone."""
        return self.num_kv_shared_layers == self.num_hidden_layers

    @property
    def full_kv_heads(self) -> int:
        return self.num_global_key_value_heads or self.num_key_value_heads

    def dims(self, i: int) -> tuple[int, int]:
        """``(head_dim, kv_heads)`` of layer ``i``."""
        if self.layer_types[i] == FULL:
            return self.global_head_dim, self.full_kv_heads
        return self.head_dim, self.num_key_value_heads

    def owns_kv(self, i: int) -> bool:
        """Whether layer ``i`` projects its own K/V (the last ``num_kv_shared_layers`` don't)."""
        return i < self.num_hidden_layers - self.num_kv_shared_layers

    def k_eq_v(self, i: int) -> bool:
        """Whether layer ``i``'s values come from its key projection (full layers only)."""
        return self.attention_k_eq_v and self.layer_types[i] == FULL

    def mlp_width(self, i: int) -> int:
        wide = self.use_double_wide_mlp and not self.owns_kv(i)
        return self.intermediate_size * (2 if wide else 1)

    def window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    def owners(self, kind: str) -> tuple[int, ...]:
        """Layers of ``kind`` that keep a cache, in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind and self.owns_kv(i))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_ids(self.eos_token_id)

    # -- config.json ------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Gemma4Config:
        """Parse a ``gemma4_text`` config.json, or a ``gemma4`` one's ``text_config``.

        Keys left out take ``Gemma4TextConfig``'s defaults. Both ways of giving the full
        layers' head shape are read: ``global_head_dim`` / ``num_global_key_value_heads``
        (the latter only counts with ``attention_k_eq_v``, as in the reference) and the
        ``per_layer_config`` that transformers 5.24 writes.

        Raises:
          ModelLoadError: naming the key, for a wrong model type, a malformed value, an
            unsupported feature (bidirectional attention, another activation or RoPE type)
            or inconsistent shapes.
        """
        model_type = hf_model_type(d)
        if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
            raise ModelLoadError(f"unsupported model_type {model_type!r} for the Gemma 4 family "
                                 f"(supported: {', '.join(ARCHITECTURES)})")
        outer: Mapping[str, Any] = {}
        if model_type == "gemma4":
            outer, d = d, text_config(d)
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}

        def get(key: str, kind: type, source: Mapping[str, Any] = d) -> Any:
            value = source.get(key, defaults.get(key))
            if value is None:
                if defaults.get(key) is not None:  # a null where transformers needs a value
                    raise ModelLoadError(f"config.json key {key!r} must be {kind.__name__}, "
                                         f"got null")
                return None
            return typed_value(key, value, kind)

        moe = d.get("enable_moe_block", False)
        if not isinstance(moe, bool):
            raise ModelLoadError(f"config.json key 'enable_moe_block' must be bool, got {moe!r}")
        if d.get("use_bidirectional_attention") not in (None, "vision"):
            raise ModelLoadError("config.json key 'use_bidirectional_attention' = "
                                 f"{d['use_bidirectional_attention']!r} is not supported "
                                 "(text decoding is causal)")
        layers = get("num_hidden_layers", int)
        types = d.get("layer_types")
        if types is not None and not (isinstance(types, list) and
                                      all(isinstance(t, str) for t in types)):
            raise ModelLoadError(f"config.json key 'layer_types' must be a list of names, "
                                 f"got {types!r}")
        k_eq_v = get("attention_k_eq_v", bool)
        global_dim = get("global_head_dim", int)
        global_kv = get("num_global_key_value_heads", int) if k_eq_v else None
        if d.get("per_layer_config") is not None:
            global_dim, global_kv = _per_layer_shapes(d["per_layer_config"], types, layers,
                                                      get("head_dim", int),
                                                      get("num_key_value_heads", int))
        tokens = token_ids(d, outer, defaults)
        return cls(
            model_type=model_type,
            **{k: get(k, int) for k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                "vocab_size_per_layer_input", "num_kv_shared_layers")},
            num_hidden_layers=layers,
            global_head_dim=global_dim,
            num_global_key_value_heads=global_kv,
            hidden_activation=get("hidden_activation", str),
            initializer_range=get("initializer_range", float),
            rms_norm_eps=get("rms_norm_eps", float),
            tie_word_embeddings=get("tie_word_embeddings", bool, outer or d),
            attention_bias=get("attention_bias", bool),
            layer_types=tuple(types or ()),
            sliding_rope=_parse_rope(d.get("rope_parameters"), SLIDING),
            full_rope=_parse_rope(d.get("rope_parameters"), FULL),
            final_logit_softcapping=get("final_logit_softcapping", float),
            hidden_size_per_layer_input=get("hidden_size_per_layer_input", int) or 0,
            attention_k_eq_v=k_eq_v,
            use_double_wide_mlp=get("use_double_wide_mlp", bool),
            dtype=checkpoint_dtype(d, outer),
            use_bidirectional_attention=d.get("use_bidirectional_attention"),
            enable_moe_block=moe,
            **{k: get(k, int) for k in ("num_experts", "top_k_experts",
                                        "moe_intermediate_size")},
            **tokens,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers and :meth:`from_hf_dict` read as this config
        (both spellings of the full layers' head shape are written)."""
        overrides: dict[str, Any] = {"head_dim": self.global_head_dim}
        if self.num_global_key_value_heads is not None:
            overrides["num_key_value_heads"] = self.num_global_key_value_heads
        text: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name not in ("sliding_rope", "full_rope", "eos_token_id", "dtype")
        }
        text.update(
            model_type="gemma4_text", layer_types=list(self.layer_types),
            eos_token_id=eos_to_json(self.eos_token_id),
            rope_parameters={SLIDING: self.sliding_rope.to_hf_dict(),
                             FULL: self.full_rope.to_hf_dict()},
            per_layer_config={str(i): overrides for i, t in enumerate(self.layer_types)
                              if t == FULL},
        )
        if self.dtype is not None:
            text["dtype"] = self.dtype
        if self.model_type == "gemma4_text":
            return {"architectures": [ARCHITECTURES["gemma4_text"]], **text}
        return {"architectures": [ARCHITECTURES["gemma4"]], "model_type": "gemma4",
                "text_config": text, "tie_word_embeddings": self.tie_word_embeddings,
                **({"dtype": self.dtype} if self.dtype is not None else {})}


def _per_layer_shapes(raw: Any, types: Any, layers: int, head_dim: int,
                      kv_heads: int) -> tuple[int, int | None]:
    """``(global_head_dim, num_global_key_value_heads)`` from a ``per_layer_config``, which
    must give every full layer the same shape and no sliding layer another one."""
    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"config.json key 'per_layer_config' must be an object, got {raw!r}")
    types = types or [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
    shapes = set()
    for i, kind in enumerate(types):
        over = raw.get(str(i), raw.get(i, {}))
        if not isinstance(over, Mapping) or set(over) - {"head_dim", "num_key_value_heads"}:
            raise ModelLoadError(f"config.json key 'per_layer_config' entry {i}: only head_dim "
                                 f"and num_key_value_heads overrides are supported, got {over!r}")
        shape = (over.get("head_dim", head_dim), over.get("num_key_value_heads"))
        if kind == SLIDING and shape != (head_dim, None):
            raise ModelLoadError(f"config.json key 'per_layer_config' reshapes sliding layer {i}")
        if kind == FULL:
            shapes.add(shape)
    if len(shapes) > 1:
        raise ModelLoadError(f"config.json key 'per_layer_config' gives full layers different "
                             f"shapes {sorted(shapes, key=str)}")
    dim, kv = shapes.pop() if shapes else (512, None)
    if not isinstance(dim, int) or not (kv is None or isinstance(kv, int)):
        raise ModelLoadError(f"config.json key 'per_layer_config' holds a non-integer shape "
                             f"{raw!r}")
    return dim, (kv if kv != kv_heads else None)


def _parse_rope(raw: Any, kind: str) -> Rope:
    if raw is None:
        return _DEFAULT_ROPE[kind]
    spec = raw.get(kind) if isinstance(raw, Mapping) else None
    if not isinstance(spec, Mapping):
        raise ModelLoadError(f"config.json key 'rope_parameters' must map {kind!r} to its RoPE "
                             f"settings, got {raw!r}")
    rope_type = spec.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ModelLoadError(f"config.json key 'rope_parameters.{kind}.rope_type' = "
                             f"{rope_type!r} is not supported ('default', 'proportional')")
    values = {}
    for key, default in (("rope_theta", None), ("partial_rotary_factor", 1.0), ("factor", 1.0)):
        value = spec.get(key, default)
        floor = 0 if key == "partial_rotary_factor" else 1e-30  # nothing rotating is allowed
        if isinstance(value, bool) or not isinstance(value, int | float) or value < floor:
            raise ModelLoadError(f"config.json key 'rope_parameters.{kind}.{key}' must be a "
                                 f"positive number, got {value!r}")
        values[key] = float(value)
    if values["partial_rotary_factor"] > 1:
        raise ModelLoadError(f"config.json key 'rope_parameters.{kind}.partial_rotary_factor' "
                             f"must be at most 1, got {values['partial_rotary_factor']}")
    return Rope(rope_type, **values)
