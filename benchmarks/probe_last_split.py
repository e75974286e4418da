"""Probe: can a long context's attention fold its key splits in the last split's program?

At a long context a decode step's row-invariant attention is two launches a layer: the split
kernel (one program per KV head, query tile and key split, each writing its split's partial
``(acc, m, l)``) and the fold kernel (one program per KV head and query tile, folding the
partials in order). On an H200 the 1B's attention costs 238 us a token at 4k against 113 at
128, where one kernel folds on chip (NOTES.md, thirteenth session). Here the split kernel's
programs bump a counter per (KV head, query tile) with an atomic add after their partial is
stored; the one that finds itself last folds that tile's partials with the fold kernel's own
body (:func:`~turbospark_jax.models.pallas_attention.fold_partial_refs`) and resets the
counter. The fold is elementwise across splits, in split order, so the bits should be the
two launches'.

For the 1B's, 0.6B's and 8B's attention shapes at 4k and 8k context this checks the fused
kernel's rows against :func:`~turbospark_jax.models.pallas_attention.cached_attention`
(row-invariant: the split and fold kernels) bitwise over a scan of steps with fresh queries
(a partial read before it was visible would show), that the counters end at zero, and
times a step of each, the counters carried from step to step (as a model would thread them)
or made afresh in every step (zeros: what a memset costs).

    PYTHONPATH=. python -m benchmarks.probe_last_split --out OUT.json

``--interpret`` runs small shapes in the Pallas interpreter (the arithmetic and the counter;
its programs run one after another, so it proves nothing about visibility).
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from benchmarks.rowinv import add_record, best_time
from turbospark_jax.models import pallas_attention as pa

#: (name, query heads, KV heads, head width).
SHAPES = (("1b", 32, 8, 64), ("0.6b", 16, 8, 128), ("8b", 32, 8, 128))
CONTEXTS = (4096, 8192)


def _kernel(bound_ref, q_ref, pos_ref, k_ref, v_ref, count_in, acc_ref, m_ref, l_ref, o_ref,
            count_ref, *, scale: float, capacity: int, split_len: int, splits: int,
            rows: int | None, interpret: bool) -> None:
    """One program per (KV head, query tile, split): its split's partial, as the split
    kernel computes it; the last program of its (KV head, query tile) then folds them all
    (:func:`~turbospark_jax.models.pallas_attention.fold_in_last_split`)."""
    del count_in  # read and written through its aliased output
    h, t, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    part = pa.split_of(q_ref[...], pos_ref[...], bound_ref[()], k_ref, v_ref, scale=scale,
                       capacity=capacity, split_len=split_len, window=None, mma_sums=True)
    pa.fold_in_last_split(bound_ref[()], part, s, acc_ref, m_ref, l_ref, o_ref, count_ref,
                          h * pl.num_programs(1) + t, t, splits=splits, scale=scale,
                          capacity=capacity, split_len=split_len, rows=rows,
                          barrier=not interpret)


def last_split_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                         q_positions: jax.Array, count: jax.Array, interpret: bool
                         ) -> tuple[jax.Array, jax.Array]:
    """``(out [W, H, hd], count)``: the row-invariant attention of a decode-sized call with
    the fold in each tile's last split program (``count``: int32, zeros, one a KV head and
    query tile, handed back at zero)."""
    width, heads, head_dim = q.shape
    capacity, kv_heads, _ = k_cache.shape
    groups = heads // kv_heads
    rows = width * groups
    tiles = pa.tiles_for(rows, head_dim)
    tile, tile_count, splits, split_len = pa.plan_keys(rows, capacity, tiles.max_row_tile)
    splits = pa.partial_splits(splits)
    padded = tile * tile_count
    qr = pa.arrange_queries(q, kv_heads, capacity, tiles)
    pos = jnp.repeat(q_positions.astype(jnp.int32), groups)
    pos = jnp.pad(pos, (0, padded - rows), constant_values=-1)
    bound = jnp.max(q_positions).astype(jnp.int32) + 1
    head = pl.BlockSpec((capacity, None, head_dim), lambda h, t, s: (0, h, 0))
    slots = pl.BlockSpec((kv_heads * tile_count,), lambda h, t, s: (0,))
    _, _, _, out, count = pl.pallas_call(
        functools.partial(_kernel, scale=1.0 / math.sqrt(head_dim), capacity=capacity,
                          split_len=split_len, splits=splits,
                          rows=None if rows == padded else rows, interpret=interpret),
        grid=(kv_heads, tile_count, splits),
        in_specs=[pl.BlockSpec((), lambda h, t, s: ()),
                  pl.BlockSpec((None, tile, head_dim), lambda h, t, s: (h, t, 0)),
                  pl.BlockSpec((tile,), lambda h, t, s: (t,)), head, head, slots],
        out_specs=[pl.BlockSpec((splits, None, tile, head_dim), lambda h, t, s: (0, h, t, 0)),
                   pl.BlockSpec((splits, None, tile), lambda h, t, s: (0, h, t)),
                   pl.BlockSpec((splits, None, tile), lambda h, t, s: (0, h, t)),
                   pl.BlockSpec((None, tile, head_dim), lambda h, t, s: (h, t, 0)), slots],
        out_shape=[jax.ShapeDtypeStruct((splits, kv_heads, padded, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((splits, kv_heads, padded), jnp.float32),
                   jax.ShapeDtypeStruct((splits, kv_heads, padded), jnp.float32),
                   jax.ShapeDtypeStruct((kv_heads, rows, head_dim), v_cache.dtype),
                   jax.ShapeDtypeStruct(count.shape, jnp.int32)],
        input_output_aliases={5: 4}, interpret=interpret, name="probe_last_split",
        **pa.compiler_kwargs(tiles, interpret),
    )(bound, qr, pos, k_cache, v_cache, count)
    out = out.reshape(kv_heads, width, groups, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(width, heads, head_dim), count


def slots(heads: int, kv_heads: int, head_dim: int, capacity: int, width: int = 1) -> int:
    """The counters a call needs: one a KV head and query tile."""
    rows = width * (heads // kv_heads)
    _, tile_count, _, _ = pa.plan_keys(rows, capacity, pa.tiles_for(rows, head_dim).max_row_tile)
    return kv_heads * tile_count


@functools.partial(jax.jit, static_argnames=("form", "interpret"))
def chain(qs: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, count: jax.Array,
          *, form: str, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """Every step's rows ``[steps, W, H, hd]`` (step ``i``: queries ``qs[i]`` at
    ``positions[i]``) and the counters after the last step."""
    def body(count, x):
        q, pos = x
        if form == "two launches":
            return count, pa.cached_attention(q, k, v, pos, interpret=interpret,
                                              row_invariant=True)
        if form == "last split, fresh counters":  # zeros made in the step (a memset)
            out, _ = last_split_attention(q, k, v, pos, jnp.zeros_like(count), interpret)
            return count, out
        out, count = last_split_attention(q, k, v, pos, count, interpret)
        return count, out

    count, outs = jax.lax.scan(body, count, (qs, positions))
    return outs, count


def _inputs(seed: int, steps: int, heads: int, kv_heads: int, head_dim: int, capacity: int,
            context: int) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    qs = rng.standard_normal((steps, 1, heads, head_dim))
    k = rng.standard_normal((capacity, kv_heads, head_dim))
    v = rng.standard_normal((capacity, kv_heads, head_dim))
    # the decode positions walk up from the context, as a decode's do
    positions = (context - 1 + np.arange(steps))[:, None]
    bf16 = jnp.bfloat16
    return (jnp.asarray(qs, bf16), jnp.asarray(k, bf16), jnp.asarray(v, bf16),
            jnp.asarray(positions, jnp.int32))


def probe(shapes: tuple, contexts: tuple, steps: int, repeats: int, seeds: int,
          interpret: bool, out: Path | None = None) -> list[dict]:
    """Each shape and context's bits (the last split's fold against the two launches) and
    step times, each record printed and written to ``out`` as it comes."""
    records = []
    for name, heads, kv_heads, head_dim in shapes:
        for context in contexts:
            capacity = context + max(steps, 192)
            zero = jnp.zeros((slots(heads, kv_heads, head_dim, capacity),), jnp.int32)
            rec: dict[str, Any] = {"shape": name, "context": context, "capacity": capacity,
                                   "steps": steps}
            if not pa.folds_on_chip(heads // kv_heads, capacity,
                                    pa.tiles_for(heads // kv_heads, head_dim)):
                equal, reset = [], []
                for seed in range(seeds):
                    args = _inputs(seed, steps, heads, kv_heads, head_dim, capacity, context)
                    ref, _ = chain(*args, zero, form="two launches", interpret=interpret)
                    got, count = chain(*args, zero, form="last split", interpret=interpret)
                    equal.append(bool(np.array_equal(np.asarray(ref).view(np.uint16),
                                                     np.asarray(got).view(np.uint16))))
                    reset.append(not np.asarray(count).any())
                rec["bits_equal"], rec["counter_reset"] = all(equal), all(reset)
                # control: a key every row sees, changed, shows in the rows
                qs, k, v, positions = _inputs(0, steps, heads, kv_heads, head_dim, capacity,
                                              context)
                ref, _ = chain(qs, k, v, positions, zero, form="two launches",
                               interpret=interpret)
                moved, _ = chain(qs, k.at[3].multiply(4), v.at[3].multiply(4), positions,
                                 zero, form="last split", interpret=interpret)
                rec["control_differs"] = not np.array_equal(np.asarray(ref), np.asarray(moved))
                if not interpret:
                    for form in ("two launches", "last split", "last split, fresh counters"):
                        fn = functools.partial(chain, form=form, interpret=False)
                        s = best_time(fn, qs, k, v, positions, zero, repeats=repeats)
                        rec[f"us_per_step: {form}"] = round(s / steps * 1e6, 2)
            else:
                rec["skipped"] = "one kernel folds this context on chip already"
            add_record(out, records, rec, date=time.strftime("%Y-%m-%d"))
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    ap.add_argument("--steps", type=int, default=128, help="decode steps a timed call")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls a case (best kept)")
    ap.add_argument("--seeds", type=int, default=2, help="input draws for the bit checks")
    ap.add_argument("--interpret", action="store_true",
                    help="the Pallas interpreter (small shapes, no timing)")
    args = ap.parse_args(argv)
    if args.interpret:
        shapes, contexts, steps = (("small", 4, 2, 16),), (1100,), min(args.steps, 2)
    else:
        shapes, contexts, steps = SHAPES, CONTEXTS, args.steps
    records = probe(shapes, contexts, steps, args.repeats, args.seeds, args.interpret,
                    args.out)
    checked = [r for r in records if "skipped" not in r]
    ok = bool(checked) and all(r["bits_equal"] and r["counter_reset"] and r["control_differs"]
                               for r in checked)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
