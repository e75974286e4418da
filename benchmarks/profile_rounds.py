"""Where a speculative round's time goes on the device: kernels per round, busy time, gaps.

    PYTHONPATH=. python -m benchmarks.profile_rounds [--shape llama-3.2-1b] [--embedded]

Decodes one burst of device rounds (oracle drafter, or the embedded target with n-gram
lookup) under the JAX profiler and reads the trace back, as ``profile_decode`` does for
plain decoding: wall and device-busy time per round, kernels per round, the largest idle
gaps (a gap inside one device call is a host sync: a control-flow predicate read back) and
the top kernels. Also times plain decode bursts and device rounds without the profiler.
Writes ``<out>/profile_rounds_<name>.json``.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.profile_decode import traced_events


def _setup(shape_name: str | None) -> tuple[Any, Any, list[int], int]:
    """(target producer, drafter, prompt, vocab)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.run import SHAPES
    from turbospark_jax import CompletionRequest, run_raw_completion
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel, init_params, unstack_layers
    from turbospark_jax.speculative.drafters import NGramDrafter, OracleDrafter

    if shape_name is None:
        import turbospark_jax as tsj

        model = tsj.load(context=1024, width=16)
        prompt = model.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):",
                                        add_special_tokens=False)
        return model.producer, NGramDrafter(model.producer.vocab_size, 3), prompt, \
            model.producer.vocab_size
    shape = SHAPES[shape_name]
    config = DenseConfig.from_hf_dict(shape.hf_dict())
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    model = DenseModel(config, dtype, scan_layers=False)
    params = unstack_layers(init_params(config, jax.random.PRNGKey(0), dtype))
    target = BlockProducer(model, params, capacity=1024, width=16, donate=True)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, 128)]
    ref = run_raw_completion(target, CompletionRequest(prompt_ids=prompt, max_tokens=400))
    return target, OracleDrafter(config.vocab_size, prompt + ref.token_ids, 0.9), prompt, \
        config.vocab_size


def prefilled(pair: Any, prompt: list[int]) -> Any:
    """A fresh state of ``pair`` with ``prompt`` fed, ready on the device."""
    import jax

    state = pair.init_state()
    _, state = pair.prefill_chunk(state, prompt, 0)
    return jax.block_until_ready(state)


def profile(shape_name: str | None, draft_len: int, budget: int) -> dict[str, Any]:
    import jax

    from turbospark_jax.core import sampling
    from turbospark_jax.speculative.pair import SpeculativePair

    target, drafter, prompt, vocab = _setup(shape_name)
    pair = SpeculativePair(target, drafter)
    greedy = sampling.SamplingParams.greedy()
    key = sampling.request_key(0)

    def burst() -> tuple[float, Any]:
        state = prefilled(pair, prompt)
        t0 = time.perf_counter()
        out, state = pair.device_rounds(
            state, 1, draft_len=draft_len, budget=budget, params=greedy,
            history=sampling.History.empty(vocab), key=key, gen_index=1, remaining=budget + 8,
            record_logits=False)
        jax.block_until_ready(state)
        return time.perf_counter() - t0, out

    burst()
    walls = [burst() for _ in range(3)]
    wall, out = min(walls, key=lambda w: w[0])
    rounds = len(out.rounds)
    result: dict[str, Any] = {
        "target": shape_name or "embedded", "draft_len": draft_len, "rounds": rounds,
        "tokens": len(out.tokens), "wall_per_round_us": wall / rounds * 1e6,
        "tokens_per_s": len(out.tokens) / wall,
    }
    # the plain decode step for comparison, timed the same way
    def plain() -> float:
        state = target.init_state()
        _, state = target.prefill_chunk(state, prompt, 0)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        _, state = target.decode(state, 1, 32, params=greedy,
                                 history=sampling.History.empty(vocab), key=key, gen_index=1,
                                 record_logits=False)
        jax.block_until_ready(state)
        return time.perf_counter() - t0

    plain()
    result["plain_wall_per_token_us"] = min(plain() for _ in range(3)) / 32 * 1e6
    (traced_wall, out), events = traced_events(burst)
    if not events:
        return result
    events.sort(key=lambda e: e[1])
    end = max(s + d for _, s, d in events)
    window = [e for e in events if e[1] >= end - traced_wall * 1e9]
    rounds = max(len(out.rounds), 1)
    busy = sum(d for _, _, d in window)
    gaps = sorted(((b[1] - (a[1] + a[2])) / 1e3 for a, b in itertools.pairwise(window)),
                  reverse=True)
    by_name: dict[str, list[int]] = collections.defaultdict(list)
    for name, _, d in window:
        by_name[name].append(d)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    result.update({
        "traced_wall_per_round_us": traced_wall / rounds * 1e6,
        "busy_per_round_us": busy / rounds / 1e3,
        "kernels_per_round": len(window) / rounds,
        "largest_gaps_us": gaps[:12],
        "gaps_over_20us_per_round": sum(g > 20 for g in gaps) / rounds,
        "top_kernels": [(n[:80], len(ds) / rounds, sum(ds) / rounds / 1e3)
                        for n, ds in ranked[:25]],
    })
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--embedded", action="store_true")
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    result = profile(None if args.embedded else args.shape, args.draft_len, args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "embedded" if args.embedded else args.shape
    (args.out / f"profile_rounds_{name}.json").write_text(json.dumps(result, indent=1))
    short = {k: v for k, v in result.items() if k != "top_kernels"}
    print(json.dumps(short))
    for n, count, us in result.get("top_kernels", [])[:15]:
        print(f"  {us:8.1f} us x{count:5.1f}  {n}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
