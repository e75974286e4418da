"""The OpenAI-compatible server, live on localhost: the official client, concurrent clients
checked against the same request served alone, disconnects, the error table, overload, a
failure mid-generation, and metrics parsed with prometheus_client.

One server for the module: a toy attention model over a small byte-level BPE tokenizer with a
chat template, so text, stop strings and chat are real while every step compiles and runs fast.
"""

import contextlib
import json
import threading
import time

import httpx
import jax
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.server.build import make_server
from turbospark_jax.server.requests import choice_seed
from turbospark_jax.testing.live_server import running
from turbospark_jax.testing.tokenizers import byte_level_bpe
from turbospark_jax.testing.toy import ToyAttentionModel

CAPACITY, SLOTS, NAME = 160, 4, "toy"
TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


class PoisonableTokenizer:
    """The real tokenizer, except that decoding an id in ``poison`` fails (a fault injected
    mid-generation: the request ends with an error, the others carry on)."""

    def __init__(self, inner):
        self.inner = inner
        self.poison: set[int] = set()

    def decode(self, ids, skip_special_tokens=False):
        if self.poison.intersection(int(i) for i in ids):
            raise BadInputError("poisoned id")
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def server():
    tok = PoisonableTokenizer(Tokenizer.from_tokenizers(
        byte_level_bpe(), bos="<|bos|>", eos="<|eos|>", pad="<|pad|>", chat_template=TEMPLATE))
    model = ToyAttentionModel(vocab=tok.vocab_size, dim=16)
    producer = BlockProducer(model, model.init_params(jax.random.PRNGKey(0)),
                             capacity=CAPACITY, width=4, steps_per_call=8, donate=True)
    srv = make_server(producer, tok, model_name=NAME, slots=SLOTS, stop_token_ids=(1,),
                      max_waiting=8, prefill_chunk=16)
    with running(srv) as url:
        yield srv, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=60, **kw)


