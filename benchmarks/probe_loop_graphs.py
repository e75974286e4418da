"""Probe: which construct XLA gets wrong when a program's while loops are recorded as CUDA
graphs.

With while loops recorded (``device_flags.decode_program_options``), the speculative rounds'
sampled fixed form gave wrong tokens on an H100 (jax 0.11.2;
docs/decisions/0004-loop-graphs.md), while every greedy form gave the right ones. The sampled
form then held, inside a loop of known trip count, conditionals whose branches sort the
vocabulary and draw from it, some of them inside a second loop of conditionals. This probe
compiles small programs of those shapes twice, with XLA's default command buffers and with while
loops recorded, runs each on the same inputs, and reports which outputs differ bit for bit:

- ``cond_sort``: a loop of known trip count, each iteration a conditional whose branch sorts;
- ``cond_top_k``: the same with ``lax.top_k``;
- ``cond_draw``: the branch draws a token from a row with ``jax.random.categorical``;
- ``cond_sampling``: the branch shapes a row and draws from it as the sampled rounds do
  (top-k 50, top-p 0.95, temperature 0.8: ``sampling.process_logits``, ``draw_processed``);
- ``nested_cond_sort``: a loop of conditionals, each holding a loop of conditionals that sort
  (the bounded judge inside the fixed rounds);
- ``cond_no_sort``: the branch does arithmetic only (the greedy rounds' kind; the control).

    PYTHONPATH=. python -m benchmarks.probe_loop_graphs --out OUT.json

On a CPU the options change nothing and every case agrees: the probe's point is the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

TRIPS = 32
INNER = 8
VOCAB = 8192


def _cases() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    def looped(branch):
        """``TRIPS`` iterations, each running ``branch`` while the carry's count is under the
        data's stop (a data-dependent condition, as a burst's), then nothing."""
        def program(rows, stop, key):
            def iteration(i, c):
                count, acc = c
                return jax.lax.cond(count < stop, lambda c: branch(i, c, rows, key),
                                    lambda c: c, (count, acc))
            start = (jnp.int32(0), jnp.zeros((), jnp.float32))
            return jax.lax.fori_loop(0, TRIPS, iteration, start)
        return program

    def sort_branch(i, c, rows, key):
        count, acc = c
        row = jnp.sort(rows[i % rows.shape[0]] + acc)
        return count + 1, acc + row[-1] - row[0]

    def top_k_branch(i, c, rows, key):
        count, acc = c
        values, ids = jax.lax.top_k(rows[i % rows.shape[0]] + acc, 64)
        return count + 1, acc + values[0] * 1e-3 + ids[-1].astype(jnp.float32) * 1e-6

    def draw_branch(i, c, rows, key):
        count, acc = c
        token = jax.random.categorical(jax.random.fold_in(key, i), rows[i % rows.shape[0]])
        return count + 1, acc + token.astype(jnp.float32)

    def nested_branch(i, c, rows, key):
        count, acc = c

        def inner(j, a):
            return jax.lax.cond(j < (i % INNER) + 1,
                                lambda a: a + jnp.sort(rows[j] + a)[-1] * 1e-3,
                                lambda a: a, a)
        return count + 1, jax.lax.fori_loop(0, INNER, inner, acc)

    from turbospark_jax.core import sampling

    params = sampling.SamplingParams.make(temperature=0.8, top_k=50, top_p=0.95)
    history = sampling.History.empty(VOCAB)

    def sampling_branch(i, c, rows, key):
        count, acc = c
        processed = sampling.process_logits(rows[i % rows.shape[0]] + acc, params, history)
        token = sampling.draw_processed(processed, params, sampling.token_key(key, i))
        return count + 1, acc + token.astype(jnp.float32) * 1e-4

    def plain_branch(i, c, rows, key):
        count, acc = c
        return count + 1, acc + jnp.sum(rows[i % rows.shape[0]] * 0.5)

    return {"cond_sort": looped(sort_branch), "cond_top_k": looped(top_k_branch),
            "cond_draw": looped(draw_branch), "cond_sampling": looped(sampling_branch),
            "nested_cond_sort": looped(nested_branch), "cond_no_sort": looped(plain_branch)}


def same_bits(a: Any, b: Any) -> bool:
    """Whether two programs' outputs (tuples of arrays) agree bit for bit."""
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip(a, b, strict=True))


def run(seeds: int) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    from turbospark_jax.engine import loop_graphs as device_flags

    recorded = {"xla_gpu_enable_command_buffer": device_flags.DECODE_COMMAND_BUFFERS}
    out = []
    for name, program in _cases().items():
        default, graphs = jax.jit(program), jax.jit(program, compiler_options=recorded)
        differing = []
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            rows = jnp.asarray(rng.normal(size=(INNER, VOCAB)), jnp.float32)
            stop = jnp.int32(rng.integers(1, TRIPS + 1))
            key = jax.random.PRNGKey(seed)
            a = jax.device_get(default(rows, stop, key))
            b = jax.device_get(graphs(rows, stop, key))
            if not same_bits(a, b):
                differing.append({"seed": seed, "default": [float(x) for x in a],
                                  "graphs": [float(x) for x in b]})
        out.append({"case": name, "seeds": seeds, "differing": len(differing),
                    "examples": differing[:3], "backend": jax.default_backend()})
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args(argv)
    records = run(args.seeds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
