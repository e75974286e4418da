"""Constrained generation through tsj.generate / tsj.stream on the embedded model: outputs
parse and validate, a forced run fed as a chunk gives the same tokens as one fed token by
token, the recorded rows equal a token-by-token reference loop's masked logits bitwise (with a
control), the finish reasons say how the constraint ended, and bad constraints are refused
before any work."""

import json

import jsonschema
import numpy as np
import pytest

import turbospark_jax as tsj
from turbospark_jax.core.constraints import ConstraintSpec
from turbospark_jax.errors import BadInputError
from turbospark_jax.generation.completion import CompletionRequest, FinishReason
from turbospark_jax.generation.driver import stream_completion

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPT = "# one person as JSON\n"


@pytest.fixture(scope="module")
def model():
    return tsj.load()


@pytest.mark.parametrize("settings", [{}, {"temperature": 1.0, "seed": 5},
                                      {"temperature": 0.8, "top_k": 20, "seed": 9}])
def test_schema_outputs_validate(model, settings):
    c = tsj.generate(model, PROMPT, max_tokens=64, json_schema=PERSON, **settings)
    assert c.finish_reason is FinishReason.CONSTRAINT_END
    jsonschema.validate(json.loads(c.text), PERSON)


def test_regex_grammar_and_stream(model):
    c = tsj.generate(model, "x = ", max_tokens=16, regex=r"[0-9]{3}-[a-z]{2}")
    assert c.finish_reason is FinishReason.CONSTRAINT_END
    assert len(c.text) == 6 and c.text[3] == "-" and c.text[:3].isdigit()
    s = tsj.stream(model, "ok? ", max_tokens=8, grammar='start: "yes" | "no" | "maybe"')
    deltas = "".join(e.text for e in s)
    assert deltas == s.result.text and s.result.text in {"yes", "no", "maybe"}


def test_unsatisfied_within_max_tokens(model):
    c = tsj.generate(model, PROMPT, max_tokens=3, json_schema=PERSON)
    assert c.finish_reason is FinishReason.CONSTRAINT_UNMET and len(c.token_ids) == 3
    # a constraint that is satisfied when max_tokens comes is a plain length finish
    c = tsj.generate(model, "x = ", max_tokens=4, regex="a+")
    assert c.finish_reason is FinishReason.LENGTH and c.text == "a" * len(c.text)


def test_stop_token_allowed_only_at_the_end(model):
    # "[0-9]+" may end after any digit: the model's stop id becomes allowed there
    c = tsj.generate(model, "n = ", max_tokens=40, regex="[0-9]+", temperature=1.0, seed=1)
    assert c.text.isdigit()
    assert c.finish_reason in (FinishReason.STOP_TOKEN, FinishReason.LENGTH)


def reference(model, spec, prompt_ids, max_tokens):
    """Token by token through produce, greedy over the masked logits (a forced token's row
    masked to it alone): the tokens and the rows."""
    p = model.producer
    con = spec.bind(model.tokenizer, p.vocab_size, model.stop_token_ids)
    state = p.init_state()
    for i, t in enumerate(prompt_ids[:-1]):
        state = p.produce_prefill(state, t, i)
    logits, state = p.produce(state, prompt_ids[-1], len(prompt_ids) - 1)
    tokens, rows, queue = [], [], []
    while True:
        if tokens:
            queue = queue or con.forced(max_tokens - len(tokens))
            logits, state = p.produce(state, tokens[-1], len(prompt_ids) + len(tokens) - 1)
        forced = bool(queue)
        allowed = np.zeros(p.vocab_size, bool)
        if forced:
            allowed[queue.pop(0)] = True
        else:
            allowed = con.allowed_mask()
        row = np.where(allowed, np.asarray(logits), -np.inf).astype(np.float32)
        t = int(np.argmax(row))
        if not forced:
            con.advance(t)
        tokens.append(t)
        rows.append(row)
        if t in model.stop_token_ids or len(tokens) >= max_tokens or (
                con.is_done and not queue):
            return tokens, rows


def test_equals_token_by_token_reference_bitwise(model):
    spec = ConstraintSpec.json_schema(PERSON)
    ids = model.tokenizer.encode(PROMPT, add_special_tokens=False)
    req = CompletionRequest(prompt_ids=ids, max_tokens=40, constraint=spec, record_logits=True,
                            stop_token_ids=model.stop_token_ids)
    recorded = stream_completion(model.producer, req, tokenizer=model.tokenizer).drain()
    chunked = stream_completion(model.producer, CompletionRequest(
        prompt_ids=ids, max_tokens=40, constraint=spec, stop_token_ids=model.stop_token_ids),
        tokenizer=model.tokenizer).drain()
    # forced runs fed as one chunk or token by token: the same tokens
    assert chunked.token_ids == recorded.token_ids
    assert chunked.finish_reason is recorded.finish_reason is FinishReason.CONSTRAINT_END
    tokens, rows = reference(model, spec, ids, 40)
    assert tokens == recorded.token_ids
    assert np.array_equal(np.stack(rows), recorded.logits)
    # control: an unmasked row differs from the recorded one
    raw = np.array(recorded.logits[1])
    raw[~np.isfinite(raw)] = 0.0
    assert not np.array_equal(raw, recorded.logits[1])


@pytest.mark.parametrize("kwargs, named", [
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"regex": "(a"}, "unclosed group"),
    ({"grammar": "start: nowhere"}, "nowhere"),
    ({"regex": "a", "json_schema": {}}, "at most one"),
])
def test_bad_constraints_refused_before_work(model, kwargs, named, monkeypatch):
    calls = []
    monkeypatch.setattr(type(model.producer), "init_state",
                        lambda self, *a, **k: calls.append(1))
    with pytest.raises(BadInputError, match=named):
        tsj.stream(model, "x", max_tokens=4, **kwargs)
    assert not calls


def test_constraint_needs_a_tokenizer(model):
    req = CompletionRequest(prompt_ids=[5, 6], max_tokens=2, constraint=ConstraintSpec.regex("a"))
    with pytest.raises(BadInputError, match="needs a tokenizer"):
        stream_completion(model.producer, req)


def test_masked_sample_keys_are_the_plain_ones(model):
    # the token after a forced run samples with its own index's key: a seed reproduces
    a = tsj.generate(model, PROMPT, max_tokens=48, json_schema=PERSON, temperature=1.0, seed=4)
    b = tsj.generate(model, PROMPT, max_tokens=48, json_schema=PERSON, temperature=1.0, seed=4)
    assert a.token_ids == b.token_ids


def test_a_session_pool_turn_takes_the_constraint(model):
    from turbospark_jax.sessions.session_pool import SessionPool

    ids = model.tokenizer.encode(PROMPT, add_special_tokens=False)
    req = CompletionRequest(prompt_ids=ids, max_tokens=48, stop_token_ids=model.stop_token_ids,
                            constraint=ConstraintSpec.json_schema(PERSON))
    turn = SessionPool(model.producer, 2).stream("s", req, tokenizer=model.tokenizer).drain()
    alone = tsj.generate(model, PROMPT, max_tokens=48, json_schema=PERSON)
    assert turn.token_ids == alone.token_ids and turn.finish_reason is alone.finish_reason
