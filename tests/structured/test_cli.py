"""--json-schema, --regex and --grammar on the embedded model: the output matches, equals the
library's, and a bad constraint or a clash of flags is refused before any model loads."""

from __future__ import annotations

import io
import json
from pathlib import Path

import jsonschema
import pytest

import turbospark_jax as tsj
from turbospark_jax.cli import main

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tsj-pycoder"
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["x", "ok"], "additionalProperties": False}


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["generate", "--model", str(EMBEDDED), *argv], stdin=io.StringIO(""),
                stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_json_schema_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCHEMA))
    code, out, err = run("# a point", "--json-schema", str(path), "--max-tokens", "32",
                         "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["finish_reason"] == "constraint_end"
    jsonschema.validate(json.loads(record["text"]), SCHEMA)
    lib = tsj.generate(tsj.load(), "# a point", max_tokens=32, json_schema=SCHEMA)
    assert lib.text == record["text"]


def test_regex_and_grammar(tmp_path):
    code, out, err = run("n = ", "--regex", "[0-9]{2}", "--max-tokens", "8")
    assert code == 0, err
    assert len(out.strip()) == 2 and out.strip().isdigit()
    code, drafted, err = run("n = ", "--regex", "[0-9]{2}", "--max-tokens", "8", "--ngram", "3")
    assert code == 0, err
    assert drafted == out  # drafting emits what plain decoding emits
    path = tmp_path / "g.lark"
    path.write_text('start: "yes" | "no"\n')
    code, out, err = run("ok? ", "--grammar", str(path), "--max-tokens", "8")
    assert code == 0, err
    assert out.strip() in ("yes", "no")


@pytest.mark.parametrize("argv, said", [
    (("--regex", "(a"), "unclosed group"),
    (("--regex", "a", "--grammar", "g.lark"), "choose one constraint"),
    (("--grammar", "/nonexistent/g.lark"), "No such file"),
    (("--regex", "a", "--chat"), "drop --chat"),
    (("--regex", "a", "-n", "2"), "drop --num-completions"),
])
def test_refused_before_loading(argv, said):
    code, _, err = run("x", *argv)
    assert code != 0 and said in err and "loading" not in err
