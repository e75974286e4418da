"""Quantized checkpoints in the layouts publishers ship: reading them straight into
:class:`~turbospark_jax.quant.weights.QuantizedWeight` leaves, and writing ours back out.

A folder whose ``config.json`` (or a multimodal config's ``text_config``) carries a
``quantization_config`` stores each quantized linear layer as a few tensors in its method's own
layout instead of one ``weight``. :func:`checkpoint_quantization` reads that config (and
refuses what we do not load, before any tensor is read); :func:`read_quantized` turns the
tensors of each quantized layer into a ``QuantizedWeight`` without passing through a dense
matrix; :func:`write_quantized` does the reverse for :func:`~turbospark_jax.io.saving.save_folder`.

Layouts read (``K`` inputs, ``N`` outputs; ours is ``[K, N]``, every file here is ``[N, K]`` or
packs it):

* ``gptq``, 4 bits: ``qweight`` int32 ``[K / 8, N]`` (eight rows a word, row ``8i + j`` in
  bits ``4j``), ``qzeros`` int32 ``[K / group, N / 8]`` (eight columns a word, the same
  order), ``scales`` ``[K / group, N]``, ``g_idx`` ``[K]``. The original ("v1",
  ``checkpoint_format`` ``gptq``) layout stores each zero point less one, ``gptq_v2`` stores it
  as is; the matrix is ``(q - zero) * scale``. Only a ``g_idx`` of consecutive groups (no
  act-order permutation) is taken.
* ``awq``, 4 bits, GEMM: ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32
  ``[K / group, N / 8]``, eight columns a word with column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``
  in bits ``4i``; ``scales`` ``[K / group, N]``; ``(q - zero) * scale``.
* ``fp8`` (block-wise, e4m3, 128 x 128): ``weight`` float8 ``[N, K]`` and
  ``weight_scale_inv`` ``[N / 128, K / 128]``, the matrix each block's values times its scale.
* ``compressed-tensors``: ``pack-quantized`` 4 bits (``weight_packed`` int32 ``[N, K / 8]``
  with eight consecutive inputs a word, low bits first, each value offset by 8;
  ``weight_scale`` ``[N, K / group]``; ``weight_zero_point`` int32 ``[N / 8, K / group]``
  packed the same way along ``N`` when asymmetric; ``weight_shape`` ``[N, K]``), and
  ``int-quantized`` int8 and ``float-quantized`` fp8 e4m3 (``weight`` ``[N, K]``,
  ``weight_scale`` ``[N, 1]`` per channel, ``[N, K / group]`` per group, one value per
  tensor, or ``[N / 128, K / 128]`` per block).

Everything here is exact: the integer values keep their bits (a packed nibble is moved, never
recomputed), and every scale arrives in float32, which holds the float16, bfloat16 and float32
scales checkpoints carry without rounding.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from turbospark_jax.errors import BadInputError, ModelLoadError, UnsupportedCapabilityError
from turbospark_jax.models.family import HFTensor, Params
from turbospark_jax.quant.weights import FP8_BLOCK, QuantizedWeight, pack_int4, unpack_int4

#: What :func:`checkpoint_quantization` accepts, for messages.
SUPPORTED = ("gptq (4 bits, no act-order reordering), awq (4 bits, GEMM), fp8 (e4m3, "
             "128 x 128 blocks), compressed-tensors (pack-quantized 4 bits, int-quantized 8 "
             "bits, float-quantized fp8 e4m3)")

#: The column order within one AWQ word: nibble ``i`` holds column ``AWQ_ORDER[i]``.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

_NIBBLES = 8  # 4-bit values per int32 word


@dataclasses.dataclass(frozen=True)
class LinearFormat:
    """How one quantized linear layer is stored.

    Attributes:
      layout: ``"gptq"``, ``"awq"``, ``"fp8-block"``, ``"ct-int4"``, ``"ct-int8"`` or
        ``"ct-fp8"``.
      group: inputs per scale; ``None`` for one scale per output channel (all of ``K``).
      symmetric: no zero point stored (compressed-tensors).
      zero_offset: what to add to a stored zero point (1 for GPTQ's original layout).
      strategy: compressed-tensors' ``strategy`` (``channel``, ``group``, ``tensor``,
        ``block``); ``""`` for the other methods.
    """

    layout: str
    group: int | None = None
    symmetric: bool = False
    zero_offset: int = 0
    strategy: str = ""


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """A folder's ``quantization_config``, as far as loading it needs.

    Attributes:
      method: the ``quant_method`` it names.
      formats: ``(targets, format)`` pairs: a linear layer takes the first format whose
        targets match its module name (``"Linear"`` matches every linear layer,
        ``"Embedding"`` the embedding table; ``re:`` entries are regular expressions; other
        entries are module names).
      excluded: module names (or ``re:`` patterns) stored unquantized.
      head_quantized: whether the output head (``lm_head``) is quantized when no exclusion
        names it (GPTQ's ``lm_head`` key; compressed-tensors lists it in ``ignore``).
    """

    method: str
    formats: tuple[tuple[tuple[str, ...], LinearFormat], ...]
    excluded: tuple[str, ...] = ()
    head_quantized: bool = False

    def format_of(self, module: str, linear: bool = True) -> LinearFormat | None:
        """The format of the linear layer (or, ``linear`` false, the embedding table)
        ``module``; ``None``: stored as a plain weight."""
        if any(_names_match(entry, module) for entry in self.excluded):
            return None
        if module.split(".")[-1] == "lm_head" and not self.head_quantized:
            return None
        kind = "Linear" if linear else "Embedding"
        for targets, fmt in self.formats:
            if any(t == kind or _names_match(t, module) for t in targets):
                return fmt
        return None


def _names_match(entry: str, module: str) -> bool:
    """Whether a config's module entry names ``module``: a ``re:`` pattern matching it, or a
    run of whole dotted components of it (``lm_head``, ``mlp.gate``, ``model.layers.0``)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return f".{entry}." in f".{module}."


# -- reading the config ------------------------------------------------------------------------


def checkpoint_quantization(raw: Any) -> CheckpointQuantization | None:
    """The ``quantization_config`` of a ``config.json`` dict (the top level's, else its
    ``text_config``'s), or ``None`` when it has none.

    Raises:
      UnsupportedCapabilityError: a method, bit width or variant we do not load (named, with
        what we load).
      ModelLoadError: a ``quantization_config`` whose keys are malformed (named).
    """
    if not isinstance(raw, Mapping):
        return None
    qc = raw.get("quantization_config")
    text = raw.get("text_config")
    if qc is None and isinstance(text, Mapping):
        qc = text.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ModelLoadError(f"config.json: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    readers: dict[str, Callable[[Mapping[str, Any]], CheckpointQuantization]] = {
        "gptq": _gptq_config, "awq": _awq_config, "fp8": _fp8_config,
        "compressed-tensors": _ct_config}
    if method not in readers:
        raise UnsupportedCapabilityError(
            f"config.json: quantization method {method!r} is not loaded here; supported: "
            f"{SUPPORTED}")
    return readers[method](qc)


def _key(qc: Mapping[str, Any], key: str, kind: type, default: Any, what: str) -> Any:
    value = qc.get(key, default)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ModelLoadError(f"config.json: {what} quantization_config.{key} must be an integer, "
                             f"got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ModelLoadError(f"config.json: {what} quantization_config.{key} must be true or "
                             f"false, got {value!r}")
    return value


def _names(qc: Mapping[str, Any], key: str, what: str) -> tuple[str, ...]:
    value = qc.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelLoadError(f"config.json: {what} quantization_config.{key} must be a list of "
                             f"module names, got {value!r}")
    return tuple(value)


def _group(qc: Mapping[str, Any], what: str) -> int | None:
    group = _key(qc, "group_size", int, 128, what)
    if group == -1:
        return None
    if group <= 0:
        raise ModelLoadError(f"config.json: {what} group_size must be positive or -1, got "
                             f"{group}")
    return group


def _four_bits(qc: Mapping[str, Any], key: str, what: str) -> None:
    bits = _key(qc, key, int, 4, what)
    if bits != 4:
        raise UnsupportedCapabilityError(
            f"config.json: {what} checkpoints of {bits} bits are not loaded here; supported: "
            f"{SUPPORTED}")


def _gptq_config(qc: Mapping[str, Any]) -> CheckpointQuantization:
    _four_bits(qc, "bits", "gptq")
    group = _group(qc, "gptq")
    _key(qc, "sym", bool, True, "gptq")  # both kinds store their zero points
    layout = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if layout not in ("gptq", "gptq_v2"):
        raise UnsupportedCapabilityError(
            f"config.json: gptq checkpoint_format {layout!r} is not loaded here; supported: "
            "gptq (v1, zero points stored less one) and gptq_v2")
    if qc.get("dynamic"):
        raise UnsupportedCapabilityError(
            "config.json: gptq 'dynamic' (settings that differ per module) is not loaded here")
    fmt = LinearFormat("gptq", group, zero_offset=1 if layout == "gptq" else 0)
    # desc_act checkpoints are refused only when their g_idx really permutes the groups (read
    # with the tensors): many carry desc_act with groups in order.
    return CheckpointQuantization(
        "gptq", ((("Linear",), fmt),), _names(qc, "modules_to_not_convert", "gptq"),
        head_quantized=_key(qc, "lm_head", bool, False, "gptq"))


def _awq_config(qc: Mapping[str, Any]) -> CheckpointQuantization:
    _four_bits(qc, "bits", "awq")
    group = _group(qc, "awq")
    version = str(qc.get("version", qc.get("format", "gemm"))).lower()
    if version != "gemm":
        raise UnsupportedCapabilityError(
            f"config.json: awq version {version!r} is not loaded here; supported: awq gemm")
    if not _key(qc, "zero_point", bool, True, "awq"):
        raise UnsupportedCapabilityError(
            "config.json: awq without zero points (zero_point: false) is not loaded here")
    return CheckpointQuantization(
        "awq", ((("Linear",), LinearFormat("awq", group)),),
        _names(qc, "modules_to_not_convert", "awq"))


def _fp8_config(qc: Mapping[str, Any]) -> CheckpointQuantization:
    fmt = qc.get("fmt", "e4m3")
    block = qc.get("weight_block_size")
    scheme = qc.get("activation_scheme", "dynamic")
    if fmt != "e4m3" or block != [FP8_BLOCK, FP8_BLOCK] or scheme != "dynamic":
        raise UnsupportedCapabilityError(
            f"config.json: fp8 checkpoints load here in e4m3 with weight_block_size "
            f"[{FP8_BLOCK}, {FP8_BLOCK}] and dynamic activations; got fmt={fmt!r}, "
            f"weight_block_size={block!r}, activation_scheme={scheme!r}")
    return CheckpointQuantization(
        "fp8", ((("Linear",), LinearFormat("fp8-block", FP8_BLOCK)),),
        _names(qc, "modules_to_not_convert", "fp8"))


_CT_FORMATS = {"pack-quantized": ("int", 4), "int-quantized": ("int", 8),
               "float-quantized": ("float", 8), "naive-quantized": None}


def _ct_config(qc: Mapping[str, Any]) -> CheckpointQuantization:
    what = "compressed-tensors"
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise UnsupportedCapabilityError(
            f"config.json: a compressed-tensors folder in status {status!r} holds no "
            "compressed weights; only 'compressed' folders load here")
    if qc.get("sparsity_config") or qc.get("transform_config"):
        raise UnsupportedCapabilityError(
            "config.json: compressed-tensors sparsity or transforms are not loaded here")
    if qc.get("kv_cache_scheme"):
        raise UnsupportedCapabilityError(
            "config.json: a compressed-tensors kv_cache_scheme (stored KV scales) is not loaded "
            "here; load_folder's kv_dtype quantizes the cache on its own")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ModelLoadError(f"config.json: {what} quantization_config.config_groups must be a "
                             f"non-empty object, got {groups!r}")
    formats = []
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise ModelLoadError(f"config.json: {what} config group {name!r} must be an object")
        targets = _names(group, "targets", f"{what} group {name!r}")
        formats.append((targets, _ct_format(name, group, qc.get("format"))))
    return CheckpointQuantization(what, tuple(formats), _names(qc, "ignore", what),
                                  head_quantized=True)


def _ct_format(name: str, group: Mapping[str, Any], outer_format: Any) -> LinearFormat:
    what = f"compressed-tensors group {name!r}"
    layout = group.get("format") or outer_format
    args = group.get("weights")
    if not isinstance(args, Mapping):
        raise ModelLoadError(f"config.json: {what} has no 'weights' object")
    for side in ("input_activations", "output_activations"):
        act = group.get(side)
        if act is not None and not (isinstance(act, Mapping) and act.get("dynamic") is True):
            raise UnsupportedCapabilityError(
                f"config.json: {what} quantizes {side} with static scales; only dynamic (or "
                "no) activation quantization loads here, and activations stay unquantized")
    kind, bits = args.get("type"), args.get("num_bits")
    strategy = args.get("strategy")
    symmetric = args.get("symmetric", True)
    if layout == "naive-quantized":
        layout = "int-quantized" if kind == "int" else "float-quantized"
    if _CT_FORMATS.get(layout) != (kind, bits) or not isinstance(symmetric, bool):
        raise UnsupportedCapabilityError(
            f"config.json: {what} stores {kind} {bits}-bit weights in format {layout!r}; "
            f"supported: {SUPPORTED}")
    if args.get("actorder") not in (None, False, "static", "weight"):
        raise UnsupportedCapabilityError(
            f"config.json: {what} uses actorder {args.get('actorder')!r} (a permutation of the "
            "groups), which is not loaded here")
    gsize = args.get("group_size")
    if strategy == "group":
        if isinstance(gsize, bool) or not isinstance(gsize, int) or gsize <= 0:
            raise ModelLoadError(f"config.json: {what} strategy 'group' needs a positive "
                                 f"group_size, got {gsize!r}")
    elif strategy == "block" and layout == "float-quantized":
        if args.get("block_structure") != [FP8_BLOCK, FP8_BLOCK]:
            raise UnsupportedCapabilityError(
                f"config.json: {what} blocks of {args.get('block_structure')!r} are not loaded "
                f"here; supported: [{FP8_BLOCK}, {FP8_BLOCK}]")
        gsize = FP8_BLOCK
    elif strategy not in ("channel", "tensor") or (strategy == "tensor"
                                                  and layout != "float-quantized"):
        raise UnsupportedCapabilityError(
            f"config.json: {what} strategy {strategy!r} is not loaded here for {layout}; "
            "supported: channel, group (and tensor or 128 x 128 block for fp8)")
    else:
        gsize = None
    if layout != "pack-quantized" and not symmetric:
        raise UnsupportedCapabilityError(
            f"config.json: {what} is asymmetric {layout}; 8-bit weights load here symmetric "
            "only")
    if layout == "float-quantized" and args.get("type") == "float" and bits == 8:
        return LinearFormat("ct-fp8", gsize, True, strategy=strategy)
    short = {"pack-quantized": "ct-int4", "int-quantized": "ct-int8"}[layout]
    return LinearFormat(short, gsize, symmetric, strategy=strategy)


# -- reading the tensors -----------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}


class TensorFiles:
    """The tensors of a folder's safetensors files, read by name from each file's header
    (``safetensors``' numpy reader has no float8 type, which fp8 checkpoints need).

    Args:
      folder: the folder.
      weight_map: tensor name -> the file holding it.
    """

    def __init__(self, folder: str, weight_map: Mapping[str, str]) -> None:
        self.folder = folder
        self.weight_map = weight_map
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _entry(self, name: str) -> tuple[str, int, dict[str, Any]]:
        if name not in self.weight_map:
            raise ModelLoadError(f"tensor {name} is missing from {self.folder}")
        path = os.path.join(self.folder, self.weight_map[name])
        if path not in self._headers:
            try:
                with open(path, "rb") as f:
                    (size,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(size))
            except (OSError, struct.error, ValueError) as e:
                raise ModelLoadError(f"could not read safetensors file {path} (corrupt or "
                                     f"truncated?): {e}") from e
            self._headers[path] = (8 + size, header)
        start, header = self._headers[path]
        entry = header.get(name)
        if not isinstance(entry, dict):
            raise ModelLoadError(f"tensor {name} is listed for {path} but not in it")
        return path, start, entry

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from its file's header."""
        return tuple(self._entry(name)[2].get("shape", ()))

    def get(self, name: str, shape: tuple[int, ...] | None = None,
            kinds: Iterable[str] = ()) -> np.ndarray:
        """The tensor, checked to have ``shape`` and one of the dtype tags ``kinds`` (when
        given) before it is read.

        Raises:
          ModelLoadError: the tensor is missing, of another shape or dtype (named, with both),
            or its bytes are damaged.
        """
        path, start, entry = self._entry(name)
        got = tuple(entry.get("shape", ()))
        if shape is not None and got != tuple(shape):
            raise ModelLoadError(f"tensor {name} in {path} has shape {list(got)}, expected "
                                 f"{list(shape)}")
        tag = entry.get("dtype")
        kinds = tuple(kinds)
        if (kinds and tag not in kinds) or tag not in _SAFETENSORS_DTYPES:
            raise ModelLoadError(f"tensor {name} in {path} has dtype {tag}, expected one of "
                                 f"{', '.join(kinds or _SAFETENSORS_DTYPES)}")
        dtype = _SAFETENSORS_DTYPES[tag]
        begin, end = entry.get("data_offsets", (0, -1))
        if end - begin != math.prod(got) * dtype.itemsize:
            raise ModelLoadError(f"tensor {name} in {path} has {end - begin} bytes for shape "
                                 f"{list(got)} of {tag}")
        try:
            with open(path, "rb") as f:
                f.seek(start + begin)
                data = f.read(end - begin)
        except OSError as e:
            raise ModelLoadError(f"could not read tensor {name} from {path}: {e}") from e
        if len(data) != end - begin:
            raise ModelLoadError(f"tensor {name} in {path} is truncated")
        return np.frombuffer(data, dtype).reshape(got)


_FLOATS = ("F32", "F16", "BF16")


def _words(packed: np.ndarray, axis: int) -> np.ndarray:
    """int32 words of eight 4-bit values (low bits first) -> uint8 values, each word's eight
    spread along ``axis`` (0 or 1) of a 2-D array in their order."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = np.arange(_NIBBLES, dtype=np.uint32) * 4
    values = ((words[..., None] >> shifts) & 0xF).astype(np.uint8)  # [R, C, 8]
    rows, cols = words.shape
    if axis == 1:
        return values.reshape(rows, cols * _NIBBLES)
    return values.transpose(0, 2, 1).reshape(rows * _NIBBLES, cols)


def _floats(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32)


def _int4(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, group: int,
          dtype: Any) -> QuantizedWeight:
    """A ``[K, N]`` int4 weight from unpacked values ``q`` ``[K, N]``, scales and zero points
    ``[K / group, N]``."""
    k, n = q.shape
    return QuantizedWeight(pack_int4(q), _floats(scale), np.asarray(zero, np.uint8), "int4",
                           group, (k,), (n,), jnp.dtype(dtype))


def _group_of(fmt: LinearFormat, k: int, name: str) -> int:
    group = k if fmt.group is None else fmt.group
    if k % group:
        raise ModelLoadError(f"{name}: {k} inputs do not split into groups of {group}")
    return group


def _read_gptq(files: TensorFiles, prefix: str, k: int, n: int, fmt: LinearFormat,
               dtype: Any) -> tuple[QuantizedWeight, list[str]]:
    group = _group_of(fmt, k, prefix)
    if k % _NIBBLES or n % _NIBBLES:
        raise ModelLoadError(f"{prefix}: gptq packs eight values a word; [{k}, {n}] does not")
    names = [f"{prefix}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx")]
    q = _words(files.get(names[0], (k // _NIBBLES, n), ("I32",)), 0)
    zero = _words(files.get(names[1], (k // group, n // _NIBBLES), ("I32",)), 1)
    scale = files.get(names[2], (k // group, n), _FLOATS)
    if names[3] in files:
        g_idx = files.get(names[3], (k,), ("I32", "I64"))
        if not np.array_equal(g_idx, np.arange(k) // group):
            raise UnsupportedCapabilityError(
                f"{names[3]} reorders the inputs' groups (act-order, desc_act); such "
                "checkpoints are not loaded here")
    else:
        names.pop()
    zero = zero.astype(np.uint16) + fmt.zero_offset
    if zero.max(initial=0) > 15:
        # The original layout's zero point 0 is stored as -1, whose nibble reads back 16.
        raise UnsupportedCapabilityError(
            f"{names[1]} holds a zero point of 16 (a v1 zero point of 0 stored less one), "
            "which int4 weights do not hold")
    return _int4(q, scale, zero, group, dtype), names


def _read_awq(files: TensorFiles, prefix: str, k: int, n: int, fmt: LinearFormat,
              dtype: Any) -> tuple[QuantizedWeight, list[str]]:
    group = _group_of(fmt, k, prefix)
    if n % _NIBBLES:
        raise ModelLoadError(f"{prefix}: awq packs eight columns a word; N = {n} does not")
    names = [f"{prefix}.{s}" for s in ("qweight", "qzeros", "scales")]
    order = np.argsort(AWQ_ORDER)  # the nibble that holds each column of a word

    def columns(packed: np.ndarray) -> np.ndarray:
        values = _words(packed, 1)
        return values.reshape(values.shape[0], -1, _NIBBLES)[..., order].reshape(values.shape)

    q = columns(files.get(names[0], (k, n // _NIBBLES), ("I32",)))
    zero = columns(files.get(names[1], (k // group, n // _NIBBLES), ("I32",)))
    scale = files.get(names[2], (k // group, n), _FLOATS)
    return _int4(q, scale, zero, group, dtype), names


def _block_scales(inverse: np.ndarray, k: int, n: int, name: str) -> np.ndarray:
    """Per-block scales ``[N / 128, K / 128]`` as ours: ``[K / 128, N]``, one per column."""
    if k % FP8_BLOCK or n % FP8_BLOCK:
        raise UnsupportedCapabilityError(
            f"{name}: block-wise fp8 loads here with inputs and outputs in whole "
            f"{FP8_BLOCK}-blocks; this weight is [{n}, {k}]")
    return np.repeat(_floats(inverse).T, FP8_BLOCK, axis=1)


def _read_fp8_block(files: TensorFiles, prefix: str, k: int, n: int, fmt: LinearFormat,
                    dtype: Any) -> tuple[QuantizedWeight, list[str]]:
    names = [f"{prefix}.weight", f"{prefix}.weight_scale_inv"]
    blocks = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    inverse = files.get(names[1], blocks, _FLOATS)
    scale = _block_scales(inverse, k, n, names[0])
    q = files.get(names[0], (n, k), ("F8_E4M3",)).T
    return QuantizedWeight(np.ascontiguousarray(q), scale, None, "fp8", FP8_BLOCK, (k,), (n,),
                           jnp.dtype(dtype), FP8_BLOCK), names


def _ct_scales(files: TensorFiles, name: str, fmt: LinearFormat, k: int,
               n: int) -> tuple[np.ndarray, int, int]:
    """compressed-tensors' ``weight_scale`` as ours ``[K / group, N]``, with the group and the
    columns sharing a scale."""
    if fmt.strategy == "block":
        blocks = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
        return _block_scales(files.get(name, blocks, _FLOATS), k, n, name), FP8_BLOCK, FP8_BLOCK
    if fmt.strategy == "tensor":
        shape = files.shape(name)
        if math.prod(shape) != 1 or len(shape) > 2:
            raise ModelLoadError(f"tensor {name} has shape {list(shape)}, expected one value")
        value = _floats(files.get(name, shape, _FLOATS)).reshape(1, 1)
        return np.repeat(value, n, axis=1), k, 1
    group = _group_of(fmt, k, name)
    return _floats(files.get(name, (n, k // group), _FLOATS)).T, group, 1


def _read_ct(files: TensorFiles, prefix: str, k: int, n: int, fmt: LinearFormat,
             dtype: Any) -> tuple[QuantizedWeight, list[str]]:
    scale_name = f"{prefix}.weight_scale"
    scale, group, columns = _ct_scales(files, scale_name, fmt, k, n)
    names = [scale_name]
    zero_name = f"{prefix}.weight_zero_point"
    if fmt.layout == "ct-int4":
        if k % _NIBBLES:
            raise ModelLoadError(f"{prefix}: pack-quantized packs eight inputs a word; K = {k} "
                                 "does not")
        names += [f"{prefix}.weight_packed", f"{prefix}.weight_shape"]
        shape = files.get(names[2], (2,), ("I32", "I64"))
        if [int(s) for s in shape] != [n, k]:
            raise ModelLoadError(f"tensor {names[2]} says {shape.tolist()}, expected [{n}, {k}]")
        q = _words(files.get(names[1], (n, k // _NIBBLES), ("I32",)), 1).T
        if fmt.symmetric:
            zero = np.full(scale.shape, 8, np.uint8)  # signed values are stored offset by 8
        else:
            names.append(zero_name)
            rows = -(-n // _NIBBLES)
            zero = _words(files.get(zero_name, (rows, k // group), ("I32",)), 0)[:n].T
        return _int4(np.ascontiguousarray(q), scale, zero, group, dtype), names
    names.append(f"{prefix}.weight")
    if zero_name in files:
        names.append(zero_name)
        if np.any(files.get(zero_name, None, ("I8", "I32", "F32", "F16", "BF16",
                                               "F8_E4M3")).astype(np.float32)):
            raise UnsupportedCapabilityError(f"{zero_name} holds non-zero zero points; 8-bit "
                                             "weights load here symmetric only")
    if fmt.layout == "ct-int8":
        q = files.get(names[1], (n, k), ("I8",)).T
        return QuantizedWeight(np.ascontiguousarray(q), scale, None, "int8", group, (k,), (n,),
                               jnp.dtype(dtype)), names
    q = files.get(names[1], (n, k), ("F8_E4M3",)).T
    return QuantizedWeight(np.ascontiguousarray(q), scale, None, "fp8", group, (k,), (n,),
                           jnp.dtype(dtype), columns), names


_READERS = {"gptq": _read_gptq, "awq": _read_awq, "fp8-block": _read_fp8_block,
            "ct-int4": _read_ct, "ct-int8": _read_ct, "ct-fp8": _read_ct}


def read_quantized(
    folder: str, weight_map: Mapping[str, str], tensors: list[HFTensor], shapes: Params,
    stored: CheckpointQuantization, dtype: Any,
) -> tuple[list[HFTensor], dict[tuple[Any, ...], QuantizedWeight], set[str]]:
    """Read a quantized folder's quantized linear layers.

    Args:
      folder, weight_map: the folder and which file holds each tensor.
      tensors: the family's tensors (``weight`` names).
      shapes: the family's params tree of shapes.
      stored: the folder's :func:`checkpoint_quantization`.
      dtype: the model's dtype (what the weights dequantize to).

    Returns:
      ``(plain, leaves, consumed)``: the tensors still to read as plain weights; the
      quantized leaves by params key (stacked layers stacked on the leaf's leading axis);
      the names of every tensor read here.

    Raises:
      ModelLoadError: a quantized tensor missing, of the wrong shape or dtype (named); the
        layers of one stacked leaf stored in different ways.
      UnsupportedCapabilityError: a layer stored in a way the config allows but we do not
        load (an act-order ``g_idx``, fp8 blocks that do not tile the weight).
    """
    files = TensorFiles(folder, weight_map)
    plain: list[HFTensor] = []
    parts: dict[tuple[Any, ...], list[tuple[int | None, QuantizedWeight]]] = {}
    consumed: set[str] = set()
    for t in tensors:
        module = t.name.removesuffix(".weight")
        table = t.key == ("embed_tokens",)  # quantized, it is stored as the head's [D, V]
        fmt = stored.format_of(module, t.linear) if (t.linear or table) and t.name.endswith(
            ".weight") else None
        if fmt is None:
            plain.append(t)
            continue
        n, k = t.hf_shape
        weight, names = _READERS[fmt.layout](files, module, k, n, fmt, dtype)
        consumed.update(names)
        parts.setdefault(t.key, []).append((t.stacked, weight))
        bias = f"{module}.bias"
        if bias in files and not any(u.name == bias for u in tensors):
            # GPTQ and AWQ writers save a zero bias for layers that have none.
            if np.any(files.get(bias, (n,), _FLOATS).astype(np.float32)):
                raise ModelLoadError(f"tensor {bias} is non-zero, but the model's {module} has "
                                     "no bias")
            consumed.add(bias)
    leaves = {key: _leaf(key, found, shapes) for key, found in parts.items()}
    return plain, leaves, consumed


def _leaf(key: tuple[Any, ...], parts: list[tuple[int | None, QuantizedWeight]],
          shapes: Params) -> QuantizedWeight:
    """The quantized matrices of one params leaf as that leaf: its axes split into inputs and
    outputs, and stacked layers stacked."""
    shape = shapes
    for k in key:
        shape = shape[k]
    shape = tuple(shape)
    first = parts[0][1]
    if key == ("embed_tokens",):  # the table as the tied head's [D, V] matrix
        return first
    index = parts[0][0]  # None, a layer, or (layer, expert) for a layer's expert stack
    lead = 0 if index is None else len(index) if isinstance(index, tuple) else 1
    slot = shape[lead:]
    split = next(i for i in range(len(slot) + 1) if math.prod(slot[:i]) == first.k)
    axes = {"in_shape": slot[:split], "out_shape": slot[split:]}
    if index is None:
        return dataclasses.replace(first, **axes)
    statics = {(w.scheme, w.group, w.block_columns, w.zero is None) for _, w in parts}
    if len(statics) != 1 or len(parts) != math.prod(shape[:lead]):
        raise ModelLoadError(
            f"the layers of params leaf {'/'.join(map(str, key))} are not all stored in one "
            "quantized format (a config that quantizes only some layers of a kind is not "
            "loaded here)")
    ordered = [w for _, w in sorted(parts, key=lambda p: p[0])]

    def stacked(name: str) -> Any:
        values = [getattr(w, name) for w in ordered]
        return None if values[0] is None else np.stack(values).reshape(
            *shape[:lead], *np.shape(values[0]))

    return dataclasses.replace(first, q=stacked("q"), scale=stacked("scale"),
                               zero=stacked("zero"), **axes)


def refuse_requantizing(stored: CheckpointQuantization | None, spec: Any) -> None:
    """Refuse quantizing on load a folder that is quantized already.

    Raises:
      BadInputError: both are given.
    """
    if stored is not None and spec is not None:
        raise BadInputError(
            f"this folder is quantized already ({stored.method}) and loads in its own format; "
            "load it without quantize=")


# -- writing -----------------------------------------------------------------------------------


def _uniform_blocks(w: QuantizedWeight, name: str) -> np.ndarray:
    """``w``'s per-column scales ``[K / 128, N]`` as one per 128 x 128 block,
    ``[N / 128, K / 128]``.

    Raises:
      BadInputError: the columns of a block do not share their scale.
    """
    scale = np.asarray(w.scale, np.float32)
    blocks = np.ascontiguousarray(scale[:, ::FP8_BLOCK].T)
    if w.n % FP8_BLOCK or not np.array_equal(np.repeat(blocks.T, FP8_BLOCK, axis=1), scale):
        raise BadInputError(f"{name}: its scales are not one per {FP8_BLOCK}-column block")
    return blocks


def _words_of(values: np.ndarray, axis: int) -> np.ndarray:
    """uint8 4-bit values -> int32 words of eight consecutive ones along ``axis`` (0 or 1),
    low bits first; ``axis`` is padded with zeros to a whole word."""
    values = np.asarray(values, np.uint32)
    if axis == 0:
        return np.ascontiguousarray(_words_of(values.T, 1).T)
    rows, cols = values.shape
    pad = -cols % _NIBBLES
    values = np.pad(values, ((0, 0), (0, pad))).reshape(rows, -1, _NIBBLES)
    words = np.zeros(values.shape[:2], np.uint32)
    for i in range(_NIBBLES):
        words |= values[..., i] << np.uint32(4 * i)
    return np.ascontiguousarray(words).view(np.int32)


def _ct_entry(w: QuantizedWeight) -> dict[str, Any]:
    """The ``weights`` arguments of a compressed-tensors group that stores ``w``."""
    kind, bits = {"int4": ("int", 4), "int8": ("int", 8), "fp8": ("float", 8)}[w.scheme]
    symmetric = w.scheme != "int4" or (w.zero is not None and bool(np.all(np.asarray(w.zero)
                                                                        == 8)))
    if w.block_columns == FP8_BLOCK:
        strategy, group, block = "block", None, [FP8_BLOCK, FP8_BLOCK]
    else:
        strategy, group, block = ("channel", None, None) if w.group == w.k else (
            "group", w.group, None)
    return {"num_bits": bits, "type": kind, "symmetric": symmetric, "strategy": strategy,
            "group_size": group, "block_structure": block, "dynamic": False, "actorder": None,
            "observer": "minmax"}


def _ct_tensors(module: str, w: QuantizedWeight, args: Mapping[str, Any]) -> dict[str, Any]:
    if args["strategy"] == "block":
        scale = _uniform_blocks(w, module)
    else:
        scale = np.ascontiguousarray(np.asarray(w.scale, np.float32).T)
    out = {f"{module}.weight_scale": scale}
    if w.scheme == "int4":
        q = np.asarray(unpack_int4(w.q))
        out[f"{module}.weight_packed"] = _words_of(q.T, 1)
        out[f"{module}.weight_shape"] = np.array([w.n, w.k], np.int32)
        if not args["symmetric"]:
            zero = np.zeros(scale.shape[::-1], np.uint8) if w.zero is None else np.asarray(w.zero)
            out[f"{module}.weight_zero_point"] = _words_of(zero.T, 0)
    else:
        out[f"{module}.weight"] = np.ascontiguousarray(np.asarray(w.q).T)
    return out


def write_quantized(weights: Mapping[str, QuantizedWeight],
                    plain: Iterable[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The tensors and ``quantization_config`` of a folder holding ``weights``.

    Block-wise fp8 weights (every one of them, the output head and the embedding table among
    the plain ones) are written in the ``fp8`` layout ``transformers`` reads; everything else
    in compressed-tensors': ``pack-quantized`` int4, ``int-quantized`` int8,
    ``float-quantized`` fp8, one config group per kind of weight. A quantized embedding
    table (``[D, V]`` here) is written as the ``[V, D]`` matrix its file holds, named among
    its group's targets.

    Args:
      weights: ``weight`` tensor name -> its quantized matrix (one layer's; the embedding
        table's as the head's ``[D, V]``).
      plain: the names of the linear weights stored unquantized.

    Raises:
      BadInputError: a weight whose scales do not fit the layout (block-wise fp8 scales that
        differ within a block).
    """
    plain_modules = sorted(n.removesuffix(".weight") for n in plain)
    modules = {n.removesuffix(".weight"): w for n, w in weights.items()}
    out: dict[str, np.ndarray] = {}
    blockwise = all(w.scheme == "fp8" and w.block_columns == FP8_BLOCK
                    and w.group == FP8_BLOCK for w in modules.values())
    tables = {m for m in modules if m.split(".")[-1] == "embed_tokens"}
    if blockwise and not tables and not any(m.split(".")[-1] == "lm_head" for m in modules):
        for module, w in modules.items():
            out[f"{module}.weight"] = np.ascontiguousarray(np.asarray(w.q).T)
            out[f"{module}.weight_scale_inv"] = _uniform_blocks(w, module)
        return out, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                     "modules_to_not_convert": plain_modules}
    groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for module, w in modules.items():
        args = _ct_entry(w)
        groups.setdefault(json.dumps(args, sort_keys=True), (args, []))[1].append(module)
        out.update(_ct_tensors(module, w, args))
    layouts = {"int": {4: "pack-quantized", 8: "int-quantized"}, "float": {8: "float-quantized"}}
    config_groups = {}
    for i, (args, members) in enumerate(groups.values()):
        config_groups[f"group_{i}"] = {
            "targets": ["Linear", *sorted(tables)] if len(groups) == 1 else members,
            "weights": args,
            "input_activations": None, "output_activations": None,
            "format": layouts[args["type"]][args["num_bits"]]}
    formats = {g["format"] for g in config_groups.values()}
    return out, {"quant_method": "compressed-tensors", "quantization_status": "compressed",
                 "format": formats.pop() if len(formats) == 1 else "mixed-precision",
                 "config_groups": config_groups, "ignore": plain_modules,
                 "kv_cache_scheme": None}
