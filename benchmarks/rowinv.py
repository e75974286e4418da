"""Row invariance and speed of the row-invariant matrix product (kernels/rowinv.py) against
XLA's dot, on the 1B shape's projection sizes.

    PYTHONPATH=. python -m benchmarks.rowinv --out /tmp/rowinv            # on the H200
    PYTHONPATH=. python -m benchmarks.rowinv --preset cpu --out /tmp/rowinv_cpu

Parts, in order, each case on its own (an error is recorded and the run goes on), the JSON
rewritten after every case, and cases past ``--budget-s`` skipped and listed:

1. ``invariance``: for each ``(K, N)`` and each row count ``M``, whether rows ``0..M-1`` of a
   call on the first ``M`` rows are bitwise the rows of a call on all of them, and whether a
   one-row call on row ``r`` is row ``r`` of that call; for ours (``impl="auto"``, which picks
   the matvec kernel up to 16 rows and the matmul kernel above) and for XLA's dot (the
   control, expected to fail on a GPU). Then the two kernels forced on the same rows, and
   other tile sizes.
2. ``bandwidth``: GB/s of weight reads at a few rows (ours, XLA, and a plain copy's
   read + write rate), each timed over enough weight copies to overflow the L2 cache, in one
   program, so the launch cost of the call is spread.
3. ``throughput``: TFLOP/s at many rows, ours (a few tile sizes) and XLA.
4. ``sweep``: the matvec kernel's column tile and segment length at one row.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.kernels.rowinv import Schedule, Tiles, rowinv_matmul

PRESETS = {
    "h200": {
        "shapes": [(2048, 2048), (2048, 8192), (8192, 2048), (2048, 512), (2048, 128256)],
        "rows": [1, 2, 3, 4, 7, 8, 16, 17, 64, 128, 256, 1000, 2048, 4096],
        "single": 1000, "small": [1, 4, 16], "large": [2048, 4096], "copy_bytes": 1 << 30,
    },
    "cpu": {
        "shapes": [(512, 512), (2048, 512), (512, 2048)],
        "rows": [1, 2, 3, 4, 7, 8, 16, 17, 33, 64, 128, 256],
        "single": 200, "small": [1, 4, 16], "large": [256], "copy_bytes": 1 << 27,
    },
}
MATMUL_TILES = [Tiles(), Tiles(bm=128, bn=128, warps=8), Tiles(bm=128, bn=256, warps=8),
                Tiles(flat_loop=False), Tiles(bm=64, bn=256, warps=4, stages=4)]
MATVEC_SWEEP = [(bn, seg) for bn in (32, 64, 128) for seg in (2, 4, 8)]


def _label(t: Tiles) -> str:
    loop = "flat" if t.flat_loop else "nested"
    return f"bm{t.bm} bn{t.bn} warps{t.warps} stages{t.stages} {loop}"


def _xla(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


class Run:
    """The results so far, written after every case; cases past the budget are skipped."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.path = out / "rowinv.json"
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.data: dict = {
            "device": str(jax.devices()[0]), "backend": jax.default_backend(),
            "jax": jax.__version__, "python": platform.python_version(),
            "schedule": dataclasses.asdict(Schedule()), "tiles": dataclasses.asdict(Tiles()),
            "invariance": [], "kernels": [], "bandwidth": [],
            "throughput": [], "sweep": [], "errors": [], "skipped": [],
        }
        out.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        self.path.write_text(json.dumps(self.data, indent=1))

    def case(self, part: str, label: dict, fn) -> None:
        status = "ok"
        if time.perf_counter() - self.start > self.budget_s:
            self.data["skipped"].append({"part": part, **label})
            status = "skipped"
        else:
            try:
                self.data[part].append({**label, **fn()})
            except Exception as e:  # recorded; the run goes on
                self.data["errors"].append({"part": part, **label, "error": repr(e)[:500],
                                            "trace": traceback.format_exc()[-1500:]})
                status = "error"
        self.write()
        print(f"{self.data['elapsed_s']:6.1f}s", part, label, status, flush=True)


def _operands(k: int, n: int, rows: int, copies: int = 1) -> tuple[jax.Array, jax.Array]:
    kx, kw = jax.random.split(jax.random.PRNGKey(k * 7 + n))
    x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (copies, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    return x, w


def _bits(a: jax.Array) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def _invariance(f, x: jax.Array, w: jax.Array, rows: list[int], single: int) -> dict:
    full = _bits(f(x, w))
    bad, diffs = [], {}
    for m in rows:
        got = _bits(f(x[:m], w))
        if not np.array_equal(got, full[:m]):
            bad.append(m)
            diff = np.abs(got.view(jnp.bfloat16).astype(np.float32)
                          - full[:m].view(jnp.bfloat16).astype(np.float32))
            diffs[str(m)] = float(diff.max())
    one = _bits(f(x[single : single + 1], w))[0]
    return {"rows_checked": rows, "differs_at": bad, "max_abs_diff": diffs,
            "single_row_same": bool(np.array_equal(one, full[single]))}


def write_probe(out: Path, records: list, **meta) -> None:
    """A probe's JSON: ``{"meta": {device, jax, **meta}, "records": records}`` at ``out``
    (its folder made)."""
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, **meta}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "records": records}, indent=1))


def add_record(out: Path | None, records: list, record: dict, **meta) -> None:
    """Print a probe's ``record``, add it to ``records`` and rewrite the probe's JSON with
    every record so far (a run its time limit cuts short keeps what it finished; ``out``
    None: no file)."""
    print(json.dumps(record), flush=True)
    records.append(record)
    if out is not None:
        write_probe(out, records, **meta)


