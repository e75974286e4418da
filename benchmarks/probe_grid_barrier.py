"""Probe: what does a grid-wide barrier inside one kernel cost, against a kernel boundary?

Every bar of issue 19 that decode misses is bounded by kernel boundaries: on an H200 each of
a decode step's five to seven kernels a layer pays 2-4 us of launch, ramp and tail whatever
it does (NOTES.md, thirteenth session), and the 0.6B's floors alone exceed its bar. A
persistent decode kernel would run a layer's phases in one launch, one program per
multiprocessor, with a barrier across the grid where a phase needs the whole of the one
before (a product's output row before the next product). Whether that pays depends on what
such a barrier costs, which this measures on the simplest chain with the same arithmetic
both ways: ``phases`` dependent matrix-vector products of ``D x D`` bfloat16 weights (each
its own, streamed from memory), each product's output row the next one's input,

* as one Pallas kernel a product (``launches``: the chain a decode step runs today), and
* as one persistent kernel whose programs take the products' column tiles in turn and meet
  at a barrier after each (``persistent``): every program bumps a counter with an atomic add
  after its stores (after a CTA barrier, so they precede the add's release) and spins, an
  atomic read at a time, until all have. Each phase writes a row of its own, which no
  multiprocessor reads before that phase, so no L1 line of it can be stale (``.cg`` loads,
  which would bypass L1, do not lower in jax 0.10's Triton lowering).

* and the persistent kernel with each program loading the first K tiles of its next weights
  before it waits (``persistent, 4 tiles ahead``): the weights do not depend on the row, so
  their first loads' latency, which every kernel pays at its start, can overlap the barrier.

All give the same bits (the same tiles, the same order over K) unless a program read an
input before it was visible, which the check of every phase's row would show. The time a
phase of each, and their differences, are what a barrier saves or costs against a launch and
what loading ahead hides.

    PYTHONPATH=. python -m benchmarks.probe_grid_barrier --out OUT.json

The persistent kernel cannot run in the Pallas interpreter (its programs run one after
another there, so the first would wait for the rest forever); on a CPU,
``tests/test_probe_grid_barrier.py`` checks the launches' arithmetic and that both forms
lower for CUDA.
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
from turbospark_jax.models import pallas_layer_tail

ROWS = 16  # the tensor cores' row tile; row 0 is the decode row, the rest stay zero
K_TILE = 128
COLUMNS = 16  # columns a tile: 2,048 columns are 128 tiles, about one a multiprocessor
#: K tiles of the next weights a program loads before a barrier (0: none), the forms timed.
AHEAD = (0, 4)
#: Chains a timed call runs, one after another in a device loop.
STEPS = 8
#: (name, D, phases): the 1B's hidden width over its 16 layers' two products each, and the
#: 0.6B's over 28 layers'.
CASES = (("1b-like", 2048, 32), ("0.6b-like", 1024, 56))


def _tile(x_load, w_ref, p, c, d: int, first: tuple = ()) -> jax.Array:
    """Column tile ``c`` of ``x @ w[p]``, float32, over K in fixed tiles (``x_load(k)``:
    the input's K tile ``k``, ``[ROWS, K_TILE]``; ``first``: the weight's first K tiles of
    this column tile, already loaded). The same additions in the same order either way."""
    cols = pl.ds(pl.multiple_of(c * COLUMNS, COLUMNS), COLUMNS)
    acc = jnp.zeros((ROWS, COLUMNS), jnp.float32)
    for k, w_tile in enumerate(first):
        acc = acc + jnp.dot(x_load(k), w_tile, preferred_element_type=jnp.float32)

    def step(k, acc):
        ks = pl.ds(pl.multiple_of(k * K_TILE, K_TILE), K_TILE)
        return acc + jnp.dot(x_load(k), w_ref[p, ks, cols], preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(len(first), d // K_TILE, step, acc)


def _first_tiles(w_ref, p, c, count: int) -> tuple:
    """The first ``count`` K tiles of column tile ``c`` of weight ``p``."""
    cols = pl.ds(pl.multiple_of(c * COLUMNS, COLUMNS), COLUMNS)
    return tuple(w_ref[p, pl.ds(k * K_TILE, K_TILE), cols] for k in range(count))


def _product_kernel(x_ref, w_ref, o_ref, *, p: int, d: int) -> None:
    c = pl.program_id(0)
    x = lambda k: x_ref[:, pl.ds(pl.multiple_of(k * K_TILE, K_TILE), K_TILE)]  # noqa: E731
    o_ref[...] = _tile(x, w_ref, p, c, d).astype(o_ref.dtype)


def launches(x: jax.Array, w: jax.Array, interpret: bool = False) -> jax.Array:
    """Every phase's output ``[phases, ROWS, D]``, one kernel a phase."""
    phases, d, _ = w.shape
    outs = []
    for p in range(phases):
        x = pl.pallas_call(
            functools.partial(_product_kernel, p=p, d=d), grid=(d // COLUMNS,),
            in_specs=[pl.BlockSpec((ROWS, d), lambda c: (0, 0)),
                      pl.BlockSpec(w.shape, lambda c: (0, 0, 0))],
            out_specs=pl.BlockSpec((ROWS, COLUMNS), lambda c: (0, c)),
            out_shape=jax.ShapeDtypeStruct((ROWS, d), w.dtype), name="probe_phase",
            **_params(interpret))(x, w)
        outs.append(x)
    return jnp.stack(outs)


def _persistent_kernel(w_ref, acts_in, count_in, acts_ref, count_ref, *, d: int,
                       phases: int, ahead: int) -> None:
    """Program ``j`` of ``P``: for each phase, column tiles ``j, j + P, ...`` of the phase's
    product from the row before it (``acts_ref[p]``), stored at ``acts_ref[p + 1]``, then
    the barrier. With ``ahead``, the first ``ahead`` K tiles of the next phase's weights
    for the program's first column tile are loaded before the barrier (they do not depend on
    the row), so their latency overlaps the wait."""
    del acts_in, count_in  # read and written through their aliased outputs
    from jax.experimental.pallas import triton as plgpu

    j, programs = pl.program_id(0), pl.num_programs(0)
    tiles = d // COLUMNS

    def phase(p, first):
        def x(k):  # (no L1 line of a phase's row exists before the phase reads it)
            start = k * K_TILE if isinstance(k, int) else pl.multiple_of(k * K_TILE, K_TILE)
            return acts_ref[p, :, pl.ds(start, K_TILE)]

        def store(c, value):
            acts_ref[p + 1, :, pl.ds(pl.multiple_of(c * COLUMNS, COLUMNS), COLUMNS)] = (
                value.astype(acts_ref.dtype))

        store(j, _tile(x, w_ref, p, j, d, first))  # every program has a first tile

        def one(i, carry):
            c = j + i * programs
            store(c, _tile(x, w_ref, p, c, d))
            return carry

        jax.lax.fori_loop(1, (tiles - j + programs - 1) // programs, one, 0)
        upcoming = _first_tiles(w_ref, jnp.minimum(p + 1, phases - 1), j, ahead)
        plgpu.debug_barrier()  # every thread's stores issued before the release
        target = (p + 1) * programs
        seen = plgpu.atomic_add(count_ref, (jnp.int32(0),), jnp.int32(1)) + 1
        jax.lax.while_loop(lambda n: n < target,
                           lambda n: plgpu.atomic_add(count_ref, (jnp.int32(0),), jnp.int32(0)),
                           seen)
        return upcoming

    jax.lax.fori_loop(0, phases, phase, _first_tiles(w_ref, 0, j, ahead))


def persistent(x: jax.Array, w: jax.Array, programs: int, ahead: int = 0) -> jax.Array:
    """Every phase's output ``[phases, ROWS, D]`` from one kernel of ``programs`` programs
    (no more than can run at once: they wait for each other); ``ahead``: K tiles of the next
    weights each program loads before a barrier."""
    phases, d, _ = w.shape
    if not 0 <= ahead <= d // K_TILE:
        raise ValueError(f"ahead must be 0..{d // K_TILE} K tiles for D = {d}, got {ahead}")
    acts = jnp.zeros((phases + 1, ROWS, d), w.dtype).at[0].set(x)
    count = jnp.zeros((1,), jnp.int32)
    whole = lambda a: pl.BlockSpec(a.shape, lambda j: (0,) * a.ndim)  # noqa: E731
    acts, _ = pl.pallas_call(
        functools.partial(_persistent_kernel, d=d, phases=phases, ahead=ahead),
        grid=(programs,),
        in_specs=[whole(w), whole(acts), whole(count)], out_specs=[whole(acts), whole(count)],
        out_shape=[jax.ShapeDtypeStruct(acts.shape, acts.dtype),
                   jax.ShapeDtypeStruct(count.shape, jnp.int32)],
        input_output_aliases={1: 0, 2: 1}, name="probe_persistent", **_params(False))(
            w, acts, count)
    return acts[1:]


def stepped(form: Any, steps: int) -> Any:
    """``form``'s chain run ``steps`` times in a device loop, each run's last row the next
    one's input (as a decode's steps run, under the loop graphs ``benchmarks`` turns on)."""
    def run(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, steps, lambda i, x: form(x, w)[-1], x)
    return jax.jit(run)


def _params(interpret: bool) -> dict:
    if interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as plgpu

    return {"compiler_params": plgpu.CompilerParams(num_warps=4, num_stages=3)}


def inputs(seed: int, d: int, phases: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = np.zeros((ROWS, d), np.float32)
    x[0] = rng.standard_normal(d)
    w = rng.standard_normal((phases, d, d)).astype(np.float32) / np.sqrt(d)
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)


def probe(cases: tuple, repeats: int, out: Path | None) -> list[dict]:
    records = []
    sms = pallas_layer_tail.multiprocessors()
    for name, d, phases in cases:
        x, w = inputs(0, d, phases)
        programs = min(sms, d // COLUMNS)
        rec: dict[str, Any] = {"case": name, "D": d, "phases": phases, "programs": programs,
                               "weights_MB": round(w.size * 2 / 1e6, 1)}
        ref = np.asarray(jax.jit(launches)(x, w)).view(np.uint16)
        forms = {"launches": launches}
        for ahead in AHEAD:
            fn = functools.partial(persistent, programs=programs, ahead=ahead)
            form = f"persistent, {ahead} tiles ahead" if ahead else "persistent"
            forms[form] = fn
            got = np.asarray(jax.jit(fn)(x, w)).view(np.uint16)
            rec[f"bits_equal_every_phase: {form}"] = bool(np.array_equal(ref, got))
        moved = jax.jit(launches)(x, w.at[0, 0, 0].multiply(3))  # control
        rec["control_differs"] = not np.array_equal(ref, np.asarray(moved).view(np.uint16))
        for form, fn in forms.items():
            t = best_time(stepped(fn, STEPS), x, w, repeats=repeats) / STEPS
            rec[f"us_per_phase: {form}"] = round(t / phases * 1e6, 2)
            rec[f"weights_TBps: {form}"] = round(w.size * 2 / t / 1e12, 2)
        add_record(out, records, rec, date=time.strftime("%Y-%m-%d"), multiprocessors=sms)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls a case (best kept)")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        ap.error("the persistent kernel needs a GPU (its programs wait for each other)")
    records = probe(CASES, args.repeats, args.out)
    ok = all(all(v for k, v in r.items() if k.startswith("bits_equal")) and r["control_differs"]
             for r in records)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
