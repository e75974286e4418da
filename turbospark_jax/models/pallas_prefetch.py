"""Weights read ahead into the GPU's L2 cache by extra programs of a launch-bound kernel.

A decode step alternates products that stream weights from memory with small kernels (a
norm, the RoPE-store, the attention) whose time goes to launches and latencies while the
memory sits idle; each product then starts cold. A kernel of the second kind can take
extra programs on its first grid axis that read the first bytes of the weights the next
products will read, so those products find them in the L2 cache. Nothing is computed from
what the programs read but one maximum each, which the kernel stores so that the reads are
not dropped; the kernel's own results do not change, only how soon the next ones come.

The kernels that take them (:func:`~turbospark_jax.models.pallas_rope_store.
rope_store_attention`, :func:`~turbospark_jax.models.pallas_row_norm.add_parts_rms_norm`)
call :func:`prepare` for the operands and the plan, give :data:`PROGRAMS` more programs to
their grid (their own blocks' index maps clamped to their real programs), and run
:func:`warm` in the programs past their own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

#: What the dense model's row-invariant decode reads ahead (bytes; 0: nothing; read when a
#: program is traced). Speed only, and off until a GPU has measured it
#: (``benchmarks/rowinv_model.py --prefetch-mb``, ``--norm-prefetch-mb``):
#: the fused RoPE-store-and-attention kernel reads the layer's output projection, then its
#: gate, up and down projections; each norm of a deferred-sum layer reads the product's
#: after it (q/k/v after the input norm, gate and up after the post-attention norm).
ATTENTION_BYTES = 0
NORM_BYTES = 0
#: Calls of more rows than this (a prefill's) read nothing ahead: their own work keeps the
#: memory busy.
MAX_ROWS = 16
#: The extra programs a kernel gets for its prefetch.
PROGRAMS = 64
#: The weights are read as ``[-1, COLS]`` tiles of :data:`ROWS` rows.
COLS = 512
ROWS = 16


def plan(weights: tuple[jax.Array, ...], budget: int) -> tuple[int, ...]:
    """Rows of each weight (seen as ``[-1, COLS]``) to read within ``budget`` bytes: the
    first weight as far as it goes, the rest of the budget evenly over the others; none of
    a weight whose size is not whole tiles."""
    tile = ROWS * COLS
    rows = []
    left = budget
    for i, w in enumerate(weights):
        if w.size % tile:
            rows.append(0)
            continue
        share = left if i == 0 else left // (len(weights) - i)
        n = min(w.size, share // w.dtype.itemsize) // tile * ROWS
        rows.append(n)
        left -= n * COLS * w.dtype.itemsize
    return tuple(rows)


def prepare(weights: tuple[jax.Array, ...],
            budget: int) -> tuple[tuple[jax.Array, ...], tuple[int, ...]]:
    """``(views, rows)``: the weights to read as ``[-1, COLS]`` views (free reshapes) and
    how many rows of each (:func:`plan`), those with none left out; both empty without a
    budget."""
    if not budget:
        return (), ()
    views = tuple(w.reshape(-1, COLS) for w in weights if w.size % (ROWS * COLS) == 0)
    rows = plan(views, budget)
    return (tuple(v for v, n in zip(views, rows, strict=True) if n),
            tuple(n for n in rows if n))


def warm(p: jax.Array, refs: tuple[Any, ...], rows: tuple[int, ...],
         programs: int) -> jax.Array:
    """Inside a kernel: prefetch program ``p``'s share (of ``programs``) of the first
    ``rows`` rows of each weight ref, read a tile at a time; their maximum, for the caller
    to store."""
    top = jnp.float32(-jnp.inf)
    for ref, count in zip(refs, rows, strict=True):
        tiles = -(-count // ROWS)
        per = -(-tiles // programs)  # tiles per program

        def step(i, top, ref=ref, count=count, per=per):
            start = jnp.minimum((p * per + i) * ROWS, count - ROWS)
            return jnp.maximum(top, jnp.max(ref[pl.ds(start, ROWS), :].astype(jnp.float32)))

        top = jax.lax.fori_loop(0, per, step, top)
    return top


def store(top_ref: Any, p: jax.Array, top: jax.Array) -> None:
    """Keep program ``p``'s maximum in the kernel's ``[PROGRAMS]`` output."""
    top_ref[pl.ds(p, 1)] = jnp.full((1,), top, jnp.float32)
