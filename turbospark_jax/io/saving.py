"""Save model folders in the Hugging Face layout, the layout :mod:`~turbospark_jax.io.loading`
reads.

The folder written is the one the loader and ``transformers`` both read: ``config.json``, the
weights in ``safetensors`` (one file, or shards with their index), ``generation_config.json``
and the tokenizer files; quantized weights go in a published layout (see
:mod:`~turbospark_jax.io.quantized`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from turbospark_jax.core.checks import as_int
from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.io import loading
from turbospark_jax.io import quantized as stored_quantization
from turbospark_jax.io.loading import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    PROCESSOR_CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    GenerationConfig,
    _is_shape,
    _node,
)
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.io.vision import VisionEncoder
from turbospark_jax.models.family import Params
from turbospark_jax.models.gemma4 import vision as gemma4_vision
from turbospark_jax.models.registry import family_of_config
from turbospark_jax.quant.weights import is_quantized

#: Default shard limit for :func:`save_folder` (transformers' historical default).
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def save_folder(
    path: str | os.PathLike[str],
    config: Any,
    params: Params,
    tokenizer: Tokenizer | None = None,
    generation_config: GenerationConfig | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    vision: VisionEncoder | None = None,
) -> None:
    """Write a Hugging Face folder that :func:`~turbospark_jax.io.loading.load_folder` and
    ``transformers`` both load.

    Writes ``config.json`` (with ``architectures``, and ``dtype`` set to the params' dtype),
    the weights in the params' dtype as ``model.safetensors`` or, past ``max_shard_bytes``,
    as ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``,
    ``generation_config.json`` (given, or derived from ``config``) and the tokenizer files.
    Weight files already in the folder are removed first so no stale shard survives.
    Quantized weights (:class:`~turbospark_jax.quant.weights.QuantizedWeight` leaves) are
    written in a published layout with its ``quantization_config``: block-wise fp8 in the
    ``fp8`` layout, the rest in compressed-tensors' (see
    :func:`~turbospark_jax.io.quantized.write_quantized`).

    Args:
      path: the destination folder (created if needed).
      config: the model config (its ``model_type`` picks the family).
      params: the params tree, in either layer layout the family has (see
        :mod:`turbospark_jax.models.dense.model`).
      tokenizer: written alongside when given.
      generation_config: written as ``generation_config.json``; derived when ``None``.
      max_shard_bytes: the most tensor bytes in one file (a larger tensor gets a file alone).
      vision: a vision tower to save beside a ``gemma4`` text model (its config goes into
        ``vision_config``, its budget into ``processor_config.json``).

    Raises:
      ModelLoadError: no family saves ``config.model_type``, or the params do not have the
        shapes ``config`` implies.
      BadInputError: an argument of the wrong type (a config that is no family's, a
        tokenizer that is not ours, ``max_shard_bytes`` below 1).
    """
    if not isinstance(path, str | os.PathLike):
        raise BadInputError(f"path must be a folder path (str or os.PathLike), got {path!r}")
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise BadInputError(
            f"tokenizer must be a turbospark_jax.io.tokenizer.Tokenizer, got "
            f"{type(tokenizer).__name__}"
        )
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise BadInputError(
            f"generation_config must be a GenerationConfig, got "
            f"{type(generation_config).__name__}"
        )
    max_shard_bytes = as_int("max_shard_bytes", max_shard_bytes, low=1)
    family_of_config(config)  # a config of some family, not a dict
    # Looked up through the loader, so that saving and loading always agree on the family.
    family = loading.family_of(config.model_type)
    folder = os.fspath(path)
    os.makedirs(folder, exist_ok=True)
    shapes = family.param_shapes(config)
    tensors = family.hf_tensors(config)
    if family.to_layer_layout is not None:
        params = family.to_layer_layout(params, family.native_layout)
    if family.split_params is not None:  # Qwen3.5's joined DeltaNet projections, parted
        params = family.split_params(config, params)
    expected = jax.tree.leaves(shapes, is_leaf=_is_shape)
    checked = params
    table = params.get("embed_tokens") if isinstance(params, Mapping) else None
    if is_quantized(table):  # kept as the tied head's [D, V] matrix; the file's is [V, D]
        checked = dict(params, embed_tokens=jax.ShapeDtypeStruct((table.n, table.k),
                                                                 table.dtype))
    got = jax.tree.leaves(jax.tree.map(lambda a: tuple(a.shape), checked,
                                       is_leaf=is_quantized), is_leaf=_is_shape)
    if jax.tree.structure(shapes, is_leaf=_is_shape) != jax.tree.structure(
        jax.tree.map(lambda a: 0, checked, is_leaf=is_quantized)
    ) or list(map(tuple, expected)) != got:
        raise ModelLoadError("params do not match the layout the config implies")
    host = jax.tree.map(np.asarray, params)
    if vision is not None and (not isinstance(vision, VisionEncoder)
                               or config.model_type != "gemma4"):
        raise BadInputError("vision must be a VisionEncoder, saved beside a config of "
                            "model_type 'gemma4'")

    hf: dict[str, np.ndarray] = {}
    quantized, plain_linear = {}, []
    for t in tensors:
        leaf = _node(host, t.key)
        leaf = leaf if t.stacked is None else leaf[t.stacked]
        if is_quantized(leaf):
            quantized[t.name] = leaf.matrix()
            continue
        if t.linear:
            plain_linear.append(t.name)
        hf[t.name] = t.to_hf(leaf)
    if vision is not None:
        vision_host = jax.tree.map(np.asarray, vision.params)
        for t in gemma4_vision.hf_tensors(vision.tower.config):
            leaf = _node(vision_host, t.key)
            hf[t.name] = t.to_hf(leaf if t.stacked is None else leaf[t.stacked])
    first = quantized.get(tensors[0].name)
    dtype_name = np.dtype(hf[tensors[0].name].dtype if first is None else first.dtype).name
    quantization_config = None
    if quantized:
        written, quantization_config = stored_quantization.write_quantized(quantized,
                                                                           plain_linear)
        hf.update(written)

    for name in os.listdir(folder):
        if name == WEIGHTS_INDEX_FILE or (name.startswith("model") and
                                          name.endswith(".safetensors")):
            os.remove(os.path.join(folder, name))
    shards: list[list[str]] = [[]]
    size = 0
    for name, array in hf.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += array.nbytes
    metadata = {"format": "pt"}  # transformers expects the torch layout tag
    if len(shards) == 1:
        save_file(hf, os.path.join(folder, WEIGHTS_FILE), metadata=metadata)
    else:
        weight_map: dict[str, str] = {}
        for i, names in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: hf[n] for n in names}, os.path.join(folder, file), metadata=metadata)
            weight_map.update(dict.fromkeys(names, file))
        index = {
            "metadata": {"total_size": int(sum(a.nbytes for a in hf.values()))},
            "weight_map": weight_map,
        }
        _write_json(os.path.join(folder, WEIGHTS_INDEX_FILE), index)

    config_dict = config.to_hf_dict()
    config_dict["dtype"] = dtype_name
    if quantization_config is not None:
        config_dict["quantization_config"] = quantization_config
    if vision is not None:
        config_dict["vision_config"] = vision.tower.config.to_hf_dict()
        config_dict.update(image_token_id=vision.tokens.image, boi_token_id=vision.tokens.begin,
                           eoi_token_id=vision.tokens.end)
        _write_json(os.path.join(folder, PROCESSOR_CONFIG_FILE),
                    {"image_processor": {"max_soft_tokens": vision.max_soft_tokens}})
    _write_json(os.path.join(folder, CONFIG_FILE), config_dict)
    generation = generation_config or GenerationConfig.from_model_config(config)
    _write_json(os.path.join(folder, GENERATION_CONFIG_FILE), generation.to_hf_dict())
    if tokenizer is not None:
        tokenizer.save(folder)


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
