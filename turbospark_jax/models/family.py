"""What a model family declares so that a Hugging Face folder can be loaded into it.

Each family module (``dense.py``, ...) builds one :class:`Family` value naming the
``model_type`` values it serves, how to parse their ``config.json``, the shape of its params
tree, where each Hugging Face tensor goes in that tree, and how to build the runnable model.
``turbospark_jax.io.loading`` is generic over this declaration; ``registry.py`` lists the
families. The readings of ``config.json`` that several families' configs share are here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from turbospark_jax.errors import ModelLoadError
from turbospark_jax.models.base import BlockModel

Params = dict[str, Any]


def eos_ids(eos_token_id: int | tuple[int, ...] | list[int] | None) -> tuple[int, ...]:
    """A config's ``eos_token_id`` (one id, several, or none) as a tuple of ids."""
    if eos_token_id is None:
        return ()
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)


def eos_to_json(eos_token_id: int | tuple[int, ...] | None) -> int | list[int] | None:
    """A config's ``eos_token_id`` as ``config.json`` writes it (several ids as a list)."""
    return list(eos_token_id) if isinstance(eos_token_id, tuple) else eos_token_id


def hf_model_type(d: Any) -> Any:
    """The ``model_type`` a ``config.json`` dict names (``None`` when it names none).

    Raises:
      ModelLoadError: ``d`` is not a JSON object.
    """
    if not isinstance(d, Mapping):
        raise ModelLoadError(f"config.json must hold a JSON object, got {type(d).__name__}")
    return d.get("model_type")


