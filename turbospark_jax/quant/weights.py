"""Quantized weight matrices: the stored form, quantizing to it and dequantizing from it.

A :class:`QuantizedWeight` stands in a params tree where a linear layer's weight ``[K, N]``
(``K`` inputs, ``N`` outputs; a model's leaf may split either side into several axes) would
be. Every scheme is one shape of data: the values ``q`` at their stored width, and per-column
scales for each *group* of ``group`` consecutive rows of ``K`` (one group spanning all of
``K`` is a per-output-channel scale). The matrix it stands for is

* ``int8``: ``q * scale``, ``q`` int8 in ``[-127, 127]`` (symmetric);
* ``int4``: ``(q - zero) * scale``, ``q`` and ``zero`` in ``[0, 15]``; two values per byte,
  packed along ``N``: byte ``[k, j]`` holds column ``2j`` in its low four bits and column
  ``2j + 1`` in its high four, so a kernel unpacks a tile by interleaving two nibble planes
  along its last axis;
* ``fp8``: ``q * scale``, ``q`` float8 e4m3 (finite range +-448), per output channel or in
  the 128 x 128 blocks publishers ship (:attr:`QuantizedWeight.block_columns` columns share
  a scale; stored expanded to one scale per column, so every kernel reads one layout).

Each element dequantizes in float32 with one multiply (``int4`` with a subtraction first, which
is exact), then rounds once to the compute dtype: an elementwise function of the stored bits,
so a kernel that dequantizes a tile in registers gets the bits :func:`dequantize` gets, and a
quantized model keeps every bitwise guarantee of the kernels that multiply by it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from turbospark_jax.errors import BadInputError

#: The schemes a :class:`QuantizedWeight` stores.
SCHEMES = ("int8", "int4", "fp8")
#: The group sizes ``int4`` takes (rows of ``K`` per scale).
INT4_GROUPS = (32, 64, 128)
#: The block edge of block-wise fp8 checkpoints.
FP8_BLOCK = 128
#: The largest finite float8 e4m3 value.
FP8_MAX = 448.0
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)

#: Stored dtype of ``q`` per scheme.
_VALUE_DTYPES = {"int8": np.dtype(np.int8), "int4": np.dtype(np.uint8),
                 "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A linear layer's weight in a quantized scheme (see the module docstring).

    Leaves (jax or numpy arrays, with the same leading axes when layers are stacked):
      q: the values: int8 ``[..., K, N]``, uint8 ``[..., K, N / 2]`` (int4, packed) or
        float8 e4m3 ``[..., K, N]``.
      scale: float32 ``[..., K / group, N]``.
      zero: uint8 ``[..., K / group, N]`` (int4 with zero points), else None.

    Static fields (part of the tree's structure):
      scheme: one of :data:`SCHEMES`.
      group: rows of ``K`` per scale row (``K`` for one scale per output channel).
      in_shape, out_shape: the axes of the leaf this matrix stands for, ``K = prod(in_shape)``
        and ``N = prod(out_shape)``.
      dtype: the dtype it dequantizes to and multiplies in (the model's).
      block_columns: columns that share one scale in the checkpoint's own layout (128 for
        block-wise fp8; 1 otherwise): kept so a saved folder writes the scales as they came.
    """

    q: Any
    scale: Any
    zero: Any
    scheme: str
    group: int
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dtype: Any
    block_columns: int = 1

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return ((self.q, self.scale, self.zero),
                (self.scheme, self.group, self.in_shape, self.out_shape,
                 jnp.dtype(self.dtype).name, self.block_columns))

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], leaves: tuple[Any, ...]) -> QuantizedWeight:
        scheme, group, in_shape, out_shape, dtype, block_columns = aux
        return cls(*leaves, scheme, group, in_shape, out_shape, jnp.dtype(dtype), block_columns)

    # -- what a model sees: the matrix's shape ----------------------------------------------

    @property
    def k(self) -> int:
        """Rows (inputs) of the matrix."""
        return math.prod(self.in_shape)

    @property
    def n(self) -> int:
        """Columns (outputs) of the matrix."""
        return math.prod(self.out_shape)

    @property
    def lead(self) -> tuple[int, ...]:
        """The stacking axes in front of the matrix (a stacked layer axis; ``()`` for one)."""
        return tuple(np.shape(self.q)[:-2])

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the leaf it stands for."""
        return self.lead + self.in_shape + self.out_shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def stored_bytes(self) -> int:
        """Bytes of its leaves as stored (what a step reads to multiply by it)."""
        leaves = (self.q, self.scale) + ((self.zero,) if self.zero is not None else ())
        return sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in leaves)

    def reshape(self, *shape: Any) -> QuantizedWeight:
        """The same matrix as a leaf of ``shape`` (``-1`` allowed once): its axes must split
        into the inputs' and the outputs' at one place, since the stored matrix is ``[K,
        N]``.

        Raises:
          BadInputError: a stacked weight, or a shape whose axes do not split so.
        """
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        if self.lead:
            raise BadInputError(f"a stacked quantized weight {self.shape} cannot be reshaped; "
                                "index its layer first")
        total = self.k * self.n
        if shape.count(-1) == 1:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(total // known if s == -1 else s for s in shape)
        shape = tuple(int(s) for s in shape)
        for split in range(len(shape) + 1):
            if math.prod(shape[:split]) == self.k and math.prod(shape[split:]) == self.n:
                return dataclasses.replace(self, in_shape=shape[:split], out_shape=shape[split:])
        raise BadInputError(f"a quantized [{self.k}, {self.n}] matrix cannot take the shape "
                            f"{shape}: its axes must split into {self.k} inputs and {self.n} "
                            "outputs")

    def matrix(self) -> QuantizedWeight:
        """The same weight with one input and one output axis, ``[K, N]``."""
        return dataclasses.replace(self, in_shape=(self.k,), out_shape=(self.n,))

    def __getitem__(self, index: Any) -> QuantizedWeight:
        """One layer of a stacked weight (an index into the leading axes only)."""
        if not self.lead:
            raise BadInputError("only a stacked quantized weight can be indexed (by layer)")
        zero = None if self.zero is None else self.zero[index]
        return dataclasses.replace(self, q=self.q[index], scale=self.scale[index], zero=zero)

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The matrix it stands for, shaped as its leaf, in ``dtype`` (its own by default)."""
        return dequantize(self, dtype)

    def __rmatmul__(self, x: Any) -> jax.Array:
        """``x @ w`` for a model written with ``@``: the dequantized matrix, multiplied by
        XLA's own product (fast paths multiply in a kernel; see
        :func:`~turbospark_jax.kernels.plan.matmul`)."""
        return jnp.asarray(x) @ dequantize(self, jnp.asarray(x).dtype)


