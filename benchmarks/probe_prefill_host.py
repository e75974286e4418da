"""Probe: where an exact or parallel prefill's wall time goes beyond the device's kernels.

At 2,048 tokens the 1B's exact prefill took 13.3 ms of wall time on an H100 for about 9.2 ms
of kernels (``rowinv_h100_prefill_profile_s38.json``; that profile traced ``init_state``
too). This times one prefill of a prepared state: the host's time before each program call,
each call until it returns, and the wait after the last; then traces the same call alone (no
state building in the trace) for the device's busy time, its span and its widest gaps.

    PYTHONPATH=. python -m benchmarks.probe_prefill_host --shape llama-3.2-1b --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    import jax

    from benchmarks.profile_decode import idle_gaps, traced_events
    from benchmarks.rowinv import write_probe
    from benchmarks.rowinv_model import ALL_SHAPES, _model, _producer

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    _, model, params = _model(ALL_SHAPES[args.shape], "rowinv")
    producer = _producer(model, params, max(lengths) + 64, 1, 16, 2048, donate=True)
    program = producer._program
    marks: list[tuple[str, float]] = []

    def timed_program(*a, **k):
        marks.append(("call", time.perf_counter()))
        out = program(*a, **k)
        marks.append(("returned", time.perf_counter()))
        return out

    producer._program = timed_program
    records = []
    for length in lengths:
        prompt = [int(t) for t in np.random.default_rng(1).integers(0, model.config.vocab_size,
                                                                    length)]
        for path in ("exact", "parallel"):
            fn = (lambda s, p=prompt: producer.prefill_chunk(s, p, 0)) if path == "exact" else (
                lambda s, p=prompt: producer.prefill_parallel(s, p, 0))
            jax.block_until_ready(fn(producer.init_state()))
            best = None
            for _ in range(3):
                state = producer.init_state()
                jax.block_until_ready(state)
                marks.clear()
                t0 = time.perf_counter()
                jax.block_until_ready(fn(state))
                t1 = time.perf_counter()
                steps = [(what, round((t - t0) * 1e3, 3)) for what, t in marks]
                run = {"wall_ms": round((t1 - t0) * 1e3, 3), "marks_ms": steps}
                if best is None or run["wall_ms"] < best["wall_ms"]:
                    best = run
            state = producer.init_state()
            jax.block_until_ready(state)
            _, events = traced_events(lambda s=state, f=fn: jax.block_until_ready(f(s)))
            events.sort(key=lambda e: e[1])
            busy = sum(d for _, _, d in events) / 1e6
            span = (max(s + d for _, s, d in events) - events[0][1]) / 1e6 if events else 0
            gaps = idle_gaps(events, top=6)
            record = {"shape": args.shape, "length": length, "path": path, **best,
                      "traced_busy_ms": round(busy, 3), "traced_span_ms": round(span, 3),
                      "traced_idle_ms": round(gaps["total_ns"] / 1e6, 3),
                      "widest_gaps": [{"us": round(ns / 1e3, 1), "after": a[:40],
                                       "before": b[:40]} for ns, a, b in gaps["widest"]]}
            print(json.dumps(record), flush=True)
            records.append(record)
    write_probe(args.out, records)


if __name__ == "__main__":
    main()
