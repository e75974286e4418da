"""Structured output: whether constrained outputs validate, what a schema costs to compile,
and what a constraint costs in decode speed.

Validity: every schema of a set is given to the embedded model (``tsj.load()``) as
``json_schema``, greedy and sampled; a schema the engine refuses is counted as refused (it is
refused by name, before any work), and an output that finishes (``constraint_end`` or
``stop_token``) must parse and validate under its schema (``jsonschema``). The compile time of
each accepted schema is a cold compile and bind to a ready matcher. The set is
:data:`LOCAL_SCHEMAS` (one JSON Schema feature each) or an even sample of every source folder
of JSONSchemaBench, read from the folder the :data:`BENCH_ENV` environment variable names (a
checkout's ``data/``); without it the local set runs and the file says so under ``skipped``.

Speed: tokens/s of a batch-1 greedy completion with and without a constraint on the same
producer and prompt, the best of ``repeats`` after a run that compiles, the plain and
constrained runs taking turns. The constraint is :data:`SPEED_REGEX`, which never forces a
token and never ends the text; the stop ids are left out so both runs generate ``new_tokens``.
Being greedy, the constrained run decodes in optimistic bursts (plain greedy bursts whose
tokens the constraint keeps up to the first it forbids, drawn masked from that burst's row; see
``docs/guides/structured-output.md``), so what it measures is how often the model breaks the
constraint and what each break costs: the embedded model, after :data:`PROMPT`, keeps reaching
for a call's parenthesis that the regex forbids. The bar is :data:`BAR` (constrained over
plain). The model is the embedded one (``embedded``) or a shape of
:data:`benchmarks.common.SHAPES` with random weights, whose constraint reads the embedded
tokenizer (ids past it are never allowed).

Server: :data:`Preset.server_streams` greedy streams at once through one live server on the
embedded model, all plain and then every other one constrained (:data:`SERVER_FORMAT`, a
``response_format``), aggregate tokens/s of each and their ratio (bar :data:`SERVER_BAR`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common

#: The environment variable naming a JSONSchemaBench ``data/`` folder.
BENCH_ENV = "JSONSCHEMABENCH"
#: The speed cases' constraint: any run of lower-case letters, underscores and spaces.
SPEED_REGEX = "[a-z_ ]+"
#: Constrained tokens/s over plain tokens/s that a speed case should reach.
BAR = 0.9
#: The speed cases' prompt on the embedded model.
PROMPT = "def f(x):"

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


@dataclasses.dataclass(frozen=True)
class Preset:
    #: ``"local"`` (:data:`LOCAL_SCHEMAS`) or ``"bench"`` (a JSONSchemaBench sample)
    schemas: str
    #: the first this many schemas of the set (``None``: all of them)
    limit: int | None
    #: schemas taken from each JSONSchemaBench source folder
    per_folder: int
    #: the token limit of each validity run
    max_tokens: int
    #: the speed cases' models: ``"embedded"`` or shapes of :data:`common.SHAPES`
    speed_models: tuple[str, ...]
    #: tokens each speed run generates
    new_tokens: int
    repeats: int
    dtype: str
    #: streams of the server case (the embedded model; 0: no server case)
    server_streams: int = 0


_GPU = Preset("bench", None, 8, 128, ("embedded", "llama-3.2-1b"), 256, 3, "bfloat16",
              server_streams=32)
PRESETS = {
    "smoke": Preset("local", 3, 8, 24, ("tiny",), 8, 1, "float32", server_streams=2),
    "cpu": Preset("bench", None, 8, 128, ("embedded",), 128, 2, "float32", server_streams=8),
    "h100": _GPU,
    "h200": _GPU,
}


def load_bench(folder: Path, per_folder: int) -> dict[str, dict[str, Any]]:
    """An even sample of ``per_folder`` schemas from each source folder of a JSONSchemaBench
    ``data/`` checkout, named ``folder/file``; a file that is not JSON is left out."""
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


def schema_set(preset: Preset, results: common.Results) -> dict[str, dict[str, Any]]:
    """The preset's schemas; the local set, with a ``skipped`` note, where the bench folder
    is not given."""
    schemas = dict(LOCAL_SCHEMAS)
    source = "local"
    if preset.schemas == "bench":
        folder = os.environ.get(BENCH_ENV)
        if folder and Path(folder).is_dir():
            schemas = load_bench(Path(folder), preset.per_folder)
            source = f"JSONSchemaBench, {preset.per_folder} schemas from each source folder"
        else:
            results.skip(f"set {BENCH_ENV} to a JSONSchemaBench data/ folder; the local "
                         "schemas ran instead", schemas="bench")
    if preset.limit is not None:
        schemas = dict(list(schemas.items())[:preset.limit])
    results.data["meta"]["schemas"] = {"source": source, "count": len(schemas)}
    return schemas


def validity(model: Any, schemas: dict[str, dict[str, Any]], max_tokens: int,
             results: common.Results) -> dict[str, Any]:
    """One case per schema and mode (``kind`` ``run``); returns the summary figures."""
    import jsonschema

    import turbospark_jax as tsj
    from turbospark_jax.core.constraints import ConstraintSpec
    from turbospark_jax.errors import BadInputError
    from turbospark_jax.generation.completion import FinishReason

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
            c = tsj.generate(model, "# a JSON value\n", max_tokens=max_tokens,
                             json_schema=schema, **settings)
            valid = None
            if c.finish_reason in (FinishReason.CONSTRAINT_END, FinishReason.STOP_TOKEN):
                try:
                    jsonschema.validate(json.loads(c.text), schema)
                    valid = True
                except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
                    # a schema jsonschema itself cannot read says nothing against the output
                    valid = isinstance(exc, jsonschema.SchemaError)
            runs.append(results.add({"kind": "run", "schema": name, "mode": mode,
                                     "finish": c.finish_reason.value,
                                     "tokens": len(c.token_ids), "valid": valid}))
    finished = [r for r in runs if r["valid"] is not None]

    def ms(q: float) -> float | None:
        return float(np.percentile(compile_s, q) * 1e3) if compile_s else None

    return {"schemas": len(schemas), "refused": refused, "compiled": len(compile_s),
            "compile_ms_p50": ms(50), "compile_ms_p99": ms(99), "runs": len(runs),
            "finished": len(finished), "valid": sum(1 for r in finished if r["valid"]),
            "unmet": sum(1 for r in runs if r["finish"] == FinishReason.CONSTRAINT_UNMET.value)}


def speed(producer: Any, tokenizer: Any, prompt: list[int], new_tokens: int,
          repeats: int) -> dict[str, Any]:
    """Plain and constrained greedy tokens/s after the first token, each the best of
    ``repeats`` after one run that compiles, and their ratio. The two kinds of run alternate
    (plain, constrained, plain, ...), so a machine whose load drifts weighs on both alike."""
    import turbospark_jax as tsj
    from turbospark_jax.core.constraints import ConstraintSpec

    # A random-weight shape with a larger vocabulary than the tokenizer's draws ids the
    # tokenizer cannot detokenize: its plain run then decodes ids alone (the constraint keeps
    # the constrained run inside the tokenizer's ids).
    plain_tokenizer = tokenizer if producer.vocab_size <= tokenizer.vocab_size else None
    kinds = {name: (tsj.CompletionRequest(prompt_ids=prompt, max_tokens=new_tokens,
                                          stop_token_ids=(), constraint=constraint),
                    tokenizer if constraint is not None else plain_tokenizer)
             for name, constraint in (("plain", None),
                                      ("constrained", ConstraintSpec.regex(SPEED_REGEX)))}
    runs: dict[str, list[Any]] = {name: [] for name in kinds}
    for _ in range(1 + max(1, repeats)):  # the first round compiles
        for name, (request, told) in kinds.items():
            runs[name].append(tsj.run_raw_completion(producer, request, tokenizer=told))
    rates = {name: max(r.timings.decode_tokens_per_s(len(r.token_ids)) for r in done[1:])
             for name, done in runs.items()}
    ratio = rates["constrained"] / rates["plain"]
    return {"plain_tokens_per_s": round(rates["plain"], 2),
            "constrained_tokens_per_s": round(rates["constrained"], 2),
            "ratio": round(ratio, 3), "meets_bar": ratio >= BAR,
            "generated": len(runs["constrained"][0].token_ids),
            "plain_generated": len(runs["plain"][0].token_ids)}


#: The server case's constraint on its constrained half: a JSON string of lower-case words.
SERVER_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {
    "name": "words", "schema": {"type": "string", "pattern": "^[a-z_ ]+$"}}}}
#: Server throughput with half the streams constrained, over all plain, should reach this.
SERVER_BAR = 0.85


def server_mix(streams: int, new_tokens: int, dtype: str) -> dict[str, Any]:
    """Aggregate tokens/s of ``streams`` greedy streams through one live server on the
    embedded model, all plain and then half of them constrained (:data:`SERVER_FORMAT`), and
    their ratio; each after a warm-up that compiles both programs' plain and masked forms."""
    from benchmarks import serve
    from turbospark_jax.testing.live_server import running

    settings = serve.Preset("embedded", (streams,), 16, new_tokens, 16 + new_tokens + 32, 1,
                            dtype, prefill_rows=4, prefill_chunk=16, hf=False)
    server = serve.our_server(settings)
    vocab = server.engine.producer.vocab_size
    half = [SERVER_FORMAT if i % 2 else None for i in range(streams)]
    with running(server) as url:
        serve.drive(url, serve.prompts_for(2, 16, vocab, seed=7), 2, [None, SERVER_FORMAT])
        plain = serve.drive(url, serve.prompts_for(streams, 16, vocab, seed=1), new_tokens)
        mixed = serve.drive(url, serve.prompts_for(streams, 16, vocab, seed=2), new_tokens, half)
    ratio = mixed["tokens_per_s"] / plain["tokens_per_s"]
    return {"plain_tokens_per_s": round(plain["tokens_per_s"], 2),
            "half_constrained_tokens_per_s": round(mixed["tokens_per_s"], 2),
            "plain_tokens": plain["tokens"], "half_constrained_tokens": mixed["tokens"],
            "ratio": round(ratio, 3), "meets_bar": ratio >= SERVER_BAR}


