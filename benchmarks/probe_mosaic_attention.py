"""Probe: can a Mosaic GPU attention kernel give the row-invariant attention's bits?

The exact prefill's attention is our Triton folding kernel (``pallas_attention``), which on an
H100 takes about twice cuDNN's time for the same work (70.7 ms against 34.8 in the 8B's 8k
prompt, when this probe was written). A Mosaic GPU form (TMA loads, ``wgmma`` for the scores,
the row sums and the value product) could run nearer cuDNN, but only serves the exact path if every
row keeps the Triton kernels' bits, since a decode step runs the Triton split kernel. This is a
first, plain form of that kernel: one warpgroup per 64 query rows of one KV head, key and value
tiles double-buffered by TMA, every key tile through the masked step (a tile a row sees whole
gives the same bits either way: ``pallas_attention._split_partial``), the splits folded in
order as ``pallas_attention._fold`` does. Its arithmetic follows the Triton kernel's step by
step; where the two compilers differ (``probe_mosaic_elementwise.py``: Mosaic fuses a multiply
into the add after it, Triton rounds twice) an optimization barrier keeps Mosaic's products
rounded. Whether Triton adds the value product onto the rescaled accumulator inside the
tensor cores (as it does ``c + dot(a, b)`` in the matrix kernel) or after is the open
question; ``--pv-after`` runs the second form.

It compares, bit for bit, the live rows of a 2,048-row prefill block over a cache at the
1B's and 8B's head shapes against ``cached_attention(row_invariant=True)``, and times both.

    PYTHONPATH=. python -m benchmarks.probe_mosaic_attention --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

ROW_TILE = 64
#: (name, query heads, KV heads, head width, capacity, block rows, block's first position)
CASES = (("1B at 2k", 32, 8, 64, 4096, 2048, 0), ("1B at 8k", 32, 8, 64, 8192, 2048, 6144),
         ("8B at 2k", 32, 8, 128, 4096, 2048, 0), ("8B at 8k", 32, 8, 128, 8192, 2048, 6144))


def mosaic_attention(qr, pos, k_cache, v_cache, bound, *, split_len: int, pv_after: bool = False):
    """The row-invariant attention of the arranged queries ``qr [KV, R, hd]`` (positions
    ``pos [R]``, -1 on padding rows) over ``k_cache, v_cache [C, KV, hd]``: ``[KV, R, hd]``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from turbospark_jax.kernels.attention import KEY_TILE, LOG2_E, SUM_COLUMNS
    from turbospark_jax.kernels.layers import MASK_VALUE

    kv_heads, rows, hd = qr.shape
    capacity = k_cache.shape[0]
    count = rows // ROW_TILE
    c = (1.0 / math.sqrt(hd)) * LOG2_E
    per_split = split_len // KEY_TILE
    # each query tile's key bound, as the Triton folding kernel takes it
    tile_pos = pos.reshape(count, ROW_TILE)
    bounds = jnp.minimum(jnp.minimum(bound, tile_pos.max(axis=1) + 1), capacity).astype(jnp.int32)
    ones = jnp.ones((KEY_TILE, SUM_COLUMNS), qr.dtype)
    barrier = jax.lax.optimization_barrier

    def swizzled(cols, dtype):
        swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
        return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                plgpu.SwizzleTransform(swizzle))

    def rows_of(x):  # a [64] row vector across a [64, n] tile's columns
        return lambda n: jax.lax.broadcast_in_dim(x, (ROW_TILE, n), [0])

    def body(q_g, pos_g, bounds_g, ones_g, k_g, v_g, o_g, q_s, k_s, v_s, pos_s, bounds_s,
             ones_s, q_bar, k_bar, v_bar):
        h, t = jax.lax.axis_index("h"), jax.lax.axis_index("t")
        plgpu.copy_gmem_to_smem(q_g.at[h, pl.ds(t * ROW_TILE, ROW_TILE)], q_s, q_bar.at[0])
        plgpu.copy_gmem_to_smem(pos_g.at[pl.ds(t * ROW_TILE, ROW_TILE)], pos_s, q_bar.at[1])
        plgpu.copy_gmem_to_smem(bounds_g, bounds_s, q_bar.at[2])
        plgpu.copy_gmem_to_smem(ones_g, ones_s, q_bar.at[3])
        for i in range(4):
            plgpu.barrier_wait(q_bar.at[i])
        end = bounds_s[t]
        tiles = (end + KEY_TILE - 1) // KEY_TILE
        row_pos = plgpu.load(pos_s, (), layout=plgpu.Layout.WGMMA.reduce(1))

        def fetch(j, slot):
            start = jnp.minimum(j * KEY_TILE, capacity - KEY_TILE)
            plgpu.copy_gmem_to_smem(k_g.at[pl.ds(start, KEY_TILE), h], k_s.at[slot],
                                    k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_g.at[pl.ds(start, KEY_TILE), h], v_s.at[slot],
                                    v_bar.at[slot])

        pl.when(tiles > 0)(lambda: fetch(0, 0))

        def vec(value):
            return plgpu.layout_cast(jnp.full((ROW_TILE,), value, jnp.float32),
                                     plgpu.Layout.WGMMA.reduce(1))

        def mat(value):
            return plgpu.layout_cast(jnp.full((ROW_TILE, hd), value, jnp.float32),
                                     plgpu.Layout.WGMMA)

        def fold(total, part):
            acc, m, l = total
            p_acc, p_m, p_l = part
            top = jnp.maximum(m, p_m)
            old, new = jnp.exp2((m - top) * c), jnp.exp2((p_m - top) * c)
            return (barrier(acc * rows_of(old)(hd)) + barrier(p_acc * rows_of(new)(hd)), top,
                    barrier(l * old) + barrier(p_l * new))

        def step(j, carry):
            total, (acc, m, l) = carry
            slot = jax.lax.rem(j, 2)
            pl.when(j + 1 < tiles)(lambda: fetch(j + 1, 1 - slot))
            plgpu.barrier_wait(k_bar.at[slot])
            plgpu.barrier_wait(v_bar.at[slot])
            nominal = j * KEY_TILE
            start = jnp.minimum(nominal, capacity - KEY_TILE)

            def scores(ref):
                plgpu.wgmma(ref, q_s, plgpu.transpose_ref(k_s.at[slot], (1, 0)))
                return ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((ROW_TILE, KEY_TILE), jnp.float32))
            keys = start + plgpu.broadcasted_iota(jnp.int32, (ROW_TILE, KEY_TILE), 1,
                                                  layout=plgpu.Layout.WGMMA)
            visible = (keys <= rows_of(row_pos)(KEY_TILE)) & (keys >= nominal)
            s = jnp.where(visible, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1))
            correction = jnp.exp2((m - m_new) * c)
            p = jnp.exp2((s - rows_of(m_new)(KEY_TILE)) * c)
            p16 = p.astype(qr.dtype)

            def sums(ref):
                plgpu.wgmma(ref, p16, ones_s)
                return ref[...]

            row_sum = pl.run_scoped(sums, plgpu.ACC((ROW_TILE, SUM_COLUMNS), jnp.float32))
            l = barrier(l * correction) + row_sum.max(axis=1)

            def values(ref):
                plgpu.wgmma(ref, p16, v_s.at[slot])

            if pv_after:
                pv = pl.run_state(values)(plgpu.ACC.init(mat(0.0)))
                acc = barrier(acc * rows_of(correction)(hd)) + pv
            else:  # the product accumulates onto the rescaled accumulator
                acc = pl.run_state(values)(plgpu.ACC.init(acc * rows_of(correction)(hd)))
            part = (acc, m_new, l)
            split_end = (jax.lax.rem(j + 1, per_split) == 0) | (j + 1 == tiles)
            return jax.lax.cond(split_end,
                                lambda: (fold(total, part), (mat(0.0), vec(MASK_VALUE),
                                                             vec(0.0))),
                                lambda: (total, part))

        fresh = (mat(0.0), vec(MASK_VALUE), vec(0.0))
        (acc, _, l), _ = jax.lax.fori_loop(0, tiles, step, (fresh, fresh))
        q_s[...] = (acc / rows_of(l)(hd)).astype(q_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s, o_g.at[h, pl.ds(t * ROW_TILE, ROW_TILE)])
        plgpu.wait_smem_to_gmem(0)

    tile_t = swizzled(hd, qr.dtype)
    call = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(qr.shape, qr.dtype), grid=(kv_heads, count),
        grid_names=("h", "t"),
        scratch_types=[
            plgpu.SMEM((ROW_TILE, hd), qr.dtype, transforms=tile_t),
            plgpu.SMEM((2, KEY_TILE, hd), qr.dtype, transforms=tile_t),
            plgpu.SMEM((2, KEY_TILE, hd), qr.dtype, transforms=tile_t),
            plgpu.SMEM((ROW_TILE,), jnp.int32),
            plgpu.SMEM((count,), jnp.int32),
            plgpu.SMEM((KEY_TILE, SUM_COLUMNS), qr.dtype,
                       transforms=swizzled(SUM_COLUMNS, qr.dtype)),
            plgpu.Barrier(num_barriers=4), plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=2),
        ])
    return call(qr, pos, bounds, ones, k_cache, v_cache)


