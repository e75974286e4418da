"""``REPORT.md`` and its plots, generated from the suites' JSON files in one folder.

One section per suite, one table per results file (a preset on a device) in it, then what
failed or was skipped. Plots: decode tokens/s against context per shape (with the roofline and
transformers), the server's aggregate tokens/s against concurrency, and each drafter's
speed-up over plain decoding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.speculative import table as drafter_table

ORDER = ("decode", "prefill", "speculative", "serve", "kernels", "train", "quant", "quality",
         "structured", "profile")


def load(out: Path) -> list[dict[str, Any]]:
    """Every suite results file in ``out``, in suite then preset order."""
    found = []
    for path in sorted(out.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and data.get("suite") in ORDER and "cases" in data:
            found.append({**data, "file": path.name})
    return sorted(found, key=lambda d: (ORDER.index(d["suite"]), d["file"]))


def _num(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def decode_lines(data: dict[str, Any]) -> list[str]:
    cases = data["cases"]
    hf = {(c["shape"], c["context"], c["impl"]): c["tokens_per_s"] for c in cases
          if c["impl"] != "turbospark_jax"}
    lines = ["| shape | exact | W | context | sampling | tokens/s | roofline | of roofline "
             "| transformers eager | ours / eager | transformers compiled | ours / compiled |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        if c["impl"] != "turbospark_jax":
            continue
        key = (c["shape"], c["context"])
        eager = hf.get((*key, "transformers-eager")) if c["sampling"] == "greedy" else None
        comp = hf.get((*key, "transformers-static-compile")) if c["sampling"] == "greedy" else None
        lines.append(
            f"| {c['shape']} | {c['exact']} | {c['width']} | {c['context']} | {c['sampling']} | "
            f"{_num(c['tokens_per_s'])} | {_num(c['roofline_tokens_per_s'])} | "
            f"{c.get('fraction_of_roofline', 0):.0%} | {_num(eager)} | "
            f"{_ratio(c['tokens_per_s'], eager)} | {_num(comp)} | "
            f"{_ratio(c['tokens_per_s'], comp)} |")
    return lines


def prefill_lines(data: dict[str, Any]) -> list[str]:
    hf = {(c["shape"], c["length"]): c["tokens_per_s"] for c in data["cases"]
          if c["impl"] == "transformers-sdpa"}
    lines = ["| shape | length | exact tokens/s | parallel tokens/s | transformers sdpa "
             "| parallel / sdpa |", "|---|---|---|---|---|---|"]
    for c in data["cases"]:
        if c["impl"] == "turbospark_jax":
            sdpa = hf.get((c["shape"], c["length"]))
            par = c.get("parallel_tokens_per_s")
            lines.append(f"| {c['shape']} | {c['length']} | {_num(c['exact_tokens_per_s'])} | "
                         f"{_num(par)} | {_num(sdpa)} | {_ratio(par, sdpa)} |")
    return lines


def serve_lines(data: dict[str, Any]) -> list[str]:
    lines = ["| system | concurrency | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
             "| ITL p99 ms |", "|---|---|---|---|---|---|---|"]
    for c in data["cases"]:
        lines.append(f"| {c['system']} | {c['concurrency']} | {_num(c['tokens_per_s'])} | "
                     f"{c['ttft_p50_s'] * 1e3:.1f} | {c['ttft_p99_s'] * 1e3:.1f} | "
                     f"{c['itl_p50_s'] * 1e3:.1f} | {c['itl_p99_s'] * 1e3:.1f} |")
    return lines


def kernels_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    if data["meta"].get("interpreted"):
        lines += ["The kernels ran in the Pallas interpreter: these times are the "
                  "interpreter's.", ""]
    lines += ["| kernel | case | impl | us a call | GB/s | a row alone = in a block |",
              "|---|---|---|---|---|---|"]
    for c in data["cases"]:
        kernel = c["kernel"]
        if kernel == "matvec":
            case = f"{c['shape']} {c['product']} K={c['K']} N={'+'.join(map(str, c['N']))}"
            if c.get("format"):
                case += f" ({c['format']}, stored bytes)"
            rate = c.get("GBps")
        elif kernel == "norm":
            case, rate = f"{c['shape']} {c['rows']} rows", None
        elif kernel == "attention":
            case, rate = f"{c['shape']} 1 row, context {c['context']}", c.get("cache_GBps")
        else:
            case = (f"{c['value_heads']} heads, dk {c['key_dim']}, dv {c['value_dim']}, "
                    f"{c['rows']} rows")
            rate = None
        same = c.get("row_alone_equals_row_in_block")
        lines.append(f"| {kernel} | {case} | {c.get('impl', 'pallas')} | {_num(c['us'], 2)} | "
                     f"{_num(rate, 2)} | {'-' if same is None else same} |")
    return lines


def train_lines(data: dict[str, Any]) -> list[str]:
    lines = ["| recipe preset | batch | seq_len | tokens/s | MFU | peak GiB | compile s |",
             "|---|---|---|---|---|---|---|"]
    bounds = [c for c in data["cases"] if c.get("workload") == "matmul_bound"]
    for c in data["cases"]:
        if c in bounds:
            continue
        mfu = f"{c['mfu']:.1%}" if c.get("mfu") is not None else "-"
        peak = f"{c['peak_bytes'] / 2**30:.1f}" if c.get("peak_bytes") else "-"
        lines.append(f"| {c['model']} | {c['batch']} | {c['seq_len']} | "
                     f"{_num(c['tokens_per_s'])} | {mfu} | {peak} | {c['compile_s']} |")
    for c in bounds:
        ceiling = "-" if c["mfu_ceiling"] is None else f"{c['mfu_ceiling']:.1%}"
        lines += ["", f"Matmul bound of `{c['model']}` at {c['batch']} x {c['seq_len']} tokens: "
                  f"its {c['products']} products take {c['time_s'] * 1e3:.2f} ms together "
                  f"({c['tflops']:.2f} TFLOP/s), which caps MFU at {ceiling}."]
    return lines


def quant_lines(data: dict[str, Any]) -> list[str]:
    decode = [c for c in data["cases"] if c.get("kind") == "decode"]
    prefill = [c for c in data["cases"] if c.get("kind") == "prefill"]
    lines = ["| shape | format | context | tokens/s | over unquantized | MiB read a step "
             "| roofline | of roofline |", "|---|---|---|---|---|---|---|---|"]
    for c in decode:
        lines.append(f"| {c['shape']} | {c['format']} | {c['context']} | "
                     f"{_num(c['tokens_per_s'])} | {_times(c.get('speedup_over_baseline'))} | "
                     f"{c['step_bytes'] / 2**20:,.1f} | {_num(c['roofline_tokens_per_s'])} | "
                     f"{c['fraction_of_roofline']:.0%} |")
    if prefill:
        lines += ["", "| shape | format | prompt | prefill tokens/s | over unquantized "
                  "| at least 0.8x |", "|---|---|---|---|---|---|"]
        for c in prefill:
            bar = {True: "yes", False: "**NO**", None: "-"}[c.get("meets_bar")]
            lines.append(f"| {c['shape']} | {c['format']} | {c['length']} | "
                         f"{_num(c['tokens_per_s'])} | {_times(c.get('ratio_to_baseline'))} | "
                         f"{bar} |")
    kv = [c for c in data["cases"] if c.get("kind") == "kv_decode"]
    if kv:
        lines += ["", "| shape | KV cache | context | tokens/s | over unquantized cache "
                  "| cache MiB |", "|---|---|---|---|---|---|"]
        for c in kv:
            lines.append(f"| {c['shape']} | {c['kv_dtype']} | {c['context']} | "
                         f"{_num(c['tokens_per_s'])} | {_times(c.get('speedup_over_baseline'))} "
                         f"| {c['cache_bytes'] / 2**20:,.1f} |")
    return lines


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def quality_lines(data: dict[str, Any]) -> list[str]:
    lines = ["| model | format | bits a weight | matrices quantized (kept) | perplexity "
             "| vs float32 | greedy agreement | mean KL |", "|---|---|---|---|---|---|---|---|"]
    for c in data["cases"]:
        kept = (f"{c['quantized_matrices']} ({c['kept_matrices']})"
                if "quantized_matrices" in c else "-")
        ratio, agree, kl = (c.get(k) for k in ("perplexity_ratio", "greedy_agreement", "mean_kl"))
        lines.append(f"| {c['model']} | {c['format']} | "
                     f"{_num(c.get('bits_per_quantized_weight'), 2)} | {kept} | "
                     f"{c['perplexity']:.4f} | "
                     f"{'-' if ratio is None else f'{(ratio - 1) * 100:+.2f}%'} | "
                     f"{'-' if agree is None else f'{agree:.2%}'} | "
                     f"{'-' if kl is None else f'{kl:.2g}'} |")
    return lines


def structured_lines(data: dict[str, Any]) -> list[str]:
    """The validity summary and the speed cases; the runs one by one stay in the file."""
    lines = []
    about = data["meta"].get("schemas", {})
    for c in data["cases"]:
        if c["kind"] != "validity":
            continue
        share = f" ({c['valid'] / c['finished']:.0%})" if c["finished"] else ""
        lines += [f"Schemas: {about.get('source', '-')}.", "",
                  "| schemas | refused by name | compiled | compile p50 / p99 ms "
                  "| runs (greedy + sampled) | finished | valid | constraint unmet |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| {c['schemas']} | {c['refused']} | {c['compiled']} | "
                  f"{_num(c['compile_ms_p50'])} / {_num(c['compile_ms_p99'])} | {c['runs']} | "
                  f"{c['finished']} | {c['valid']}{share} | {c['unmet']} |", ""]
    speed = [c for c in data["cases"] if c["kind"] == "speed"]
    if speed:
        bar = data["meta"].get("speed", {}).get("bar")
        lines += ["| model | batch | tokens | plain tokens/s | constrained tokens/s "
                  f"| constrained / plain | at least {bar}x |", "|---|---|---|---|---|---|---|"]
        for c in speed:
            meets = "yes" if c["meets_bar"] else "**NO**"
            lines.append(f"| {c['model']} | {c['batch']} | {c['new_tokens']} | "
                         f"{_num(c['plain_tokens_per_s'])} | "
                         f"{_num(c['constrained_tokens_per_s'])} | {_times(c['ratio'])} | "
                         f"{meets} |")
    for c in (c for c in data["cases"] if c["kind"] == "server"):
        meets = "yes" if c["meets_bar"] else "**NO**"
        lines += ["", "| server, model | streams | plain tokens/s | half constrained tokens/s "
                  "| ratio | at least 0.85x |", "|---|---|---|---|---|---|",
                  f"| {c['model']} | {c['streams']} | {_num(c['plain_tokens_per_s'])} | "
                  f"{_num(c['half_constrained_tokens_per_s'])} | {_times(c['ratio'])} | "
                  f"{meets} |"]
    return lines


def profile_lines(data: dict[str, Any]) -> list[str]:
    """Per shape: the decode's kernels a token, busy share and mapped share, then its device
    time a token by layer kind (every kind a case has, largest first)."""
    lines = ["| shape | tokens/s untraced (traced) | kernels a token | device us a token "
             "| busy (device span) | busy (host decode) | time mapped |",
             "|---|---|---|---|---|---|---|"]
    for c in data["cases"]:
        lines.append(f"| {c['shape']} | {_num(c['untraced_tokens_per_s'])} "
                     f"({_num(c['traced_tokens_per_s'])}) | {_num(c['kernels_per_token'])} | "
                     f"{_num(c['device_us_per_token'])} | {c['device_busy']:.0%} | "
                     f"{c['device_busy_of_host_decode']:.0%} | {c['mapped_time_share']:.0%} |")
    lines += ["", "| shape | device us a token by kind |", "|---|---|"]
    for c in data["cases"]:
        kinds = ", ".join(f"{k} {_num(v)}" for k, v in c["us_per_token_by_kind"].items())
        lines.append(f"| {c['shape']} | {kinds} |")
    return lines


TABLES = {"decode": decode_lines, "prefill": prefill_lines, "serve": serve_lines,
          "kernels": kernels_lines, "train": train_lines,
          "speculative": lambda data: drafter_table(data), "quant": quant_lines,
          "quality": quality_lines, "structured": structured_lines, "profile": profile_lines}
TITLES = {"decode": "Decode (batch 1)", "prefill": "Prefill", "speculative": "Speculative decoding",
          "serve": "Serving", "kernels": "Kernels", "train": "Training step",
          "quant": "Quantized weights: speed", "quality": "Quantized weights: quality",
          "structured": "Structured output", "profile": "Decode profile"}


def write_report(out: Path) -> Path:
    """Rebuild ``out/REPORT.md`` and its plots from the results files in ``out``."""
    files = load(out)
    lines = ["# Benchmark results", "",
             "Generated by `python -m benchmarks --report` from the JSON files beside it; "
             "each file's command reproduces it.", ""]
    for suite in ORDER:
        mine = [d for d in files if d["suite"] == suite]
        if not mine:
            continue
        lines += [f"## {TITLES[suite]}", ""]
        for data in mine:
            meta = data["meta"]
            lines += [f"### `{data['file']}`: {meta['device_kind']} ({meta['backend']}), "
                      f"jax {meta['jax']}, {meta['date'][:10]}", "",
                      f"`{meta['command']}`", ""]
            lines += TABLES[suite](data) if data["cases"] else ["No case ran."]
            for what in ("errors", "skipped"):
                for item in data.get(what, []):
                    why = item.get("error") or item.get("reason")
                    label = ", ".join(f"{k} {v}" for k, v in item.items()
                                      if k not in ("error", "reason", "where"))
                    lines.append(f"- {what[:-1] if what == 'errors' else 'skipped'}: "
                                 f"{label}: {why}")
            plot = PLOTS.get(suite)
            if plot is not None and data["cases"]:
                png = out / f"{Path(data['file']).stem}.png"
                if plot(data, png):
                    lines += ["", f"![{suite}]({png.name})"]
            lines.append("")
    path = out / "REPORT.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return True


def plot_decode(data: dict[str, Any], path: Path) -> bool:
    """Greedy tokens/s against context, one panel per shape."""
    cases = [c for c in data["cases"] if c["sampling"] == "greedy"]
    shapes = list(dict.fromkeys(c["shape"] for c in cases))
    if not shapes:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        mine = [c for c in cases if c["shape"] == shape]
        for exact in (True, False):
            ours = sorted((c["context"], c["tokens_per_s"], c["roofline_tokens_per_s"])
                          for c in mine if c["impl"] == "turbospark_jax" and c["exact"] is exact)
            if ours:
                ax.plot([o[0] for o in ours], [o[1] for o in ours], "o-",
                        label="turbospark_jax" + ("" if exact else " (fast path)"))
                if exact:
                    ax.plot([o[0] for o in ours], [o[2] for o in ours], "k--", label="roofline")
        for impl, style in (("transformers-eager", "s-"), ("transformers-static-compile", "^")):
            pts = sorted((c["context"], c["tokens_per_s"]) for c in mine if c["impl"] == impl)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(shape, fontsize=9)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.legend(fontsize=6)
    return _save(fig, path)


def plot_serve(data: dict[str, Any], path: Path) -> bool:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for system in dict.fromkeys(c["system"] for c in data["cases"]):
        rows = [c for c in data["cases"] if c["system"] == system]
        ax.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], "o-",
                label=system)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_speculative(data: dict[str, Any], path: Path) -> bool:
    """Each drafter's best speed-up over plain decoding, greedy and sampled."""
    from benchmarks.speculative import fastest

    modes = [m for m in ("greedy", "sampled") if fastest(data["cases"], m)]
    if not modes:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    drafters = sorted({d for m in modes for d in fastest(data["cases"], m)})
    for i, mode in enumerate(modes):
        best = fastest(data["cases"], mode)
        xs = [j + 0.4 * i for j in range(len(drafters))]
        ax.bar(xs, [best[d]["speedup"] if d in best else 0 for d in drafters], 0.4, label=mode)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.2 * (len(modes) - 1) for j in range(len(drafters))], drafters)
    ax.set_ylabel("speed-up over plain (best draft length)")
    ax.legend(fontsize=7)
    return _save(fig, path)


PLOTS = {"decode": plot_decode, "serve": plot_serve, "speculative": plot_speculative}