def run(preset: Preset, results: common.Results) -> None:
    import jax

    import turbospark_jax as tsj

    model = tsj.load()
    results.data["meta"]["speed"] = {"regex": SPEED_REGEX, "bar": BAR}
    schemas = schema_set(preset, results)
    results.case({"kind": "validity"},
                 lambda: validity(model, schemas, preset.max_tokens, results))
    for name in preset.speed_models:
        label = {"kind": "speed", "model": name, "batch": 1, "new_tokens": preset.new_tokens}
        if name == "embedded":
            prompt = model.tokenizer.encode(PROMPT, add_special_tokens=False)
            results.case(label, lambda p=prompt: speed(model.producer, model.tokenizer, p,
                                                       preset.new_tokens, preset.repeats))
            continue
        try:
            built = common.build(name, capacity=64 + preset.new_tokens, dtype=preset.dtype,
                                 burst=min(64, preset.new_tokens))
        except Exception as exc:  # out of memory, say: recorded, next model
            results.data["errors"].append({**label,
                                           "error": f"{type(exc).__name__}: {exc}"[:600]})
            continue
        vocab = min(built.config.vocab_size, model.producer.vocab_size)
        results.case(label, lambda b=built, v=vocab: speed(
            b.producer, model.tokenizer, common.prompt_ids(16, v), preset.new_tokens,
            preset.repeats))
        del built
        jax.clear_caches()
    if preset.server_streams:
        results.case({"kind": "server", "model": "embedded", "streams": preset.server_streams,
                      "new_tokens": preset.new_tokens},
                     lambda: server_mix(preset.server_streams, preset.new_tokens, preset.dtype))
    results.write()
