"""Save and load drafter folders: block drafters (this project's own layout) and Gemma 4
assistants (the Hugging Face layout).

A drafter folder holds ``config.json`` and its weights in ``safetensors``; the files are read
with the model loader's helpers (:mod:`~turbospark_jax.io.loading`), so a drafter folder is
checked and refused the way a model folder is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.io.loading import (
    _DTYPES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    _check_dtype_argument,
    _header_shape,
    _is_shape,
    _iter_tensors,
    _node,
    _read_json,
    _weight_files,
)
from turbospark_jax.io.saving import _write_json
from turbospark_jax.models import block_drafter
from turbospark_jax.models.family import Params
from turbospark_jax.models.gemma4 import assistant as gemma4_assistant


def save_block_drafter(path: str | os.PathLike[str], config: block_drafter.BlockDrafterConfig,
                       params: Params) -> None:
    """Write a block drafter folder: ``config.json`` (``model_type``
    :data:`~turbospark_jax.models.block_drafter.MODEL_TYPE`, ``dtype`` the params') and
    ``model.safetensors`` with one tensor per params leaf, named by its dotted path.

    Raises:
      BadInputError: ``config`` is not a block drafter config, or ``path`` not a path.
      ModelLoadError: the params do not have the shapes ``config`` implies.
    """
    if not isinstance(path, str | os.PathLike):
        raise BadInputError(f"path must be a folder path (str or os.PathLike), got {path!r}")
    if not isinstance(config, block_drafter.BlockDrafterConfig):
        raise BadInputError(f"config must be a BlockDrafterConfig, got {type(config).__name__}")
    tensors = {k: np.asarray(v) for k, v in block_drafter.flat_tensors(params).items()}
    block_drafter.unflatten_tensors(config, tensors)  # refuses a params tree of other shapes
    folder = os.fspath(path)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "np"})
    config_dict = config.to_hf_dict()
    config_dict["dtype"] = np.dtype(next(iter(tensors.values())).dtype).name
    _write_json(os.path.join(folder, CONFIG_FILE), config_dict)


def _drafter_folder(path: Any, dtype: Any, what: str) -> tuple[str, Any, jnp.dtype]:
    """A drafter folder's checks before any tensor is read: ``(folder, its config.json,
    the dtype to load in)`` (``dtype``, else the folder's ``dtype``, else float32)."""
    if not isinstance(path, str | os.PathLike):
        raise BadInputError(f"path must be a folder path (str or os.PathLike), got {path!r}")
    _check_dtype_argument(dtype)
    folder = os.fspath(path)
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"no {CONFIG_FILE} in {folder} (is it a {what} folder?)")
    raw = _read_json(config_path, f"{what} config")
    if dtype is None:
        dtype = raw.get("dtype") if isinstance(raw, Mapping) and raw.get("dtype") in _DTYPES \
            else "float32"
    return folder, raw, jnp.dtype(_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype)


def load_block_drafter(
    path: str | os.PathLike[str], dtype: Any = None
) -> tuple[block_drafter.BlockDrafterConfig, Params]:
    """Read a folder :func:`save_block_drafter` wrote.

    Args:
      path: the folder.
      dtype: as :func:`~turbospark_jax.io.loading.load_folder`'s (default: the folder's
        ``dtype``, else float32).

    Returns:
      ``(config, params)``, for :class:`~turbospark_jax.speculative.drafters.block.BlockDrafter`.

    Raises:
      BadInputError: ``path`` or ``dtype`` of the wrong kind.
      ModelLoadError: a missing folder or file, a ``config.json`` of another model type or
        with a bad value, a tensor missing, unexpected or of the wrong shape (each named).
    """
    folder, raw, resolved = _drafter_folder(path, dtype, "block drafter")
    config = block_drafter.BlockDrafterConfig.from_hf_dict(raw)
    weight_map = _weight_files(folder)
    host: dict[str, np.ndarray] = {}
    for name, handle, file in _iter_tensors(folder, weight_map):
        try:
            host[name] = handle.get_tensor(name).astype(np.dtype(resolved))
        except Exception as e:
            raise ModelLoadError(f"could not read tensor {name} from {file}: {e}") from e
    params = block_drafter.unflatten_tensors(config, host)
    return config, jax.tree.map(jnp.asarray, params)


def load_assistant(path: str | os.PathLike[str], dtype: Any = None) -> tuple[Any, Params]:
    """Read a Gemma 4 assistant folder (``model_type`` ``gemma4_assistant``, the Hugging Face
    layout), for
    :class:`~turbospark_jax.speculative.drafters.gemma4_assistant.Gemma4AssistantDrafter`.

    Args:
      path: the folder.
      dtype: as :func:`~turbospark_jax.io.loading.load_folder`'s (default: the folder's
        ``dtype``, else float32); the token ordering of ordered embeddings stays int32.

    Returns:
      ``(config, params)``: an :class:`~turbospark_jax.models.gemma4.assistant.AssistantConfig`
      and its params tree.

    Raises:
      BadInputError: ``path`` or ``dtype`` of the wrong kind.
      ModelLoadError: a missing folder or file, a config of another model type or with a bad
        value, a tensor missing or of the wrong shape (each named).
    """
    folder, raw, dtype = _drafter_folder(path, dtype, "assistant")
    config = gemma4_assistant.AssistantConfig.from_hf_dict(raw)
    resolved = np.dtype(dtype)
    tensors = {t.name: t for t in gemma4_assistant.hf_tensors(config)}
    shapes = gemma4_assistant.param_shapes(config)
    weight_map = _weight_files(folder)
    missing = sorted(set(tensors) - set(weight_map))
    if missing:
        raise ModelLoadError(f"tensor {missing[0]} is missing from {folder}")
    params: Params = jax.tree.map(lambda s: None, shapes, is_leaf=_is_shape)
    for name, handle, file in _iter_tensors(folder, weight_map):
        t = tensors.get(name)
        if t is None:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # a tied head's saved copy: the tied embedding is what runs
            raise ModelLoadError(f"unexpected tensor {name} in {file}")
        got = _header_shape(handle, name, file)
        if got != t.hf_shape:
            raise ModelLoadError(
                f"tensor {name} in {file} has shape {list(got)}, expected {list(t.hf_shape)}")
        array = t.to_ours(handle.get_tensor(name), _node(shapes, t.key))
        kind = np.int32 if np.issubdtype(array.dtype, np.integer) else resolved
        _node(params, t.key[:-1])[t.key[-1]] = jnp.asarray(array.astype(kind, copy=False))
    return config, params
