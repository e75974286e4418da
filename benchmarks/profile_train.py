"""Where a training step's time goes: tokens/s and MFU per batch size, then one traced step.

The recipe's runs on the H200 reached 310k tokens/s for the Qwen3.5 target (MFU 3.4%) and 1.1M
for the dense draft (2.6%), and the target's step ran out of memory at 256 x 1024 tokens (a
109 GiB buffer). This harness finds out why, on random rows (no corpus needed)::

    PYTHONPATH=. python -m benchmarks.profile_train --out DIR
    PYTHONPATH=. python -m benchmarks.profile_train --presets draft --batch-sizes 64,128 --out DIR
    PYTHONPATH=. python -m benchmarks.profile_train --presets target35 --head-rows 0,8192 --out DIR

For each preset and batch size it compiles the recipe's own train step
(:func:`turbospark_recipe.train.make_train_step`, the one ``recipe`` runs), times a few
steps, and records tokens/s, MFU and the device's peak memory. Then it traces one step at the
largest batch that ran and reads the trace back: the device's busy share of the wall time,
kernels per step, and the kernels that took the time, by name and by kind (matrix products,
triangular solves, fusions, copies). A step whose device is busy throughout is limited by its
kernels; the top kernels then say which. Writes ``<out>/profile_train.json`` after every case.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.profile_decode import traced_events

#: Substrings of kernel names and the kind they count under (first match wins).
KINDS = (
    ("trsm", "triangular solve"), ("gemm", "matrix product"), ("cutlass", "matrix product"),
    ("sm90", "matrix product"), ("cublas", "matrix product"), ("triton", "triton"),
    ("memcpy", "copy"), ("memset", "copy"), ("copy", "copy"), ("transpose", "transpose"),
    ("reduce", "reduction"), ("fusion", "fusion"),
)


def kind_of(name: str) -> str:
    """The coarse kind of a kernel, from its name."""
    low = name.lower()
    return next((kind for key, kind in KINDS if key in low), "other")


def token_rows(rng: np.random.Generator, shape: tuple[int, int], vocab: int,
               tokens: str) -> np.ndarray:
    """int32 rows of ids ``>= 3`` (past the special tokens): ``uniform`` over the vocabulary,
    or ``zipf`` (rank ``r`` drawn with weight ``r ** -1.1``, about how often code's tokens
    recur; a step whose cost depends on repeated ids, a scatter-add of the embedding's
    gradient say, shows it only on such rows)."""
    if tokens == "uniform":
        return rng.integers(3, vocab, shape, dtype=np.int32)
    weights = np.arange(1, vocab - 2, dtype=np.float64) ** -1.1
    ids = rng.choice(vocab - 3, size=shape, p=weights / weights.sum()) + 3
    return ids.astype(np.int32)


def _case(preset: str, batch: int, seq_len: int, steps: int, trace: bool,
          head_rows: int = 0, tokens: str = "uniform") -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path
    from turbospark_jax.io.tokenizer import Tokenizer
    from turbospark_recipe import train as rt
    from turbospark_recipe.flops import mfu, training_flops_per_token

    tokenizer = Tokenizer.from_folder(embedded_model_path(DEFAULT_TARGET))
    config = rt.model_config(preset, tokenizer)
    tc = rt.TrainConfig(steps=1000, batch_size=batch, seq_len=seq_len, warmup_steps=10,
                        head_rows=head_rows)
    model = rt.build_model(config, tc.compute_dtype)
    step_fn = rt.make_train_step(model, tc)
    state = rt.init_state(config, tc)
    rng = np.random.default_rng(0)
    rows = jax.device_put(token_rows(rng, (4 * batch, seq_len + 1), config.vocab_size, tokens))
    order = [jnp.asarray(rng.permutation(4 * batch)[:batch].astype(np.int32))
             for _ in range(steps + 3)]

    t0 = time.perf_counter()
    state, metrics = step_fn(state, rows, order[0])
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    for i in (1, 2):
        state, metrics = step_fn(state, rows, order[i])
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for i in range(steps):
        state, metrics = step_fn(state, rows, order[3 + i % steps])
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - t0) / steps
    tokens_per_s = batch * seq_len / step_s
    flops = training_flops_per_token(config, state.params, seq_len)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    record: dict[str, Any] = {
        "preset": preset, "batch": batch, "seq_len": seq_len, "head_rows": head_rows,
        "tokens": tokens, "compile_s": compile_s,
        "step_s": step_s, "tokens_per_s": tokens_per_s, "flops_per_token": flops,
        "mfu": mfu(tokens_per_s, flops, getattr(device, "device_kind", "?")),
        "peak_bytes": stats.get("peak_bytes_in_use"),
        "loss": float(jax.device_get(metrics["loss"])),
    }
    if trace and jax.default_backend() == "gpu":
        def step() -> tuple[Any, Any, float]:  # the step donates its state: keep the new one
            t0 = time.perf_counter()
            new_state, new_metrics = step_fn(state, rows, order[1])
            jax.block_until_ready(new_metrics)
            return new_state, new_metrics, time.perf_counter() - t0

        (state, metrics, wall), events = traced_events(step)
        busy = sum(d for _, _, d in events)
        by_name: dict[str, list[int]] = collections.defaultdict(list)
        by_kind: dict[str, int] = collections.defaultdict(int)
        for name, _, d in events:
            by_name[name].append(d)
            by_kind[kind_of(name)] += d
        ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
        record["trace"] = {
            "wall_ms": wall * 1e3, "device_busy_ms": busy / 1e6,
            "device_busy_fraction": busy / (wall * 1e9), "kernels": len(events),
            "by_kind_ms": {k: v / 1e6 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n[:100], "count": len(ds), "ms": sum(ds) / 1e6}
                            for n, ds in ranked[:25]],
        }
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="target35,draft",
                    help="recipe presets, comma-separated (default target35,draft)")
    ap.add_argument("--batch-sizes", default="16,32,64",
                    help="sequences per step, comma-separated (default 16,32,64)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per case (default 5)")
    ap.add_argument("--head-rows", default="0",
                    help="output-head slice sizes to compare, comma-separated (0: whole; "
                    "Qwen3.5 presets only)")
    ap.add_argument("--tokens", default="uniform",
                    help="the rows' ids, comma-separated to compare: uniform (default) or zipf "
                    "(skewed like real code: the recipe ran 1.9x slower on real rows than this "
                    "harness on uniform ones, on the H200)")
    ap.add_argument("--no-trace", action="store_true", help="time only, no profiler trace")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    cases = [(p, t, int(h), int(b)) for p in args.presets.split(",")
             for t in args.tokens.split(",")
             for h in args.head_rows.split(",") for b in args.batch_sizes.split(",")]
    for i, (preset, tokens, head_rows, batch) in enumerate(cases):
        # Trace the largest batch of each (preset, tokens, head_rows) group: its last.
        last_of_group = i + 1 == len(cases) or cases[i + 1][:3] != cases[i][:3]
        try:
            record = _case(preset, batch, args.seq_len, args.steps,
                           trace=last_of_group and not args.no_trace, head_rows=head_rows,
                           tokens=tokens)
        except Exception as exc:
            record = {"preset": preset, "batch": batch, "head_rows": head_rows,
                      "tokens": tokens, "error": repr(exc)[:400]}
        results.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "trace"}), flush=True)
        if "trace" in record:
            t = record["trace"]
            print(json.dumps({"busy": t["device_busy_fraction"], "kinds": t["by_kind_ms"]}))
            for k in t["top_kernels"][:12]:
                print(f"  {k['ms']:8.2f} ms  x{k['count']:<4d} {k['name']}")
        (args.out / "profile_train.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
