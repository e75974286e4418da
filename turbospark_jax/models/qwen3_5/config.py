"""The Qwen3.5 / Qwen3-Next family's config: :class:`Qwen35Config`, parsed from and written
back to a Hugging Face ``config.json`` (a ``qwen3_5_text``, ``qwen3_5_moe_text`` or
``qwen3_next`` one, or a ``qwen3_5`` or ``qwen3_5_moe`` one's ``text_config``).

Keys left out take the transformers defaults of that model type (``layer_types`` from
``full_attention_interval``); RoPE is read from ``rope_parameters`` or the legacy top-level
keys. A malformed value, a RoPE type other than the default, or inconsistent shapes is a
:class:`ModelLoadError` naming the key.

Mixture of experts (:mod:`~turbospark_jax.models.moe`): a ``qwen3_5_moe`` model's every layer,
and a ``qwen3_next`` model's layers by transformers' rule (``num_experts > 0``, ``(i + 1) %
decoder_sparse_step == 0``, ``i`` not in ``mlp_only_layers``), run ``num_experts`` routed
experts (``num_experts_per_tok`` a token, softmax top-k, renormalised; Qwen3-Next's
``norm_topk_prob`` may turn that off) beside a shared expert scaled by a sigmoid gate. The MTP
layers of a model with experts have them too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from turbospark_jax.errors import ModelLoadError
from turbospark_jax.models import moe
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

LINEAR, FULL = "linear_attention", "full_attention"
ARCHITECTURES = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
#: Multimodal model types (the text decoder's keys under ``text_config``, its tensors under
#: ``model.language_model.``) -> their text model type.
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_EXPERT_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size")
# Keys whose transformers defaults differ between the two configuration classes.
_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {},
    "qwen3_next": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=48, num_key_value_heads=2, num_experts=512,
                       num_experts_per_tok=10, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512),
    "qwen3_5_moe_text": dict(hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2,
                             num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                             shared_expert_intermediate_size=512),
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
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_types:  # the reference's default: every fourth layer attends fully
            object.__setattr__(self, "layer_types", _interval_types(self.num_hidden_layers, 4))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
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
        if self.num_experts < 0:
            raise bad("num_experts", f"must be >= 0, got {self.num_experts}")
        if self.decoder_sparse_step <= 0:
            raise bad("decoder_sparse_step", f"must be positive, got {self.decoder_sparse_step}")
        if self.model_type in ("qwen3_5_text", "qwen3_5") and self.num_experts:
            raise bad("num_experts", f"= {self.num_experts}: a {self.model_type} model has no "
                                     "experts (its mixture-of-experts form is qwen3_5_moe)")
        if self.moe:
            for key in _EXPERT_KEYS[2:]:
                if getattr(self, key) <= 0:
                    raise bad(key, f"must be positive, got {getattr(self, key)}")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise bad("num_experts_per_tok", f"must be in 1..num_experts "
                          f"({self.num_experts}), got {self.num_experts_per_tok}")

    # -- derived shapes -----------------------------------------------------------------------

    @property
    def fused(self) -> bool:
        """Whether the DeltaNet projections are fused (Qwen3-Next's ``in_proj_qkvz``)."""
        return self.model_type == "qwen3_next"

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is a mixture of experts (see the module docstring)."""
        return moe.sparse_layers(self.num_experts, self.mlp_only_layers,
                                 self.decoder_sparse_step, self.num_hidden_layers)

    @property
    def moe(self) -> bool:
        """Whether any layer (and then every MTP layer) has experts."""
        return any(self.sparse_layers)

    @property
    def routing(self) -> Routing:
        """The routers' rule (a model with experts only)."""
        return Routing(self.num_experts, self.num_experts_per_tok, self.norm_topk_prob)

    @property
    def text_model_type(self) -> str:
        """The model type of the text decoder (the ``text_config``'s, for a multimodal one)."""
        return MULTIMODAL.get(self.model_type, self.model_type)

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
            RoPE type other than the default, or inconsistent shapes.
        """
        model_type = hf_model_type(d)
        outer: Mapping[str, Any] = {}
        if model_type in MULTIMODAL:
            outer, d = d, text_config(d)
            inner = d.get("model_type", MULTIMODAL[model_type])
            if inner != MULTIMODAL[model_type]:
                raise ModelLoadError(f"config.json's text_config has model_type {inner!r}; a "
                                     f"{model_type} folder's is {MULTIMODAL[model_type]!r}")
        if model_type not in ARCHITECTURES:
            raise ModelLoadError(f"unsupported model_type {model_type!r} for the Qwen3.5 family "
                                 f"(supported: {', '.join(ARCHITECTURES)})")
        base = model_type if model_type in _TYPE_DEFAULTS else MULTIMODAL.get(model_type,
                                                                              "qwen3_5_text")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)} | _TYPE_DEFAULTS[base]

        def get(key: str, kind: type, source: Mapping[str, Any] = d, default: Any = None) -> Any:
            value = source.get(key, defaults.get(key, default))
            if value is None:
                return None
            return typed_value(key, value, kind)

        layers = get("num_hidden_layers", int)
        experts = _parse_experts(d, base, get)
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
            **experts,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers and :meth:`from_hf_dict` read as this config."""
        skip = ("model_type", "rope_theta", "partial_rotary_factor", "eos_token_id", "dtype",
                *_EXPERT_KEYS, "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
        text: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                if f.name not in skip}
        text.update(
            layer_types=list(self.layer_types),
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.partial_rotary_factor},
            eos_token_id=eos_to_json(self.eos_token_id),
            **({"dtype": self.dtype} if self.dtype is not None else {}),
        )
        if self.model_type == "qwen3_next" or self.moe:
            # (qwen3_next's reference default is 512 experts: a 0 must be written)
            text.update({k: getattr(self, k) for k in _EXPERT_KEYS})
        if self.model_type == "qwen3_next":
            text.update(norm_topk_prob=self.norm_topk_prob,
                        decoder_sparse_step=self.decoder_sparse_step,
                        mlp_only_layers=list(self.mlp_only_layers))
        if self.model_type not in MULTIMODAL:
            return {"architectures": [ARCHITECTURES[self.model_type]],
                    "model_type": self.model_type, **text}
        return {"architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
                "text_config": {"model_type": self.text_model_type, **text},
                "tie_word_embeddings": self.tie_word_embeddings,
                **({"dtype": self.dtype} if self.dtype is not None else {})}


