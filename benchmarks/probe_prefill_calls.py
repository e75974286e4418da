"""Probe: does an exact prefill's program call hold the host until the device is done?

The prefill profile (``rowinv_model --parts prefill-profile``) shows the device idle for
about 2 ms between the 2,048-row blocks of an exact prefill, each block one program call. If
the calls were asynchronous the host would enqueue the next block while the device ran this
one, and there would be no gap. This times, for one shape, an 8k-token exact prefill with one
block a call (the default before ``block_producer.PREFILL_CALL_ROWS``) and with every block in
one call (the default after it), for each the host's time to return from ``prefill_chunk``
against the time until the result is ready, and checks that the two give the same logits
and cache, bit for bit (the blocks are the same program's steps, one loop or several calls).

    PYTHONPATH=. python -m benchmarks.probe_prefill_calls --shape llama-3.2-1b --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    import jax

    from benchmarks.rowinv import write_probe
    from benchmarks.rowinv_model import ALL_SHAPES, _bits, _live_cache, _model, _producer

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--width", type=int, default=2048, help="the prefill block's rows")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    _, model, params = _model(ALL_SHAPES[args.shape], "rowinv")
    vocab = model.config.vocab_size
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, vocab, args.length)]
    blocks = -(-args.length // args.width)
    records, results = [], []
    for per_call in (1, blocks):
        # steps_per_call caps the blocks a prefill call holds
        producer = _producer(model, params, args.length + 64, 1, per_call, args.width,
                             donate=True)
        assert producer._steps_for(args.width) == per_call
        jax.block_until_ready(producer.prefill_chunk(producer.init_state(), prompt, 0))
        runs = []
        for _ in range(3):
            state = producer.init_state()
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            out = producer.prefill_chunk(state, prompt, 0)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            t2 = time.perf_counter()
            runs.append((t1 - t0, t2 - t0))
        returned, total = min(runs, key=lambda r: r[1])
        logits, state = out
        results.append((_bits(logits), _live_cache(state, args.length)))
        record = {"shape": args.shape, "length": args.length, "block_rows": args.width,
                  "blocks_per_call": per_call, "calls": -(-blocks // per_call),
                  "host_returned_ms": round(1e3 * returned, 2),
                  "ready_ms": round(1e3 * total, 2),
                  "tokens_per_s": round(args.length / total, 1)}
        print(json.dumps(record), flush=True)
        records.append(record)
        del producer, out, state
    (la, ca), (lb, cb) = results
    pairs = list(zip(ca, cb, strict=True))
    same = bool(np.array_equal(la, lb)) and all(np.array_equal(a, b) for a, b in pairs)
    # control: the comparison sees one flipped bit in one cache row
    cb[0] = cb[0].copy()
    cb[0].reshape(-1)[5] ^= 1
    control = not all(np.array_equal(a, b) for a, b in zip(ca, cb, strict=True))
    records.append({"bitwise_equal": same, "control_detects_one_bit": control})
    print(json.dumps(records[-1]), flush=True)
    write_probe(args.out, records)


if __name__ == "__main__":
    main()
