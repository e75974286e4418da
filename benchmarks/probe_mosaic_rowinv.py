"""Probe: our Mosaic GPU matrix kernel (``kernels/mosaic_matmul.py``) against our Triton one.

For each product of the 0.6B, 1B and 8B shapes at a 2,048-row prefill block: are its rows
bitwise the Triton matrix kernel's under the model's schedule (``rowinv.schedule_for``, and
one segment as the gated product runs), in float32 and rounded to bfloat16; and what rate
does each tiling reach against the Triton kernel's and XLA's (cuBLAS) on the same operands?
Rates are over four weight copies a program, so one launch's host time is not the figure.

    PYTHONPATH=. python -m benchmarks.probe_mosaic_rowinv --out OUT.json
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import numpy as np

#: (shape, product, K, N): the products a dense layer runs at prefill (q/k/v and gate/up as
#: one weight of their summed width).
CASES = (("1B", "qkv", 2048, 3072), ("1B", "o", 2048, 2048), ("1B", "gate_up", 2048, 16384),
         ("1B", "down", 8192, 2048), ("0.6B", "qkv", 1024, 4096), ("0.6B", "o", 2048, 1024),
         ("0.6B", "gate_up", 1024, 6144), ("0.6B", "down", 3072, 1024),
         ("8B", "qkv", 4096, 6144), ("8B", "o", 4096, 4096), ("8B", "gate_up", 4096, 28672),
         ("8B", "down", 14336, 4096))
ROWS = 2048
COPIES = 4


def _rate(f, x, ws, flops: int) -> float:
    import jax

    from benchmarks.rowinv import best_time

    run = jax.jit(lambda x, *ws: [f(x, w) for w in ws])
    return round(flops * len(ws) / best_time(run, x, *ws) / 1e12, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="", help="comma-separated shape names")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from benchmarks.rowinv import add_record, tiling_entry
    from turbospark_jax.kernels.mosaic_matmul import MosaicTiles, mosaic_matmul
    from turbospark_jax.kernels.rowinv import Schedule, rowinv_matmul, schedule_for

    tilings = {"128x64 cols, 5 stages": MosaicTiles(),
               "128x64 cols, 6 stages": MosaicTiles(stages=6),
               "64x128 rows, 5 stages": MosaicTiles(wg_rows=64, wg_cols=128, split="rows"),
               "64x128 rows, 4 stages": MosaicTiles(wg_rows=64, wg_cols=128, split="rows",
                                                    stages=4),
               "64x128 rows, 6 stages": MosaicTiles(wg_rows=64, wg_cols=128, split="rows",
                                                    stages=6)}
    records = []
    for shape, what, k, n in CASES:
        if args.only and shape not in args.only.split(","):
            continue
        kx, kw = jax.random.split(jax.random.PRNGKey(k + n))
        x = jax.random.normal(kx, (ROWS, k), jnp.bfloat16)
        ws = [(jax.random.normal(jax.random.fold_in(kw, c), (k, n), jnp.float32)
               / np.sqrt(k)).astype(jnp.bfloat16) for c in range(COPIES)]
        flops = 2 * ROWS * k * n
        schedules = {"model": schedule_for(k, n), "one segment": Schedule(segment_tiles=k // 128)}
        record = {"shape": shape, "product": what, "K": k, "N": n,
                  "segment_cols": {s: v.plan(k)[2] * v.k_tile for s, v in schedules.items()},
                  "triton_TFLOPs": _rate(lambda x, w, v=schedules["model"]: rowinv_matmul(
                      x, w, impl="pallas", kernel="matmul", schedule=v),
                      x, ws, flops),
                  "xla_TFLOPs": _rate(lambda x, w: jnp.dot(
                      x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                      x, ws, flops)}
        want = {(s, d): np.asarray(jax.jit(lambda x, w, v=v, d=d: rowinv_matmul(
                    x, w, impl="pallas", kernel="matmul", schedule=v, out_dtype=d))(x, ws[0]))
                for s, v in schedules.items() for d in (jnp.float32, jnp.bfloat16)}
        for name, tiles in tilings.items():
            with tiling_entry(record, name) as entry:
                for (s, d), ref in want.items():
                    seg = schedules[s].plan(k)[2] * 128
                    got = np.asarray(jax.jit(functools.partial(
                        mosaic_matmul, seg_cols=seg, out_dtype=d, tiles=tiles))(x, (ws[0],)))
                    key = f"{s} {jnp.dtype(d).name}"
                    entry[key] = int(np.sum(np.any(got.view(np.uint8) != ref.view(np.uint8),
                                                   axis=1)))
                seg = schedules["model"].plan(k)[2] * 128
                entry["TFLOPs"] = _rate(lambda x, w, seg=seg, tiles=tiles: mosaic_matmul(
                    x, (w,), seg_cols=seg, out_dtype=jnp.bfloat16, tiles=tiles), x, ws, flops)
        add_record(args.out, records, record, rows=ROWS,
                   note="per tiling: rows differing from the Triton kernel per schedule/dtype")


if __name__ == "__main__":
    main()
