"""Probe: can a decode step's norm run in the last program of the product before it?

A decode step launches a norm kernel after the output projection and after the down
projection of every layer (2.3-3.3 us each on an H200, 72 us a token on the 1B shape). Putting
the norm in the prologue of the product after it kept the bits and cost more than the launch
(every program of that product must finish the row's reduction before its first weight tile:
docs/decisions/0012-removed-measured-losers.md, both forms). The other side is open: the product
*before* the norm finishes its output tile by tile, and the program that finishes last could
norm the whole row while the others are already done. It learns that it is last from a
counter every program bumps with an atomic add after its tile is stored (release, then the
last one's acquire, make every tile visible to it); it resets the counter for the next call.

This times, in a loop of dependent steps (each step's ``h`` the next one's residual, as a
decode's layers chain), for the products a decode step runs before its norms:

* ``matvec`` alone (the floor);
* ``two launches``: the matvec, then the norm kernel (``h = residual + y``, its RMSNorm);
* ``last program``: the matvec whose last program norms the row, its counter carried from
  step to step (as a model would thread it) or made afresh in every step (zeros: what a
  memset costs);

each with the sum of squares as Triton lays ``jnp.sum`` out and as a fixed halving tree (a
sum no layout can reorder, which a prefill's norm kernel could share). It checks the last
program's ``h`` and normed row against the two launches' bitwise on every step of the loop
(a tile read before it was visible would show there) and over fresh inputs, and that the
counter is back to zero.

    PYTHONPATH=. python -m benchmarks.probe_last_program --out OUT.json

``--interpret`` runs the kernels in the Pallas interpreter (the CPU's check of the
arithmetic and of the counter; programs run one after another there, so it proves nothing
about visibility).
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from benchmarks.rowinv import add_record, best_time
from turbospark_jax.kernels.row_norm import finished_rows, inverse_rms, scaled_rows

#: (name, K, N): the products before a decode step's norms (output projection, down
#: projection) of the 1B, 0.6B and 8B shapes.
SHAPES = (("1b o", 2048, 2048), ("1b down", 8192, 2048), ("0.6b o", 2048, 1024),
          ("0.6b down", 3072, 1024), ("8b o", 4096, 4096), ("8b down", 14336, 4096))
ROWS = 16  # the row tile of the tensor-core product; row 0 is the decode row
K_TILE = 128
EPS = 1e-5


def _columns(n: int) -> int:
    """Columns a program: 32 up to 2,048 columns (64 programs), 64 above."""
    return 32 if n <= 2048 else 64


def _norm_row(y: jax.Array, residual: jax.Array, weight: jax.Array, tree: bool
              ) -> tuple[jax.Array, jax.Array]:
    """``h = residual + y`` (``y`` float32, rounded to the residual's dtype first, as a
    finished product is) and ``h``'s RMSNorm times ``weight``: the norm kernel's own
    functions (:mod:`~turbospark_jax.kernels.row_norm`), its sum of squares as Triton
    lays ``jnp.sum`` out or as the halving tree (``tree``)."""
    dtype = residual.dtype
    h = finished_rows(residual, y.astype(dtype), dtype=dtype)
    return h, scaled_rows(h, inverse_rms(h, h.shape[0], EPS, tree), weight, dtype)


def _tile(x_ref: Any, w_ref: Any, k: int) -> jax.Array:
    """This program's columns of ``x @ w`` (all :data:`ROWS` rows: a row of a tensor-core
    tile is not sliced out in Triton), float32, over K in fixed tiles."""
    def step(i, acc):
        ks = pl.ds(pl.multiple_of(i * K_TILE, K_TILE), K_TILE)
        return acc + jnp.dot(x_ref[:, ks], w_ref[ks, :],
                             preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k // K_TILE, step,
                            jnp.zeros((ROWS, w_ref.shape[1]), jnp.float32))
    return acc


def _matvec_kernel(x_ref, w_ref, y_ref, *, k: int) -> None:
    y_ref[...] = _tile(x_ref, w_ref, k)


def _norm_kernel(y_ref, r_ref, wn_ref, h_ref, o_ref, *, tree: bool) -> None:
    h_ref[...], o_ref[...] = _norm_row(y_ref[0, :], r_ref[...], wn_ref[...], tree)


def _last_program_kernel(x_ref, w_ref, r_ref, wn_ref, count_in, y_ref, h_ref, o_ref,
                         count_ref, *, k: int, tree: bool, interpret: bool) -> None:
    del count_in  # the counter is read and written through its aliased output
    j, programs = pl.program_id(0), pl.num_programs(0)
    cols = w_ref.shape[1]
    y_ref[:, pl.ds(pl.multiple_of(j * cols, cols), cols)] = _tile(x_ref, w_ref, k)
    from jax.experimental.pallas import triton as plgpu

    if not interpret:  # (the interpreter runs the programs one after another)
        plgpu.debug_barrier()  # every thread's stores issued before the release
    before = plgpu.atomic_add(count_ref, (jnp.int32(0),), jnp.int32(1))

    @pl.when(before == programs - 1)
    def _():
        h_ref[...], o_ref[...] = _norm_row(y_ref[0, :], r_ref[...], wn_ref[...], tree)
        count_ref[0] = jnp.int32(0)


def _params(interpret: bool, warps: int) -> dict:
    if interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as plgpu

    return {"compiler_params": plgpu.CompilerParams(num_warps=warps, num_stages=3)}


def matvec(x: jax.Array, w: jax.Array, interpret: bool) -> jax.Array:
    k, n = w.shape
    cols = _columns(n)
    return pl.pallas_call(
        functools.partial(_matvec_kernel, k=k), grid=(n // cols,),
        in_specs=[pl.BlockSpec((ROWS, k), lambda j: (0, 0)),
                  pl.BlockSpec((k, cols), lambda j: (0, j))],
        out_specs=pl.BlockSpec((ROWS, cols), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((ROWS, n), jnp.float32), name="probe_matvec",
        **_params(interpret, 4))(x, w)


def norm(y: jax.Array, residual: jax.Array, weight: jax.Array, tree: bool,
         interpret: bool) -> tuple[jax.Array, jax.Array]:
    n = y.shape[1]
    whole = pl.BlockSpec((n,), lambda i: (0,))
    return pl.pallas_call(
        functools.partial(_norm_kernel, tree=tree), grid=(1,),
        in_specs=[pl.BlockSpec(y.shape, lambda i: (0, 0)), whole, whole],
        out_specs=[whole] * 2,
        out_shape=[jax.ShapeDtypeStruct((n,), residual.dtype)] * 2, name="probe_norm",
        **_params(interpret, 4 if n <= 1024 else 8))(y, residual, weight)


def last_program(x: jax.Array, w: jax.Array, residual: jax.Array, weight: jax.Array,
                 count: jax.Array, tree: bool, interpret: bool) -> tuple[jax.Array, ...]:
    """``(y, h, normed, count)``: the matvec with the norm in its last program."""
    k, n = w.shape
    cols = _columns(n)
    whole = pl.BlockSpec((n,), lambda j: (0,))
    one = pl.BlockSpec((1,), lambda j: (0,))
    return pl.pallas_call(
        functools.partial(_last_program_kernel, k=k, tree=tree, interpret=interpret),
        grid=(n // cols,),
        in_specs=[pl.BlockSpec((ROWS, k), lambda j: (0, 0)),
                  pl.BlockSpec((k, cols), lambda j: (0, j)), whole, whole, one],
        out_specs=[pl.BlockSpec((ROWS, n), lambda j: (0, 0)), whole, whole, one],
        out_shape=[jax.ShapeDtypeStruct((ROWS, n), jnp.float32),
                   jax.ShapeDtypeStruct((n,), residual.dtype),
                   jax.ShapeDtypeStruct((n,), residual.dtype),
                   jax.ShapeDtypeStruct((1,), jnp.int32)],
        input_output_aliases={4: 3}, name="probe_last_program",
        **_params(interpret, 4))(x, w, residual, weight, count)


def _step(form: str, tree: bool, interpret: bool):
    """One step ``(x, w, residual, weight, count) -> (h, normed, count)`` of ``form``."""
    def step(x, w, residual, weight, count):
        if form == "matvec":
            y = matvec(x, w, interpret)[0]
            return y.astype(residual.dtype), y.astype(residual.dtype), count
        if form == "two launches":
            h, o = norm(matvec(x, w, interpret), residual, weight, tree, interpret)
            return h, o, count
        if form == "last program, fresh counter":  # zeros made in the step (a memset)
            _, h, o, _ = last_program(x, w, residual, weight, jnp.zeros_like(count), tree,
                                      interpret)
            return h, o, count
        _, h, o, count = last_program(x, w, residual, weight, count, tree, interpret)
        return h, o, count
    return step


@functools.partial(jax.jit, static_argnames=("form", "tree", "steps", "interpret"))
def chain(x, w, residual, weight, count, *, form: str, tree: bool, steps: int,
          interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``steps`` dependent steps (each ``h`` the next residual): every step's normed row
    ``[steps, N]``, the last ``h`` and the counter."""
    step = _step(form, tree, interpret)

    def body(carry, _):
        residual, count = carry
        h, o, count = step(x, w, residual, weight, count)
        return (h, count), o

    (h, count), normed = jax.lax.scan(body, (residual, count), None, length=steps)
    return normed, h, count


