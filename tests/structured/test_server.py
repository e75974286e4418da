"""Structured output in the server: per-row masks in the batched engine never change a free
neighbour's bits (with controls), and the OpenAI routes take ``response_format`` and
``tools`` / ``tool_choice`` through the official client, streamed or not, with bad schemas
refused as 400s before any work.

A toy attention model over a small byte-level tokenizer: its replies are noise, which is the
point: whatever it prefers, the constrained replies parse."""

import json

import httpx
import jax
import jsonschema
import numpy as np
import openai
import pytest

from turbospark_jax.core.constraints import ConstraintSpec
from turbospark_jax.core.sampling import SamplingConfig
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.generation.completion import CompletionRequest, FinishReason
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.server.build import make_server
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.requests import Done, ServeRequest
from turbospark_jax.testing.live_server import running
from turbospark_jax.testing.tokenizers import byte_level_bpe
from turbospark_jax.testing.toy import ToyAttentionModel

TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
NAME = "toy"
_SMALL = {"type": "integer", "minimum": -99, "maximum": 99}
POINT = {"type": "object", "properties": {"x": _SMALL, "y": _SMALL},
         "required": ["x", "y"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_tokenizers(byte_level_bpe(), bos="<|bos|>", eos="<|eos|>",
                                     pad="<|pad|>", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def model(tok):
    m = ToyAttentionModel(vocab=tok.vocab_size, dim=16)
    return m, m.init_params(jax.random.PRNGKey(1))


def producer(model):
    return BlockProducer(*model, capacity=128, width=4, steps_per_call=8, donate=True)


def serve(engine, requests):
    results = {}
    for i, req in enumerate(requests):
        engine.submit(ServeRequest(completion=req),
                      lambda ev, i=i: results.setdefault(i, []).append(ev))
    while not engine.idle:
        engine.run_once()
    ends = [results[i][-1] for i in range(len(requests))]
    assert all(isinstance(e, Done) for e in ends), ends
    return [e.completion for e in ends]


def test_constrained_rows_leave_free_neighbours_bitwise_alone(tok, model):
    ids = tok.encode("a point: ", add_special_tokens=False)
    free = CompletionRequest(prompt_ids=ids, max_tokens=12, seed=3, record_logits=True,
                             sampling=SamplingConfig(temperature=0.9), stop_token_ids=[1])
    spec = ConstraintSpec.json_schema(POINT)
    bound = [CompletionRequest(prompt_ids=ids, max_tokens=40, seed=s, record_logits=True,
                               sampling=SamplingConfig(temperature=t), stop_token_ids=[1],
                               constraint=spec) for s, t in ((0, 0.0), (5, 1.0))]
    (alone,) = serve(Engine(producer(model), slots=4, tokenizer=tok), [free])
    mixed = serve(Engine(producer(model), slots=4, tokenizer=tok), [bound[0], free, bound[1]])
    assert mixed[1].token_ids == alone.token_ids
    assert np.array_equal(mixed[1].logits, alone.logits)
    for c in (mixed[0], mixed[2]):
        assert c.finish_reason in (FinishReason.CONSTRAINT_END, FinishReason.STOP_TOKEN)
        jsonschema.validate(json.loads(c.text), POINT)
    # controls: the mask did act (the same seed unconstrained says something else), and a
    # masked row holds minus infinity where the free row's logits are finite
    (loose,) = serve(Engine(producer(model), slots=4, tokenizer=tok),
                     [CompletionRequest(prompt_ids=ids, max_tokens=12, seed=0, stop_token_ids=[1],
                                        record_logits=True)])
    assert loose.token_ids[:len(mixed[0].token_ids)] != mixed[0].token_ids
    assert np.isinf(mixed[0].logits).any() and np.isfinite(mixed[1].logits).all()


@pytest.fixture(scope="module")
def client(tok, model):
    srv = make_server(producer(model), tok, model_name=NAME, slots=4, stop_token_ids=(1,),
                      prefill_chunk=16)
    with running(srv) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), url


def chat(client, **kw):
    kw.setdefault("temperature", 0)
    return client[0].chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "go"}], **kw)


def test_response_format_json_schema_and_object(client):
    r = chat(client, max_tokens=48, response_format={
        "type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), POINT)
    assert r.choices[0].finish_reason == "stop"
    r = chat(client, max_tokens=48, response_format={"type": "json_object"}, temperature=1.0,
             seed=2)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    text = client[0].completions.create(model=NAME, prompt="p: ", max_tokens=48, temperature=0,
                                        extra_body={"response_format": {
                                            "type": "json_schema",
                                            "json_schema": {"name": "p", "schema": POINT}}})
    jsonschema.validate(json.loads(text.choices[0].text), POINT)
    parts = list(chat(client, max_tokens=48, stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}))
    streamed = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    jsonschema.validate(json.loads(streamed), POINT)
    # too few tokens to finish: OpenAI's "length"
    r = chat(client, max_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "point", "schema": POINT}})
    assert r.choices[0].finish_reason == "length"


def test_tool_choice_required_named_and_none(client):
    r = chat(client, max_tokens=80, tools=[WEATHER, ADD], tool_choice="required",
             parallel_tool_calls=False)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    schema = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id.startswith("call_") and call.type == "function"
    r = chat(client, max_tokens=80, tools=[WEATHER, ADD],
             tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    r = chat(client, max_tokens=8, tools=[WEATHER], tool_choice="none")
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"


def test_tool_calls_stream_as_openai_streams_them(client):
    parts = list(chat(client, max_tokens=80, tools=[ADD], stream=True,
                      tool_choice={"type": "function", "function": {"name": "add"}}))
    calls = [tc for p in parts if p.choices for tc in (p.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "add" and calls[0].index == 0
    json.loads(calls[0].function.arguments)
    assert parts[-1].choices[0].finish_reason == "tool_calls"
    content = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert "<tool_call>" not in content


def test_a_conversation_with_tool_results_renders(client):
    r = client[0].chat.completions.create(model=NAME, max_tokens=4, temperature=0, tools=[ADD],
                                          messages=[
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}])
    assert r.choices[0].message.role == "assistant"


@pytest.mark.parametrize("extra, named", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "u", "schema": {"type": "array", "uniqueItems": True}}}}, "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "u"}}},
     "needs a schema"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the tools"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "not both"),
])
def test_bad_formats_are_400s(client, extra, named):
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            **extra}
    r = httpx.post(client[1] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text
