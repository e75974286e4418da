"""Quantized KV caches: key and value rows stored at one byte a value, each with its own scale.

A model loaded with ``kv_dtype="int8"`` or ``"fp8"`` keeps its attention caches in that
form. A cache row (one position, one KV head: ``head_dim`` values) is quantized when it is
written, from its own values alone: its scale is the row's largest magnitude over the
largest stored value (127 for int8, 448 for float8 e4m3), 1 for a row of zeros, and the
stored values are the row divided by it, clipped to the stored range and rounded (int8: to
nearest, ties upward, as ``floor(x + 0.5)``, an operation every kernel compiler has; fp8:
the conversion's round to nearest even). The scale sits beside the values in a float32
``[.., C, KV]`` buffer (``k_scale``, ``v_scale``) that travels, rolls back and snapshots
with them.

Reading dequantizes: each value times its row's scale in float32, rounded once to the
compute dtype (:func:`dequantize`), in every path that reads a quantized cache, in XLA or
in a kernel's registers. Since a row's stored bits depend on nothing but that row, feeding a
prompt in chunks or token by token, verifying or decoding, reusing a prefix or starting
fresh all write the same bits, and every bitwise guarantee of the block program holds within
the quantized-KV model exactly as without it. The model is not its unquantized parent: its
logits differ within the rounding of the stored rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from turbospark_jax.errors import BadInputError

#: The stored forms a KV cache takes besides the model dtype.
KV_DTYPES = ("int8", "fp8")
#: The largest magnitude each stored form holds: a row's largest value maps to it.
_LIMITS = {"int8": 127.0, "fp8": 448.0}
_STORED = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
#: The dtype of a row's scale.
SCALE_DTYPE = jnp.dtype(jnp.float32)


def check_kv_dtype(kv_dtype: Any) -> str | None:
    """``kv_dtype`` if it names a stored form (or is ``None``: the model dtype).

    Raises:
      BadInputError: anything else, naming the choices.
    """
    if kv_dtype is None or (isinstance(kv_dtype, str) and kv_dtype in KV_DTYPES):
        return kv_dtype
    raise BadInputError(
        f"kv_dtype must be one of {', '.join(repr(k) for k in KV_DTYPES)} or None (the "
        f"model's own dtype); got {kv_dtype!r}"
    )


def stored_dtype(kv_dtype: str | None, dtype: Any) -> jnp.dtype:
    """The dtype a cache's values are kept in: ``kv_dtype``'s, or the model's ``dtype``."""
    return jnp.dtype(dtype) if kv_dtype is None else _STORED[kv_dtype]


def row_scale(amax: jax.Array, kv_dtype: str) -> jax.Array:
    """The float32 scale of rows whose largest magnitudes are ``amax``: ``amax`` over the
    stored form's largest value, 1 where that is zero (a row of zeros stores zeros)."""
    scale = amax.astype(jnp.float32) / jnp.float32(_LIMITS[kv_dtype])
    return jnp.where(scale > 0, scale, jnp.float32(1.0))


def quantize_with(x: jax.Array, scale: jax.Array, kv_dtype: str) -> jax.Array:
    """``x`` divided by ``scale`` (broadcast against it) in float32, rounded and clipped to
    the stored form. Elementwise, so a kernel quantizing a row in pieces gets the bits of
    the whole row's (given the same scale)."""
    limit = _LIMITS[kv_dtype]  # Python floats: the bounds are constants in a kernel too
    y = x.astype(jnp.float32) / scale
    if kv_dtype == "int8":
        y = jnp.floor(y + 0.5)
    return jnp.clip(y, -limit, limit).astype(_STORED[kv_dtype])


def rounded(x: jax.Array) -> jax.Array:
    """``x`` in float32 holding exactly values of its own dtype. XLA may carry a 16-bit
    computation's float32 intermediate into a conversion to float32 unrounded (its excess
    precision), which would quantize a value no row held, and differently where the
    compiler fuses differently; rounding explicitly pins the value. (A compiled kernel's
    16-bit values are rounded already, so kernels call this in the interpreter only.)"""
    if x.dtype in (jnp.bfloat16, jnp.float16):
        info = jnp.finfo(x.dtype)
        return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=info.nexp,
                                        mantissa_bits=info.nmant)
    return x.astype(jnp.float32)