def wait_idle(srv, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not srv.engine.idle:
        assert time.monotonic() < deadline, srv.engine.load()
        time.sleep(0.01)


def test_completions_streaming_and_logprobs(server, client):
    r = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=8,
                                  temperature=0, logprobs=3)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 8
    assert len(choice.logprobs.token_logprobs) == 8
    assert all(len(t) <= 3 for t in choice.logprobs.top_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text
    parts = list(client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=8,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == choice.text
    assert parts[-1].usage.completion_tokens == 8
    assert parts[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_chat_streaming_logprobs_and_sessions(server, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"session_id": "chat-a"})
    msg = r.choices[0].message
    assert msg.role == "assistant" and len(r.choices[0].logprobs.content) == 6
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"session_id": "chat-a"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    usage = chunks[-1].usage
    assert usage.model_extra["session_id"] == "chat-a"
    assert usage.model_extra["slot"] == r.usage.model_extra["slot"]
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_models_and_health(server):
    url = server[1]
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == NAME
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["slots"] == SLOTS


def test_a_missing_model_is_the_served_one(server):
    url = server[1]
    body = {"prompt": "x = 1", "max_tokens": 4, "temperature": 0, "seed": 3}
    named = post(url, "/v1/completions", {**body, "model": NAME})
    omitted = post(url, "/v1/completions", body)
    assert named.status_code == omitted.status_code == 200
    assert omitted.json()["model"] == NAME
    assert omitted.json()["choices"][0]["text"] == named.json()["choices"][0]["text"]
    chat = post(url, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["model"] == NAME
    wrong = post(url, "/v1/completions", {**body, "model": "gpt-9"})  # control
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_not_found"


def _alone_then_together(url, bodies):
    alone = [post(url, "/v1/completions", b).json() for b in bodies]
    together = [None] * len(bodies)

    def run(i):
        together[i] = post(url, "/v1/completions", bodies[i]).json()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return alone, together


def test_concurrent_clients_get_what_they_get_alone(server):
    srv, url = server
    bodies = [
        {"model": NAME, "prompt": "import os\n" * (1 + i % 3), "max_tokens": 6 + 3 * i,
         "temperature": [0, 0.8, 1.3][i % 3], "top_k": [0, 20, 5][i % 3], "seed": i,
         "min_p": 0.02 * (i % 2), "frequency_penalty": 0.2 * (i % 2), "logprobs": 2}
        for i in range(6)
    ]
    alone, together = _alone_then_together(url, bodies)
    for a, t in zip(alone, together, strict=True):
        ca, ct = a["choices"][0], t["choices"][0]
        assert ca["token_ids"] == ct["token_ids"]
        assert ca["logprobs"] == ct["logprobs"]  # floats round-trip through JSON exactly
    wait_idle(srv)


def test_several_choices_are_each_the_request_alone_with_its_seed(server, client):
    """``n = 3``: choice ``i`` is the same request with ``n = 1`` and ``choice_seed(seed, i)``,
    whole or streamed; the usage counts the prompt once and every choice's tokens."""
    srv, url = server
    body = {"model": NAME, "prompt": "for i in range(", "max_tokens": 7, "temperature": 0.9,
            "seed": 11, "logprobs": 1}
    alone = [post(url, "/v1/completions", {**body, "seed": choice_seed(11, i)}).json()
             for i in range(3)]
    r = post(url, "/v1/completions", {**body, "n": 3}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for c, a in zip(r["choices"], alone, strict=True):
        assert c["token_ids"] == a["choices"][0]["token_ids"]
        assert c["logprobs"] == a["choices"][0]["logprobs"]
    assert r["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert r["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"])
    assert len({tuple(c["token_ids"]) for c in r["choices"]}) > 1
    parts = list(client.completions.create(
        model=NAME, prompt=body["prompt"], max_tokens=7, temperature=0.9, seed=11, n=3,
        stream=True, stream_options={"include_usage": True}))
    texts = ["".join(p.choices[0].text for p in parts if p.choices and p.choices[0].index == i)
             for i in range(3)]
    assert texts == [c["text"] for c in r["choices"]]
    finishes = [p.choices[0].finish_reason for p in parts if p.choices
                and p.choices[0].finish_reason]
    assert len(finishes) == 3
    assert parts[-1].usage.completion_tokens == r["usage"]["completion_tokens"]
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, n=2,
                                          temperature=1.0, seed=4)
    one = [client.chat.completions.create(model=NAME, messages=messages, max_tokens=5,
                                          temperature=1.0, seed=choice_seed(4, i))
           for i in range(2)]
    assert [c.message.content for c in chat.choices] == [o.choices[0].message.content
                                                          for o in one]
    stream = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=5,
                                                 n=2, temperature=1.0, seed=4, stream=True))
    for i in range(2):
        deltas = [c.choices[0].delta for c in stream if c.choices[0].index == i]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == chat.choices[i].message.content
    wait_idle(srv)


@pytest.mark.parametrize("n", [1, SLOTS])
def test_disconnect_frees_the_slot_at_once(server, n):
    srv, url = server
    body = {"model": NAME, "prompt": "x = 1", "max_tokens": 120, "temperature": 0,
            "stream": True, "n": n}
    with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/completions",
                                                       json=body) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
        assert srv.engine.load()["busy_slots"] >= 1
    wait_idle(srv, seconds=5)
    assert srv.engine.load()["busy_slots"] == 0


@contextlib.contextmanager
def scheduler_paused(srv):
    """Hold the scheduler thread before its next tick (outside the engine's lock), so
    requests stay waiting until the block ends."""
    gate = threading.Event()
    run_once = srv.engine.run_once

    def paused():
        gate.wait()
        run_once()

    srv.engine.run_once = paused
    try:
        yield
    finally:
        del srv.engine.run_once
        gate.set()


def test_disconnect_without_streaming_cancels_the_request(server):
    """A client that gives up on a response without streaming cancels it: the request waits
    (the scheduler is paused), the client times out, and the request never runs."""
    srv, url = server
    wait_idle(srv)

    def cancelled():
        return srv.metrics.registry.get_sample_value("turbospark_requests_finished_total",
                                                     {"outcome": "cancelled"}) or 0.0

    before = cancelled()
    with scheduler_paused(srv):
        body = {"model": NAME, "prompt": "z = 3", "max_tokens": 5, "temperature": 0}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 5
        while not all(j.ticket.cancelled for j in srv.engine._waiting):
            assert time.monotonic() < deadline, "the disconnect went unnoticed"
            time.sleep(0.02)
        assert srv.engine.load()["waiting"] == 1
    wait_idle(srv)
    assert cancelled() == before + 1 and srv.engine.load()["busy_slots"] == 0


ERRORS = [
    # (name, path, body (a str is sent raw), param, code)
    ("malformed json", "/v1/completions", "{not json", None, "invalid_json"),
    ("not an object", "/v1/completions", "[1, 2]", None, "invalid_json"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "a"}, "model",
     "model_not_found"),
    ("wrong type", "/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": "5"},
     "max_tokens", "invalid_type"),
    ("wrong type chat", "/v1/chat/completions",
     {"model": NAME, "messages": [{"role": "user", "content": 3}]}, "messages.0.content",
     "invalid_type"),
    ("temperature out of range", "/v1/completions",
     {"model": NAME, "prompt": "a", "temperature": -1}, "temperature", "invalid_value"),
    ("top_p out of range", "/v1/completions", {"model": NAME, "prompt": "a", "top_p": 0},
     "top_p", "invalid_value"),
    ("max_tokens zero", "/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 0},
     "max_tokens", "invalid_value"),
    ("logprobs too many", "/v1/completions", {"model": NAME, "prompt": "a", "logprobs": 21},
     "logprobs", "invalid_value"),
    ("unknown field", "/v1/completions", {"model": NAME, "prompt": "a", "temprature": 1},
     "temprature", "unknown_parameter"),
    ("prompt over the context", "/v1/completions",
     {"model": NAME, "prompt": "word " * 400, "max_tokens": 4}, "prompt",
     "context_length_exceeded"),
    ("max_tokens over the context", "/v1/completions",
     {"model": NAME, "prompt": "a", "max_tokens": CAPACITY}, "prompt",
     "context_length_exceeded"),
    ("token id outside the vocabulary", "/v1/completions",
     {"model": NAME, "prompt": [10**7]}, None, "invalid_value"),
    ("too many stop strings", "/v1/completions",
     {"model": NAME, "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop",
     "too_many_stop_strings"),
    ("empty message list", "/v1/chat/completions", {"model": NAME, "messages": []},
     "messages", "empty_messages"),
    ("n above the slots", "/v1/completions", {"model": NAME, "prompt": "a", "n": SLOTS + 1},
     "n", "invalid_value"),
    ("n zero", "/v1/chat/completions",
     {"model": NAME, "messages": [{"role": "user", "content": "a"}], "n": 0}, "n",
     "invalid_value"),
]


