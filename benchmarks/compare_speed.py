"""Decode runs side by side: the speed records of several ``rowinv_model`` outputs as one table.

    PYTHONPATH=. python -m benchmarks.compare_speed BASE.json OTHER.json [...] [--names a,b]

Each file is a ``benchmarks/rowinv_model.py`` output (``--parts speed``). The table has a row
for each (shape, kernels, workload, context) and a column for each file: tokens/s greedy /
sampled, and in the columns after the first the change against the first in percent. The
runs to compare should come from one machine in one call (the figures move a few percent
from machine to machine).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

Key = tuple[str, str, str, int]


def speeds(path: Path) -> dict[Key, dict[str, float]]:
    """``{(shape, kernels, workload, context): {sampling: tokens/s}}`` of a file's speed
    records (decode and completion workloads)."""
    out: dict[Key, dict[str, float]] = {}
    for r in json.loads(path.read_text()).get("records", []):
        if r.get("part") != "speed" or "tokens_per_s" not in r or "context" not in r:
            continue
        key = (r["shape"], r.get("kernels", ""), r.get("workload", ""), int(r["context"]))
        out.setdefault(key, {})[r.get("sampling", "greedy")] = float(r["tokens_per_s"])
    return out


def _cell(run: dict[str, float] | None, base: dict[str, float] | None) -> str:
    if not run:
        return "-"
    parts = []
    for kind in ("greedy", "sampled"):
        if kind not in run:
            continue
        text = f"{run[kind]:.1f}"
        if base is not None and base.get(kind):
            text += f" ({100 * (run[kind] / base[kind] - 1):+.1f}%)"
        parts.append(text)
    return " / ".join(parts)


def table(paths: list[Path], names: list[str] | None = None) -> str:
    """The markdown table of the files' decode speeds, the first file the base."""
    names = names or [p.stem for p in paths]
    runs = [speeds(p) for p in paths]
    keys = sorted(set().union(*runs))
    lines = ["| shape, kernels, workload, context | " + " | ".join(names) + " |",
             "| --- |" + " --- |" * len(names)]
    for key in keys:
        base = runs[0].get(key)
        cells = [_cell(run.get(key), None if i == 0 else base) for i, run in enumerate(runs)]
        lines.append(f"| {key[0]}, {key[1]}, {key[2]}, {key[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="rowinv_model outputs; the first is "
                                                          "the base")
    ap.add_argument("--names", help="comma-separated column names (default: the file names)")
    args = ap.parse_args(argv)
    names: Any = args.names.split(",") if args.names else None
    if names is not None and len(names) != len(args.files):
        ap.error(f"--names gives {len(names)} names for {len(args.files)} files")
    missing = [str(p) for p in args.files if not p.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    print(table(args.files, names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
