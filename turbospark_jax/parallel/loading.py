"""Load a model folder (dense, Qwen3.5 with its MTP head, Gemma 4) straight into its
tensor-parallel shards.

:func:`~turbospark_jax.io.loading.load_folder` reads every tensor into host memory and then
places the whole tree on one device; a model larger than one device cannot go that way. Here
each params leaf is made with ``jax.make_array_from_callback``: for every shard a device (of
this process) holds, the callback reads from the safetensors files only the rows and columns
that shard covers (``get_slice``), so no device and no host buffer ever holds a whole split
matrix. On a multi-host mesh each process reads only its own devices' shards.

The sharded axes (heads, KV heads, intermediate columns, vocabulary, conv channels) are each
the leading axis of the group of our dimensions that one file dimension flattens, so every
shard is one contiguous range of a file dimension (``q_proj`` rows ``h0 * hd : h1 * hd``,
say). A file dimension of size 1 that none of ours matches (``nn.Conv1d``'s ``[C, 1, K]``)
is read whole.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh

from turbospark_jax.errors import ModelLoadError, UnsupportedCapabilityError
from turbospark_jax.io.loading import (
    LoadedModel,
    _header_shape,
    _load_vision,
    _open_safetensors,
    _weight_files,
    folder_config,
    folder_extras,
)
from turbospark_jax.io.quantized import checkpoint_quantization
from turbospark_jax.models.family import Family, HFTensor, Params
from turbospark_jax.parallel.sharding import (
    check_divisible,
    ep_size,
    param_shardings,
    tp_size,
)

Index = tuple[slice, ...]


def _groups(ours: Sequence[int], view: Sequence[int]) -> list[list[int]]:
    """Which of our dimensions each dimension of the file's view flattens (by products)."""
    groups: list[list[int]] = []
    axis = 0
    for size in view:
        if size == 1 and (axis == len(ours) or ours[axis] != 1):
            groups.append([])  # a file dimension of 1 with no dimension of ours
            continue
        group, product = [], 1
        while axis < len(ours) and (product < size or not group):
            group.append(axis)
            product *= ours[axis]
            axis += 1
        while axis < len(ours) and ours[axis] == 1 and product == size:
            group.append(axis)
            axis += 1
        if product != size:
            raise ModelLoadError(f"cannot map shape {list(view)} onto {list(ours)}")
        groups.append(group)
    return groups


def read_slice(handle: Any, t: HFTensor, shape: tuple[int, ...], index: Index) -> np.ndarray:
    """``ours[index]`` where ``ours`` is tensor ``t`` as our leaf of ``shape``, reading from
    the file only the contiguous range of each file dimension that ``index`` needs."""
    view = t.hf_shape[::-1] if t.transpose else t.hf_shape  # the file's array, transposed
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
    ranges, local_shape, rest = [], [], []
    for group in _groups(shape, view):
        if not group:
            ranges.append(slice(0, 1))
            continue
        head, tail = group[0], group[1:]
        inner = math.prod(shape[a] for a in tail)
        if all(index[a] == slice(0, shape[a]) for a in tail):
            s = index[head]
            ranges.append(slice(s.start * inner, s.stop * inner))
            local_shape += [s.stop - s.start] + [shape[a] for a in tail]
            rest += [slice(None)] * len(group)
        else:  # not one contiguous range: read the dimension whole, cut after
            ranges.append(slice(0, view[len(ranges)]))
            local_shape += [shape[a] for a in group]
            rest += [index[a] for a in group]
    file_index = tuple(ranges[::-1]) if t.transpose else tuple(ranges)
    try:
        part = handle.get_slice(t.name)[file_index]
    except Exception as e:
        raise ModelLoadError(f"could not read tensor {t.name}: {e}") from e
    part = part.T if t.transpose else part
    return part.reshape(local_shape)[tuple(rest)]


