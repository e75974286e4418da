"""Probe: does Pallas' Mosaic GPU backend compile our elementwise float32 arithmetic to the
same bits as its Triton backend?

Fusing more of the exact path into Mosaic kernels (SwiGLU's gating into the matrix kernel's
epilogue; the attention's softmax, whose decode form is a Triton kernel) keeps the row
invariance only if each elementwise step rounds identically in both backends. Triton's
``exp2`` is libdevice's ``__nv_exp2f``, its division ``arith.divf``, and it contracts a
multiply feeding an add into one fused multiply-add; Mosaic's lowering goes through its own
path. This runs each step in a Triton kernel and in Mosaic kernels (exact and approximate
math) over the same inputs and counts the elements whose bits differ:

* ``exp2`` over a dense sweep of [-150, 10] (the softmax's range, subnormal results
  included) and over the same sweep with results below 2^-126 set to zero in both;
* ``a * b + c`` (contracted or not; with an optimization barrier after Mosaic's product),
  ``a / b``;
* SwiGLU's gating (:func:`rowinv.swiglu_gating`) of bfloat16 products, and SiLU alone.

    PYTHONPATH=. python -m benchmarks.probe_mosaic_elementwise --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import numpy as np

ROWS, COLS = 1024, 256  # 2^18 elements a case
BLOCK = (16, 256)
#: The Mosaic variants: lane semantics (exact and approximate math) and warpgroup semantics
#: (the matrix kernel's).
BACKENDS = ("mosaic", "mosaic, approx math", "mosaic, warpgroup")


def _ops():
    import jax
    import jax.numpy as jnp

    from turbospark_jax.kernels.rowinv import swiglu_gating

    def flushed_exp2(x):
        return jnp.where(x < -126.0, 0.0, jnp.exp2(x))

    return {
        "exp2": (lambda x, a, b: jnp.exp2(x), jnp.float32),
        "exp2, below 2^-126 flushed": (lambda x, a, b: flushed_exp2(x), jnp.float32),
        "a * b + c": (lambda x, a, b: a * b + x, jnp.float32),
        # Triton rounds the product, then the sum; Mosaic marks its arithmetic contractible
        # and fuses the two into one multiply-add unless a barrier stands between them
        "a * b + c, Mosaic's product behind a barrier": (
            lambda x, a, b: a * b + x, jnp.float32,
            lambda x, a, b: jax.lax.optimization_barrier(a * b) + x),
        "a / b": (lambda x, a, b: a / b, jnp.float32),
        "softmax step": (lambda x, a, b: a * jnp.exp2((x - b) * 0.18033688) + x, jnp.float32),
        "swiglu": (lambda x, a, b: swiglu_gating(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                                           jnp.bfloat16), jnp.bfloat16),
        "silu alone": (lambda x, a, b: jax.nn.silu(a), jnp.float32),
        # x holds every finite bfloat16 value (as float32): the gating's whole domain, since
        # the gate is rounded to bfloat16 before SiLU and the product after it is exact
        "swiglu, every bfloat16 gate": (
            lambda x, a, b: swiglu_gating(x.astype(jnp.bfloat16), jnp.ones_like(x, jnp.bfloat16),
                                    jnp.bfloat16), jnp.bfloat16),
    }


def _run(backend: str, fn, out_dtype, x, a, b):
    import jax
    from jax.experimental import pallas as pl

    if backend == "triton":
        from jax.experimental.pallas import triton as plt

        def kernel(x_ref, a_ref, b_ref, o_ref):
            o_ref[...] = fn(x_ref[...], a_ref[...], b_ref[...]).astype(o_ref.dtype)

        spec = pl.BlockSpec(BLOCK, lambda i: (i, 0))
        call = pl.pallas_call(kernel, grid=(ROWS // BLOCK[0],), in_specs=[spec] * 3,
                              out_specs=spec,
                              out_shape=jax.ShapeDtypeStruct((ROWS, COLS), out_dtype),
                              compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))
        return np.asarray(jax.jit(call)(x, a, b))
    from jax.experimental.pallas import mosaic_gpu as plm

    def step(_, x_s, a_s, b_s, o_s):
        o_s[...] = fn(x_s[...], a_s[...], b_s[...]).astype(o_s.dtype)

    def body(x_g, a_g, b_g, o_g):
        spec = plm.BlockSpec(BLOCK, lambda i: (i, 0))
        plm.emit_pipeline(step, grid=(ROWS // BLOCK[0],), in_specs=[spec] * 3,
                          out_specs=[spec], max_concurrent_steps=2)(x_g, a_g, b_g, o_g)

    params = plm.CompilerParams(
        approx_math=backend == "mosaic, approx math",
        lowering_semantics=(plm.LoweringSemantics.Warpgroup if "warpgroup" in backend
                            else plm.LoweringSemantics.Lane))
    call = plm.kernel(body, out_type=jax.ShapeDtypeStruct((ROWS, COLS), out_dtype),
                      compiler_params=params)
    return np.asarray(jax.jit(call)(x, a, b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import jax.numpy as jnp

    from benchmarks.rowinv import write_probe

    rng = np.random.default_rng(0)
    n = ROWS * COLS
    x = jnp.asarray(np.linspace(-150.0, 10.0, n, dtype=np.float32).reshape(ROWS, COLS))
    a = jnp.asarray(rng.standard_normal((ROWS, COLS), np.float32) * 4)
    b = jnp.asarray(rng.standard_normal((ROWS, COLS), np.float32) * 4 + 0.01)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(jnp.bfloat16)
    every = np.where(np.isfinite(every.astype(np.float32)), every.astype(np.float32), 0.0)
    every = jnp.asarray(np.resize(every, n).reshape(ROWS, COLS).astype(np.float32))
    records = []
    for name, (fn, out_dtype, *mosaic_fn) in _ops().items():
        record = {"op": name}
        x_in = every if name.startswith("swiglu, every") else x
        try:
            want = _run("triton", fn, out_dtype, x_in, a, b)
        except Exception as exc:
            record["triton_error"] = repr(exc)[:300]
            records.append(record)
            print(json.dumps(record), flush=True)
            continue
        for backend in BACKENDS:
            try:
                got = _run(backend, (mosaic_fn or [fn])[0], out_dtype, x_in, a, b)
                differ = got.view(np.uint8 if got.itemsize == 1 else
                                  {2: np.uint16, 4: np.uint32}[got.itemsize]) != want.view(
                    {2: np.uint16, 4: np.uint32}[want.itemsize])
                record[backend] = {"differing": int(differ.sum()), "of": int(differ.size)}
                if differ.any():
                    at = np.argwhere(differ)[0]
                    record[backend]["first"] = {
                        "x": float(x_in[tuple(at)]), "a": float(a[tuple(at)]),
                        "b": float(b[tuple(at)]), "triton": float(want[tuple(at)]),
                        "mosaic": float(got[tuple(at)])}
            except Exception:  # the error's last frames say where it arose
                record[backend] = {"error": traceback.format_exc()[-900:]}
        records.append(record)
        print(json.dumps(record), flush=True)
    write_probe(args.out, records)


if __name__ == "__main__":
    main()
