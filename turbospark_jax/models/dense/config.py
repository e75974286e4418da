"""The dense family's config: :class:`DenseConfig`, parsed from and written back to a Hugging
Face ``config.json``.

One pre-norm decoder covers four model types; they differ only in small switches that
:class:`DenseConfig` derives from ``config.json``:

=========  ==========================  ===================  ==========================
family     attention biases            q/k RMSNorm (head)   sliding window
=========  ==========================  ===================  ==========================
llama      q,k,v,o if attention_bias   no                   never
mistral    none                        no                   every layer if set
qwen2      q,k,v always, o never       no                   layers marked sliding
qwen3      q,k,v,o if attention_bias   yes, before RoPE     layers marked sliding
qwen3_moe  q,k,v,o if attention_bias   yes, before RoPE     every layer if enabled
=========  ==========================  ===================  ==========================

``qwen3_moe`` replaces every layer's MLP by a sparse mixture of experts
(:mod:`~turbospark_jax.models.moe`): ``num_experts`` experts of width
``moe_intermediate_size``, ``num_experts_per_tok`` of them per token, picked by a softmax top-k
router, renormalised when ``norm_topk_prob``. Its layers are stacked like the others', so they
must all be alike: a config whose ``decoder_sparse_step`` or ``mlp_only_layers`` leaves some
layers dense is refused.

A key that ``config.json`` leaves out takes the value Hugging Face's config class for that
``model_type`` gives it, so a sparse file means the same model here as there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from turbospark_jax.errors import ModelLoadError
from turbospark_jax.kernels.layers import SUPPORTED_ROPE_TYPES, RopeScaling
from turbospark_jax.models import moe
from turbospark_jax.models.family import checkpoint_dtype, eos_ids, eos_to_json, hf_model_type
from turbospark_jax.models.moe import Routing

#: ``model_type`` values this module implements, with the HF class each saves as.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(ARCHITECTURES)

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)

# Values Hugging Face's config classes use when config.json leaves a key out, per family, so a
# sparse config.json means the same model here as there.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8,
                "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32,
              "sliding_window": 4096},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32,
              "sliding_window": 4096, "head_dim": 128},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4,
                  "sliding_window": 4096, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1},
}

_FULL, _SLIDING = "full_attention", "sliding_attention"

@dataclasses.dataclass(frozen=True)
class DenseConfig:
    """A dense decoder's hyperparameters; field names are the Hugging Face ``config.json`` keys.

    Frozen and hashable: it is static under ``jit``. Build one from a ``config.json`` dict with
    :meth:`from_hf_dict`; :meth:`to_hf_dict` writes one back.

    Attributes beyond the obvious HF ones:
      head_dim: per-head width; may differ from ``hidden_size // num_attention_heads``.
      rope_scaling: ``None`` for plain RoPE, else the parsed scaling.
      sliding_window: the window of layers marked sliding, ``None`` when no layer slides
        (Qwen's ``use_sliding_window: false`` lands here as ``None``).
      layer_types: ``"full_attention"`` / ``"sliding_attention"`` per layer; filled in from
        the family's rule when left empty.
      max_window_layers: Qwen's first sliding layer, kept so the config round-trips.
      eos_token_id: an int, a tuple of ints, or ``None``.
      dtype: the checkpoint dtype named in config.json (``"bfloat16"``...), if any.
      num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob: a
        ``qwen3_moe`` model's experts, experts per token, expert width and whether the
        chosen probabilities are renormalised (``num_experts == 0``: no experts).
      decoder_sparse_step, mlp_only_layers: which layers are sparse, kept so the config
        round-trips (every layer must be, see the module docstring).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    max_window_layers: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    dtype: str | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        derived_head_dim = self.head_dim is None
        if derived_head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.model_type in ("qwen2", "qwen3") and self.max_window_layers is None:
            object.__setattr__(self, "max_window_layers", 28)  # the HF default, for round trips
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if not self.layer_types:
            slides = self.sliding_window is not None and self.model_type in ("mistral",
                                                                             "qwen3_moe")
            object.__setattr__(
                self, "layer_types", (_SLIDING if slides else _FULL,) * self.num_hidden_layers
            )
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self._check(derived_head_dim)

    def _check(self, derived_head_dim: bool) -> None:
        def bad(msg: str) -> ModelLoadError:
            return ModelLoadError(f"invalid {self.model_type} config: {msg}")

        if self.model_type not in ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported model_type {self.model_type!r}; the dense family supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (*_REQUIRED_KEYS, "num_key_value_heads"):
            if getattr(self, name) <= 0:
                raise bad(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        # Without head_dim the heads split hidden_size; a remainder would leave q/k/v
        # narrower than the hidden state, which transformers refuses too.
        if derived_head_dim and self.hidden_size % self.num_attention_heads:
            raise bad(
                f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_attention_heads}) and no head_dim is given"
            )
        if self.head_dim <= 0:
            raise bad(f"head_dim must be positive, got {self.head_dim}")
        if self.head_dim % 2:
            raise bad(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise bad(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - {_FULL, _SLIDING}
        if unknown:
            raise bad(f"unsupported layer_types {sorted(unknown)}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise bad(f"sliding_window must be positive, got {self.sliding_window}")
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in (
            SUPPORTED_ROPE_TYPES
        ):
            raise bad(
                f"unsupported rope_type {self.rope_scaling.rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        self._check_experts(bad)

    def _check_experts(self, bad: Callable[[str], ModelLoadError]) -> None:
        if self.model_type != "qwen3_moe":
            if self.num_experts:
                raise bad("num_experts is a qwen3_moe key; this model_type has no experts")
            return
        if self.num_experts < 0:
            raise bad(f"num_experts must be >= 0, got {self.num_experts}")
        if self.decoder_sparse_step <= 0:
            raise bad(f"decoder_sparse_step must be positive, got {self.decoder_sparse_step}")
        sparse = self.sparse_layers
        if any(sparse) and not all(sparse):
            raise bad(
                f"layers {[i for i, s in enumerate(sparse) if not s]} are dense and the others "
                f"sparse (decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers="
                f"{list(self.mlp_only_layers)}); the dense family stacks its layers, so they "
                "must all be sparse or all dense"
            )
        if self.moe:
            if self.moe_intermediate_size <= 0:
                raise bad(f"moe_intermediate_size must be positive, got "
                          f"{self.moe_intermediate_size}")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise bad(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                          f"got {self.num_experts_per_tok}")

    # -- derived switches -----------------------------------------------------------------

    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v projections carry a bias (always for qwen2)."""
        if self.model_type == "qwen2":
            return True
        return self.attention_bias and self.model_type in ("llama", "qwen3", "qwen3_moe")

    @property
    def o_bias(self) -> bool:
        """Whether the output projection carries a bias (never for qwen2 and mistral)."""
        return self.attention_bias and self.model_type in ("llama", "qwen3", "qwen3_moe")

    @property
    def has_mlp_bias(self) -> bool:
        """Whether the MLP projections carry biases (a llama-only option)."""
        return self.mlp_bias and self.model_type == "llama"

    @property
    def qk_norm(self) -> bool:
        """Whether q and k get a per-head RMSNorm before RoPE (qwen3, qwen3_moe)."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is a mixture of experts (transformers' rule)."""
        return moe.sparse_layers(self.num_experts, self.mlp_only_layers,
                                 self.decoder_sparse_step, self.num_hidden_layers)

    @property
    def moe(self) -> bool:
        """Whether the layers' MLPs are mixtures of experts (all of them; see the module
        docstring)."""
        return self.model_type == "qwen3_moe" and all(self.sparse_layers)

    @property
    def routing(self) -> Routing:
        """The router's rule (a ``qwen3_moe`` model with experts only)."""
        return Routing(self.num_experts, self.num_experts_per_tok, self.norm_topk_prob)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The sliding window of each layer, ``None`` where the layer attends to everything."""
        return tuple(
            self.sliding_window if t == _SLIDING and self.sliding_window is not None else None
            for t in self.layer_types
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple (empty when unset)."""
        return eos_ids(self.eos_token_id)

    # -- config.json ------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> DenseConfig:
        """Parse a Hugging Face ``config.json`` dict.

        Accepts both rope layouts: transformers 5.x ``rope_parameters`` (holding
        ``rope_theta`` and the scaling keys) and the older top-level ``rope_theta`` plus a
        ``rope_scaling`` dict keyed ``rope_type`` or ``type``. Keys left out take the values
        Hugging Face's config class for that ``model_type`` would give them.

        Args:
          d: the parsed ``config.json``.

        Returns:
          The config.

        Raises:
          ModelLoadError: an unsupported ``model_type`` (the message lists the supported
            ones), a missing required key, a value of the wrong type, an unsupported RoPE
            variant or activation, or inconsistent head counts.
        """
        model_type = hf_model_type(d)
        if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}; the dense family supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in _REQUIRED_KEYS if d.get(k) is None]
        if missing:
            raise ModelLoadError(f"config.json is missing required key(s): {', '.join(missing)}")
        defaults = _HF_DEFAULTS[model_type]

        def get(key: str, kind: Callable[[Any], Any], default: Any = None) -> Any:
            value = d.get(key, defaults.get(key, default))
            if value is None:
                return None
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ModelLoadError(f"config.json key {key!r} must be an integer, got {value!r}")
            if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ModelLoadError(f"config.json key {key!r} must be a number, got {value!r}")
            if kind is bool and not isinstance(value, bool):
                raise ModelLoadError(f"config.json key {key!r} must be true/false, got {value!r}")
            return kind(value)

        layers = get("num_hidden_layers", int)
        if model_type == "mistral":
            window = get("sliding_window", int)
            layer_types: tuple[str, ...] = ()
        elif model_type in ("qwen2", "qwen3"):
            use_window = get("use_sliding_window", bool, False)
            window = get("sliding_window", int) if use_window else None
            raw_types = d.get("layer_types")
            max_window_layers = get("max_window_layers", int, 28)
            if raw_types is not None:
                if not isinstance(raw_types, list):
                    raise ModelLoadError(f"config.json key 'layer_types' must be a list, got "
                                         f"{raw_types!r}")
                layer_types = tuple(str(t) for t in raw_types)
            else:
                layer_types = tuple(
                    _SLIDING if window is not None and i >= max_window_layers else _FULL
                    for i in range(layers)
                )
        elif model_type == "qwen3_moe":
            use_window = get("use_sliding_window", bool, False)
            window = get("sliding_window", int) if use_window else None
            layer_types = ()
        else:
            window, layer_types = None, ()
        experts = _parse_experts(d, get) if model_type == "qwen3_moe" else {}

        theta, scaling = _parse_rope(d, get("max_position_embeddings", int))
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            if not all(isinstance(e, int) for e in eos):
                raise ModelLoadError(f"config.json key 'eos_token_id' must hold integers: {eos!r}")
            eos = tuple(eos)
        elif eos is not None and not isinstance(eos, int):
            raise ModelLoadError(f"config.json key 'eos_token_id' must be an integer, got {eos!r}")
        return cls(
            model_type=model_type,
            vocab_size=get("vocab_size", int),
            hidden_size=get("hidden_size", int),
            intermediate_size=get("intermediate_size", int),
            num_hidden_layers=layers,
            num_attention_heads=get("num_attention_heads", int),
            num_key_value_heads=get("num_key_value_heads", int),
            head_dim=get("head_dim", int),
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=get("max_position_embeddings", int),
            tie_word_embeddings=get("tie_word_embeddings", bool, False),
            attention_bias=get("attention_bias", bool, False),
            mlp_bias=get("mlp_bias", bool, False),
            hidden_act=str(d.get("hidden_act", "silu")),
            sliding_window=window,
            layer_types=layer_types,
            max_window_layers=(
                get("max_window_layers", int, 28) if model_type in ("qwen2", "qwen3") else None
            ),
            bos_token_id=get("bos_token_id", int),
            eos_token_id=eos,
            pad_token_id=get("pad_token_id", int),
            initializer_range=get("initializer_range", float, 0.02),
            dtype=checkpoint_dtype(d),
            **experts,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers (5.x and 4.x) and :meth:`from_hf_dict` read
        back as this config. Rope settings go in 5.x ``rope_parameters``; ``rope_theta`` and
        ``rope_scaling`` are repeated at the top level for older readers."""
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling.to_hf_dict())
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": rope,
            "rope_theta": self.rope_theta,
            "rope_scaling": (
                self.rope_scaling.to_hf_dict() if self.rope_scaling is not None else None
            ),
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos_to_json(self.eos_token_id),
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type in ("llama", "qwen3", "qwen3_moe"):
            out["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = self.sliding_window is not None
            out["sliding_window"] = self.sliding_window
            out["max_window_layers"] = self.max_window_layers
            out["layer_types"] = list(self.layer_types)
        if self.model_type == "qwen3_moe":
            out.update(use_sliding_window=self.sliding_window is not None,
                       sliding_window=self.sliding_window, num_experts=self.num_experts,
                       num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step,
                       mlp_only_layers=list(self.mlp_only_layers))
        if self.dtype is not None:
            out["dtype"] = self.dtype
        return out


def _parse_experts(d: Mapping[str, Any], get: Callable) -> dict[str, Any]:
    """A ``qwen3_moe`` config's expert keys. transformers 5 writes ``num_experts`` as
    ``num_local_experts``; either name is read, and both must agree when both are given."""
    if "num_experts" in d and "num_local_experts" in d and (
            d["num_experts"] != d["num_local_experts"]):
        raise ModelLoadError(f"config.json keys 'num_experts' ({d['num_experts']!r}) and "
                             f"'num_local_experts' ({d['num_local_experts']!r}) disagree")
    key = "num_local_experts" if "num_local_experts" in d else "num_experts"
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ModelLoadError(f"config.json key 'mlp_only_layers' must be a list of layer "
                             f"indices, got {only!r}")
    return dict(
        num_experts=get(key, int),
        num_experts_per_tok=get("num_experts_per_tok", int),
        moe_intermediate_size=get("moe_intermediate_size", int),
        norm_topk_prob=get("norm_topk_prob", bool),
        decoder_sparse_step=get("decoder_sparse_step", int),
        mlp_only_layers=tuple(only),
    )


def _parse_rope(d: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    # transformers prefers a legacy `rope_scaling` dict over `rope_parameters` when both exist.
    source = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(source, Mapping):
        raise ModelLoadError(f"config.json rope settings must be an object, got {source!r}")
    if source and all(isinstance(v, Mapping) for v in source.values()):
        raise ModelLoadError(
            "per-layer-type rope_parameters are not supported by the dense family"
        )
    theta = source.get("rope_theta", d.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise ModelLoadError(f"config.json rope_theta must be a number, got {theta!r}")
    partial = source.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"partial_rotary_factor {partial!r} is not supported (only 1.0)")
    kind = source.get("rope_type", source.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                "yarn": ()}[kind]
    absent = [k for k in required if source.get(k) is None]
    if absent:
        raise ModelLoadError(f"rope_type {kind!r} needs {', '.join(absent)} in config.json")

    def number(key: str) -> float | None:
        value = source.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelLoadError(f"rope setting {key!r} must be a number, got {value!r}")
        return float(value)

    original = source.get("original_max_position_embeddings")
    if original is None and kind in ("llama3", "yarn"):
        original = d.get("original_max_position_embeddings", max_positions)
    if original is not None and (isinstance(original, bool) or not isinstance(original, int)):
        raise ModelLoadError(
            f"rope setting 'original_max_position_embeddings' must be an integer, got "
            f"{original!r}"
        )
    truncate = source.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ModelLoadError(f"rope setting 'truncate' must be true/false, got {truncate!r}")
    scaling = RopeScaling(
        rope_type=kind,
        factor=number("factor"),
        low_freq_factor=number("low_freq_factor"),
        high_freq_factor=number("high_freq_factor"),
        original_max_position_embeddings=original,
        beta_fast=number("beta_fast"),
        beta_slow=number("beta_slow"),
        attention_factor=number("attention_factor"),
        mscale=number("mscale"),
        mscale_all_dim=number("mscale_all_dim"),
        truncate=bool(source.get("truncate", True)),
    )
    return float(theta), scaling