def text_config(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text decoder's keys of a multimodal ``config.json``: its ``text_config`` (left out
    or null: no keys).

    Raises:
      ModelLoadError: ``text_config`` is not an object.
    """
    text = d.get("text_config") or {}
    if not isinstance(text, Mapping):
        raise ModelLoadError(f"config.json key 'text_config' must be an object, got {text!r}")
    return text


def typed_value(key: str, value: Any, kind: type) -> Any:
    """``value``, read from ``config.json`` key ``key``, as ``kind`` (``int``, ``float``,
    ``bool`` or ``str``); ``true`` and ``false`` count as bools only.

    Raises:
      ModelLoadError: naming the key, when ``value`` is not of ``kind``.
    """
    ok = {int: isinstance(value, int), float: isinstance(value, int | float),
          bool: isinstance(value, bool), str: isinstance(value, str)}[kind]
    if not ok or (kind is not bool and isinstance(value, bool)):
        raise ModelLoadError(f"config.json key {key!r} must be {kind.__name__}, got {value!r}")
    return kind(value)


def token_ids(text: Mapping[str, Any], outer: Mapping[str, Any],
              defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``bos_token_id``, ``eos_token_id`` and ``pad_token_id``, each from ``outer`` where it
    has the key, else from ``text``, else from ``defaults``; a list of ids becomes a tuple.

    Raises:
      ModelLoadError: naming the key, for a value that is not an integer, null or a list of
        those.
    """
    tokens = {k: (outer if k in outer else text).get(k, defaults[k])
              for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for key, value in tokens.items():
        ids = value if isinstance(value, list) else [value]
        if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in ids):
            raise ModelLoadError(f"config.json key {key!r} must be an integer, got {value!r}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in tokens.items()}


def checkpoint_dtype(d: Mapping[str, Any], outer: Mapping[str, Any] | None = None) -> str | None:
    """The checkpoint dtype a ``config.json`` names (``dtype``, or the older ``torch_dtype``;
    an outer multimodal config's ``dtype`` first), or ``None`` when it names none."""
    dtype = (outer or {}).get("dtype", d.get("dtype", d.get("torch_dtype")))
    return str(dtype) if dtype is not None else None


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One Hugging Face tensor and the params leaf it fills.

    Fields:
      name: its name in the safetensors files (``model.layers.0.self_attn.q_proj.weight``).
      key: the path to the leaf in our params tree; ``int`` entries index lists (a family
        whose layers are a list of per-layer dicts puts the layer index here).
      hf_shape: its shape in the file.
      transpose: Hugging Face keeps ``nn.Linear`` weights as ``[out, in]``; we keep
        ``[in, out]`` (then reshape to the leaf's shape).
      stacked: the index on a stacked leading layer axis of the leaf, ``None`` when the leaf
        holds this tensor alone; a tuple indexes several leading axes (one expert of a
        stacked layer's expert stack: ``(layer, expert)``).
    """

    name: str
    key: tuple[str | int, ...]
    hf_shape: tuple[int, ...]
    transpose: bool = False
    stacked: int | tuple[int, ...] | None = None

    @property
    def linear(self) -> bool:
        """Whether it is an ``nn.Linear`` weight (``[out, in]`` in the file): a matrix a
        quantized model stores quantized."""
        return self.transpose and len(self.hf_shape) == 2

    def to_ours(self, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The file's array as our leaf (or one slice of a stacked leaf) of ``shape``."""
        return (array.T if self.transpose else array).reshape(shape)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        """Our leaf (or slice) as the file's array."""
        flat = array.reshape(self.hf_shape[::-1] if self.transpose else self.hf_shape)
        return np.ascontiguousarray(flat.T if self.transpose else flat)


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family's declaration (see the module docstring).

    Fields:
      name: the family's name, for messages.
      architectures: ``model_type`` -> the Hugging Face class name a saved folder names.
      parse_config: ``config.json`` dict -> the family's frozen config; raises
        ``ModelLoadError`` naming what is wrong. The config has ``model_type``,
        ``vocab_size``, ``max_position_embeddings``, ``eos_token_ids``, ``bos_token_id``,
        ``pad_token_id``, ``dtype`` (the name config.json gives, or ``None``) and
        ``to_hf_dict()``.
      param_shapes: config -> params tree with a shape tuple at every leaf.
      hf_tensors: config -> every tensor a folder must hold, in the order a saved folder
        writes them.
      build: ``(config, dtype, layer_layout)`` -> the runnable :class:`BlockModel`;
        ``layer_layout`` is ``"stacked"`` or ``"list"``.
      tolerated: names of extra tensors a folder may carry that the family ignores
        (recomputed rotary buffers, heads it does not run).
      tied_copies: config -> ``{extra tensor: the tensor it copies}``: copies of tied weights
        a folder may carry (a tied model that saved its head anyway). The loader accepts one
        only when it is bitwise equal to the tensor it copies: which of two different
        tensors the author meant is not ours to guess.
      list_layout_only: the family's params have per-layer dicts in a list already (mixed
        layer kinds); ``load_folder``'s ``layer_layout`` must then be ``"list"``.
      to_layer_layout: ``(params, layer_layout)`` -> the params (in either layout) in that
        layout. ``None`` for a family whose params have only the layout
        :attr:`param_shapes` describes (``"list"`` when :attr:`list_layout_only`, else
        ``"stacked"``).
      config_type: the class :attr:`parse_config` returns (how ``save_folder`` tells a
        config of this family from anything else).
      join_params: ``(config, params)`` -> the params as the model runs them, from the
        layout :attr:`param_shapes` describes (a family that stores matrices read by the
        same rows side by side joins them here; ``load_folder`` calls it after quantizing, so
        quantized matrices stay apart). ``None``:
        the model runs that layout.
      split_params: :attr:`join_params` undone (saving and a tensor-parallel mesh lay out
        the folder's tensors); ``None`` where :attr:`join_params` is.
    """

    name: str
    architectures: Mapping[str, str]
    parse_config: Callable[[Mapping[str, Any]], Any]
    param_shapes: Callable[[Any], Params]
    hf_tensors: Callable[[Any], list[HFTensor]]
    build: Callable[[Any, Any, str], BlockModel]
    tolerated: Callable[[str], bool] = lambda name: False
    tied_copies: Callable[[Any], Mapping[str, str]] = lambda config: {}
    list_layout_only: bool = False
    to_layer_layout: Callable[[Params, str], Params] | None = None
    config_type: type = object
    join_params: Callable[[Any, Params], Params] | None = None
    split_params: Callable[[Any, Params], Params] | None = None

    @property
    def native_layout(self) -> str:
        """The layer layout :attr:`param_shapes` and :attr:`hf_tensors` describe."""
        return "list" if self.list_layout_only else "stacked"
