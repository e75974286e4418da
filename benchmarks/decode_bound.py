"""What bounds a decode step, read from a traced profile: how long the matrix products would
take at the copy rate (the weights streamed once), what they spend beyond that, the other
kernels (attention, norms, the RoPE-store, the loop's own bookkeeping and sampling), and the
time the device sat idle; then what the same step would take at another copy bandwidth (the
issue's H200: 4.24 TB/s) and what share of that machine's roofline it would reach.

Two readings of "at another bandwidth" bracket the answer. *Streaming scales*: the products'
streaming time shrinks with the bandwidth and everything else (each product's time beyond
its stream, which is its launch, ramp and tail; the other kernels, bound by their launch
floors at decode sizes; the idle) stays as measured. *Rates scale*: the products keep their
share of the copy rate, so their time beyond the stream shrinks too (the optimistic one).
Neither counts a change of kernels. A traced burst runs without XLA's command buffers unless
its flags kept them, so its idle time is a run's without CUDA graphs: each reading is also
given with no idle time at all (``no_idle``), the bound the kernels alone set.

Run from the repository root on any machine (it reads JSON, no device)::

    PYTHONPATH=. python -m benchmarks.decode_bound \
        benchmarks/results/rowinv_h100_profile_1b_s35.json
    PYTHONPATH=. python -m benchmarks.decode_bound PROFILE.json --bandwidth-gbps 4240 --bar 0.7

The profile comes from ``python -m benchmarks.rowinv_model --parts profile`` (its records'
``all_kernels``: calls and microseconds per token for every kernel name).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.rowinv_model import products_of
from benchmarks.run import SHAPES, Shape, kv_bytes

#: The issue's H200 copy rate (GB/s), at which its rooflines are stated.
H200_COPY_GBPS = 4240.0
#: The issue's decode bars on an H200: a share of the roofline, or tokens/s.
ISSUE_BARS = {"llama-3.2-1b": ("share", 0.7), "qwen3-0.6b": ("tokens_per_s", 1500.0),
              "llama-3.1-8b": ("share", 0.9)}
#: Kernel name prefixes of each group, checked in this order; the rest is ``"loop"`` (the
#: decode loop's bookkeeping, sampling, copies). The attention's first kernel with the
#: RoPE-store's work inside (``rope_store_attention``, the default) counts as attention.
GROUPS = (("products", ("rowinv_matvec_", "rowinv_matmul_", "rowinv_mosaic")),
          ("attention", ("cached_attention", "rope_store_attention")),
          ("norms", ("row_rms_norm", "add_parts")),
          ("rope_store", ("rope_store",)))


def group_of(kernel: str) -> str:
    for group, prefixes in GROUPS:
        if kernel.startswith(prefixes):
            return group
    return "loop"


def weight_bytes(shape: Shape) -> int:
    """Bytes of bfloat16 weights a decode step reads: every layer's products and the head
    (:func:`~benchmarks.rowinv_model.products_of`; the embedding row gathered is
    negligible)."""
    each = {name: k * sum(ns) * 2 for name, k, ns, _ in products_of(shape)}
    head = each.pop("head")
    return shape.num_hidden_layers * sum(each.values()) + head


def check_whole_steps(record: dict[str, Any], layers: int) -> None:
    """Refuse a profile whose trace holds fewer product launches a token than a step makes
    (every layer launches at least one): a trace of a burst run in loop graphs, which on
    JAX 0.11.2 records one step's kernels for the whole burst."""
    products = sum(calls for name, (calls, _) in record["all_kernels"].items()
                   if group_of(name) == "products")
    if products < layers:
        raise ValueError(
            f"{record['shape']} at {record['context']}: the trace holds {products:.2f} product "
            f"launches a token against {layers} layers, so it did not record every step "
            "(taken with the loop graphs on?); profile with TURBOSPARK_LOOP_GRAPHS=0")


