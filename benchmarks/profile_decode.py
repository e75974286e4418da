"""Where a decode step's time goes: kernels per token, device busy time, the top kernels.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python -m benchmarks.profile_decode --shape llama-3.2-1b --widths 1,16

It decodes greedy bursts from a short context (as ``benchmarks.run`` does), then traces one
burst with the JAX profiler and reads the trace back: how many kernels ran per token, how much
of the wall time the device was busy, and which kernels took the time. A device that is busy
for only part of the wall time is waiting on the host (kernel launches, control-flow syncs);
one that is busy throughout is limited by the kernels themselves. Prints a table and writes
``<out>/profile_<shape>.json``. XLA flags come from the environment (``XLA_FLAGS``), so
variants of them are compared by running this once per variant.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.families import SHAPES as FAMILY_SHAPES
from benchmarks.run import SHAPES, _dense, _producer, copy_bandwidth, decode_rate, weight_bytes


def traced_events(call: Any) -> tuple[Any, list[tuple[str, int, int]]]:
    """``call()`` run under a profiler trace: its result and the device's events
    (:func:`_kernel_events`; none on a machine without a GPU)."""
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            result = call()
        return result, _kernel_events(tmp)


def _kernel_events(trace_dir: str) -> list[tuple[str, int, int]]:
    """``(name, start_ns, duration_ns)`` of every device kernel/memcpy in a trace folder."""
    from jax.profiler import ProfileData

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"no trace written under {trace_dir}")
    data = ProfileData.from_file(paths[0])
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                events.append((ev.name, int(ev.start_ns), int(ev.duration_ns)))
    return events


def idle_gaps(events: list[tuple[str, int, int]], top: int = 12) -> dict[str, Any]:
    """The device's idle stretches between ``events`` (``(name, start_ns, duration_ns)``,
    sorted by start): their total, the ``top`` events they follow most (name ->
    ``(gaps, ns)``), how many gaps fall in each size band, and the ``top`` widest gaps
    ``(ns, the event before, the event after)``. Overlapping events (two streams) leave no
    gap."""
    after: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    bands = {"<2us": 0, "2-10us": 0, "10-50us": 0, ">=50us": 0}
    widest: list[tuple[int, str, str]] = []
    total, end, last = 0, None, None
    for name, start, duration in events:
        if end is not None and start > end:
            gap = start - end
            total += gap
            after[last][0] += 1
            after[last][1] += gap
            widest.append((gap, last, name))
            us = gap / 1e3
            bands["<2us" if us < 2 else "2-10us" if us < 10 else "10-50us" if us < 50
                  else ">=50us"] += 1
        if end is None or start + duration >= end:
            end, last = start + duration, name
    ranked = sorted(after.items(), key=lambda kv: -kv[1][1])[:top]
    return {"total_ns": total, "after": [(n, (c, ns)) for n, (c, ns) in ranked],
            "sizes": bands, "widest": sorted(widest, reverse=True)[:top]}


def profile_burst(producer: Any, context: int, steps: int, vocab: int,
                  params: Any = None) -> dict[str, Any]:
    """Trace one ``steps``-token decode burst and summarise the device activity; ``params``
    are the sampling settings (greedy when None)."""
    import jax

    from turbospark_jax.core import sampling

    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, vocab, context)]
    greedy = sampling.SamplingParams.greedy() if params is None else params
    key = sampling.request_key(0)

    def burst() -> float:
        state = producer.init_state()
        _, state = producer.prefill_parallel(state, prompt, 0)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        _, state = producer.decode(state, 1, steps, params=greedy,
                                   history=sampling.History.empty(vocab), key=key, gen_index=1,
                                   record_logits=False)
        jax.block_until_ready(state)
        return time.perf_counter() - t0

    burst()  # compile
    wall, events = traced_events(burst)
    if not events:
        return {"error": "the trace held no device stream events"}
    events.sort(key=lambda e: e[1])
    # The burst is the last stretch of activity: drop the prefill's events by keeping those
    # after the largest gap at the start of the decode call.
    span_end = max(s + d for _, s, d in events)
    window = [e for e in events if e[1] >= span_end - wall * 1e9]
    busy = sum(d for _, _, d in window)
    by_name: dict[str, list[int]] = collections.defaultdict(list)
    for name, _, d in window:
        by_name[name].append(d)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    top = ranked[:15]
    idle = idle_gaps(window)
    return {
        "steps": steps,
        "wall_s": wall,
        "wall_per_token_us": wall / steps * 1e6,
        "kernels_per_token": len(window) / steps,
        "device_busy_per_token_us": busy / steps / 1e3,
        "device_busy_fraction": busy / (wall * 1e9),
        "top_kernels": [
            {"name": n[:90], "count_per_token": len(ds) / steps,
             "us_per_token": sum(ds) / steps / 1e3}
            for n, ds in top
        ],
        "all_kernels": {n: [len(ds) / steps, sum(ds) / steps / 1e3] for n, ds in ranked},
        # Where the device sat idle between two events of the burst, per token: after which
        # event (a host sync ends in ``MemcpyD2H``), and how the gaps are sized.
        "idle_per_token_us": idle["total_ns"] / steps / 1e3,
        "idle_after": {n: [c / steps, ns / steps / 1e3] for n, (c, ns) in idle["after"]},
        "idle_gap_sizes": idle["sizes"],
        # The first events of the burst in order, (name, microseconds): one token's pipeline.
        "sequence": [(n, d / 1e3) for n, _, d in window[:200]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b",
                        choices=sorted(SHAPES) + sorted(FAMILY_SHAPES))
    parser.add_argument("--widths", default="1,16")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--label", default=os.environ.get("XLA_FLAGS", "default") or "default")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--no-trace", action="store_true")
    parser.add_argument("--rope-store", choices=["auto", "xla"], default="auto",
                        help="the model's RoPE-and-cache-write kernel (see DenseModel.rope_store)")
    parser.add_argument("--attention", choices=["auto", "xla"], default="auto",
                        help="the model's attention kernel (see DenseModel.attention)")
    args = parser.parse_args(argv)

    import jax

    bw = copy_bandwidth(4 << 30 if jax.default_backend() == "gpu" else 64 << 20)
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        cap = args.context + args.tokens + width + 1
        if args.shape in FAMILY_SHAPES:  # Qwen3.5 / Gemma 4: random weights as families builds
            from benchmarks import families

            config, producer, params = families.build(args.shape, cap, width, args.burst)
            roof = bw / families.step_bytes(config, params, args.context)
        else:
            config, model, params = _dense(SHAPES[args.shape])
            model = dataclasses.replace(model, rope_store=args.rope_store,
                                        attention=args.attention)
            roof = bw / weight_bytes(params, config)
            producer = _producer(model, params, cap, width, args.burst)
        rate = decode_rate(producer, args.context, args.tokens, args.burst, 2048,
                           config.vocab_size)
        row: dict[str, Any] = {"shape": args.shape, "width": width, "context": args.context,
                               "label": args.label, "rope_store": args.rope_store,
                               "attention": args.attention,
                               "tokens_per_s": rate["tokens_per_s"],
                               "roofline_tokens_per_s": roof,
                               "fraction_of_roofline": rate["tokens_per_s"] / roof}
        if not args.no_trace:
            try:
                row["profile"] = profile_burst(producer, args.context, args.burst,
                                               config.vocab_size)
            except Exception as exc:  # a trace that cannot be read is reported, not fatal
                row["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        del producer
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile_{args.shape}.json"
    old = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(old + rows, indent=1))
    for row in rows:
        p = row.get("profile", {})
        print(f"[{row['label']} rope_store={row['rope_store']} attention={row['attention']}] "
              f"{row['shape']} W={row['width']} ctx={row['context']}: "
              f"{row['tokens_per_s']:.0f} tok/s ({row['fraction_of_roofline']:.0%} of "
              f"{row['roofline_tokens_per_s']:.0f})")
        if "kernels_per_token" in p:
            print(f"   {p['wall_per_token_us']:.0f} us/token wall, "
                  f"{p['device_busy_per_token_us']:.0f} us busy "
                  f"({p['device_busy_fraction']:.0%}), {p['kernels_per_token']:.0f} kernels, "
                  f"{p['idle_per_token_us']:.0f} us idle")
            for k in p["top_kernels"][:12]:
                print(f"     {k['us_per_token']:7.1f} us x{k['count_per_token']:.0f}  {k['name']}")
        elif p:
            print("   profile:", p)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
