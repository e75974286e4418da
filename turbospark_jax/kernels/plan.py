"""The per-row work of a dense layer (matrix products, RMSNorm, RoPE, attention) under a model's
``kernels`` mode.

* ``"xla"``: XLA's own kernels. Fast, but a row's bits may change with the number of rows
  in the call, so exactness needs one program width for every path (DESIGN.md section 2).
* ``"rowinv"``: every piece gives a row the same bits whatever the number of rows beside it,
  so programs of different widths (decode at one row, verify at ``k + 1``, prefill in wide
  chunks) agree row for row. Matrix products run through
  :func:`~turbospark_jax.kernels.rowinv.rowinv_matmul` (Pallas kernels with a fixed order
  over K on a GPU). On a GPU the norm is a Pallas kernel of one program per row
  (:mod:`~turbospark_jax.kernels.row_norm`) and RoPE's elementwise arithmetic runs as
  XLA writes it (no reduction, so nothing whose order could follow the shape); attention is
  the fused kernel in its row-invariant form where the dense model's cache is per layer
  (:mod:`~turbospark_jax.models.dense.attention`). On the CPU, where XLA's own reductions
  and products change with the row count, the norm, RoPE and attention run in fixed-shape
  tiles of :data:`~turbospark_jax.kernels.rowinv.XLA_ROW_TILE` rows
  (:func:`~turbospark_jax.kernels.rowinv.row_tiled`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import layers
from turbospark_jax.kernels.rowinv import (
    row_tiled,
    rowinv_matmul,
    rowinv_swiglu,
    schedule_for,
    sum_parts,
)

#: Values of a model's ``kernels`` field.
KERNELS = ("xla", "rowinv")
#: The CPU's tiled attention runs at least one tile, like the product
#: (:data:`~turbospark_jax.kernels.rowinv.DOT_MIN_TILES`), not the norms' two: checked across
#: widths under the default and the tests' XLA flags (``tests/test_rowinv*.py`` and
#: ``benchmarks.rowinv_model --preset cpu --parts exact``); a one-row decode step then attends
#: with 4 query rows, not 8 (43-46 to 52-55 tokens/s on the CPU preset).
ATTEND_MIN_TILES = 1


def check_kernels(kernels: Any) -> None:
    """Raises:
      BadInputError: ``kernels`` is not one of :data:`KERNELS`."""
    if kernels not in KERNELS:
        raise BadInputError(f"kernels must be one of {', '.join(KERNELS)}; got {kernels!r}")


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def matmul(kernels: str, x: jax.Array, w: jax.Array | tuple[jax.Array, ...],
           out_dtype: Any = None, w_layout: str = "kn", label: str = "") -> jax.Array:
    """``x [W, K] @ w [K, N]`` in ``out_dtype`` (``x.dtype`` when None), float32 accumulation.

    ``w`` may be a tuple of weights whose products come out side by side (one launch under
    ``"rowinv"``), and ``w_layout="nk"`` takes weights stored ``[N, K]`` (a tied head);
    ``label`` names the row-invariant kernel in a profile."""
    if kernels == "rowinv":
        return rowinv_matmul(x, w, w_layout=w_layout, out_dtype=out_dtype,
                             schedule=_schedule(x, w, w_layout), label=label)
    ws = w if isinstance(w, tuple) else (w,)
    if w_layout == "nk":
        ws = tuple(a.T for a in ws)
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=1)
    if out_dtype is None:
        return x @ w
    return jnp.matmul(x, w, preferred_element_type=out_dtype)


def swiglu(kernels: str, x: jax.Array, gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU's hidden rows ``silu(x @ gate) * (x @ up)`` under ``"rowinv"``: one launch on a
    GPU that gates in its epilogue (:func:`~turbospark_jax.kernels.rowinv.rowinv_swiglu`),
    labelled ``gate_up``."""
    if kernels != "rowinv":
        raise BadInputError(f"the gated product is a row-invariant kernel; got {kernels!r}")
    return rowinv_swiglu(x, gate, up, label="gate_up")