def load_sharded(
    path: str | os.PathLike[str],
    mesh: Mesh,
    dtype: Any = None,
    layer_layout: Literal["stacked", "list"] = "stacked",
) -> LoadedModel:
    """Load a model folder with every params leaf split over ``mesh`` as
    :func:`~turbospark_jax.parallel.tp_specs.param_specs` says, each shard read from the files into
    its own device.

    Args:
      path: the folder: a dense, Qwen3.5 / Qwen3-Next (its MTP head too, when the config
        declares one) or Gemma 4 model.
      mesh: a mesh with a :data:`~turbospark_jax.parallel.sharding.TP` axis.
      dtype, layer_layout: as :func:`~turbospark_jax.io.loading.load_folder` (Qwen3.5 and
        Gemma 4 take only ``"list"``).

    Returns:
      The :class:`~turbospark_jax.io.loading.LoadedModel`, params on the mesh (serve it with
      :class:`~turbospark_jax.parallel.sharding.ShardedProducer`). A ``gemma4`` folder's vision
      tower
      (small, and not split) is loaded whole on the default device, as ``load_folder`` does.

    Raises:
      BadInputError: as :func:`~turbospark_jax.io.loading.load_folder`; or the mesh size does
        not divide the query heads or MLP width (the dense family: or KV heads); or the
        folder's family has no tensor-parallel layout in :mod:`~turbospark_jax.parallel.tp_specs`
        (every registered family has one). All raised before any tensor is read.
      UnsupportedCapabilityError: a quantized checkpoint, or a mixture-of-experts model
        (before any tensor is read).
      ModelLoadError: as :func:`~turbospark_jax.io.loading.load_folder`. A tied model's extra
        copy of its head is accepted without the bitwise comparison ``load_folder`` makes
        (that would read the whole embedding on one host).
    """
    folder, family, config, resolved = folder_config(path, dtype, layer_layout)
    check_divisible(config, tp_size(mesh), ep_size(mesh))
    if getattr(config, "moe", False):
        raise UnsupportedCapabilityError(
            f"{folder} holds a mixture-of-experts model, whose expert stacks are not read shard "
            "by shard yet: load it with load_folder and split it with "
            "turbospark_jax.parallel.sharding.shard_params")
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        if checkpoint_quantization(json.load(f)) is not None:
            raise UnsupportedCapabilityError(
                f"{folder} holds a quantized checkpoint; tensor parallelism shards plain "
                "weights only: load it with load_folder (or tsj.load) on one device")
    files = _weight_files(folder)
    tensors = _checked_tensors(folder, family, config, files)
    np_dtype = np.dtype(resolved)
    shapes = family.param_shapes(config)
    if layer_layout != family.native_layout:  # the dense family's per-layer list
        layers = shapes["layers"]
        n = config.num_hidden_layers
        shapes = {**shapes, "layers": [{k: s[1:] for k, s in layers.items()} for _ in range(n)]}
    as_structs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np_dtype), shapes,
                              is_leaf=lambda x: isinstance(x, tuple))
    shardings = param_shardings(mesh, config, as_structs)

    def leaf(path: Any, struct: jax.ShapeDtypeStruct, sharding: Any) -> jax.Array:
        key = tuple(p.key if hasattr(p, "key") else p.idx for p in path)
        if (*key, None) in tensors:  # a tensor of its own (every leaf of a list family)
            sources = [(tensors[(*key, None)], ())]
        elif key[0] == "layers" and isinstance(key[1], int):  # dense layers/<i>/<name>
            sources = [(tensors[("layers", key[2], key[1])], ())]
        else:  # the dense stacked layers: one tensor per index of the L axis
            sources = [(tensors[(*key, i)], (i,)) for i in range(struct.shape[0])]

        def read(index: Index) -> np.ndarray:
            stacked = sources[0][1] != ()
            picked = sources[index[0]] if stacked else sources
            inner = index[1:] if stacked else index
            parts = []
            for t, _ in picked:
                slot = struct.shape[1:] if stacked else struct.shape
                with _open_safetensors(os.path.join(folder, files[t.name])) as f:
                    parts.append(read_slice(f, t, slot, inner).astype(np_dtype, copy=False))
            return np.stack(parts) if stacked else parts[0]

        return jax.make_array_from_callback(struct.shape, sharding, read)

    params: Params = jax.tree_util.tree_map_with_path(leaf, as_structs, shardings)
    tokenizer, generation = folder_extras(folder, config)
    return LoadedModel(
        model=family.build(config, resolved, layer_layout), params=params, config=config,
        tokenizer=tokenizer, generation_config=generation, path=folder,
        vision=_load_vision(folder, np_dtype),
    )


def _checked_tensors(
    folder: str, family: Family, config: Any, files: dict[str, str]
) -> dict[tuple[Any, ...], HFTensor]:
    """Every tensor the family needs, keyed by ``(*leaf key, stacked index)``, after checking
    that each is present with its shape and that nothing unexpected is there."""
    tensors = family.hf_tensors(config)
    wanted = {t.name: t for t in tensors}
    missing = [t.name for t in tensors if t.name not in files]
    if missing:
        raise ModelLoadError(f"tensor {missing[0]} is missing from {folder}")
    extra = [n for n in files if n not in wanted and not family.tolerated(n)
             and n not in family.tied_copies(config)]
    if extra:
        raise ModelLoadError(f"unexpected tensor {extra[0]} in {files[extra[0]]}")
    for file in sorted(set(files.values())):
        with _open_safetensors(os.path.join(folder, file)) as f:
            for name in (n for n, where in files.items() if where == file and n in wanted):
                t = wanted[name]
                if _header_shape(f, name, file) != t.hf_shape:
                    raise ModelLoadError(
                        f"tensor {name} in {file} has shape "
                        f"{list(_header_shape(f, name, file))}, expected {list(t.hf_shape)}"
                    )
    return {(*t.key, t.stacked): t for t in tensors}