def quantize(x: jax.Array, kv_dtype: str) -> tuple[jax.Array, jax.Array]:
    """Rows ``x [..., hd]`` in the stored form: ``(values [..., hd], scale float32 [...])``,
    each row from its own values only."""
    x = rounded(x)
    scale = row_scale(jnp.max(jnp.abs(x), axis=-1), kv_dtype)
    return quantize_with(x, scale[..., None], kv_dtype), scale


def dequantize(values: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """Stored rows back in ``dtype``: ``values [..., hd]`` times ``scale [...]`` in float32,
    rounded once."""
    return (values.astype(jnp.float32) * scale[..., None]).astype(dtype)


def round_trip(x: jax.Array, kv_dtype: str | None) -> jax.Array:
    """``x`` as a quantized cache gives it back (``x`` itself when ``kv_dtype`` is None): what
    a pass that attends over its own new rows before reading them from the cache uses."""
    if kv_dtype is None:
        return x
    return dequantize(*quantize(x, kv_dtype), x.dtype)


def write(buffer: jax.Array, scales: Any, at: Any, rows: jax.Array, kv_dtype: str | None,
          **scatter: Any) -> tuple[jax.Array, Any]:
    """``(buffer, scales)`` with ``rows [..., hd]`` written at index ``at`` (a scatter with
    ``scatter``'s options), quantized when ``kv_dtype`` is set (``scales`` then takes their
    scales at the same index)."""
    if kv_dtype is None:
        return buffer.at[at].set(rows.astype(buffer.dtype), **scatter), scales
    values, scale = quantize(rows, kv_dtype)
    return buffer.at[at].set(values, **scatter), scales.at[at].set(scale, **scatter)


def read(buffer: jax.Array, scales: Any, dtype: Any) -> jax.Array:
    """A cache buffer's rows in ``dtype``: dequantized where it has ``scales`` (an array),
    as they are where not (``None`` or an empty tuple)."""
    if scales is None or isinstance(scales, tuple | list):
        return buffer
    return dequantize(buffer, scales, dtype)


def zeros(shape: tuple[int, ...], kv_dtype: str | None, dtype: Any) -> tuple[jax.Array, Any]:
    """A zeroed buffer of ``shape`` (``[..., hd]``) in the stored form and its scales
    (``[...]``, zeros: a dead row dequantizes to zeros, finite as the attention kernels need;
    ``()`` without quantization)."""
    values = jnp.zeros(shape, stored_dtype(kv_dtype, dtype))
    return values, (() if kv_dtype is None else jnp.zeros(shape[:-1], SCALE_DTYPE))


def scale_field(buffer_field: Any) -> Any:
    """A state field for the scales of the buffer field ``buffer_field`` (an
    :func:`~turbospark_jax.core.state.append_only` or :func:`~turbospark_jax.core.state.ring`
    field): the same position axis and rollback, default ``()`` (no quantization)."""
    return struct.field(pytree_node=True, default=(), metadata=dict(buffer_field.metadata))


def cache_bytes_per_token(model: Any, kv_dtype: Any = ...) -> int:
    """Bytes a model's cache grows by for each position it holds (values and scales of every
    position-indexed buffer: KV rows and any rows a model keeps beside them), as its
    :meth:`init_cache` allocates them; a ring of fixed size (a sliding window's) does not
    grow and is not counted. ``kv_dtype``: the model as loaded with this one instead of its
    own (``None``: the model dtype). Computed from shapes alone; no memory is allocated.

    Raises:
      BadInputError: ``kv_dtype`` is not one of :data:`KV_DTYPES` or None.
    """
    if kv_dtype is not ...:
        model = dataclasses.replace(model, kv_dtype=check_kv_dtype(kv_dtype))

    def total(capacity: int) -> int:
        shapes = jax.eval_shape(lambda: model.init_cache(capacity))
        return sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(shapes))

    return total(2) - total(1)


def kv_dtype_of(stored: Any) -> str:
    """The ``kv_dtype`` whose values are kept in the dtype ``stored`` (a kernel knows its
    cache's form from its refs' dtype).

    Raises:
      BadInputError: ``stored`` is no quantized form's dtype.
    """
    for name, dtype in _STORED.items():
        if jnp.dtype(stored) == dtype:
            return name
    raise BadInputError(f"a quantized KV cache keeps int8 or float8_e4m3fn values; got {stored}")
