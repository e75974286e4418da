"""Speculative decoding with the embedded pair and with prompt lookup: acceptance and speedup.

    PYTHONPATH=. python -m benchmarks.speculative --out benchmarks/results

Greedy, so every speculative run must reproduce the plain run token for token (checked and
reported). Writes ``speculative_<backend>.json`` and ``.md``. Timings are wall clock after a
warm-up run of the same configuration (compiles excluded).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\nimport sys\n\n\ndef main(argv):",
    "    def __repr__(self):\n        return",
]


def _load(path: Path, dtype: str | None, width: int, capacity: int) -> Any:
    from turbospark_jax.block_producer import BlockProducer
    from turbospark_jax.loading import load_folder

    loaded = load_folder(path, dtype=dtype, layer_layout="list")
    producer = BlockProducer(loaded.model, loaded.params, capacity=capacity, width=width,
                             steps_per_call=32, donate=True)
    return loaded, producer


def run(out: Path, tokens: int, blocks: list[int], dtype: str | None, width: int) -> Path:
    import jax

    from turbospark_jax.cli import DEFAULT_DRAFT, DEFAULT_TARGET, embedded_model_path
    from turbospark_jax.drafters import DraftModelDrafter, NGramDrafter, SpeculativePair
    from turbospark_jax.generate import CompletionRequest, run_raw_completion
    from turbospark_jax.speculative import run_raw_completion_speculative

    capacity = 1024
    loaded, target = _load(embedded_model_path(DEFAULT_TARGET), dtype, width, capacity)
    _, draft = _load(embedded_model_path(DEFAULT_DRAFT), dtype, width, capacity)
    tok = loaded.tokenizer
    stops = list(loaded.generation_config.eos_token_ids)
    configs: list[tuple[str, int, Any]] = [("plain", 0, target)]
    configs += [("draft_model", k, SpeculativePair(target, DraftModelDrafter(draft)))
                for k in blocks]
    configs += [("ngram", k, SpeculativePair(target, NGramDrafter(target.vocab_size, max_n=3)))
                for k in blocks]
    records = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt, add_special_tokens=False)
        req = CompletionRequest(prompt_ids=ids, max_tokens=tokens, stop_token_ids=stops)
        plain_tokens = None
        for name, k, producer in configs:
            def go(producer=producer, k=k, req=req):
                if k == 0:
                    return run_raw_completion(producer, req)
                return run_raw_completion_speculative(producer, req, block_size=k)

            go()  # warm up: compiles
            t0 = time.perf_counter()
            c = go()
            dt = time.perf_counter() - t0
            if name == "plain":
                plain_tokens, plain_s = c.token_ids, dt
            s = c.speculative
            records.append({
                "prompt": prompt, "drafter": name, "block": k, "seconds": dt,
                "generated": len(c.token_ids), "tokens_per_s": len(c.token_ids) / dt,
                "speedup": plain_s / dt, "equal_to_plain": c.token_ids == plain_tokens,
                "mean_acceptance_length": s.mean_acceptance_length if s else 1.0,
                "acceptance_rate": s.acceptance_rate if s else None,
                "acceptance_by_position": s.acceptance_by_position if s else None,
            })
            print(json.dumps(records[-1]), flush=True)
    backend = jax.default_backend()
    meta = {"backend": backend, "device": getattr(jax.devices()[0], "device_kind", backend),
            "jax": jax.__version__, "tokens": tokens, "width": width, "dtype": dtype or "model"}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"speculative_{backend}.json"
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    _table(records, meta, out / f"speculative_{backend}.md")
    return path


def _table(records: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        rows.setdefault((r["drafter"], r["block"]), []).append(r)
    lines = [f"# Speculative decoding on {meta['device']} ({meta['backend']}), greedy, "
             f"{meta['tokens']} new tokens, W={meta['width']}", "",
             "| drafter | block | mean acceptance length | acceptance rate | tokens/s | "
             "speedup vs plain | equal to plain |", "|---|---|---|---|---|---|---|"]
    for (name, k), rs in rows.items():
        mean = sum(r["mean_acceptance_length"] for r in rs) / len(rs)
        rates = [r["acceptance_rate"] for r in rs if r["acceptance_rate"] is not None]
        rate = f"{sum(rates) / len(rates):.2f}" if rates else "-"
        tps = sum(r["generated"] for r in rs) / sum(r["seconds"] for r in rs)
        speed = sum(r["speedup"] for r in rs) / len(rs)
        equal = all(r["equal_to_plain"] for r in rs)
        lines.append(f"| {name} | {k or '-'} | {mean:.2f} | {rate} | {tps:.1f} | "
                     f"{speed:.2f}x | {equal} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--blocks", default="2,4")
    parser.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16"])
    parser.add_argument("--width", type=int, default=8)
    args = parser.parse_args(argv)
    run(args.out, args.tokens, [int(b) for b in args.blocks.split(",")], args.dtype, args.width)
    return 0


if __name__ == "__main__":
    sys.exit(main())
