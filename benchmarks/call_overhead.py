"""Per-call cost of a device burst: time decode calls of several lengths, fit ``a + b n``,
and split each call's host time into its phases.

    PYTHONPATH=. python -m benchmarks.call_overhead [--shape llama-3.2-1b] [--kernels rowinv]
        [--out OUT.json]

``a`` is what one call costs beyond its steps (host work, launch, whatever the runtime does
per execution); ``b`` the cost of one step. The phases of a call, medians over the calls of
each length: ``checks`` (from the call's entry to the program's call: the state's checks,
which read its cursor back, the plan and the controls), ``dispatch`` (the program's call,
until it returns to the host), ``wait`` (reading the burst's tokens back: the device's time
left after the dispatch) and ``rest``. While the host runs ``checks`` and ``dispatch`` the
device has nothing of the burst yet, so between two bursts of a generation it idles for
about their sum; the end-to-end decode figures pay it once a call (about five calls for 256
tokens on the 8B shape). Run it under different ``XLA_FLAGS`` to compare.

The same fit over chains of :data:`CHAIN` bursts, each queued on the device with
``continue_decode`` before the one before is read (what the generation loop does), gives
``chained_per_call_ms``: what a call still costs when the host's work overlaps the device's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

#: Burst lengths timed (steps a call).
LENGTHS = (4, 16, 64)
#: Calls of each length (the first of each is dropped: a new length compiles).
REPEATS = 6
#: Bursts of one chained run (the first launched, the rest chained, each read after the
#: next is queued).
CHAIN = 4


def prefilled_producer(shape_name: str, capacity: int, steps_per_call: int,
                       kernels: str = "rowinv") -> tuple[Any, Any, Any]:
    """``(config, producer, state)``: a donating ``BlockProducer`` of width 16 over the dense
    shape ``shape_name`` with random weights (bfloat16 on a GPU, float32 elsewhere) and
    ``kernels``, and its state after a prefill of 128 tokens."""
    import jax
    import jax.numpy as jnp

    from benchmarks.run import SHAPES
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel, init_params, unstack_layers

    config = DenseConfig.from_hf_dict(SHAPES[shape_name].hf_dict())
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    model = DenseModel(config, dtype, scan_layers=False, kernels=kernels)
    params = unstack_layers(init_params(config, jax.random.PRNGKey(0), dtype))
    producer = BlockProducer(model, params, capacity=capacity, width=16,
                             steps_per_call=steps_per_call, donate=True)
    state = producer.prefill_chunk(producer.init_state(), list(range(1, 129)), 0)[1]
    return config, producer, state


class PhaseClock:
    """Times the phases of ``producer.decode`` calls by wrapping the program's call and the
    tokens' read-back on this producer (its class's methods are left as they are)."""

    def __init__(self, producer: Any) -> None:
        import jax

        self.marks: dict[str, float] = {}
        call, get = producer._call, jax.device_get

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            self.marks["call"] = time.perf_counter()
            out = call(*args, **kwargs)
            self.marks["called"] = time.perf_counter()
            return out

        def timed_get(x: Any) -> Any:
            if "called" not in self.marks or "get" in self.marks:  # the burst's read only
                return get(x)
            self.marks["get"] = time.perf_counter()
            out = get(x)
            self.marks["got"] = time.perf_counter()
            return out

        producer._call = timed_call
        self._get = timed_get

    def run(self, fn: Any) -> dict[str, float]:
        """``fn()`` (one decode call) timed: seconds of each phase."""
        import jax

        self.marks.clear()
        real = jax.device_get
        jax.device_get = self._get
        try:
            t0 = time.perf_counter()
            fn()
            end = time.perf_counter()
        finally:
            jax.device_get = real
        m = self.marks
        return {"total": end - t0, "checks": m["call"] - t0, "dispatch": m["called"] - m["call"],
                "wait": m["got"] - m["get"],
                "rest": (end - t0) - (m["called"] - t0) - (m["got"] - m["get"])}


def measure(shape: str, kernels: str, capacity: int = 4096) -> dict:
    from turbospark_jax.core import sampling

    config, p, state = prefilled_producer(shape, capacity=capacity, steps_per_call=max(LENGTHS),
                                          kernels=kernels)
    greedy, key = sampling.SamplingParams.greedy(), sampling.request_key(0)
    hist = sampling.History.empty(config.vocab_size)
    clock = PhaseClock(p)
    holder = {"state": state}
    per_length: dict[int, dict[str, float]] = {}
    for n in LENGTHS:
        runs = []
        for _rep in range(REPEATS):
            def one(n: int = n) -> None:
                _, holder["state"] = p.decode(holder["state"], 1, n, params=greedy,
                                              history=hist, key=key, gen_index=1,
                                              record_logits=False)
            runs.append(clock.run(one))
            holder["state"] = p.rewind(holder["state"], 128)
        per_length[n] = {k: float(np.median([r[k] for r in runs[1:]])) for k in runs[0]}
    chained: dict[int, float] = {}
    for n in LENGTHS:
        runs = []
        for _rep in range(REPEATS):
            seconds, holder["state"] = chain_seconds(p, holder["state"], n, greedy, hist, key)
            runs.append(seconds)
            holder["state"] = p.rewind(holder["state"], 128)
        chained[n] = float(np.median(runs[1:]))
    ns = np.array(LENGTHS, float)
    b, a = np.polyfit(ns, [per_length[n]["total"] for n in LENGTHS], 1)
    cb, ca = np.polyfit(ns, [chained[n] for n in LENGTHS], 1)
    return {"shape": shape, "kernels": kernels, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "per_call_ms": round(a * 1e3, 3), "per_step_ms": round(b * 1e3, 4),
            "chained_per_call_ms": round(ca * 1e3, 3),
            "chained_per_step_ms": round(cb * 1e3, 4),
            "chained_burst_ms": {n: round(v * 1e3, 3) for n, v in chained.items()},
            "phases_ms": {n: {k: round(v * 1e3, 3) for k, v in ph.items()}
                          for n, ph in per_length.items()}}


def chain_seconds(p: Any, state: Any, n: int, params: Any, history: Any,
                  key: Any) -> tuple[float, Any]:
    """Seconds a burst of ``n`` steps takes in a chain of :data:`CHAIN` (launched, each
    next one queued before this one is read), and the state after the chain."""
    t0 = time.perf_counter()
    launched, state = p.launch_decode(state, 1, n, params=params, history=history, key=key,
                                      gen_index=1, record_logits=False)
    for _ in range(CHAIN - 1):
        queued, state = p.continue_decode(state, launched, n)
        p.collect(launched)
        launched = queued
    p.collect(launched)
    return (time.perf_counter() - t0) / CHAIN, state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--kernels", default="rowinv", choices=("rowinv", "xla"))
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=None, help="write the record as JSON here")
    args = ap.parse_args(argv)
    rec = measure(args.shape, args.kernels, args.capacity)
    rec["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(rec), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