def _inputs(seed: int, k: int, n: int, dtype: Any) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    x = np.zeros((ROWS, k), np.float32)
    x[0] = rng.standard_normal(k)
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    residual = rng.standard_normal(n)
    weight = 1.0 + 0.1 * rng.standard_normal(n)
    return tuple(jnp.asarray(a, dtype) for a in (x, w, residual, weight))


def probe(shapes: tuple, steps: int, repeats: int, seeds: int, interpret: bool,
          out: Path | None = None) -> list[dict]:
    """Each shape's bits (last program against two launches, both sums) and step times,
    each record printed and written to ``out`` as it comes."""
    records = []
    dtype = jnp.bfloat16
    for name, k, n in shapes:
        zero = jnp.zeros((1,), jnp.int32)
        rec: dict[str, Any] = {"shape": name, "K": k, "N": n, "steps": steps}
        for tree in (False, True):
            label = "tree" if tree else "jnp.sum"
            equal, counts = [], []
            for seed in range(seeds):
                args = _inputs(seed, k, n, dtype)
                ref = chain(*args, zero, form="two launches", tree=tree, steps=steps,
                            interpret=interpret)
                got = chain(*args, zero, form="last program", tree=tree, steps=steps,
                            interpret=interpret)
                equal.append(bool(np.array_equal(np.asarray(ref[0]).view(np.uint16),
                                                 np.asarray(got[0]).view(np.uint16))
                                  and np.array_equal(np.asarray(ref[1]).view(np.uint16),
                                                     np.asarray(got[1]).view(np.uint16))))
                counts.append(int(got[2][0]))
            rec[f"bits_equal_{label}"] = all(equal)
            rec[f"counter_reset_{label}"] = all(c == 0 for c in counts)
        # control: the comparison sees a changed norm weight
        args = _inputs(0, k, n, dtype)
        ref = chain(*args, zero, form="two launches", tree=False, steps=2, interpret=interpret)
        moved = chain(*args[:3], args[3] * 2, zero, form="last program", tree=False, steps=2,
                      interpret=interpret)
        rec["control_differs"] = not np.array_equal(np.asarray(ref[0]), np.asarray(moved[0]))
        if not interpret:
            args = _inputs(0, k, n, dtype)
            for form in ("matvec", "two launches", "last program",
                         "last program, fresh counter"):
                for tree in ((False,) if form == "matvec" else (False, True)):
                    fn = functools.partial(chain, form=form, tree=tree, steps=steps,
                                           interpret=False)
                    s = best_time(fn, *args, zero, repeats=repeats)
                    key = form if form == "matvec" else f"{form}, {'tree' if tree else 'jnp.sum'}"
                    rec[f"us_per_step: {key}"] = round(s / steps * 1e6, 2)
        add_record(out, records, rec, date=time.strftime("%Y-%m-%d"))
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    ap.add_argument("--steps", type=int, default=256, help="dependent steps a timed call")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls a case (best kept)")
    ap.add_argument("--seeds", type=int, default=3, help="input draws for the bit checks")
    ap.add_argument("--interpret", action="store_true",
                    help="the Pallas interpreter (small shapes, no timing)")
    args = ap.parse_args(argv)
    shapes = (("small", 256, 128), ("small, two K tiles", 512, 256)) if args.interpret \
        else SHAPES
    steps = min(args.steps, 3) if args.interpret else args.steps
    records = probe(shapes, steps, args.repeats, args.seeds, args.interpret, args.out)
    ok = all(r["bits_equal_jnp.sum"] and r["bits_equal_tree"] and r["counter_reset_jnp.sum"]
             and r["counter_reset_tree"] and r["control_differs"] for r in records)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