def matmul_parts(kernels: str, x: jax.Array, w: jax.Array | tuple[jax.Array, ...],
                 label: str = "") -> jax.Array:
    """``x @ w`` under ``"rowinv"``, unfinished: float32 partial sums over K ``[S, W, N]``
    (:func:`~turbospark_jax.kernels.rowinv.sum_parts` finishes them; so do
    :func:`add_norm` and the RoPE-and-cache-write kernel, without a launch of their own)."""
    if kernels != "rowinv":
        raise BadInputError(f"partial sums come from the row-invariant kernels; got {kernels!r}")
    return rowinv_matmul(x, w, parts=True, schedule=_schedule(x, w, "kn"), label=label)


def _schedule(x: jax.Array, w: Any, w_layout: str) -> Any:
    ws = w if isinstance(w, tuple) else (w,)
    return schedule_for(x.shape[-1], sum(a.shape[0 if w_layout == "nk" else 1] for a in ws))


def add_norm(kernels: str, residual: jax.Array, parts: jax.Array, weight: jax.Array | None,
             eps: float) -> tuple[jax.Array, jax.Array]:
    """``h = residual + sum_parts(parts)`` and its RMSNorm, ``(h, normed)``, under
    ``"rowinv"``: one kernel on a GPU (:func:`~turbospark_jax.kernels.row_norm.
    add_parts_rms_norm`), the sum (elementwise) and the tiled norm on the CPU. Both round
    ``h`` exactly as finishing the product and adding it would."""
    if _on_gpu():
        from turbospark_jax.kernels.row_norm import add_parts_rms_norm

        return add_parts_rms_norm(residual, parts, weight, eps)
    h = residual + sum_parts(parts, residual.dtype)
    return h, rms_norm(kernels, h, weight, eps)


