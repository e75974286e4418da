"""Speculative decoding: the loop measured apart from drafter quality, and the real pairs.

    PYTHONPATH=. python -m benchmarks.speculative --part oracle --shapes llama-3.2-1b,llama-3.1-8b
    PYTHONPATH=. python -m benchmarks.speculative --part embedded
    python -m benchmarks.speculative --report benchmarks/results

**oracle**: a random bf16 model of each shape, greedy. The oracle drafter proposes the
target's own greedy continuation with probability ``alpha`` per position (a wrong token
otherwise), so acceptance is set from outside. Beside each run stands the *ideal* speedup of a
loop with no overhead at the acceptance the run measured: ``L * t_decode / t_verify(k + 1)``
(``L`` the mean tokens per round, the two step costs measured on the same program in the same
run, each as a device-side loop of many steps). Speedups compare decode tokens per second after
the first token.

**embedded**: the embedded target with its draft model and with n-gram lookup, on code
prompts, each configuration as the CLI builds it (on a CPU the plain run has ``W = 1``, a
speculative one ``W = k + 1``; on a GPU ``W = 16``).

Every speculative run must reproduce the plain run token for token (checked, reported).
Writes ``speculative_<part>_<backend>.json``; ``--report`` turns every such file into
``speculative.md`` and ``speculative.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.run import SHAPES, _meta

PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\nimport sys\n\n\ndef main(argv):",
    "    def __repr__(self):\n        return",
]
ALPHAS = (0.5, 0.7, 0.9)
DRAFT_LENS = (2, 3, 4, 5, 6, 7, 8)


def step_seconds(producer: Any, rows: int, steps: int = 32) -> float:
    """Device seconds of one block-program step feeding ``rows`` live rows with the head on:
    ``steps`` such steps in one call (the program a verify and a decode step run), timed
    after a warm-up, per step."""
    import jax

    state = producer.init_state()
    plan = producer._plan([[1] * rows] * steps, head_on_last=False, head_all=True)

    def once() -> float:
        s = producer.init_state() if producer.donate else state
        t0 = time.perf_counter()
        out, _ = producer._call(s, plan, producer._idle, steps)
        jax.block_until_ready(out.logits)
        return time.perf_counter() - t0

    once()
    return min(once() for _ in range(3)) / steps


def _timed_completion(fn: Any) -> Any:
    fn()  # compile and warm
    return fn()


def part_oracle(shapes: list[str], tokens: int, out: Path) -> Path:
    import jax
    import jax.numpy as jnp

    from turbospark_jax import CompletionRequest, run_raw_completion
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel, init_params, unstack_layers
    from turbospark_jax.speculative.drafters import OracleDrafter
    from turbospark_jax.speculative.pair import SpeculativePair

    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    records = []
    for name in shapes:
        shape = SHAPES[name]
        config = DenseConfig.from_hf_dict(shape.hf_dict())
        model = DenseModel(config, dtype, scan_layers=False)
        params = unstack_layers(init_params(config, jax.random.PRNGKey(0), dtype))
        producer = BlockProducer(model, params, capacity=1024, width=16, donate=True)
        rng = np.random.default_rng(0)
        prompt = [int(t) for t in rng.integers(0, config.vocab_size, 128)]
        req = CompletionRequest(prompt_ids=prompt, max_tokens=tokens)  # burst sized by the loop
        plain = _timed_completion(lambda req=req, p=producer: run_raw_completion(p, req))
        plain_tps = plain.timings.decode_tokens_per_s(len(plain.token_ids))
        t_decode = step_seconds(producer, 1)
        t_verify = {k: step_seconds(producer, k + 1) for k in DRAFT_LENS}
        base = {"shape": name, "plain_tokens_per_s": plain_tps, "t_decode_s": t_decode}
        print(json.dumps({**base, "t_verify_s": t_verify}), flush=True)
        reference = prompt + plain.token_ids
        for alpha in ALPHAS:
            pair = SpeculativePair(producer, OracleDrafter(config.vocab_size, reference, alpha))
            for k in DRAFT_LENS:
                r = dataclasses.replace(req, draft_len=k)
                spec = _timed_completion(
                    lambda r=r, pair=pair: run_raw_completion_speculative(pair, r))
                s = spec.speculative
                tps = spec.timings.decode_tokens_per_s(len(spec.token_ids))
                ideal = s.mean_acceptance_length * t_decode / t_verify[k]
                records.append({
                    **base, "alpha": alpha, "draft_len": k, "t_verify_s": t_verify[k],
                    "mean_acceptance_length": s.mean_acceptance_length,
                    "tokens_per_s": tps, "speedup": tps / plain_tps, "ideal_speedup": ideal,
                    "fraction_of_ideal": tps / plain_tps / ideal,
                    "equal_to_plain": spec.token_ids == plain.token_ids,
                    "on_device": s.on_device,
                })
                print(json.dumps(records[-1]), flush=True)
    return _write(out, "oracle", records, {"tokens": tokens, "width": 16})


def part_embedded(tokens: int, out: Path, draft_lens: tuple[int, ...],
                  ngram: tuple[int, ...] = (3,)) -> Path:
    import turbospark_jax as tsj

    records = []
    drafters: list[tuple[str, dict[str, Any]]] = [("plain", {})]
    drafters += [("draft_model", {"draft": True})]
    drafters += [("ngram" if n == 3 else f"ngram-{n}", {"ngram": n}) for n in ngram]
    for name, kind in drafters:
        for k in ((0,) if name == "plain" else draft_lens):
            model = tsj.load(draft_len=max(k, 1), **kind)  # the CLI's width for this setting
            total_tokens, total_s, lengths, equal = 0, 0.0, [], True
            for prompt in PROMPTS:
                def go(prompt=prompt, model=model, k=k):
                    return tsj.generate(model, prompt, max_tokens=tokens, draft_len=k or None)

                c = _timed_completion(go)
                total_tokens += len(c.token_ids) - 1
                total_s += c.timings.decode_s
                if c.speculative is not None:
                    lengths.append(c.speculative.mean_acceptance_length)
                if name == "plain":
                    PLAIN_TOKENS[prompt] = c.token_ids
                else:
                    equal &= c.token_ids == PLAIN_TOKENS[prompt]
            producer = model.producer.target if name != "plain" else model.producer
            records.append({
                "drafter": name, "draft_len": k, "width": producer.width,
                "tokens_per_s": total_tokens / total_s,
                "mean_acceptance_length": float(np.mean(lengths)) if lengths else 1.0,
                "equal_to_plain": equal,
            })
            print(json.dumps(records[-1]), flush=True)
    plain = records[0]["tokens_per_s"]
    for r in records:
        r["speedup"] = r["tokens_per_s"] / plain
    return _write(out, "embedded", records, {"tokens": tokens, "prompts": PROMPTS})


PLAIN_TOKENS: dict[str, list[int]] = {}


def _write(out: Path, part: str, records: list[dict[str, Any]], extra: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    meta = {**_meta(), **extra}
    path = out / f"speculative_{part}_{meta['backend']}.json"
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    return path


def report(out: Path) -> None:
    """``speculative.md`` (the tables) and ``speculative.png`` (speedup vs acceptance)."""
    lines = ["# Speculative decoding", ""]
    points = []
    for path in sorted(out.glob("speculative_oracle_*.json")):
        data = json.loads(path.read_text())
        meta = data["meta"]
        lines += [f"## Oracle drafter, {meta['device']}, greedy, {meta['tokens']} new tokens, "
                  f"W={meta['width']} ({meta['date']})", "",
                  "| shape | alpha | draft length | tokens/round | speedup | ideal | of ideal "
                  "| equal to plain |", "|---|---|---|---|---|---|---|---|"]
        for r in data["records"]:
            lines.append(
                f"| {r['shape']} | {r['alpha']} | {r['draft_len']} | "
                f"{r['mean_acceptance_length']:.2f} | {r['speedup']:.2f}x | "
                f"{r['ideal_speedup']:.2f}x | {100 * r['fraction_of_ideal']:.0f}% | "
                f"{r['equal_to_plain']} |")
            points.append((r["shape"], r["mean_acceptance_length"], r["speedup"],
                           r["ideal_speedup"]))
        lines.append("")
    for path in sorted(out.glob("speculative_embedded_*.json")):
        data = json.loads(path.read_text())
        meta = data["meta"]
        lines += [f"## Embedded target, {meta['device']} ({meta['backend']}), greedy, "
                  f"{meta['tokens']} new tokens, 4 code prompts ({meta['date']})", "",
                  *([f"XLA_FLAGS={meta['xla_flags']}: {meta.get('note', '')}", ""]
                    if meta.get("xla_flags") else []),
                  "| drafter | draft length | W | tokens/round | decode tokens/s | speedup vs "
                  "plain | equal to plain |", "|---|---|---|---|---|---|---|"]
        for r in data["records"]:
            lines.append(
                f"| {r['drafter']} | {r['draft_len'] or '-'} | {r['width']} | "
                f"{r['mean_acceptance_length']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{r['speedup']:.2f}x | {r['equal_to_plain']} |")
            if r["drafter"] != "plain":
                points.append((f"embedded {r['drafter']} ({meta['backend']})",
                               r["mean_acceptance_length"], r["speedup"], None))
        lines.append("")
    (out / "speculative.md").write_text("\n".join(lines))
    _plot(points, out / "speculative.png")


def _plot(points: list[tuple[str, float, float, float | None]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in sorted({p[0] for p in points}):
        mine = sorted((p for p in points if p[0] == label), key=lambda p: p[1])
        ax.scatter([p[1] for p in mine], [p[2] for p in mine], s=14, label=label)
    ideal = [(p[1], p[3]) for p in points if p[3] is not None]
    if ideal:
        xs = np.linspace(1, max(x for x, _ in ideal), 20)
        ax.plot(xs, xs, "k--", lw=0.8, label="ideal (verify costs a decode step)")
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_xlabel("mean tokens per round")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["oracle", "embedded"])
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--draft-lens", default="2,3,4,6,8")
    parser.add_argument("--ngram", default="3",
                        help="the n-gram drafter's longest n-grams, comma-separated (embedded)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.report is not None:
        report(args.report)
        return 0
    if args.part == "oracle":
        print(part_oracle(args.shapes.split(","), args.tokens, args.out))
    elif args.part == "embedded":
        lens = tuple(int(k) for k in args.draft_lens.split(","))
        ngram = tuple(int(n) for n in args.ngram.split(","))
        print(part_embedded(args.tokens, args.out, lens, ngram))
    else:
        parser.error("give --part or --report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
