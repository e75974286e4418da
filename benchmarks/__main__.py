"""``python -m benchmarks --suite SUITE --preset PRESET`` and ``python -m benchmarks --report``.

Suites: ``decode``, ``prefill``, ``speculative``, ``serve``, ``kernels``, ``train``, ``quant``
(quantized weights' speed), ``quality`` (quantized weights' perplexity and agreement on the
embedded models), ``structured`` (validity of constrained outputs, schema compile times,
constrained against plain tokens/s), ``profile`` (a decode's device timeline: kernels a
token, busy share, time by layer kind), or ``all`` (in that order). Presets: ``cpu`` (minutes
on a laptop-class CPU), ``h100``, ``h200``, and ``smoke`` (seconds: what the tests run).
Each suite writes ``<out>/<suite>_<preset>.json``; ``--report`` rebuilds ``<out>/REPORT.md``
and its plots from every such file in ``<out>`` (a run of suites rebuilds it too). A preset
too long for one sitting runs in parts with ``--shapes``: each part replaces its own shapes'
cases in the file and keeps the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shlex
import sys
from pathlib import Path
from types import ModuleType

SUITES = ("decode", "prefill", "speculative", "serve", "kernels", "train", "quant", "quality",
          "structured", "profile")
PRESET_NAMES = ("smoke", "cpu", "h100", "h200")


def suite_module(name: str) -> ModuleType:
    return importlib.import_module(f"benchmarks.{name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default=None,
                        help=f"one of {', '.join(SUITES)}, several comma-separated, or all")
    parser.add_argument("--preset", choices=PRESET_NAMES, default=None,
                        help="default: the machine's (cpu, h100, else h200)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the results go (default benchmarks/results)")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shapes instead of the preset's (decode, prefill, "
                             "kernels, quant, profile); the file keeps an earlier run's other "
                             "shapes")
    parser.add_argument("--report", action="store_true",
                        help="rebuild REPORT.md and its plots from the JSON files in --out")
    parser.add_argument("--no-model-figures", action="store_true",
                        help="speculative: leave the target's speculative.json and model card "
                             "as they are")
    args = parser.parse_args(argv)
    from benchmarks import common, report

    out = args.out or common.RESULTS
    if args.suite is None:
        if not args.report:
            parser.error("name a --suite, or ask for --report")
        print(f"wrote {report.write_report(out)}")
        return 0
    # JAX would take most of a GPU's memory up front; transformers runs in the same process.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    names = SUITES if args.suite == "all" else tuple(args.suite.split(","))
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        parser.error(f"unknown suite {', '.join(unknown)}; the suites: {', '.join(SUITES)}")
    kind = getattr(jax.devices()[0], "device_kind", "")
    preset = args.preset or ("cpu" if jax.default_backend() == "cpu"
                             else "h100" if "H100" in kind else "h200")
    command = shlex.join(["python", "-m", "benchmarks", *argv])
    status = 0
    for name in names:
        module = suite_module(name)
        settings = module.PRESETS[preset]
        only = None
        if args.shapes and hasattr(settings, "shapes"):
            only = tuple(args.shapes.split(","))
            unknown = [s for s in only if s not in common.SHAPES]
            if unknown:
                parser.error(f"unknown shape {', '.join(unknown)}; the shapes: "
                             f"{', '.join(common.SHAPES)}")
            settings = dataclasses.replace(settings, shapes=only)
        results = common.Results(name, preset, settings, out, command,
                                 getattr(settings, "budget_s", None), only)
        options = {"model_figures": not args.no_model_figures} if name == "speculative" else {}
        status = max(status, module.run(settings, results, **options) or 0)
        results.write()
        jax.clear_caches()
    print(f"wrote {report.write_report(out)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
