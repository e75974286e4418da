"""Validity of constrained outputs: every schema of a set the engine accepts is given to the
embedded model as ``json_schema``, greedy and sampled; an output that finishes must parse and
validate under its schema (jsonschema), and the compile time of each schema is recorded.

    python -m benchmarks.structured_validity --bench DIR [--per-folder N] [--max-tokens N]
        [--out FILE]

``DIR`` is a checkout of JSONSchemaBench's ``data/`` folder; without it the engine comparison's
local schemas are used.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> None:
    import jsonschema

    import turbospark_jax as tsj
    from benchmarks.grammar_engines import LOCAL_SCHEMAS, _load_bench
    from turbospark_jax.core.constraints import ConstraintSpec
    from turbospark_jax.errors import BadInputError
    from turbospark_jax.generation.completion import FinishReason

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", type=Path, default=None)
    ap.add_argument("--per-folder", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    schemas = _load_bench(args.bench, args.per_folder) if args.bench else dict(LOCAL_SCHEMAS)
    model = tsj.load()
    compile_s, refused, runs = [], 0, []
    for name, schema in schemas.items():
        t0 = time.perf_counter()
        try:
            spec = ConstraintSpec.json_schema(schema)
            spec.bind(model.tokenizer, model.producer.vocab_size, model.stop_token_ids)
        except BadInputError:
            refused += 1
            continue
        compile_s.append(time.perf_counter() - t0)
        for mode, settings in (("greedy", {}), ("sampled", {"temperature": 1.0, "seed": 1})):
            c = tsj.generate(model, "# a JSON value\n", max_tokens=args.max_tokens,
                             json_schema=schema, **settings)
            finished = c.finish_reason in (FinishReason.CONSTRAINT_END,
                                           FinishReason.STOP_TOKEN)
            valid = None
            if finished:
                try:
                    jsonschema.validate(json.loads(c.text), schema)
                    valid = True
                except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
                    valid = isinstance(exc, jsonschema.SchemaError) or False
            runs.append({"schema": name, "mode": mode, "finish": c.finish_reason.value,
                         "tokens": len(c.token_ids), "valid": valid})
            print(json.dumps(runs[-1]), flush=True)
    finished = [r for r in runs if r["valid"] is not None]
    report = {
        "machine": f"{platform.machine()} python {platform.python_version()}",
        "schemas": len(schemas), "refused": refused, "compiled": len(compile_s),
        "compile_ms_p50": float(np.percentile(compile_s, 50) * 1e3) if compile_s else None,
        "compile_ms_p99": float(np.percentile(compile_s, 99) * 1e3) if compile_s else None,
        "runs": len(runs), "finished": len(finished),
        "valid": sum(1 for r in finished if r["valid"]),
        "unmet": sum(1 for r in runs if r["finish"] == FinishReason.CONSTRAINT_UNMET.value),
    }
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps({**report, "details": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