def _interval_types(layers: int, interval: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(max(layers, 0)))


def _parse_experts(d: Mapping[str, Any], base: str, get: Callable) -> dict[str, Any]:
    """The expert keys of a ``qwen3_next`` or ``qwen3_5_moe_text`` config (a
    ``qwen3_5_text`` has none: empty). Qwen3.5-MoE always renormalises and has experts in
    every layer, so only Qwen3-Next reads ``norm_topk_prob``, ``decoder_sparse_step`` and
    ``mlp_only_layers``."""
    if base == "qwen3_5_text":
        if get("num_experts", int, default=0):
            raise ModelLoadError(f"config.json key 'num_experts' = {d['num_experts']}: a "
                                 "qwen3_5_text model has no experts (its mixture-of-experts "
                                 "form is qwen3_5_moe_text)")
        return {}
    out = {k: get(k, int, default=0) for k in _EXPERT_KEYS}
    if base == "qwen3_next":
        only = d.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ModelLoadError(f"config.json key 'mlp_only_layers' must be a list of layer "
                                 f"indices, got {only!r}")
        out.update(norm_topk_prob=get("norm_topk_prob", bool, default=True),
                   decoder_sparse_step=get("decoder_sparse_step", int, default=1),
                   mlp_only_layers=tuple(only))
    return out


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
