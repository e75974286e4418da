"""Load model folders in the Hugging Face layout.

A folder holds ``config.json``, the weights as ``model.safetensors`` or as shards listed in
``model.safetensors.index.json``, optionally ``generation_config.json`` and tokenizer files.
Weights are read with ``safetensors`` in numpy mode (bfloat16 arrives as an ``ml_dtypes``
array); nothing is ever unpickled, so ``pytorch_model.bin`` folders are refused. Writing such
a folder is :mod:`~turbospark_jax.io.saving`'s; drafter folders (block drafters, Gemma 4
assistants) are :mod:`~turbospark_jax.io.drafter_folders`'.

The loader is generic: ``config.json``'s ``model_type`` picks a family from
:mod:`~turbospark_jax.models.registry`, whose :class:`~turbospark_jax.models.family.Family`
declaration says how to parse the config, which tensors the folder holds and where each goes.

Tensor policy:
  * every tensor the model needs must be present with the Hugging Face shape, or a
    :class:`~turbospark_jax.errors.ModelLoadError` names it (and both shapes);
  * an unexpected tensor is an error naming it, except the extras the family tolerates
    (rotary ``inv_freq`` buffers that old checkpoints carry, for example) and copies of tied
    weights (a tied model's ``lm_head.weight``) that are bitwise equal to what they copy. A
    copy that differs is refused: which of the two the author meant is not ours to guess.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from turbospark_jax.core.checks import as_bool
from turbospark_jax.errors import BadInputError, ModelLoadError, UnsupportedCapabilityError
from turbospark_jax.io import quantized as stored_quantization
from turbospark_jax.io.tokenizer import TOKENIZER_FILE, Tokenizer
from turbospark_jax.io.vision import ImageTokens, VisionEncoder
from turbospark_jax.kernels.plan import XLA_PLAN, KernelPlan, kernel_plan
from turbospark_jax.models.base import BlockModel
from turbospark_jax.models.family import Family, HFTensor, Params
from turbospark_jax.models.gemma4 import vision as gemma4_vision
from turbospark_jax.models.registry import family_of
from turbospark_jax.quant.kv import check_kv_dtype
from turbospark_jax.quant.weights import Quantization, quantize_leaf

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
PROCESSOR_CONFIG_FILE = "processor_config.json"

_DTYPES: dict[str, Any] = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """The generation defaults a folder ships (``generation_config.json``).

    Attributes:
      eos_token_ids: every id that ends a reply (``eos_token_id`` may be one id or a list).
      bos_token_id: the beginning-of-sequence id, if any.
      pad_token_id: the padding id, if any.
      extra: every other key as read (``do_sample``, ``temperature``, ``top_p``...).
    """

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> GenerationConfig:
        """Parse a ``generation_config.json`` dict.

        Raises:
          ModelLoadError: a token id that is not an integer.
        """
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else (eos if isinstance(eos, list) else [eos])
        for name, value in (("eos_token_id", e) for e in eos_list):
            _check_id(name, value)
        bos, pad = d.get("bos_token_id"), d.get("pad_token_id")
        _check_id("bos_token_id", bos)
        _check_id("pad_token_id", pad)
        extra = {
            k: v for k, v in d.items() if k not in ("eos_token_id", "bos_token_id", "pad_token_id")
        }
        return cls(eos_token_ids=tuple(eos_list), bos_token_id=bos, pad_token_id=pad, extra=extra)

    @classmethod
    def from_model_config(cls, config: Any) -> GenerationConfig:
        """The defaults implied by ``config.json`` alone (what transformers derives too)."""
        return cls(
            eos_token_ids=config.eos_token_ids,
            bos_token_id=config.bos_token_id,
            pad_token_id=config.pad_token_id,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``generation_config.json`` dict."""
        out: dict[str, Any] = dict(self.extra)
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            ids = list(self.eos_token_ids)
            out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
        if self.pad_token_id is not None:
            out["pad_token_id"] = self.pad_token_id
        return out


