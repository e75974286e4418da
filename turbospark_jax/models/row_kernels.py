"""The per-row work of a dense layer (matrix products, RMSNorm, RoPE, attention) under a model's
``kernels`` mode.

* ``"xla"``: XLA's own kernels. Fast, but a row's bits may change with the number of rows
  in the call, so exactness needs one program width for every path (DESIGN.md section 2).
* ``"rowinv"``: every piece gives a row the same bits whatever the number of rows beside it,
  so programs of different widths (decode at one row, verify at ``k + 1``, prefill in wide
  chunks) agree row for row. Matrix products run through
  :func:`~turbospark_jax.models.rowinv.rowinv_matmul`; the norm and attention run in
  fixed-shape tiles of :data:`~turbospark_jax.models.rowinv.ROW_TILE` rows
  (:func:`~turbospark_jax.models.rowinv.row_tiled`), since XLA's own reductions and
  attention products change with the row count on the CPU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from turbospark_jax.errors import BadInputError
from turbospark_jax.models import layers
from turbospark_jax.models.rowinv import row_tiled, rowinv_matmul

#: Values of a model's ``kernels`` field.
KERNELS = ("xla", "rowinv")


def check_kernels(kernels: Any) -> None:
    """Raises:
      BadInputError: ``kernels`` is not one of :data:`KERNELS`."""
    if kernels not in KERNELS:
        raise BadInputError(f"kernels must be one of {', '.join(KERNELS)}; got {kernels!r}")


def matmul(kernels: str, x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    """``x [W, K] @ w [K, N]`` in ``out_dtype`` (``x.dtype`` when None), float32 accumulation."""
    if kernels == "rowinv":
        return rowinv_matmul(x, w, out_dtype=out_dtype)
    if out_dtype is None:
        return x @ w
    return jnp.matmul(x, w, preferred_element_type=out_dtype)


def rms_norm(kernels: str, x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """:func:`~turbospark_jax.models.layers.rms_norm` over the last axis of ``x [..., D]``;
    under ``"rowinv"`` every leading index is a row of the fixed-shape tiles."""
    if kernels == "xla":
        return layers.rms_norm(x, weight, eps)
    rows = x.reshape(-1, x.shape[-1])
    if weight is None:
        return row_tiled(lambda t: layers.rms_norm(t, None, eps), rows).reshape(x.shape)
    return row_tiled(lambda t, w: layers.rms_norm(t, w, eps), rows,
                     shared=(weight,)).reshape(x.shape)


def rope_cos_sin(kernels: str, positions: jax.Array, inv_freq: Any, scale: float,
                 dtype: Any) -> tuple[jax.Array, jax.Array]:
    """:func:`~turbospark_jax.models.layers.rope_cos_sin` of ``positions [W]``; under
    ``"rowinv"`` in fixed-shape tiles (XLA's vectorised sine and cosine need not round a
    row alike at every row count)."""
    if kernels == "xla":
        return layers.rope_cos_sin(positions, inv_freq, scale, dtype)
    return row_tiled(lambda p: layers.rope_cos_sin(p, inv_freq, scale, dtype), positions)


def apply_rope(kernels: str, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """:func:`~turbospark_jax.models.layers.apply_rope` of ``x [W, N, hd]``; under
    ``"rowinv"`` in fixed-shape tiles."""
    if kernels == "xla":
        return layers.apply_rope(x, cos, sin)
    return row_tiled(layers.apply_rope, x, cos, sin)


def attend(kernels: str, q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
           k_positions: jax.Array, window: Any) -> jax.Array:
    """:func:`~turbospark_jax.models.layers.attend` of queries ``[W, H, hd]`` over keys and
    values ``[S, KV, hd]``; under ``"rowinv"`` the queries go in fixed-shape tiles, so a
    query row's score and value products have one shape whatever ``W`` is."""
    if kernels == "xla":
        return layers.attend(q, k, v, q_positions, k_positions, window)
    return row_tiled(
        lambda qt, pt, k, v, kp: layers.attend(qt, k, v, pt, kp, window), q, q_positions,
        shared=(k, v, k_positions),
    )