def rms_norm(kernels: str, x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """:func:`~turbospark_jax.kernels.layers.rms_norm` over the last axis of ``x [..., D]``;
    under ``"rowinv"`` every leading index is a row of the fixed-shape tiles."""
    if kernels == "xla":
        return layers.rms_norm(x, weight, eps)
    if _on_gpu():
        from turbospark_jax.kernels.row_norm import row_rms_norm

        return row_rms_norm(x, weight, eps)
    rows = x.reshape(-1, x.shape[-1])
    if weight is None:
        return row_tiled(lambda t: layers.rms_norm(t, None, eps), rows).reshape(x.shape)
    return row_tiled(lambda t, w: layers.rms_norm(t, w, eps), rows,
                     shared=(weight,)).reshape(x.shape)


def rope_cos_sin(kernels: str, positions: jax.Array, inv_freq: Any, scale: float,
                 dtype: Any) -> tuple[jax.Array, jax.Array]:
    """:func:`~turbospark_jax.kernels.layers.rope_cos_sin` of ``positions [W]``; under
    ``"rowinv"`` in fixed-shape tiles (XLA's vectorised sine and cosine need not round a
    row alike at every row count)."""
    if kernels == "xla" or _on_gpu():
        return layers.rope_cos_sin(positions, inv_freq, scale, dtype)
    return row_tiled(lambda p: layers.rope_cos_sin(p, inv_freq, scale, dtype), positions)


def apply_rope(kernels: str, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """:func:`~turbospark_jax.kernels.layers.apply_rope` of ``x [W, N, hd]``; under
    ``"rowinv"`` in fixed-shape tiles."""
    if kernels == "xla" or _on_gpu():
        return layers.apply_rope(x, cos, sin)
    return row_tiled(layers.apply_rope, x, cos, sin)


def attend(kernels: str, q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
           k_positions: jax.Array, window: Any) -> jax.Array:
    """:func:`~turbospark_jax.kernels.layers.attend` of queries ``[W, H, hd]`` over keys and
    values ``[S, KV, hd]``; under ``"rowinv"`` the queries go in fixed-shape tiles, so a
    query row's score and value products have one shape whatever ``W`` is. On a CPU each tile
    walks the keys in blocks up to the last one its rows see (:func:`_attend_blocks`); on a
    GPU (where this is the fallback for shapes the fused kernel does not take) it takes the
    whole softmax, since a loop whose trip count is data waits on the host there, per block."""
    if kernels == "xla":
        return layers.attend(q, k, v, q_positions, k_positions, window)
    attend_tile = layers.attend if _on_gpu() else _attend_blocks
    return row_tiled(
        lambda qt, pt, k, v, kp: attend_tile(qt, k, v, pt, kp, window), q, q_positions,
        shared=(k, v, k_positions), min_tiles=ATTEND_MIN_TILES,
    )


#: Keys per block of the row-invariant XLA form's attention (:func:`_attend_blocks`).
KEY_BLOCK = 256


def _attend_blocks(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                   k_positions: jax.Array, window: Any) -> jax.Array:
    """Causal grouped-query attention of a tile of query rows ``[T, H, hd]`` over ``[S, KV,
    hd]`` keys and values (the contract of :func:`~turbospark_jax.kernels.layers.attend`),
    walking the keys in blocks of :data:`KEY_BLOCK` rows at fixed offsets, up to the block of
    the last key a row of the tile sees, with an online softmax (as the GPU kernel does).

    A decode step then reads its context's blocks, not the whole cache. A row's bits do not
    depend on how many blocks its tile walks: a block with no key the row sees leaves its
    maximum, multiplies its sums by ``exp(0) == 1`` and adds exact zeros (the maximum starts
    at the finite ``MASK_VALUE``: blocks before the first key a row sees add only what the
    first such block then multiplies by ``exp(MASK_VALUE - m) == 0``). The last block may
    overlap the one before it (it ends at ``S``); keys before its nominal start are masked.
    """
    rows, heads, head_dim = q.shape
    length, kv_heads, _ = k.shape
    block = min(KEY_BLOCK, length)
    groups = heads // kv_heads
    qg = q.reshape(rows, kv_heads, groups, head_dim)
    scale = head_dim**-0.5
    # The last cache row any row of the tile sees: an exact integer reduction.
    index = jnp.arange(length, dtype=jnp.int32)
    last = jnp.max(jnp.where(k_positions <= jnp.max(q_positions), index, -1))
    blocks = (last + block) // block

    def one(b: jax.Array, carry: tuple) -> tuple:
        acc, m, l = carry
        nominal = b * block
        start = jnp.minimum(nominal, length - block)
        kb, vb, pb = (jax.lax.dynamic_slice_in_dim(a, start, block, 0)
                      for a in (k, v, k_positions))
        scores = jnp.einsum("wkgd,skd->kgws", qg, kb,
                            preferred_element_type=jnp.float32) * scale
        visible = (pb[None, :] <= q_positions[:, None]) & (
            (start + jnp.arange(block))[None, :] >= nominal)
        if window is not None:
            visible &= pb[None, :] > q_positions[:, None] - window
        scores = jnp.where(visible[None, None], scores, layers.MASK_VALUE)
        top = jnp.maximum(m, jnp.max(scores, axis=-1))
        fade = jnp.exp(m - top)
        probs = jnp.exp(scores - top[..., None])
        acc = acc * fade[..., None] + jnp.einsum(
            "kgws,skd->kgwd", probs.astype(v.dtype), vb, preferred_element_type=jnp.float32)
        return acc, top, l * fade + jnp.sum(probs, axis=-1)

    shape = (kv_heads, groups, rows)
    acc, _, l = jax.lax.fori_loop(0, blocks, one, (
        jnp.zeros((*shape, head_dim), jnp.float32),
        jnp.full(shape, layers.MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32)))
    l = jnp.where(l > 0, l, 1.0)  # a tile of padding rows that sees no key: zeros, not NaN
    out = (acc / l[..., None]).astype(v.dtype)  # [KV, G, T, hd]
    return out.transpose(2, 0, 1, 3).reshape(rows, heads, head_dim)
