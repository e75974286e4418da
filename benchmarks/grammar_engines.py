"""Compare grammar engines for structured output on our tokenizer: compile time, per-token mask
time and JSON Schema coverage.

Each engine is driven the same way: build its token table from the model's ``tokenizers``
tokenizer, compile every schema (a small local set of JSON Schema features, plus a sample of
JSONSchemaBench when its folder is given), then walk each compiled schema for a fixed number of
steps, computing the allowed-token mask and taking a seeded random allowed token each step.
The walk only exercises the matcher; it does not aim at a complete document.

    python -m benchmarks.grammar_engines [--bench DIR] [--per-folder N] [--steps N] [--out FILE]

``DIR`` is a checkout of JSONSchemaBench's ``data/`` folder (one sub-folder per source).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

#: Small schemas, one JSON Schema feature (or a common combination) each.
LOCAL_SCHEMAS: dict[str, dict[str, Any]] = {
    "object_required": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum_const": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "kind": {"const": "pixel"}},
        "required": ["color", "kind"],
    },
    "array_bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "string_lengths": {"type": "string", "minLength": 2, "maxLength": 8},
    "pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "number_bounds": {"type": "integer", "minimum": 10, "maximum": 99},
    "nullable": {"type": ["string", "null"]},
    "any_of": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    "one_of": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                         {"required": ["a"]}]},
    "refs": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                             "y": {"type": "number"}},
                            "required": ["x", "y"]}},
        "type": "array", "items": {"$ref": "#/$defs/point"},
    },
    "recursive": {
        "$defs": {"node": {"type": "object",
                           "properties": {"v": {"type": "integer"},
                                          "kids": {"type": "array",
                                                   "items": {"$ref": "#/$defs/node"}}},
                           "required": ["v"]}},
        "$ref": "#/$defs/node",
    },
    "format_date_time": {"type": "string", "format": "date-time"},
    "format_email": {"type": "string", "format": "email"},
    "pattern_properties": {"type": "object", "patternProperties": {"^x-": {"type": "string"}}},
    "additional_schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "multiple_of": {"type": "integer", "multipleOf": 5},
    "unique_items": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "min_max_properties": {"type": "object", "minProperties": 1, "maxProperties": 2},
    "if_then_else": {"type": "object", "if": {"properties": {"a": {"const": 1}}},
                     "then": {"required": ["b"]}},
}


def _vocab_bytes(backend) -> list[bytes | None]:
    """Each token id's bytes (byte-level BPE), ``None`` for special tokens."""
    table = {}
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(
        range(0xAE, 0x100))
    shifted = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    out: list[bytes | None] = [None] * backend.get_vocab_size(with_added_tokens=True)
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        out[i] = None if text in special else bytes(table[c] for c in text)
    return out


class Llguidance:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        import llguidance.numpy as lln
        self._ll, self._np = llguidance, lln
        self.tok = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=tok.eos_token_id)
        self.vocab = tok.vocab_size

    def compile(self, schema):
        grammar = self._ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self._ll.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m):
        bm = self._np.allocate_token_bitmask(1, self.tok.vocab_size)
        self._np.fill_next_token_bitmask(m, bm, 0)
        return _unpack(bm[0], self.vocab)

    def advance(self, m, t):
        assert m.consume_token(t), m.get_error()

    def done(self, m):
        return m.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import transformers
        import xgrammar
        self._x = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_token_id])
        # a fresh cache per compile: the figures are cold compiles, as for a new request
        self.info = info
        self.vocab = tok.vocab_size

    def compile(self, schema):
        compiler = self._x.GrammarCompiler(self.info, cache_enabled=False)
        g = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return self._x.GrammarMatcher(g)

    def mask(self, m):
        bm = self._x.allocate_token_bitmask(1, self.vocab)
        m.fill_next_token_bitmask(bm)
        return _unpack(bm[0].numpy(), self.vocab)

    def advance(self, m, t):
        assert m.accept_token(t)

    def done(self, m):
        return m.is_terminated()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok):
        import outlines_core
        self._o = outlines_core
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(_vocab_bytes(tok.backend)):
            if b is not None and i != tok.eos_token_id:
                table.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tok.eos_token_id, table)
        self.vocab = tok.vocab_size

    def compile(self, schema):
        regex = self._o.json_schema.build_regex_from_schema(json.dumps(schema))
        return self._o.Guide(self._o.Index(regex, self.vocabulary))

    def mask(self, m):
        out = np.zeros(self.vocab, bool)
        out[np.asarray(m.get_tokens())] = True
        return out

    def advance(self, m, t):
        m.advance(t)

    def done(self, m):
        return m.is_finished()


