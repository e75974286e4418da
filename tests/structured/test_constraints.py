"""The constraint seam (turbospark_jax.core.constraints): specs are checked when made and refuse
what the engine cannot honour by name; a bound constraint's masks, forced runs and end follow
the text, on the embedded model's tokenizer."""

import json

import numpy as np
import pytest

from turbospark_jax.core.constraints import ConstraintSpec
from turbospark_jax.errors import BadInputError
from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path
from turbospark_jax.io.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(embedded_model_path(DEFAULT_TARGET))


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def walk(constraint, tok, text):
    """Follow ``text`` through ``constraint``, checking each token is in the mask."""
    for t in ids_of(tok, text):
        assert constraint.allowed_mask()[t], (text, tok.decode([t]))
        constraint.advance(t)


def test_schema_mask_forced_run_and_end(tok):
    eos = tok.eos_token_id
    c = ConstraintSpec.json_schema(SCHEMA).bind(tok, tok.vocab_size + 8, [eos])
    forced = c.forced(64)
    assert tok.decode(forced) == '{"n'  # the only way an object with one required key starts
    mask = c.allowed_mask()
    assert mask.shape == (tok.vocab_size + 8,) and not mask[tok.vocab_size:].any()
    assert not mask[eos]  # not complete yet
    walk(c, tok, '":12')
    assert not c.is_satisfied
    bad = ids_of(tok, "x")[0]
    assert not c.allowed_mask()[bad]
    with pytest.raises(BadInputError, match="breaks the json_schema constraint"):
        c.fork().advance(bad)  # a fork fails; the original is untouched
    walk(c, tok, "}")
    assert c.is_satisfied and c.is_done
    assert np.flatnonzero(c.allowed_mask()).tolist() == [eos]  # only the end may follow


def test_forks_are_independent(tok):
    c = ConstraintSpec.regex("(ab|cd)[0-9]").bind(tok, tok.vocab_size, [tok.eos_token_id])
    other = c.fork()
    walk(c, tok, "ab")
    assert not np.array_equal(c.allowed_mask(), other.allowed_mask())
    walk(other, tok, "cd7")
    assert other.is_done and not c.is_done


def test_regex_and_grammar(tok):
    g = ConstraintSpec.grammar('start: "yes" | "no"').bind(tok, tok.vocab_size, [1])
    allowed = {tok.decode([i]) for i in np.flatnonzero(g.allowed_mask())}
    assert {"yes", "no"} <= allowed and all(s in {"y", "n", "ye", "yes", "no"} for s in allowed)
    r = ConstraintSpec.regex("[0-9]{3}").bind(tok, tok.vocab_size, [1])
    walk(r, tok, "123")
    assert r.is_done


def test_json_object_accepts_any_object(tok):
    spec = ConstraintSpec.json_object()
    assert spec.kind == "json_object"
    c = spec.bind(tok, tok.vocab_size, [1])
    walk(c, tok, json.dumps({"a": [1, {"b": None}]}, separators=(",", ":")))
    assert c.is_satisfied


@pytest.mark.parametrize("kwargs, named", [
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"json_schema": {"if": {"type": "object"}, "then": {}}}, '"if"'),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": [1]}, "must be a JSON object"),
    ({"regex": "(a"}, "unclosed group"),
    ({"regex": ""}, "non-empty"),
    ({"grammar": "start: missing_rule"}, "missing_rule"),
    ({"regex": "a", "grammar": 'start: "a"'}, "at most one"),
])
def test_bad_constraints_are_refused_by_name(kwargs, named):
    with pytest.raises(BadInputError, match=named):
        ConstraintSpec.of(**kwargs)


def test_no_constraint_is_none():
    assert ConstraintSpec.of() is None


def test_a_tokenizer_without_backend_is_refused():
    with pytest.raises(BadInputError, match="tokenizers"):
        ConstraintSpec.regex("a").bind(object(), 10)