def _check_id(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ModelLoadError(f"{GENERATION_CONFIG_FILE}: {name} must be an integer, got {value!r}")


@dataclasses.dataclass
class LoadedModel:
    """Everything a model folder provides.

    Attributes:
      model: the runnable model (static under ``jit``).
      params: its params tree, on the default device.
      config: the parsed ``config.json`` (the family's config type).
      tokenizer: the tokenizer, or ``None`` when the folder has no ``tokenizer.json``.
      generation_config: ``generation_config.json``, or defaults derived from ``config.json``.
      path: the folder it came from.
      vision: the vision tower of a ``gemma4`` folder with a ``vision_config`` (``None``:
        a text-only model).
    """

    model: BlockModel
    params: Params
    config: Any
    tokenizer: Tokenizer | None
    generation_config: GenerationConfig
    path: str
    vision: VisionEncoder | None = None


# -- params trees ----------------------------------------------------------------------------


def _node(tree: Any, key: tuple[str | int, ...]) -> Any:
    """The subtree at ``key``: ``str`` entries index dicts, ``int`` entries index lists."""
    for k in key:
        tree = tree[k]
    return tree


def _stack_axes(t: HFTensor) -> int:
    """How many leading axes of ``t``'s leaf index its slot: 0 (the leaf is the tensor), 1
    (a stacked layer axis) or more (``stacked`` a tuple: a layer's expert stack)."""
    if t.stacked is None:
        return 0
    return len(t.stacked) if isinstance(t.stacked, tuple) else 1


def _slot_shape(shapes: Params, t: HFTensor) -> tuple[int, ...]:
    """The shape ``t`` fills: its leaf's, less the stacked axes it has."""
    return tuple(_node(shapes, t.key))[_stack_axes(t):]


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


# -- loading ---------------------------------------------------------------------------------


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{what} {path} is not valid JSON: {e}") from e
    except OSError as e:
        raise ModelLoadError(f"could not read {what} {path}: {e}") from e


def _check_dtype_argument(dtype: Any) -> None:
    """Refuse a ``dtype`` argument we do not compute in (the caller's, so BadInputError)."""
    if dtype is None:
        return
    try:
        resolved = jnp.dtype(_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
    except TypeError:
        resolved = None
    if resolved not in {jnp.dtype(d) for d in _DTYPES.values()}:
        raise BadInputError(f"unsupported dtype {dtype!r}; supported: {', '.join(_DTYPES)}")


def _resolve_dtype(dtype: Any, config: Any) -> jnp.dtype:
    if dtype is None:
        # The folder's own dtype: one we do not compute in is the folder's problem.
        named = config.dtype or "float32"
        if named not in _DTYPES:
            raise ModelLoadError(
                f"config.json names dtype {named!r}, which we do not compute in; pass "
                f"dtype= one of {', '.join(_DTYPES)}"
            )
        dtype = named
    return jnp.dtype(_DTYPES[dtype] if isinstance(dtype, str) else dtype)


def _weight_files(folder: str) -> dict[str, str]:
    """Map each tensor name to the file holding it, as the folder declares."""
    index_path = os.path.join(folder, WEIGHTS_INDEX_FILE)
    single_path = os.path.join(folder, WEIGHTS_FILE)
    if os.path.isfile(index_path):
        index = _read_json(index_path, "weight index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ModelLoadError(f"{index_path} has no valid 'weight_map' object")
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(folder, shard)):
                raise ModelLoadError(f"weight shard {shard} listed in {index_path} is missing")
        return dict(weight_map)
    if os.path.isfile(single_path):
        with _open_safetensors(single_path) as f:
            return dict.fromkeys(f.keys(), WEIGHTS_FILE)
    hint = ""
    if any(n.endswith(".bin") or n.endswith(".pt") for n in os.listdir(folder)):
        hint = " (pickled torch weights are never loaded; convert them to safetensors)"
    raise ModelLoadError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} in {folder}{hint}")


@contextlib.contextmanager
def _open_safetensors(path: str) -> Iterator[Any]:
    """``safe_open`` that turns the library's errors into a ModelLoadError naming the file."""
    try:
        handle = safe_open(path, framework="np")
    except Exception as e:  # SafetensorError, OSError, ...: all mean "unreadable"
        raise ModelLoadError(
            f"could not read safetensors file {path} (corrupt or truncated?): {e}"
        ) from e
    with handle as f:
        yield f


def _iter_tensors(folder: str, weight_map: Mapping[str, str]) -> Iterator[tuple[str, Any, str]]:
    """Yield ``(name, handle, file)`` for every tensor, one shard open at a time."""
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    for file in sorted(by_file):
        path = os.path.join(folder, file)
        with _open_safetensors(path) as f:
            present = set(f.keys())
            for name in by_file[file]:
                if name not in present:
                    raise ModelLoadError(f"tensor {name} is listed for {file} but not in it")
                yield name, f, path


def load_folder(
    path: str | os.PathLike[str],
    dtype: Any = None,
    layer_layout: Literal["stacked", "list"] = "stacked",
    plan: KernelPlan | None = None,
    quantize: Quantization | str | None = None,
    kv_dtype: str | None = None,
) -> LoadedModel:
    """Load a Hugging Face model folder of any family the registry knows.

    Args:
      path: the folder.
      dtype: the params / activation dtype (``"float32"``, ``"bfloat16"``, ``"float16"`` or a
        jnp dtype); by default the ``dtype`` (or ``torch_dtype``) that ``config.json`` names,
        else float32. Tensors stored in another dtype are cast (round to nearest even).
      layer_layout: ``"stacked"`` (per-layer leaves on a leading L axis: training, scans,
        saving) or ``"list"`` (one dict per layer: the fast layout for GPU decoding, see
        :mod:`turbospark_jax.models.dense.model`). A family whose layers differ in shape has only
        ``"list"``.
      plan: the kernel plan the model runs (:func:`serving_plan` resolves the one to serve
        with); ``None``: the family's own XLA kernels, which training, saving and sharding
        want. A row-invariant plan needs a family with row-invariant kernels
        (:attr:`~turbospark_jax.models.base.BlockModel.row_invariant_kernels`).
      quantize: quantize the linear weights on load (a
        :class:`~turbospark_jax.quant.weights.Quantization` or its name, such as ``"int8"``).
        A folder whose ``config.json`` carries a ``quantization_config`` loads in its own
        format without it (:mod:`turbospark_jax.io.quantized` lists the layouts read).
      kv_dtype: the attention caches' stored form: ``None`` (the model dtype), ``"int8"`` or
        ``"fp8"`` (e4m3): one byte a value and a float32 scale a row and KV head, about
        half the bytes a token of a 16-bit cache takes (:mod:`turbospark_jax.quant.kv`).
        Every bitwise guarantee holds within the model loaded so.

    Returns:
      The :class:`LoadedModel`.

    Raises:
      BadInputError: ``path`` is not a path, ``dtype`` is not one we compute in,
        ``layer_layout`` is neither layout, or one the family does not have, ``plan`` is
        not a :class:`~turbospark_jax.kernels.plan.KernelPlan`, ``quantize`` for a folder
        that is quantized already, ``kv_dtype`` is none of the choices (all checked before
        any tensor is read).
      UnsupportedCapabilityError: a plan other than XLA's for a family without
        row-invariant kernels (checked before any tensor is read); a quantization method,
        bit width or variant :mod:`turbospark_jax.io.quantized` does not read (named, before
        any tensor is read).
      ModelLoadError: the folder or a file is missing (named); ``config.json`` is malformed
        or names an unsupported ``model_type`` (the supported ones are listed); a tensor is
        missing, unexpected, or of the wrong shape (named, with expected and actual shapes);
        a safetensors file is corrupt or truncated (named).
    """
    if not (plan is None or isinstance(plan, KernelPlan)):
        raise BadInputError(f"plan must be a KernelPlan or None; got {plan!r}")
    kv_dtype = check_kv_dtype(kv_dtype)
    spec = Quantization.parse(quantize)
    folder, family, config, resolved = folder_config(path, dtype, layer_layout)
    stored = stored_quantization.checkpoint_quantization(
        _read_json(os.path.join(folder, CONFIG_FILE), "model config"))
    stored_quantization.refuse_requantizing(stored, spec)
    model = _with_plan(family.build(config, resolved, layer_layout), family, config, plan)
    if kv_dtype is not None:
        model = dataclasses.replace(model, kv_dtype=kv_dtype)
    host = _read_params(folder, family, config, np.dtype(resolved), stored)
    if spec is not None:
        host = quantize_params(host, family.hf_tensors(config), spec, resolved)
    vision = _load_vision(folder, np.dtype(resolved))
    tokenizer, generation = folder_extras(folder, config)
    if family.join_params is not None:  # after quantizing: quantized parts stay apart
        host = family.join_params(config, host)
    params = jax.tree.map(jnp.asarray, host)
    if layer_layout != family.native_layout:
        params = family.to_layer_layout(params, layer_layout)
    return LoadedModel(
        model=model,
        params=params,
        config=config,
        tokenizer=tokenizer,
        generation_config=generation,
        path=folder,
        vision=vision,
    )


def _with_plan(model: BlockModel, family: Family, config: Any,
               plan: KernelPlan | None) -> BlockModel:
    """``model`` running ``plan``: a family with row-invariant kernels takes any plan, one
    with kernels per backend (:attr:`~turbospark_jax.models.base.BlockModel.backend_kernels`)
    a plan without ``row_invariant``, any other XLA's only."""
    takes_plan = model.row_invariant_kernels or model.backend_kernels
    if plan is None or (plan == XLA_PLAN and not takes_plan):
        return model
    if not takes_plan:
        raise UnsupportedCapabilityError(
            f"the {family.name} family (model_type {config.model_type!r}) runs XLA's kernels "
            f"only, so the plan {plan} is not available for it; load it without a plan"
        )
    if plan.row_invariant and not model.row_invariant_kernels:
        raise UnsupportedCapabilityError(
            f"the {family.name} family (model_type {config.model_type!r}) has no row-invariant "
            f"kernels, so the plan {plan} is not available for it; load it with a plan "
            f"without row_invariant (serving_plan resolves the backend's)"
        )
    return dataclasses.replace(model, plan=plan)


def serving_plan(path: str | os.PathLike[str], exact: bool) -> KernelPlan:
    """The kernel plan a model folder serves with on this backend
    (:func:`~turbospark_jax.kernels.plan.kernel_plan`), from its ``config.json`` alone.

    Raises:
      BadInputError: ``exact`` is not a bool; the rest as :func:`load_folder` raises before
        reading a tensor.
    """
    exact = as_bool("exact", exact)
    _, family, config, resolved = folder_config(path, None, "list")
    model = family.build(config, resolved, "list")
    return kernel_plan(jax.default_backend(), exact, model.row_invariant_kernels,
                       backend_kernels=model.backend_kernels)


def folder_config(path: Any, dtype: Any, layer_layout: str) -> tuple[str, Family, Any, Any]:
    """The checks :func:`load_folder` makes before reading any tensor, and what they find:
    ``(folder, family, config, dtype)``. Raises as :func:`load_folder` does."""
    if not isinstance(path, str | os.PathLike):
        raise BadInputError(f"path must be a folder path (str or os.PathLike), got {path!r}")
    if layer_layout not in ("stacked", "list"):
        raise BadInputError(f"layer_layout must be 'stacked' or 'list', got {layer_layout!r}")
    _check_dtype_argument(dtype)
    folder = os.fspath(path)
    if not isinstance(folder, str):
        raise BadInputError(f"path must be a text path, got {folder!r}")
    if not os.path.isdir(folder):
        raise ModelLoadError(f"model folder {folder} does not exist")
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"no {CONFIG_FILE} in {folder}")
    raw_config = _read_json(config_path, "model config")
    if not isinstance(raw_config, Mapping):
        raise ModelLoadError(
            f"{CONFIG_FILE} must hold a JSON object, got {type(raw_config).__name__}"
        )
    family = family_of(raw_config.get("model_type"))
    config = family.parse_config(raw_config)
    if layer_layout != family.native_layout and family.to_layer_layout is None:
        raise BadInputError(
            f"the {family.name} family's params come only in the {family.native_layout!r} "
            f"layer layout; got layer_layout={layer_layout!r}"
        )
    resolved = _resolve_dtype(dtype, config)

    return folder, family, config, resolved