@pytest.mark.parametrize(("name", "path", "body", "param", "code"), ERRORS,
                         ids=[e[0] for e in ERRORS])
def test_bad_input_is_a_400_that_touches_no_session(server, name, path, body, param, code):
    srv, url = server
    wait_idle(srv)
    before = [(s.owner, s.fed_ids, s.last_used) for s in srv.engine.slots]
    if isinstance(body, str):
        r = httpx.post(url + path, content=body.encode(),
                       headers={"Content-Type": "application/json"})
    else:
        r = post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert [(s.owner, s.fed_ids, s.last_used) for s in srv.engine.slots] == before


@contextlib.contextmanager
def queue_full(srv, url):
    """As many requests as slots, waiting behind a paused scheduler, and no room for more."""
    saved, srv.engine.max_waiting = srv.engine.max_waiting, 0
    body = {"model": NAME, "prompt": "y = 2", "max_tokens": 3, "temperature": 0,
            "stream": True}
    try:
        with scheduler_paused(srv), httpx.Client(timeout=30) as http, \
                contextlib.ExitStack() as streams:
            for _ in range(SLOTS):
                streams.enter_context(http.stream("POST", url + "/v1/completions", json=body))
            yield
    finally:
        srv.engine.max_waiting = saved


@contextlib.contextmanager
def shutting_down(srv, url):
    srv.engine.stop()
    try:
        yield
    finally:
        srv.engine.start()


@contextlib.contextmanager
def scheduler_failed(srv, url):
    """A fault outside the device calls kills the scheduler thread: the request it was
    admitting fails, and the engine takes no more work until restarted."""

    def broken():
        raise RuntimeError("slot table corrupted")

    srv.engine._admit = broken
    try:
        r = post(url, "/v1/completions", {"model": NAME, "prompt": "q", "max_tokens": 2})
        assert r.status_code == 500 and "slot table corrupted" in r.json()["error"]["message"]
        yield
    finally:
        del srv.engine._admit
        srv.engine.start()


OVERLOAD = [
    # (name, situation, status, code, seconds the Retry-After asks for at least)
    ("queue full", queue_full, 429, "overloaded", 1),
    ("shutting down", shutting_down, 503, "unavailable", 5),
    ("scheduler failed", scheduler_failed, 503, "unavailable", 5),
]


@pytest.mark.parametrize(("name", "situation", "status", "code", "retry"), OVERLOAD,
                         ids=[o[0] for o in OVERLOAD])