ENGINES = (Llguidance, Xgrammar, OutlinesCore)


def _unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(np.asarray(words).view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


def _load_bench(folder: Path | None, per_folder: int) -> dict[str, dict]:
    if folder is None:
        return {}
    out = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        files = sorted(sub.glob("*.json"))
        step = max(1, len(files) // per_folder)
        for f in files[::step][:per_folder]:
            try:
                out[f"{sub.name}/{f.stem}"] = json.loads(f.read_text())
            except ValueError:
                continue
    return out


def measure(engine_cls, tok, schemas, steps: int, seed: int = 0) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = engine_cls(tok)
    setup = time.perf_counter() - t0
    compiles, masks, failures = [], [], {}
    for name, schema in schemas.items():
        t0 = time.perf_counter()
        try:
            m = engine.compile(schema)
        except Exception as e:  # any engine error counts as unsupported
            failures[name] = f"{type(e).__name__}: {str(e)[:120]}"
            continue
        compiles.append(time.perf_counter() - t0)
        rng = random.Random(f"{seed}/{name}")
        for _ in range(steps):
            if engine.done(m):
                break
            t0 = time.perf_counter()
            allowed = engine.mask(m)
            masks.append(time.perf_counter() - t0)
            ids = np.flatnonzero(allowed)
            ids = ids[ids != tok.eos_token_id] if len(ids) > 1 else ids
            if not len(ids):
                break
            token = int(ids[rng.randrange(len(ids))])
            if token == tok.eos_token_id:
                break
            engine.advance(m, token)

    def pct(xs, q):
        return float(np.percentile(xs, q) * 1e3) if xs else None

    return {
        "engine": engine.name,
        "setup_ms": setup * 1e3,
        "schemas": len(schemas),
        "compiled": len(compiles),
        "compile_ms_p50": pct(compiles, 50),
        "compile_ms_p99": pct(compiles, 99),
        "mask_us_mean": statistics.fmean(masks) * 1e6 if masks else None,
        "mask_us_p99": pct(masks, 99) * 1e3 if masks else None,
        "masks": len(masks),
        "failures": failures,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", type=Path, default=None)
    ap.add_argument("--per-folder", type=int, default=20)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--engines", default=",".join(e.name for e in ENGINES),
                    help="comma-separated engine names")
    args = ap.parse_args(argv)
    import turbospark_jax as tsj

    tok = tsj.load().tokenizer
    local = dict(LOCAL_SCHEMAS)
    bench = _load_bench(args.bench, args.per_folder)
    report = {"machine": f"{platform.machine()} {platform.processor() or ''} "
                         f"python {platform.python_version()}".strip(),
              "vocab": tok.vocab_size, "results": []}
    chosen = [e for e in ENGINES if e.name in args.engines.split(",")]
    for engine_cls in chosen:
        for label, schemas in (("local", local), ("bench", bench)):
            if not schemas:
                continue
            r = measure(engine_cls, tok, schemas, args.steps)
            r["set"] = label
            report["results"].append(r)
            fails = r.pop("failures")
            r["failed"] = sorted(fails)
            print(json.dumps({k: v for k, v in r.items() if k != "failed"}), flush=True)
            if label == "local":
                print("  unsupported:", {k: fails[k] for k in sorted(fails)})
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
