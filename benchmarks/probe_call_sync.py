"""Probe: which program calls return to the host before the device is done, and why not.

An exact prefill's calls hold the host until the device has finished them
(``benchmarks/probe_prefill_calls.py``), so the device idles for the host's turnaround
between calls. This asks the same of a decode burst (the time to return from the producer's
program call against the burst's whole time, its tokens read back) and, with ``--dump``,
reads XLA's optimized programs to say for each while loop whether it runs inside a command
buffer (a CUDA graph, whose condition the device evaluates) or on the host (which reads the
condition back each trip and so waits for the device).

    PYTHONPATH=. python -m benchmarks.probe_call_sync --shape llama-3.2-1b --dump /tmp/d \\
        --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import numpy as np


def loops_in_command_buffers(dump: Path) -> list[dict]:
    """For each optimized module XLA dumped: its while loops, and how many of them sit in a
    computation that a command buffer holds (a ``command_buffer`` computation, or one it
    calls)."""
    found = []
    for path in sorted(dump.glob("*after_optimizations.txt")):
        text = path.read_text(errors="replace")
        bodies, name = {}, None
        for line in text.splitlines():
            head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
            if head:
                name = head.group(1)
                bodies[name] = []
            elif name is not None:
                bodies[name].append(line)
        calls = {n: set(re.findall(r"(?:to_apply|body|condition|calls|branch_computations)="
                                   r"\{?%?([\w.\-]+)", "\n".join(b)))
                 for n, b in bodies.items()}
        inside, todo = set(), [n for n in bodies if "command_buffer" in n]
        while todo:
            n = todo.pop()
            if n not in inside:
                inside.add(n)
                todo.extend(calls.get(n, ()))
        loops = [n for n, b in bodies.items() for line in b if " while(" in line]
        if loops:
            found.append({"module": path.name[:90], "while_loops": len(loops),
                          "in_command_buffers": sum(n in inside for n in loops)})
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--dump", type=Path, help="dump XLA's optimized programs here and read them")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.dump:  # before JAX starts a backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_dump_to={args.dump} --xla_dump_hlo_as_text").strip()
    import jax

    from benchmarks.rowinv_model import ALL_SHAPES, _model, _producer
    from turbospark_jax.core import sampling

    _, model, params = _model(ALL_SHAPES[args.shape], "rowinv")
    vocab = model.config.vocab_size
    producer = _producer(model, params, 4096 + 64, 1, args.steps, 2048, donate=True)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, vocab, 128)]
    timed = {}
    original = producer._call

    def timing_call(*a, **k):
        t0 = time.perf_counter()
        result = original(*a, **k)
        timed["call_s"] = time.perf_counter() - t0
        return result

    producer._call = timing_call
    records = []
    for _ in range(4):  # the first compiles
        state = producer.init_state()
        _, state = producer.prefill_chunk(state, prompt, 0)
        jax.block_until_ready(state)
        history = sampling.History.from_prompt(prompt, vocab)
        t0 = time.perf_counter()
        burst, state = producer.decode(
            state, prompt[-1], args.steps, params=sampling.SamplingParams.greedy(),
            history=history, key=sampling.request_key(0), gen_index=0, record_logits=False)
        total = time.perf_counter() - t0
        records.append({"steps": len(burst.tokens),
                        "call_returned_ms": round(1e3 * timed["call_s"], 2),
                        "burst_ms": round(1e3 * total, 2)})
        print(json.dumps(records[-1]), flush=True)
    result = {"meta": {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "xla_flags": os.environ.get("XLA_FLAGS", ""), "shape": args.shape},
              "decode_bursts": records[1:]}
    if args.dump:
        result["loops"] = loops_in_command_buffers(args.dump)
        for row in result["loops"]:
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
