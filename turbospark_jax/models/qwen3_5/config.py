"""The Qwen3.5 / Qwen3-Next family's config: :class:`Qwen35Config`, parsed from and written
back to a Hugging Face ``config.json`` (a ``qwen3_5_text`` or ``qwen3_next`` one, or a
``qwen3_5`` one's ``text_config``).

Keys left out take the transformers defaults of that model type (``layer_types`` from
``full_attention_interval``); RoPE is read from ``rope_parameters`` or the legacy top-level
keys. A malformed value, a mixture-of-experts config (``qwen3_5_moe``, or ``qwen3_next``
experts in any layer), a RoPE type other than the default, or inconsistent shapes is a
:class:`ModelLoadError` naming the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from turbospark_jax.errors import ModelLoadError
from turbospark_jax.models.family import (
    checkpoint_dtype,
    eos_ids,
    eos_to_json,
    hf_model_type,
    text_config,
    token_ids,
    typed_value,
)

LINEAR, FULL = "linear_attention", "full_attention"
ARCHITECTURES = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
}
_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
# Keys whose transformers defaults differ between the two configuration classes.
_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {},
    "qwen3_next": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=48, num_key_value_heads=2),
}


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    """Hyperparameters; field names and defaults are ``Qwen3_5TextConfig``'s (``qwen3_next``
    overrides a few, see ``_TYPE_DEFAULTS``). ``model_type`` ``"qwen3_5"`` is the text decoder
    of a multimodal folder (tensors under ``model.language_model.``). RoPE is read from
    ``rope_parameters`` (or the legacy top-level keys); only the default type is supported, and
    mRoPE sections are ignored (text positions are equal on all three axes). Build with
    :meth:`from_hf_dict`."""

    model_type: str = "qwen3_5_text"
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: tuple[str, ...] = ()
    mtp_num_hidden_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:  # the reference's default: every fourth layer attends fully
            object.__setattr__(self, "layer_types", _interval_types(self.num_hidden_layers, 4))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._check()

    def _check(self) -> None:
        def bad(key: str, msg: str) -> ModelLoadError:
            return ModelLoadError(f"invalid {self.model_type} config: {key!r} {msg}")

        if self.model_type not in ARCHITECTURES:
            raise bad("model_type", f"must be one of {', '.join(ARCHITECTURES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim",
                    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_num_key_heads", "linear_num_value_heads", "max_position_embeddings"):
            if getattr(self, key) <= 0:
                raise bad(key, f"must be positive, got {getattr(self, key)}")
        for heads, kv in (("num_attention_heads", "num_key_value_heads"),
                          ("linear_num_value_heads", "linear_num_key_heads")):
            if getattr(self, heads) % getattr(self, kv):
                raise bad(kv, f"({getattr(self, kv)}) must divide {heads} "
                              f"({getattr(self, heads)})")
        if self.hidden_act != "silu":
            raise bad("hidden_act", f"{self.hidden_act!r} is not supported (only 'silu')")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise bad("partial_rotary_factor", f"({self.partial_rotary_factor}) must rotate an "
                      f"even, non-zero part of head_dim {self.head_dim}")
        if self.rope_theta <= 0:
            raise bad("rope_theta", f"must be positive, got {self.rope_theta}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", f"has {len(self.layer_types)} entries for "
                                     f"{self.num_hidden_layers} layers")
        if set(self.layer_types) - {LINEAR, FULL}:
            raise bad("layer_types", f"holds {sorted(set(self.layer_types) - {LINEAR, FULL})}; "
                                     f"only {LINEAR!r} and {FULL!r} are known")
        if self.mtp_num_hidden_layers < 0:
            raise bad("mtp_num_hidden_layers", f"must be >= 0, got {self.mtp_num_hidden_layers}")

    # -- derived shapes -----------------------------------------------------------------------

    @property
    def fused(self) -> bool:
        """Whether the DeltaNet projections are fused (Qwen3-Next's ``in_proj_qkvz``)."""
        return self.model_type == "qwen3_next"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        """Conv channels: q and k (``Hk * dk`` each) then v (``Hv * dv``)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def kind_index(self, i: int) -> int:
        """Layer ``i``'s index among the layers of its kind (its cache slot)."""
        return self.layer_types[:i].count(self.layer_types[i])

    def count(self, kind: str) -> int:
        return self.layer_types.count(kind)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_ids(self.eos_token_id)

    # -- config.json --------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Qwen35Config:
        """Parse a ``qwen3_5_text`` / ``qwen3_next`` config.json, or a ``qwen3_5`` one's
        ``text_config``. Keys left out take the transformers defaults of that model type
        (``layer_types`` from ``full_attention_interval``, 4 by default).

        Raises:
          ModelLoadError: naming the key, for a wrong model type, a malformed value, a
            mixture-of-experts config (``qwen3_5_moe``, or ``qwen3_next`` experts in any
            layer), a RoPE type other than the default, or inconsistent shapes.
        """
        model_type = hf_model_type(d)
        outer: Mapping[str, Any] = {}
        if model_type == "qwen3_5":
            outer, d = d, text_config(d)
        if model_type in _MOE_TYPES or d.get("model_type") in _MOE_TYPES:
            raise ModelLoadError(f"model_type {model_type!r} is a mixture-of-experts model: MoE "
                                 "is not supported by the Qwen3.5 family")
        if model_type not in ARCHITECTURES:
            raise ModelLoadError(f"unsupported model_type {model_type!r} for the Qwen3.5 family "
                                 f"(supported: {', '.join(ARCHITECTURES)})")
        base = "qwen3_next" if model_type == "qwen3_next" else "qwen3_5_text"
        defaults = {f.name: f.default for f in dataclasses.fields(cls)} | _TYPE_DEFAULTS[base]

        def get(key: str, kind: type, source: Mapping[str, Any] = d, default: Any = None) -> Any:
            value = source.get(key, defaults.get(key, default))
            if value is None:
                return None
            return typed_value(key, value, kind)

        layers = get("num_hidden_layers", int)
        _refuse_moe(d, model_type, layers, get)
        if get("mtp_use_dedicated_embeddings", bool, default=False):
            raise ModelLoadError("config.json key 'mtp_use_dedicated_embeddings' is true: an MTP "
                                 "head with its own embeddings is not supported")
        if not get("attn_output_gate", bool, default=True):
            raise ModelLoadError("config.json key 'attn_output_gate' is false: attention without "
                                 "its output gate is not supported")
        types = d.get("layer_types")
        if types is None:
            interval = get("full_attention_interval", int, default=4)
            if interval <= 0:
                raise ModelLoadError(f"config.json key 'full_attention_interval' must be "
                                     f"positive, got {interval}")
            types = _interval_types(layers, interval)
        elif not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
            raise ModelLoadError(f"config.json key 'layer_types' must be a list of names, "
                                 f"got {types!r}")
        theta, partial = _parse_rope(d)
        tokens = token_ids(d, outer, defaults)
        return cls(
            model_type=model_type,
            **{k: get(k, int) for k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings",
                "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "mtp_num_hidden_layers")},
            num_hidden_layers=layers,
            hidden_act=get("hidden_act", str),
            initializer_range=get("initializer_range", float),
            rms_norm_eps=get("rms_norm_eps", float),
            tie_word_embeddings=get("tie_word_embeddings", bool, outer or d),
            attention_bias=get("attention_bias", bool),
            rope_theta=theta,
            partial_rotary_factor=partial,
            layer_types=tuple(types),
            dtype=checkpoint_dtype(d, outer),
            **tokens,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers and :meth:`from_hf_dict` read as this config."""
        skip = ("model_type", "rope_theta", "partial_rotary_factor", "eos_token_id", "dtype")
        text: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                if f.name not in skip}
        text.update(
            layer_types=list(self.layer_types),
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.partial_rotary_factor},
            eos_token_id=eos_to_json(self.eos_token_id),
            **({"dtype": self.dtype} if self.dtype is not None else {}),
        )
        if self.model_type == "qwen3_next":
            text["num_experts"] = 0  # the reference's default is 512 experts
        if self.model_type != "qwen3_5":
            return {"architectures": [ARCHITECTURES[self.model_type]],
                    "model_type": self.model_type, **text}
        return {"architectures": [ARCHITECTURES["qwen3_5"]], "model_type": "qwen3_5",
                "text_config": {"model_type": "qwen3_5_text", **text},
                "tie_word_embeddings": self.tie_word_embeddings,
                **({"dtype": self.dtype} if self.dtype is not None else {})}


def _interval_types(layers: int, interval: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(max(layers, 0)))


def _refuse_moe(d: Mapping[str, Any], model_type: str, layers: int, get: Callable) -> None:
    """Raise if any layer would get a mixture-of-experts MLP (transformers' rule for
    ``qwen3_next``: experts in layer ``i`` unless ``i`` is in ``mlp_only_layers``, when
    ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``)."""
    experts = get("num_experts", int, default=512 if model_type == "qwen3_next" else 0)
    if experts < 0:
        raise ModelLoadError(f"config.json key 'num_experts' must be >= 0, got {experts}")
    if not experts:
        return
    step = get("decoder_sparse_step", int, default=1)
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ModelLoadError(f"config.json key 'mlp_only_layers' must be a list of layer "
                             f"indices, got {only!r}")
    if step <= 0:
        raise ModelLoadError(f"config.json key 'decoder_sparse_step' must be positive, got {step}")
    sparse = [i for i in range(layers) if i not in only and (i + 1) % step == 0]
    if sparse or get("mtp_num_hidden_layers", int, default=0):
        raise ModelLoadError(f"config.json key 'num_experts' = {experts} asks for "
                             f"mixture-of-experts MLPs (layers {sparse[:8]}, or the MTP "
                             "layer): MoE is not supported by the Qwen3.5 family")


def _parse_rope(d: Mapping[str, Any]) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` from ``rope_parameters`` or the legacy keys."""
    params = d.get("rope_parameters")
    legacy = d.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, Mapping):
            raise ModelLoadError(f"config.json key {key!r} must be an object, got {value!r}")
        kind = (value or {}).get("rope_type", (value or {}).get("type", "default"))
        if kind != "default":
            raise ModelLoadError(f"config.json key '{key}.rope_type' = {kind!r} is not "
                                 "supported (only 'default')")
    params = params or {}
    out = []
    for key, default in (("rope_theta", 10000.0), ("partial_rotary_factor", 0.25)):
        value = params.get(key, d.get(key, default))
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelLoadError(f"config.json key {key!r} must be a number, got {value!r}")
        out.append(float(value))
    return out[0], out[1]
