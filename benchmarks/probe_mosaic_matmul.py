"""Probe: could a Mosaic GPU matrix kernel carry the exact prefill's products?

The exact prefill's products run our Triton matrix kernel at 410-450 TFLOP/s on an H100
where cuBLAS reaches 690-820 (when this probe was written); for the 8B shape
the products alone take most of transformers' whole prefill time. A kernel with TMA loads,
warp specialisation and ``wgmma`` (Pallas' Mosaic GPU backend) could run nearer cuBLAS, but
it would only serve the exact path if each row's sums keep the bits of our kernels: ours add
K in one chain of tensor-core steps from zero per segment (``rowinv.Schedule``), which is
what a Mosaic kernel accumulating into one register accumulator from zero also does.

This asks both questions with JAX's own example Hopper kernel
(``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``, called as a library): for a K of one
segment, are its float32 results bitwise ours (one row too, against our matrix-vector
kernel)? And at the model's prefill shapes, what rate does it reach against ours and XLA's?

    PYTHONPATH=. python -m benchmarks.probe_mosaic_matmul --out OUT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

#: (rows, K, N, what): a K of four 128-column tiles (one segment) for the bits; the 1B's
#: gate/up and down and the 8B's gate/up at a 2,048-row prefill block for the rates.
CASES = ((2048, 512, 2048, "one segment"), (2048, 2048, 16384, "1B gate/up"),
         (2048, 8192, 2048, "1B down"), (2048, 4096, 28672, "8B gate/up"))


def _folded(hopper, config, x, w, cols: int):
    """``x @ w`` in float32 as segments of ``cols`` columns of K, each a call of the example
    kernel from zero with the running total (from -0.0) as its addend."""
    import jax
    import jax.numpy as jnp

    run = jax.jit(lambda x, w, c: hopper.matmul(x, w, c, config))
    total = jnp.full((x.shape[0], w.shape[1]), -0.0, jnp.float32)
    for at in range(0, x.shape[1], cols):
        total = run(x[:, at:at + cols], w[at:at + cols], total)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper

    from benchmarks.rowinv import best_time, write_probe
    from turbospark_jax.kernels.rowinv import Schedule, rowinv_matmul

    configs = {f"{m}x{n}, minor {d}": hopper.TuningConfig(
        tile_m=m, tile_n=n, tile_k=64, max_concurrent_steps=4, epi_tile_m=64, epi_tile_n=64,
        grid_minor_dim=d, grid_tile_width=8, wg_dimension=hopper.MatmulDimension.N)
        for m, n in ((128, 128), (128, 64)) for d in hopper.MatmulDimension}
    records = []
    for rows, k, n, what in CASES:
        kx, kw = jax.random.split(jax.random.PRNGKey(rows + k + n))
        x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        one_segment = Schedule(segment_tiles=k // Schedule.k_tile)
        ours = jax.jit(lambda x, w, s=one_segment: rowinv_matmul(
            x, w, out_dtype=jnp.float32, impl="pallas", kernel="matmul", schedule=s))
        ours_bf16 = jax.jit(lambda x, w: rowinv_matmul(x, w, impl="pallas", kernel="matmul"))
        xla = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32
                                           ).astype(jnp.bfloat16))
        flops = 2 * rows * k * n
        record = {"case": what, "rows": rows, "K": k, "N": n,
                  "ours_TFLOPs": round(flops / best_time(ours_bf16, x, w) / 1e12, 1),
                  "xla_TFLOPs": round(flops / best_time(xla, x, w) / 1e12, 1)}
        want = np.asarray(ours(x, w)).view(np.uint32)
        row = np.asarray(jax.jit(lambda x, w, s=one_segment: rowinv_matmul(
            x, w, out_dtype=jnp.float32, impl="pallas", kernel="matvec", schedule=s))(
            x[7:8], w)).view(np.uint32)
        record["ours_matvec_row_equals_matmul"] = bool(np.array_equal(row[0], want[7]))
        # the addend -0.0 keeps a sum of -0.0 as ours does (its total starts at -0.0)
        zeros = jnp.full((rows, n), -0.0, jnp.float32)
        for name, config in configs.items():
            try:
                # a float32 output doubles the epilogue's shared memory: fewer stages
                narrow = dataclasses.replace(config, max_concurrent_steps=2)
                got = np.asarray(jax.jit(lambda x, w, c, cf=narrow: hopper.matmul(x, w, c, cf))(
                    x, w, zeros)).view(np.uint32)
                rate = flops / best_time(
                    jax.jit(lambda x, w, cf=config: hopper.matmul(x, w, None, cf)), x, w) / 1e12
                record[name] = {"TFLOPs": round(rate, 1),
                                "bitwise_ours_one_segment": bool(np.array_equal(got, want)),
                                "rows_differing": int(np.sum(np.any(got != want, axis=1)))}
            except Exception as exc:  # a config the shape or shared memory refuses
                record[name] = {"error": repr(exc)[:300]}
        # Our default schedule folds segments of up to four tiles in order into a total that
        # starts at -0.0; the example kernel's addend reproduces that fold: one call a
        # segment, each from zero, the running total its addend (``c + acc`` in float32).
        tiles = k // Schedule.k_tile
        _, _, per = Schedule().plan(k)
        if per < tiles:
            narrow = dataclasses.replace(next(iter(configs.values())), max_concurrent_steps=2)
            try:
                seg_want = np.asarray(jax.jit(lambda x, w: rowinv_matmul(
                    x, w, out_dtype=jnp.float32, impl="pallas", kernel="matmul"))(x, w))
                got = np.asarray(_folded(hopper, narrow, x, w, per * Schedule.k_tile))
                record["segments"] = {
                    "count": tiles // per,
                    "bitwise_ours_default_schedule": bool(np.array_equal(
                        got.view(np.uint32), seg_want.view(np.uint32))),
                    "rows_differing": int(np.sum(np.any(got != seg_want, axis=1)))}
            except Exception as exc:
                record["segments"] = {"error": repr(exc)[:300]}
        print(json.dumps(record), flush=True)
        records.append(record)
    write_probe(args.out, records)


if __name__ == "__main__":
    main()