def folder_extras(folder: str, config: Any) -> tuple[Tokenizer | None, GenerationConfig]:
    """The folder's tokenizer (``None`` without ``tokenizer.json``) and generation config
    (defaults from ``config`` without ``generation_config.json``)."""
    tokenizer = Tokenizer.from_folder(folder) if os.path.isfile(
        os.path.join(folder, TOKENIZER_FILE)
    ) else None
    gen_path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if os.path.isfile(gen_path):
        raw_gen = _read_json(gen_path, "generation config")
        if not isinstance(raw_gen, dict):
            raise ModelLoadError(f"{gen_path} must hold a JSON object")
        generation = GenerationConfig.from_hf_dict(raw_gen)
        if not generation.eos_token_ids and config.eos_token_ids:
            generation = dataclasses.replace(generation, eos_token_ids=config.eos_token_ids)
    else:
        generation = GenerationConfig.from_model_config(config)
    return tokenizer, generation


def _load_vision(folder: str, np_dtype: np.dtype) -> VisionEncoder | None:
    """The vision tower a ``gemma4`` folder's ``vision_config`` names (``None`` without one),
    its soft-token budget from ``processor_config.json`` (280 when it names none)."""
    raw = _read_json(os.path.join(folder, CONFIG_FILE), "model config")
    if raw.get("model_type") != "gemma4":
        return None
    config = gemma4_vision.Gemma4VisionConfig.from_hf_dict(raw)
    if config is None:
        return None
    host = _read_params(folder, gemma4_vision.TENSORS, config, np_dtype)
    budget = 280
    processor = os.path.join(folder, PROCESSOR_CONFIG_FILE)
    if os.path.isfile(processor):
        settings = _read_json(processor, "processor config")
        image = settings.get("image_processor", {}) if isinstance(settings, Mapping) else {}
        budget = image.get("max_soft_tokens", budget) if isinstance(image, Mapping) else budget
    if budget not in (70, 140, 280, 560, 1120):
        raise ModelLoadError(f"{PROCESSOR_CONFIG_FILE}: max_soft_tokens must be one of 70, "
                             f"140, 280, 560, 1120, got {budget!r}")
    return VisionEncoder(
        tower=gemma4_vision.Gemma4Vision(config, jnp.dtype(np_dtype)),
        params=jax.tree.map(jnp.asarray, host),
        tokens=ImageTokens.from_hf_dict(dict(raw)),
        max_soft_tokens=int(budget),
    )


