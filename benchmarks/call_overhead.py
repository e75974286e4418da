"""Per-call cost of a device burst: time decode calls of several lengths and fit ``a + b n``.

    PYTHONPATH=. python -m benchmarks.call_overhead [--shape llama-3.2-1b]

``a`` is what one call costs beyond its steps (host work, launch, whatever the runtime does
per execution); ``b`` the cost of one step. Run it under different ``XLA_FLAGS`` to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.run import SHAPES
    from turbospark_jax import sampling
    from turbospark_jax.block_producer import BlockProducer
    from turbospark_jax.models.dense import DenseModel, init_params, unstack_layers
    from turbospark_jax.models.dense_config import DenseConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    config = DenseConfig.from_hf_dict(shape.hf_dict())
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    model = DenseModel(config, dtype, scan_layers=False)
    params = unstack_layers(init_params(config, jax.random.PRNGKey(0), dtype))
    p = BlockProducer(model, params, capacity=4096, width=16, steps_per_call=64, donate=True)
    greedy, key = sampling.SamplingParams.greedy(), sampling.request_key(0)
    hist = sampling.History.empty(config.vocab_size)
    state = p.prefill_chunk(p.init_state(), list(range(1, 129)), 0)[1]
    times: dict[int, float] = {}
    for n in (4, 16, 64):
        runs = []
        for _rep in range(6):
            t0 = time.perf_counter()
            _burst, state = p.decode(state, 1, n, params=greedy, history=hist, key=key,
                                    gen_index=1, record_logits=False)
            runs.append(time.perf_counter() - t0)
            state = p.rewind(state, 128)
        times[n] = float(np.median(runs[1:]))
    ns = np.array(sorted(times), float)
    ts = np.array([times[int(n)] for n in ns])
    b, a = np.polyfit(ns, ts, 1)
    print(json.dumps({"shape": args.shape, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                      "call_ms": {int(n): t * 1e3 for n, t in times.items()},
                      "per_call_ms": a * 1e3, "per_step_ms": b * 1e3}))


if __name__ == "__main__":
    main()