def test_overload_is_refused_with_a_retry_hint(server, name, situation, status, code, retry):
    srv, url = server
    wait_idle(srv)
    before = [(s.owner, s.fed_ids, s.last_used) for s in srv.engine.slots]
    body = {"model": NAME, "prompt": "w = 4", "max_tokens": 3, "temperature": 0}
    with situation(srv, url):
        for path, b in (("/v1/completions", body), ("/v1/completions", {**body, "stream": True}),
                        ("/v1/chat/completions", {"model": NAME, "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "w"}]})):
            r = post(url, path, b)
            assert r.status_code == status and int(r.headers["Retry-After"]) >= retry, r.text
            assert r.json()["error"]["code"] == code
        health = httpx.get(url + "/health")
        assert health.status_code == (200 if status == 429 else 503)
        if status == 503:
            assert health.json()["status"] == "unavailable"
            busy = [(s.owner, s.fed_ids, s.last_used) for s in srv.engine.slots]
            assert busy == before or name == "scheduler failed"
    wait_idle(srv)
    r = post(url, "/v1/completions", body)  # served again once the situation has passed
    assert r.status_code == 200, r.text


def test_failure_mid_generation_ends_that_stream_only(server):
    srv, url = server
    victim = {"model": NAME, "prompt": "class A:", "max_tokens": 8, "temperature": 0}
    bystander = {"model": NAME, "prompt": "while True:", "max_tokens": 12, "temperature": 0.7,
                 "seed": 9}
    ids = post(url, "/v1/completions", victim).json()["choices"][0]["token_ids"]
    ref = post(url, "/v1/completions", bystander).json()["choices"][0]
    # The first generated id, after the first, that nothing before it (and not the bystander)
    # uses: decoding it fails mid-generation.
    poison = next(t for k, t in enumerate(ids) if k >= 1 and t not in ids[:k]
                  and t not in ref["token_ids"])
    tok = srv.config.tokenizer
    tok.poison.add(poison)
    try:
        result = {}
        t = threading.Thread(target=lambda: result.update(
            post(url, "/v1/completions", bystander).json()))
        t.start()
        with httpx.Client(timeout=30) as http, http.stream(
            "POST", url + "/v1/completions", json={**victim, "stream": True}
        ) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        t.join()
    finally:
        tok.poison.clear()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "generation_failed" and "poisoned" in error["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])
    assert "choices" in result, result
    assert result["choices"][0]["token_ids"] == ref["token_ids"]
    tok.poison.add(poison)
    try:  # the official client raises on the error event
        with pytest.raises(openai.APIError, match="poisoned"):
            list(openai.OpenAI(base_url=url + "/v1", api_key="x").completions.create(
                model=NAME, prompt="class A:", max_tokens=8, temperature=0, stream=True))
    finally:
        tok.poison.clear()
    wait_idle(srv)


def test_metrics_parse(server, client):
    srv, url = server
    client.completions.create(model=NAME, prompt="abc", max_tokens=3, temperature=0)
    client.completions.create(model=NAME, prompt="abc def", max_tokens=3, temperature=0)
    wait_idle(srv)
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(url + "/metrics").text)}
    for name in ("turbospark_http_requests", "turbospark_generated_tokens",
                 "turbospark_time_to_first_token_seconds", "turbospark_inter_token_seconds",
                 "turbospark_busy_slots", "turbospark_decode_batch_rows",
                 "turbospark_cached_prompt_tokens", "turbospark_prefilled_prompt_tokens",
                 "turbospark_prefill_batch_rows", "turbospark_parallel_choices"):
        assert name in families, sorted(families)

    def sample(family, suffix):
        return next(s.value for s in families[family].samples if s.name == family + suffix)

    assert sample("turbospark_generated_tokens", "_total") >= 6
    codes = {s.labels["status"] for s in families["turbospark_http_requests"].samples}
    assert "200" in codes
    # Every prompt token a started request brought was either reused or prefilled (no request
    # in this module is cancelled part way through its prompt), and the second prompt above
    # reused the first's.
    prompt = sample("turbospark_prompt_tokens", "_total")
    cached = sample("turbospark_cached_prompt_tokens", "_total")
    prefilled = sample("turbospark_prefilled_prompt_tokens", "_total")
    assert cached > 0 and prefilled > 0 and cached + prefilled == prompt
    calls = sample("turbospark_prefill_batch_rows", "_count")
    rows = sample("turbospark_prefill_batch_rows", "_sum")
    assert calls >= 2 and calls <= rows <= calls * srv.engine.decoder.prefill_rows