def _read_params(folder: str, family: Family, config: Any, np_dtype: np.dtype,
                 stored: stored_quantization.CheckpointQuantization | None = None) -> Params:
    """The folder's tensors as a host params tree (numpy, ``np_dtype``) in the family's
    native layout, every tensor checked against the family's declaration; the linear layers
    of a quantized folder (``stored``) as quantized leaves."""
    weight_map = _weight_files(folder)
    tensors = family.hf_tensors(config)
    shapes = family.param_shapes(config)
    quantized: dict[tuple[Any, ...], Any] = {}
    consumed: set[str] = set()
    if stored is not None:
        tensors, quantized, consumed = stored_quantization.read_quantized(
            folder, weight_map, tensors, shapes, stored, np_dtype)
    wanted = {t.name: t for t in tensors}
    missing = [t.name for t in tensors if t.name not in weight_map]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"tensor {missing[0]} is missing from {folder}{more}")
    # Every shape is checked against the files' headers before the params are allocated, so a
    # config that implies absurd sizes is refused, not allocated.
    for name, handle, file in _iter_tensors(folder, weight_map):
        t = wanted.get(name)
        if t is not None:
            got = _header_shape(handle, name, file)
            if got != t.hf_shape:
                raise ModelLoadError(
                    f"tensor {name} in {file} has shape {list(got)}, expected {list(t.hf_shape)}"
                )
    host: Params = jax.tree.map(lambda s: np.empty(s, np_dtype), shapes, is_leaf=_is_shape)
    copies = family.tied_copies(config)
    spares: list[tuple[str, np.ndarray, str]] = []
    for name, handle, file in _iter_tensors(folder, weight_map):
        t = wanted.get(name)
        if t is None:
            if family.tolerated(name) or name in consumed:
                continue
            if name in copies:
                spares.append((name, handle.get_tensor(name), file))
                continue
            raise ModelLoadError(f"unexpected tensor {name} in {file}")
        try:
            array = handle.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"could not read tensor {name} from {file}: {e}") from e
        converted = t.to_ours(array, _slot_shape(shapes, t)).astype(np_dtype, copy=False)
        parent = _node(host, t.key[:-1])
        if t.stacked is None:
            parent[t.key[-1]] = converted
        else:
            parent[t.key[-1]][t.stacked] = converted
    for name, array, file in spares:
        original = wanted[copies[name]]
        leaf = _node(host, original.key)
        ours = original.to_hf(leaf if original.stacked is None else leaf[original.stacked])
        if array.shape != ours.shape or not np.array_equal(array.astype(np_dtype), ours):
            raise ModelLoadError(
                f"the config ties {name} to {original.name}, but {file} holds a {name} that "
                f"differs from it; untie the config or drop the tensor"
            )
    for key, leaf in quantized.items():
        _node(host, key[:-1])[key[-1]] = leaf
    return host


