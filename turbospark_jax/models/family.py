"""What a model family declares so that a Hugging Face folder can be loaded into it.

Each family module (``dense.py``, ...) builds one :class:`Family` value naming the
``model_type`` values it serves, how to parse their ``config.json``, the shape of its params
tree, where each Hugging Face tensor goes in that tree, and how to build the runnable model.
``turbospark_jax.loading`` is generic over this declaration; ``registry.py`` lists the
families.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from turbospark_jax.models.base import BlockModel

Params = dict[str, Any]


def eos_ids(eos_token_id: int | tuple[int, ...] | list[int] | None) -> tuple[int, ...]:
    """A config's ``eos_token_id`` (one id, several, or none) as a tuple of ids."""
    if eos_token_id is None:
        return ()
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)


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
        holds this tensor alone.
    """

    name: str
    key: tuple[str | int, ...]
    hf_shape: tuple[int, ...]
    transpose: bool = False
    stacked: int | None = None

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

    @property
    def native_layout(self) -> str:
        """The layer layout :attr:`param_shapes` and :attr:`hf_tensors` describe."""
        return "list" if self.list_layout_only else "stacked"