def is_quantized(w: Any) -> bool:
    """Whether ``w`` is a :class:`QuantizedWeight`."""
    return isinstance(w, QuantizedWeight)


def as_array(w: Any, dtype: Any) -> Any:
    """``w`` as a plain array: a :class:`QuantizedWeight` dequantized to ``dtype``, anything
    else as it is (for the places that multiply by XLA's own operations)."""
    return dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w


def take_rows(table: Any, tokens: jax.Array, dtype: Any) -> jax.Array:
    """Embedding rows ``[*tokens.shape, D]`` in ``dtype`` of a table ``[V, D]``: a plain
    array's rows, or a quantized table's (stored as its transpose, the head's ``[D, V]``
    matrix, one column per token) columns dequantized alone, bitwise as
    :func:`dequantize` makes them."""
    if not isinstance(table, QuantizedWeight):
        return jnp.take(table, tokens, axis=0).astype(dtype)
    flat = tokens.reshape(-1)
    q = jnp.asarray(table.q)
    if table.scheme == "int4":
        packed = jnp.take(q, flat // 2, axis=1)
        columns = jnp.where(flat % 2 == 0, packed & 0xF, packed >> 4)
    else:
        columns = jnp.take(q, flat, axis=1)  # [D, T]
    values = columns.astype(jnp.float32)
    d = values.shape[0]
    groups = d // table.group
    values = values.reshape(groups, table.group, -1)
    if table.zero is not None:
        values = values - jnp.take(jnp.asarray(table.zero), flat, axis=1).astype(
            jnp.float32)[:, None, :]
    scale = jnp.take(jnp.asarray(table.scale), flat, axis=1)[:, None, :]
    rows = (values * scale).astype(dtype).reshape(d, -1).T
    return rows.reshape(*tokens.shape, d)


def tied_logits(h: jax.Array, table: Any) -> jax.Array:
    """float32 logits ``h [W, D] @ table.T`` of a head tied to the embedding table ``[V, D]``
    (a quantized table is stored as the head's ``[D, V]`` matrix already)."""
    if isinstance(table, QuantizedWeight):
        return jnp.matmul(h, dequantize(table, h.dtype), preferred_element_type=jnp.float32)
    return jnp.einsum("wd,vd->wv", h, table, preferred_element_type=jnp.float32)


def dequantize(w: QuantizedWeight, dtype: Any = None) -> jax.Array:
    """``w``'s matrix in ``dtype`` (``w.dtype`` when None), shaped as its leaf: each element
    ``(q - zero) * scale`` (or ``q * scale``) in float32, rounded once."""
    dtype = jnp.dtype(w.dtype if dtype is None else dtype)
    q = jnp.asarray(w.q)
    lead = q.shape[:-2]
    if w.scheme == "int4":
        q = unpack_int4(q)
    values = q.astype(jnp.float32)
    k, n = values.shape[-2:]
    groups = k // w.group
    values = values.reshape(*lead, groups, w.group, n)
    if w.zero is not None:
        values = values - jnp.asarray(w.zero).astype(jnp.float32)[..., None, :]
    out = (values * jnp.asarray(w.scale)[..., None, :]).astype(dtype)
    return out.reshape(*lead, *w.in_shape, *w.out_shape)


def unpack_int4(packed: Any) -> jax.Array:
    """uint8 ``[..., K, N / 2]`` packed along ``N`` -> uint8 ``[..., K, N]`` of nibbles."""
    packed = jnp.asarray(packed)
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_int4(values: np.ndarray) -> np.ndarray:
    """uint8 nibbles ``[..., K, N]`` (``N`` even) -> ``[..., K, N / 2]`` packed along ``N``."""
    values = np.asarray(values, np.uint8)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


# -- quantizing --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How to quantize a model's weights on load.

    Attributes:
      scheme: ``"int8"`` (per output channel, symmetric), ``"int4"`` (group-wise with zero
        points), ``"fp8"`` (e4m3, per output channel) or ``"fp8-block"`` (e4m3, one scale
        per 128 x 128 block).
      group: rows of ``K`` per scale for ``int4``: one of :data:`INT4_GROUPS`.
      head: quantize the output head (an untied ``lm_head``) too.
      embeddings: quantize the embedding table too (and with it a head tied to it), stored
        as the head's ``[D, V]`` matrix so a tied head multiplies by it in place; a token's
        embedding is its column, dequantized (:func:`take_rows`).

    Both stay in the model's dtype by default: the head is the product most sensitive to
    rounding, and the table's rows are read one per token, so quantizing it saves memory
    rather than decode time.
    """

    scheme: str
    group: int = 128
    head: bool = False
    embeddings: bool = False

    def __post_init__(self) -> None:
        if self.scheme not in (*SCHEMES, "fp8-block"):
            raise BadInputError(
                f"quantize must be one of int8, int4, fp8, fp8-block; got {self.scheme!r}")
        if self.scheme == "int4" and self.group not in INT4_GROUPS:
            raise BadInputError(f"int4 groups hold {', '.join(map(str, INT4_GROUPS))} rows; "
                                f"got group={self.group!r}")
        for name in ("head", "embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise BadInputError(f"{name} must be a bool; got {getattr(self, name)!r}")

    def fits(self, k: int, n: int) -> bool:
        """Whether a ``[k, n]`` matrix takes this scheme: whole groups (and blocks) and, for
        int4, an even ``n``. A loader keeps a matrix that does not fit in the model's dtype
        (a small projection whose inputs are fewer than one group)."""
        if self.scheme == "int4":
            return k % self.group == 0 and n % 2 == 0
        if self.scheme == "fp8-block":
            return k % FP8_BLOCK == 0 and n % FP8_BLOCK == 0
        return True

    @classmethod
    def parse(cls, spec: Any) -> Quantization | None:
        """``spec`` as a :class:`Quantization`: None, one already, or a name such as
        ``"int8"``, ``"int4"``, ``"int4-g64"`` or ``"fp8"``.

        Raises:
          BadInputError: anything else (the names are listed).
        """
        if spec is None or isinstance(spec, Quantization):
            return spec
        if not isinstance(spec, str):
            raise BadInputError(f"quantize must be a scheme name such as 'int8' or a "
                                f"Quantization; got {type(spec).__name__}")
        scheme, _, group = spec.partition("-g")
        if group:
            if scheme != "int4" or not group.isdigit():
                raise BadInputError(f"a group size goes with int4 only ('int4-g64'); got "
                                    f"{spec!r}")
            return cls(scheme, int(group))
        return cls(spec)


def quantize(matrix: np.ndarray, scheme: str, *, group: int | None = None,
             in_shape: tuple[int, ...] | None = None, out_shape: tuple[int, ...] | None = None,
             dtype: Any = jnp.bfloat16) -> QuantizedWeight:
    """Quantize a weight ``[K, N]`` (host numpy; float32 arithmetic) in ``scheme``
    (:data:`SCHEMES` or ``"fp8-block"``).

    Round to nearest; int8 and fp8 scales map each column's largest magnitude to the format's
    largest value; int4 maps each group's range ``[min, max]`` (stretched to hold 0) onto
    ``[0, 15]`` with a zero point.

    Raises:
      BadInputError: not a 2-D matrix; ``K`` not a multiple of the group; an odd ``N`` for
        int4; non-finite values.
    """
    w = np.asarray(matrix, np.float32)
    if w.ndim != 2:
        raise BadInputError(f"quantize takes a [K, N] matrix; got shape {w.shape}")
    if not np.isfinite(w).all():
        raise BadInputError("a weight with non-finite values cannot be quantized")
    k, n = w.shape
    in_shape = (k,) if in_shape is None else tuple(in_shape)
    out_shape = (n,) if out_shape is None else tuple(out_shape)
    if scheme == "int8":
        scale = _safe(np.abs(w).max(axis=0, keepdims=True) / 127.0)
        q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
        return QuantizedWeight(q, scale, None, "int8", k, in_shape, out_shape, jnp.dtype(dtype))
    if scheme == "int4":
        group = 128 if group is None else group
        grouped = _grouped(w, group, "int4")
        low = np.minimum(grouped.min(axis=1), 0.0)
        high = np.maximum(grouped.max(axis=1), 0.0)
        scale = _safe((high - low) / 15.0)
        zero = np.clip(np.rint(-low / scale), 0, 15)
        q = np.clip(np.rint(grouped / scale[:, None]) + zero[:, None], 0, 15).reshape(k, n)
        if n % 2:
            raise BadInputError(f"int4 packs two columns a byte; N = {n} is odd")
        return QuantizedWeight(pack_int4(q), scale, zero.astype(np.uint8), "int4", group,
                               in_shape, out_shape, jnp.dtype(dtype))
    if scheme in ("fp8", "fp8-block"):
        if scheme == "fp8":
            scale = _safe(np.abs(w).max(axis=0, keepdims=True) / FP8_MAX)
            group, columns = k, 1
        else:
            grouped = _grouped(w, FP8_BLOCK, "fp8-block")
            if n % FP8_BLOCK:
                raise BadInputError(f"fp8-block needs N a multiple of {FP8_BLOCK}; got {n}")
            peak = np.abs(grouped).max(axis=1).reshape(k // FP8_BLOCK, n // FP8_BLOCK, FP8_BLOCK)
            scale = np.repeat(_safe(peak.max(axis=2) / FP8_MAX), FP8_BLOCK, axis=1)
            group, columns = FP8_BLOCK, FP8_BLOCK
        q = _fp8(w.reshape(k // group, group, n) / scale[:, None]).reshape(k, n)
        return QuantizedWeight(q, scale.astype(np.float32), None, "fp8", group, in_shape,
                               out_shape, jnp.dtype(dtype), columns)
    raise BadInputError(f"unknown quantization scheme {scheme!r}")


def _safe(scale: np.ndarray) -> np.ndarray:
    """Scales with zeros (an all-zero column or group) made 1, so nothing divides by zero."""
    return np.where(scale > 0, scale, 1.0).astype(np.float32)


def _grouped(w: np.ndarray, group: int, what: str) -> np.ndarray:
    k, n = w.shape
    if k % group:
        raise BadInputError(f"{what} groups of {group} rows need K a multiple of {group}; "
                            f"got K = {k}")
    return w.reshape(k // group, group, n)


def _fp8(x: np.ndarray) -> np.ndarray:
    """float32 -> float8 e4m3, rounded to nearest and clipped to its finite range."""
    return np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def split_inputs(shape: tuple[int, ...], k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A matrix leaf's axes ``shape`` as ``(inputs, outputs)``: the leading axes whose product
    is ``k``, and the rest.

    Raises:
      BadInputError: no leading axes make ``k``.
    """
    shape = tuple(shape)
    split = next((i for i in range(len(shape) + 1) if math.prod(shape[:i]) == k), None)
    if split is None:
        raise BadInputError(f"a leaf of shape {shape} has no {k} inputs to quantize")
    return shape[:split], shape[split:]


def quantize_leaf(leaf: np.ndarray, k: int, lead: int, spec: Quantization,
                  dtype: Any) -> QuantizedWeight:
    """A params leaf ``[*stack, *in, *out]`` (host numpy) whose matrix has ``k`` inputs,
    after ``lead`` stacking axes (0, or 1 for stacked layers), quantized by ``spec``: one
    matrix (and its own scales) per stacked layer.

    Raises:
      BadInputError: the axes after the stack do not split into ``k`` inputs.
    """
    leaf = np.asarray(leaf)
    stack = leaf.shape[:lead]
    in_shape, out_shape = split_inputs(leaf.shape[lead:], k)
    n = math.prod(out_shape)
    parts = [quantize(m, spec.scheme, group=spec.group, in_shape=in_shape,
                      out_shape=out_shape, dtype=dtype) for m in leaf.reshape(-1, k, n)]
    if not stack:
        return parts[0]

    def stacked(name: str) -> Any:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else np.stack(values).reshape(
            *stack, *values[0].shape)

    return dataclasses.replace(parts[0], q=stacked("q"), scale=stacked("scale"),
                               zero=stacked("zero"))


def stored_dtype(scheme: str) -> np.dtype:
    """The dtype of ``q`` in ``scheme``."""
    return _VALUE_DTYPES[scheme]
