"""Where the fixed cost of one device call goes: host phases and the traced host events.

    PYTHONPATH=. python -m benchmarks.profile_call [--shape llama-3.2-1b] [--steps 4]

Times short decode calls (so the fixed cost dominates) phase by phase on the host (building
the inputs, the dispatch returning, the device finishing, reading the tokens back), then traces
a few calls with the JAX profiler and lists the longest host-side events and the device's idle
gaps around each call. ``benchmarks.call_overhead`` measured the cost (a decode call on the 1B
shape: 5.3 ms beyond its steps); this says where it is spent.
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
import json
import os
import tempfile
import time

import numpy as np


def main() -> None:
    import jax

    from benchmarks.call_overhead import prefilled_producer
    from turbospark_jax.core import sampling

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    config, p, state = prefilled_producer(args.shape, capacity=1024, steps_per_call=32)
    greedy, key = sampling.SamplingParams.greedy(), sampling.request_key(0)
    hist = sampling.History.empty(config.vocab_size)
    n = args.steps

    # phase timings: the same work BlockProducer.decode does, split
    phases: dict[str, list[float]] = collections.defaultdict(list)
    for rep in range(12):
        t0 = time.perf_counter()
        count = int(state.fed.count)
        control = p._idle.replace(feedback=np.bool_(True), params=greedy, history=hist, key=key,
                                  gen_index=np.int32(1))
        plan = p._plan([[1]] + [[0]] * (n - 1), head_on_last=False, head_all=True,
                       offsets=np.arange(p.steps_per_call, dtype=np.int32))
        t1 = time.perf_counter()
        out, state = p._call(state, plan, control, n)
        t2 = time.perf_counter()
        jax.block_until_ready(out.sampled)
        t3 = time.perf_counter()
        jax.device_get((out.steps, out.finish, out.sampled))
        t4 = time.perf_counter()
        state = p.rewind(state, count)
        t5 = time.perf_counter()
        if rep >= 2:
            for name, dt in (("inputs", t1 - t0), ("dispatch", t2 - t1), ("device", t3 - t2),
                             ("read_back", t4 - t3), ("rewind", t5 - t4), ("total", t5 - t0)):
                phases[name].append(dt * 1e3)
    summary = {k: float(np.median(v)) for k, v in phases.items()}
    print(json.dumps({"shape": args.shape, "steps": n, "phase_ms": summary}), flush=True)

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(3):
                out, state = p._call(state, plan, control, n)
                jax.block_until_ready(out.sampled)
                state = p.rewind(state, count)
        path = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)[0]
        data = ProfileData.from_file(path)
    host, device = collections.defaultdict(list), []
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                if plane.name.startswith("/device:GPU") and line.name.startswith("Stream"):
                    device.append((int(ev.start_ns), int(ev.duration_ns)))
                elif plane.name.startswith("/host"):
                    host[ev.name].append(int(ev.duration_ns))
    ranked = sorted(host.items(), key=lambda kv: -sum(kv[1]))[:30]
    for name, ds in ranked:
        print(f"  host {sum(ds) / 3 / 1e3:9.1f} us/call x{len(ds) / 3:5.1f}  {name[:90]}")
    device.sort()
    if device:
        span = (device[-1][0] + device[-1][1] - device[0][0]) / 1e3
        busy = sum(d for _, d in device) / 1e3
        gaps = sorted(((b[0] - a[0] - a[1]) / 1e3 for a, b in itertools.pairwise(device)),
                      reverse=True)
        print(json.dumps({"device_span_us": span, "device_busy_us": busy,
                          "largest_gaps_us": gaps[:10]}))


if __name__ == "__main__":
    main()