def quantize_params(host: Params, tensors: list[HFTensor], spec: Quantization,
                    dtype: Any) -> Params:
    """``host`` (a params tree of numpy leaves) with each leaf that holds linear weights
    (:attr:`~turbospark_jax.models.family.HFTensor.linear`) quantized by ``spec``; the output
    head only when ``spec.head``, the embedding table only when ``spec.embeddings``, and
    only matrices the scheme fits
    (:meth:`~turbospark_jax.quant.weights.Quantization.fits`). Leaves are replaced in place
    of the tree's dicts."""
    done: set[tuple[Any, ...]] = set()
    for t in tensors:
        if t.key == ("embed_tokens",) and spec.embeddings:
            v, d = t.hf_shape
            if spec.fits(d, v):  # as the head's [D, V] matrix: a column per token
                host["embed_tokens"] = quantize_leaf(np.asarray(host["embed_tokens"]).T, d, 0,
                                                     spec, dtype)
            continue
        if not t.linear or t.key in done or (t.key[-1] == "lm_head" and not spec.head):
            continue
        if not spec.fits(t.hf_shape[1], t.hf_shape[0]):
            continue
        done.add(t.key)
        parent = _node(host, t.key[:-1])
        parent[t.key[-1]] = quantize_leaf(parent[t.key[-1]], t.hf_shape[1], _stack_axes(t),
                                          spec, dtype)
    return host


def _header_shape(handle: Any, name: str, file: str) -> tuple[int, ...]:
    try:
        return tuple(handle.get_slice(name).get_shape())
    except Exception as e:  # the library's errors for a damaged header entry
        raise ModelLoadError(f"could not read tensor {name} from {file}: {e}") from e


# -- the embedded models ---------------------------------------------------------------------

#: Names of the embedded models under ``models/``.
DEFAULT_TARGET = "tsj-pycoder"
DEFAULT_DRAFT = "tsj-pycoder-draft"


def embedded_model_path(name: str) -> Path:
    """Where the embedded model ``name`` lives, in an editable install or an installed wheel.

    Raises:
      ModelLoadError: it is in neither place.
    """
    candidates = []
    try:
        from importlib.resources import files

        candidates.append(Path(str(files("turbospark_jax_models") / name)))
    except ModuleNotFoundError:
        pass
    candidates.append(Path(__file__).resolve().parents[2] / "models" / name)
    for path in candidates:
        if (path / "config.json").is_file():
            return path
    raise ModelLoadError(
        f"the embedded model {name!r} is missing (looked in {', '.join(map(str, candidates))}); "
        "pass --model PATH"
    )
