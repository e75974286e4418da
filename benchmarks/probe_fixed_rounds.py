"""Whether a burst of speculative rounds holds the host on a GPU: the time ``launch_rounds``
and ``continue_rounds`` take to return, and chained calls' tokens/s, with the greedy burst
as a loop of known trip count (``rounds.FIXED_ROUNDS`` iterations, the default for loop-free
drafters that do not record the target rows) and as the ``while_loop`` (session 48), with
the rows recorded (``--record-logits 1``, the default) and without (``0``).

    PYTHONPATH=. python -m benchmarks.probe_fixed_rounds [--shape llama-3.2-1b] [--calls 4]

The target is the 1B shape with XLA's kernels (W = 16) and an oracle drafter, as in
``profile_rounds``. A call that returns in a few milliseconds left the device running; one
that returns after the whole burst held the host (the loop's predicate read back each round).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.profile_rounds import _setup, prefilled


def measure(shape: str, calls: int, budget: int, draft_len: int,
            record_logits: bool) -> list[dict]:
    import jax

    from turbospark_jax.core import sampling
    from turbospark_jax.speculative import pair as pair_module
    from turbospark_jax.speculative import rounds
    from turbospark_jax.speculative.pair import SpeculativePair

    target, drafter, prompt, vocab = _setup(shape)
    pair = SpeculativePair(target, drafter)
    greedy = sampling.SamplingParams.greedy()
    results = []
    for form, fixed in (("fixed", True), ("while_loop", False)):
        pair_module.compiled_rounds = functools.partial(_forced, fixed=fixed)

        def chain() -> dict:
            state = prefilled(pair, prompt)
            t0 = time.perf_counter()
            launched, state = pair.launch_rounds(
                state, 1, draft_len=draft_len, budget=budget, params=greedy,
                history=sampling.History.empty(vocab), key=sampling.request_key(0),
                gen_index=1, remaining=calls * budget, record_logits=record_logits)
            returns = [time.perf_counter() - t0]
            handles = [launched]
            for _ in range(calls - 1):
                t = time.perf_counter()
                launched, state = pair.continue_rounds(state, launched, budget)
                returns.append(time.perf_counter() - t)
                handles.append(launched)
            bursts = [pair.collect_rounds(h) for h in handles]
            jax.block_until_ready(state)
            wall = time.perf_counter() - t0
            tokens = sum(len(b.tokens) for b in bursts)
            return {"returns_ms": [round(r * 1e3, 2) for r in returns],
                    "wall_ms": round(wall * 1e3, 2), "tokens": tokens,
                    "rounds": sum(len(b.rounds) for b in bursts),
                    "tokens_per_s": round(tokens / wall, 1)}

        chain()  # compile
        runs = [chain() for _ in range(3)]
        best = min(runs, key=lambda r: r["wall_ms"])
        results.append({"shape": shape, "form": form, "budget": budget, "calls": calls,
                        "draft_len": draft_len, "record_logits": record_logits, **best})
        print(json.dumps(results[-1]), flush=True)
    pair_module.compiled_rounds = rounds.compiled_rounds
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--record-logits", default="1",
                        help="comma-separated 0/1: with and without the target rows recorded")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    import jax

    results = []
    for record in args.record_logits.split(","):
        results += measure(args.shape, args.calls, args.budget, args.draft_len, record == "1")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"probe_fixed_rounds_{jax.default_backend()}.json"
    path.write_text(json.dumps(results, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())


def _forced(spec: object, donate: bool, *, fixed: bool) -> object:
    """The pair's compiled rounds with the burst's form forced."""
    import dataclasses

    from turbospark_jax.speculative import rounds

    return rounds.compiled_rounds(dataclasses.replace(spec, fixed=fixed), donate)
