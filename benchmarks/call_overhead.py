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
from typing import Any

import numpy as np


def prefilled_producer(shape_name: str, capacity: int,
                       steps_per_call: int) -> tuple[Any, Any, Any]:
    """``(config, producer, state)``: a donating ``BlockProducer`` of width 16 over the dense
    shape ``shape_name`` with random weights (bfloat16 on a GPU, float32 elsewhere), and its
    state after a prefill of 128 tokens."""
    import jax
    import jax.numpy as jnp

    from benchmarks.run import SHAPES
    from turbospark_jax.block_producer import BlockProducer
    from turbospark_jax.models.dense import DenseModel, init_params, unstack_layers
    from turbospark_jax.models.dense_config import DenseConfig

    config = DenseConfig.from_hf_dict(SHAPES[shape_name].hf_dict())
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    model = DenseModel(config, dtype, scan_layers=False)
    params = unstack_layers(init_params(config, jax.random.PRNGKey(0), dtype))
    producer = BlockProducer(model, params, capacity=capacity, width=16,
                             steps_per_call=steps_per_call, donate=True)
    state = producer.prefill_chunk(producer.init_state(), list(range(1, 129)), 0)[1]
    return config, producer, state


def main() -> None:
    from turbospark_jax import sampling

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    args = ap.parse_args()
    config, p, state = prefilled_producer(args.shape, capacity=4096, steps_per_call=64)
    greedy, key = sampling.SamplingParams.greedy(), sampling.request_key(0)
    hist = sampling.History.empty(config.vocab_size)
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
