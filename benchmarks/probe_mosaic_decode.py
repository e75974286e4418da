"""Probe: a decode step's products on the Mosaic kernel, against the Triton matvec kernel.

A decode step reads every weight once for one row, so its products are bound by how fast a
kernel streams weights. The Triton matvec kernel streams them at 1.6-3.0 TB/s on an H100
(session 36's traces); the Mosaic kernel's TMA pipeline may stream faster. Here the decode
row is padded to the Mosaic kernel's 64-row tile and each product of the 1B and 8B shapes
runs as the matvec kernel does: its segments side by side, float32 partial sums out
(``mosaic_matmul.mosaic_partials``), or the gated product in one segment with the gating in
the epilogue (``mosaic_gated``). For each: are row 0's bits the matvec kernel's (partials,
and the gated row), and the time and weight bandwidth of each kernel, with the pad and the
slice around the Mosaic call and without (a caller that keeps 64-row buffers). Times are
over enough weight copies a program to pass the L2 cache.

    PYTHONPATH=. python -m benchmarks.probe_mosaic_decode --out OUT.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np

#: (shape, product, K, N): a dense layer's decode products and the output head (stored
#: [K, N] here; the tied head's [N, K] the Mosaic kernel does not read).
CASES = (("1B", "qkv", 2048, 3072), ("1B", "o", 2048, 2048), ("1B", "gate_up", 2048, 8192),
         ("1B", "down", 8192, 2048), ("1B", "head", 2048, 128256),
         ("8B", "qkv", 4096, 6144), ("8B", "o", 4096, 4096), ("8B", "gate_up", 4096, 14336),
         ("8B", "down", 14336, 4096))
ROWS = 64
#: Weight bytes a timed program reads, over copies of the weight (at most :data:`MAX_COPIES`:
#: each copy is a call site XLA compiles on its own, about a second each for Triton's). The
#: time is the kernels' own, from a trace: a program's dispatch would swamp a few
#: microseconds of work (the first run, timed by the wall clock, read 25-45 us for every
#: kernel alike).
PROGRAM_BYTES = 200 << 20
MAX_COPIES = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="", help="comma-separated products")
    ap.add_argument("--shapes", default="1B,8B", help="comma-separated shapes")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from benchmarks.rowinv import add_record, tiling_entry
    from benchmarks.rowinv_model import _device_seconds
    from turbospark_jax.kernels.mosaic_matmul import MosaicTiles, mosaic_gated, mosaic_partials
    from turbospark_jax.kernels.rowinv import (
        gated_schedule,
        rowinv_matmul,
        rowinv_swiglu,
        schedule_for,
        swiglu_gating,
    )

    tilings = {"64x64 cols, 6 stages": MosaicTiles(wg_rows=64, wg_cols=64, stages=6),
               "64x128 cols, 3 stages": MosaicTiles(wg_rows=64, wg_cols=128, stages=3)}
    bf16 = jnp.bfloat16
    records = []
    for shape, what, k, n in CASES:
        if (args.only and what not in args.only.split(",")) or shape not in args.shapes.split(","):
            continue
        gated = what == "gate_up"
        weights = 2 if gated else 1
        copies = int(max(1, min(MAX_COPIES, PROGRAM_BYTES // (k * n * 2 * weights))))
        kx, kw = jax.random.split(jax.random.PRNGKey(k + n))
        x = jax.random.normal(kx, (1, k), bf16)
        xp = jnp.pad(x, ((0, ROWS - 1), (0, 0)))
        ws = [tuple((jax.random.normal(jax.random.fold_in(kw, c * 2 + i), (k, n), jnp.float32)
                     / np.sqrt(k)).astype(bf16) for i in range(weights))
              for c in range(copies)]
        gbytes = k * n * 2 * weights / 1e9
        sched = gated_schedule(k) if gated else schedule_for(k, n)
        seg = sched.plan(k)[2] * sched.k_tile

        def timed(f, *operands, ws=ws, gbytes=gbytes):
            run = jax.jit(lambda *a: [f(*a, *w) for w in ws])
            seconds = _device_seconds(run, *operands) / len(ws)
            return {"us": round(seconds * 1e6, 2), "TB/s": round(gbytes / seconds / 1e3, 3)}

        if gated:
            triton = lambda x, g, u: rowinv_swiglu(x, g, u, impl="pallas", kernel="matvec")  # noqa: E731
        else:
            triton = lambda x, w, v=sched: rowinv_matmul(  # noqa: E731
                x, w, impl="pallas", kernel="matvec", schedule=v, parts=True)
        say = functools.partial(print, shape, what, file=sys.stderr, flush=True)
        say("triton")
        want = np.asarray(jax.jit(triton)(x, *ws[0]))
        record = {"shape": shape, "product": what, "K": k, "N": n, "segment_cols": seg,
                  "copies": copies, "triton_matvec": timed(triton, x),
                  "xla": timed(lambda x, *w: jnp.concatenate(
                      [jnp.dot(x, v, preferred_element_type=jnp.float32) for v in w], 1), x)}
        for name, tiles in tilings.items():
            if gated:
                mosaic = functools.partial(mosaic_gated, epilogue=functools.partial(
                    swiglu_gating, dtype=bf16), out_dtype=bf16, tiles=tiles)
                kernel = lambda x, g, u, m=mosaic: m(x, g, u)  # noqa: E731
                row = lambda out: out[0]  # noqa: E731
            else:
                part = functools.partial(mosaic_partials, seg_cols=seg, tiles=tiles)
                kernel = lambda x, w, p=part: p(x, (w,))  # noqa: E731
                row = lambda out: out[:, 0]  # noqa: E731
            with tiling_entry(record, name) as entry:
                say(name)
                got = np.asarray(row(jax.jit(kernel)(xp, *ws[0])))
                ref = want[0] if gated else want[:, 0]
                entry["elements_differing"] = int(np.sum(got.view(np.uint8).reshape(-1)
                                                         != ref.view(np.uint8).reshape(-1)))
                say(name, "bits", entry["elements_differing"])
                entry["kernel"] = timed(kernel, xp)
                entry["padded_and_sliced"] = timed(
                    lambda x, *w, r=row, f=kernel: r(f(jnp.pad(x, ((0, ROWS - 1), (0, 0))), *w)),
                    x)
        add_record(args.out, records, record, rows=ROWS,
                   note="per tiling: row 0's elements differing from the Triton matvec "
                        "kernel's (bytes of float32 partials, or of the gated bfloat16 row), "
                        "and times")


if __name__ == "__main__":
    main()