@contextlib.contextmanager
def tiling_entry(record: dict, name: str):
    """``record[name]``, a new dict for one kernel tiling's figures, filled in the ``with``
    block; for a tiling the shape or the shared memory refuses, its error instead (the probe
    goes on to the next)."""
    entry = record[name] = {}
    try:
        yield entry
    except Exception as exc:
        entry["error"] = repr(exc)[:400]


def best_time(f, *args, repeats: int = 5) -> float:
    """The fastest of ``repeats`` timed calls of ``f(*args)`` (after one to compile), s."""
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def _copies(k: int, n: int, copy_bytes: int) -> int:
    return int(max(1, min(64, copy_bytes // (k * n * 2))))


def _over_copies(product):
    """One program applying ``product(x, w)`` to every weight copy in turn (unrolled). The
    copies come as separate arguments: slices of one stacked array would be copied out before
    a custom call (our kernels) reads them, charging each product a copy of its weight."""
    return jax.jit(lambda x, *ws: [product(x, w) for w in ws])


def _bandwidth(product, k: int, n: int, m: int, copy_bytes: int) -> dict:
    copies = _copies(k, n, copy_bytes)
    x, stacked = _operands(k, n, m, copies)
    ws = [jnp.array(stacked[i]) for i in range(copies)]  # a buffer each
    del stacked
    dt = best_time(_over_copies(product), x, *ws) / copies
    return {"us": dt * 1e6, "weight_GBps": k * n * 2 / dt / 1e9, "copies": copies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    ap.add_argument("--budget-s", type=float, default=170.0)
    args = ap.parse_args()
    p = PRESETS[args.preset]
    run = Run(args.out, args.budget_s)
    ours = jax.jit(lambda x, w: rowinv_matmul(x, w))
    xla = jax.jit(_xla)
    top = max(p["rows"])

    nested = jax.jit(lambda x, w: rowinv_matmul(x, w, tiles=Tiles(flat_loop=False)))
    for index, (k, n) in enumerate(p["shapes"]):
        x, w = _operands(k, n, top)
        impls = [("ours", ours), ("xla", xla)] + ([("ours nested", nested)] if index == 0 else [])
        for name, f in impls:
            run.case("invariance", {"impl": name, "K": k, "N": n},
                     lambda f=f, x=x, w=w: _invariance(f, x, w[0], p["rows"], p["single"]))

    def forced(k: int, n: int, m: int) -> dict:
        x, w = _operands(k, n, m)
        outs = {f"{kernel} {t}": _bits(rowinv_matmul(x, w[0], kernel=kernel, tiles=t))
                for kernel in ("matvec", "matmul") for t in (Tiles(), *MATMUL_TILES[1:3])}
        first = next(iter(outs.values()))
        return {"all_equal": all(np.array_equal(first, o) for o in outs.values()),
                "differ": [name for name, o in outs.items() if not np.array_equal(first, o)]}

    on_gpu = jax.default_backend() == "gpu"  # off it, kernel, schedule and tiles are unused
    for k, n in p["shapes"][:3] if on_gpu else []:
        for m in (1, 16, 64):
            run.case("kernels", {"K": k, "N": n, "M": m}, lambda k=k, n=n, m=m: forced(k, n, m))

    copy = jax.jit(lambda a: -a)
    size = p["copy_bytes"] // 2
    run.case("bandwidth", {"impl": "copy (read + write)", "bytes": 2 * size}, lambda: {
        "GBps": 2 * size * 2 / best_time(copy, jnp.ones((size // 4096, 4096), jnp.bfloat16)) / 1e9})
    for k, n in p["shapes"]:
        for m in p["small"]:
            for name, product in (("ours", rowinv_matmul), ("xla", _xla)):
                run.case("bandwidth", {"impl": name, "K": k, "N": n, "M": m},
                         lambda product=product, k=k, n=n, m=m: _bandwidth(
                             product, k, n, m, p["copy_bytes"]))

    for k, n in p["shapes"]:
        for m in p["large"]:
            x, w = _operands(k, n, m)
            cases = [("xla", _xla)] + [
                (f"ours {_label(t)}", lambda a, b, t=t: rowinv_matmul(a, b, tiles=t))
                for t in (MATMUL_TILES if on_gpu and k * n <= 2048 * 8192 else MATMUL_TILES[:1])]
            for name, product in cases:
                run.case("throughput", {"impl": name, "K": k, "N": n, "M": m},
                         lambda product=product, x=x, w=w, k=k, n=n, m=m: {
                             "TFLOPs": 2 * m * k * n / best_time(jax.jit(product), x, w[0]) / 1e12})

    for k, n in p["shapes"][:3] if on_gpu else []:
        for bn, seg in MATVEC_SWEEP:
            schedule, tiles = Schedule(segment_tiles=seg), Tiles(matvec_bn=bn)
            run.case("sweep", {"K": k, "N": n, "M": 1, "matvec_bn": bn, "segment_tiles": seg},
                     lambda k=k, n=n, s=schedule, t=tiles: _bandwidth(
                         lambda a, b: rowinv_matmul(a, b, schedule=s, tiles=t), k, n, 1,
                         p["copy_bytes"]))
    run.write()
    print(json.dumps({key: run.data[key] for key in ("errors", "skipped")}, indent=1)[:3000])


if __name__ == "__main__":
    main()