def _case(name, heads, kv_heads, hd, capacity, width, first, pv_after):
    import jax
    import jax.numpy as jnp

    from benchmarks.rowinv import best_time
    from turbospark_jax.kernels import attention as pa

    rng = np.random.default_rng(hd + capacity)
    q = jnp.asarray(rng.standard_normal((width, heads, hd)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((capacity, kv_heads, hd)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((capacity, kv_heads, hd)), jnp.bfloat16)
    positions = jnp.arange(first, first + width, dtype=jnp.int32)
    want = jax.jit(lambda q, k, v, p: pa.cached_attention(q, k, v, p, row_invariant=True))
    groups = heads // kv_heads
    rows = width * groups
    _, _, _, split_len = pa._plan(rows, capacity, pa.tiles_for(rows, hd).max_row_tile)

    def mosaic(q, k, v, p):
        qr = pa.arrange_queries(q, kv_heads, capacity)
        pos = jnp.pad(jnp.repeat(p, groups), (0, qr.shape[1] - rows), constant_values=-1)
        out = mosaic_attention(qr, pos, k, v, jnp.max(p) + 1, split_len=split_len,
                               pv_after=pv_after)
        out = out[:, :rows].reshape(kv_heads, width, groups, hd).transpose(1, 0, 2, 3)
        return out.reshape(width, heads, hd)

    got_fn = jax.jit(mosaic)
    record = {"case": name, "split_len": split_len}
    ref = np.asarray(want(q, k, v, positions))
    try:
        got = np.asarray(got_fn(q, k, v, positions))
    except Exception:  # what the first GPU run must say
        import traceback
        record["error"] = traceback.format_exc()[-1500:]
        return record
    differ = np.any(got.view(np.uint16) != ref.view(np.uint16), axis=(1, 2))
    record["rows_differing"] = int(differ.sum())
    record["max_abs_difference"] = float(np.max(np.abs(got.astype(np.float32)
                                                        - ref.astype(np.float32))))
    for label, fn in (("triton_ms", want), ("mosaic_ms", got_fn)):
        record[label] = round(best_time(fn, q, k, v, positions) * 1e3, 3)
    return record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pv-after", action="store_true",
                    help="add the value product after rescaling, not inside the tensor cores")
    args = ap.parse_args()
    from benchmarks.rowinv import write_probe

    records = []
    for case in CASES:
        record = _case(*case, pv_after=args.pv_after)
        print(json.dumps(record), flush=True)
        records.append(record)
    write_probe(args.out, records, pv_after=args.pv_after)


if __name__ == "__main__":
    main()