def product_line(record: dict[str, Any], shape: Shape) -> dict[str, Any] | None:
    """The layers' products (all but the head) as one line, time a call = a fixed cost +
    bytes / rate, fitted by least squares over the profile's product kernels
    (``rowinv_matvec_<name>``, a point each): the fixed cost a kernel pays whatever it reads
    (launch, first loads' latency, tail), the rate its stream reaches, and what the fixed
    costs add up to a token. ``None`` with fewer than two such kernels, or when they do not
    rise with their bytes."""
    bytes_of = {name: k * sum(ns) * 2 for name, k, ns, _ in products_of(shape)}
    points, calls = [], 0.0
    for name, (n, us) in record["all_kernels"].items():
        label = name.removeprefix("rowinv_matvec_")
        if label != name and label in bytes_of and label != "head" and n:
            points.append((bytes_of[label], us / n))
            calls += n
    if len(points) < 2:
        return None
    mean_b = sum(b for b, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    var = sum((b - mean_b) ** 2 for b, _ in points)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / var if var else 0.0
    if slope <= 0:
        return None
    fixed = mean_t - slope * mean_b
    return {"us_per_kernel": round(fixed, 2), "stream_TBps": round(1e-6 / slope, 2),
            "fixed_us_per_token": round(fixed * calls, 1)}


def bound(record: dict[str, Any], source_gbps: float, target_gbps: float,
          bar: tuple[str, float] | None = None) -> dict[str, Any]:
    """One profile record's decode step, split and carried to ``target_gbps``; times in
    microseconds a token. ``bar``: ``("share", s)`` of the target's roofline or
    ``("tokens_per_s", r)`` to compare with: the time beyond the stream it leaves room for."""
    shape = SHAPES[record["shape"]]
    check_whole_steps(record, shape.num_hidden_layers)
    groups: dict[str, float] = {}
    for name, (_, us) in record["all_kernels"].items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + us
    weights = weight_bytes(shape)
    stream = weights / (source_gbps * 1e3)
    products = groups.get("products", 0.0)
    busy = sum(groups.values())
    wall = record["wall_per_token_us"]
    idle = max(0.0, wall - busy)
    beyond = busy + idle - stream  # what the streaming-scales reading keeps as measured
    target_stream = weights / (target_gbps * 1e3)
    roofline_us = (weights + kv_bytes(shape, record["context"])) / (target_gbps * 1e3)
    readings = {"streaming_scales": target_stream + beyond - idle,
                "rates_scale": products * source_gbps / target_gbps + (busy - products)}
    out = {
        "shape": record["shape"], "sampling": record.get("sampling"),
        "context": record["context"], "capacity": record.get("capacity"),
        "wall_us": round(wall, 1), "idle_us": round(idle, 1),
        "groups_us": {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "kernels_per_token": record.get("kernels_per_token"),
        "products_stream_us": round(stream, 1),
        "products_share_of_copy_rate": round(stream / products, 3) if products else None,
        "beyond_stream_us": round(beyond, 1),
        "products_line": product_line(record, shape),
        "target_gbps": target_gbps,
        "target_roofline_tokens_per_s": round(1e6 / roofline_us, 1),
        "target_tokens_per_s": {
            name + suffix: round(1e6 / (us + extra), 1)
            for name, us in readings.items() for suffix, extra in (("", idle), ("_no_idle", 0.0))},
        "target_share_of_roofline": {
            name + suffix: round(roofline_us / (us + extra), 3)
            for name, us in readings.items() for suffix, extra in (("", idle), ("_no_idle", 0.0))},
    }
    if bar is not None:
        kind, value = bar
        if kind not in ("share", "tokens_per_s") or value <= 0:
            raise ValueError(f"a bar is ('share', s) or ('tokens_per_s', r); got {bar!r}")
        allowed = roofline_us / value if kind == "share" else 1e6 / value
        out["bar"] = {kind: value}
        out["beyond_stream_allowed_us"] = round(allowed - target_stream, 1)
    return out


def _rows(path: Path, kernels: str) -> tuple[float, list[dict[str, Any]]]:
    data = json.loads(path.read_text())
    source = data["meta"].get("copy_bandwidth_GBps")
    if not source:
        raise SystemExit(f"{path}: its meta has no copy_bandwidth_GBps")
    records = [r for r in data["records"] if r.get("part") == "profile"
               and r.get("kernels") == kernels and "all_kernels" in r]
    return float(source), records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="+", type=Path, help="rowinv_model profile JSONs")
    ap.add_argument("--bandwidth-gbps", type=float, default=H200_COPY_GBPS,
                    help="the copy rate to carry the step to (default: the issue's H200)")
    ap.add_argument("--bar", type=float,
                    help="a share of the roofline to compare every shape with (default: the "
                         "issue's bar for each shape, ISSUE_BARS)")
    ap.add_argument("--kernels", default="rowinv", help="the profile records' kernel mode")
    ap.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    results, refused = [], 0
    for path in args.profiles:
        source, records = _rows(path, args.kernels)
        if not records:
            print(f"{path}: no {args.kernels} profile records", file=sys.stderr)
        for r in records:
            bar = ("share", args.bar) if args.bar is not None else ISSUE_BARS.get(r["shape"])
            try:
                row = bound(r, source, args.bandwidth_gbps, bar)
            except ValueError as e:
                print(f"{path}: {e}", file=sys.stderr)
                refused += 1
                continue
            row["source"] = path.name
            row["source_gbps"] = source
            results.append(row)
            print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 1 if refused else 0


if __name__ == "__main__":
    raise SystemExit(main())
