"""Graceful shutdown: once it begins no request is admitted (503 with ``Retry-After``,
``/health`` says ``stopping``), the requests in flight finish within the grace period, and
the rest are cut off (a ``server_shutdown`` error event ending their streams, their slots
freed). In-process through the engine's drain API and the app, and once in a child process
that a real SIGTERM shuts down (``Server.run``, what ``serve`` runs)."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from turbospark_jax.cli import main
from turbospark_jax.core.sampling import SamplingConfig
from turbospark_jax.errors import UnavailableError
from turbospark_jax.generation.completion import CompletionRequest
from turbospark_jax.server.build import make_server
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.metrics import ServerMetrics
from turbospark_jax.server.requests import Done, Failed, ServeRequest
from turbospark_jax.testing.live_server import free_port, running
from turbospark_jax.testing.toy import toy_attention_producer

VOCAB, SLOTS = 48, 3


def engine(**kw):
    return Engine(toy_attention_producer(vocab=VOCAB, capacity=160, donate=True), slots=SLOTS,
                  prefill_rows=2, prefill_chunk=8, warm_up=False, **kw)


def request(max_tokens=100, n=1, seed=3):
    return ServeRequest(completion=CompletionRequest(
        prompt_ids=[4, 8, 15, 16, 23, 42], max_tokens=max_tokens, seed=seed,
        sampling=SamplingConfig(temperature=0.8)), n=n)


@contextlib.contextmanager
def paused(eng):
    """Hold the scheduler before its next tick until the block ends."""
    gate = threading.Event()
    run_once = eng.run_once

    def held():
        gate.wait()
        run_once()

    eng.run_once = held
    try:
        yield
    finally:
        del eng.run_once
        gate.set()


def in_thread(fn, *args):
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn(*args)))
    thread.start()
    return thread, out


def test_drain_lets_the_requests_in_flight_finish():
    eng = engine().start()
    try:
        events = []
        with paused(eng):
            eng.submit(request(max_tokens=20, n=2), events.append)
            thread, out = in_thread(eng.drain, 60.0)
            deadline = time.monotonic() + 5
            while not eng.stopping:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(UnavailableError, match="shutting down"):
                eng.submit(request(), events.append)
        thread.join(timeout=60)
        assert out["value"] == 0
        assert sorted(e.index for e in events if isinstance(e, Done)) == [0, 1]
        assert not any(isinstance(e, Failed) for e in events)
        assert eng.idle and eng.load()["busy_slots"] == 0
    finally:
        eng.stop()
    eng.start()  # a restart takes work again
    try:
        got = []
        eng.submit(request(max_tokens=3), got.append)
        deadline = time.monotonic() + 30
        while not any(isinstance(e, Done) for e in got):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        eng.stop()


def test_drain_cuts_off_what_the_grace_period_does_not_cover():
    metrics = ServerMetrics()
    eng = engine(observer=metrics).start()
    try:
        events = []
        eng.submit(request(max_tokens=150, n=2), events.append)
        deadline = time.monotonic() + 30
        while not any(e.index == 1 for e in events):  # both choices are decoding
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with paused(eng):  # the rows stay mid-reply while the grace period runs out
            thread, out = in_thread(eng.drain, 0.2)
            time.sleep(0.4)
        thread.join(timeout=30)
        assert out["value"] == 2
        ends = [e for e in events if isinstance(e, Done | Failed)]
        assert sorted(e.index for e in ends) == [0, 1]
        assert all(isinstance(e, Failed) and e.shutdown for e in ends)
        assert eng.idle and eng.load()["busy_slots"] == 0
        cut = metrics.registry.get_sample_value("turbospark_requests_finished_total",
                                                {"outcome": "shutdown"})
        assert cut == 2
    finally:
        eng.stop()


def test_drain_without_a_scheduler_thread_cuts_off_at_once():
    eng = engine()  # driven by run_once: nothing ends the requests but the drain itself
    events = []
    eng.submit(request(max_tokens=50), events.append)
    eng.run_once()
    assert eng.drain(0) == 1
    assert isinstance(events[-1], Failed) and events[-1].shutdown
    assert eng.idle and eng.load()["busy_slots"] == 0
    eng.run_once()  # nothing left to do
    with pytest.raises(UnavailableError):
        eng.submit(request(), events.append)


@pytest.fixture
def server():
    from turbospark_jax.io.tokenizer import Tokenizer
    from turbospark_jax.testing.tokenizers import byte_level_bpe

    tok = Tokenizer.from_tokenizers(byte_level_bpe(), bos="<|bos|>", eos="<|eos|>",
                                    pad="<|pad|>")
    srv = make_server(toy_attention_producer(vocab=tok.vocab_size, capacity=200, donate=True),
                      tok, model_name="toy", slots=SLOTS, prefill_chunk=16)
    with running(srv) as url:
        yield srv, url


def test_the_app_while_draining(server):
    """``/health`` says ``stopping`` and new requests get 503 while a streamed and a whole
    request are in flight; when the grace period runs out, the stream ends with a
    ``server_shutdown`` error event and the whole one with a 503."""
    srv, url = server
    body = {"model": "toy", "prompt": "def f(x):", "max_tokens": 150, "temperature": 0}
    results = {}

    def whole():
        results["whole"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

    with httpx.Client(timeout=60) as http, contextlib.ExitStack() as stack:
        with paused(srv.engine):
            resp = stack.enter_context(http.stream("POST", url + "/v1/completions",
                                                   json={**body, "stream": True}))
            worker = threading.Thread(target=whole)
            worker.start()
            deadline = time.monotonic() + 10
            while srv.engine.load()["waiting"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            thread, out = in_thread(srv.engine.drain, 0.3)
            while not srv.engine.stopping:
                time.sleep(0.01)
            health = http.get(url + "/health")
            assert health.status_code == 503 and health.json()["status"] == "stopping"
            assert int(health.headers["Retry-After"]) >= 1
            refused = http.post(url + "/v1/completions", json=body)
            assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["code"] == "unavailable"
            time.sleep(0.5)  # the grace period runs out while the scheduler is held
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        thread.join(timeout=30)
        worker.join(timeout=30)
    assert out["value"] == 2
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutdown" and error["type"] == "server_error"
    whole_reply = results["whole"]
    assert whole_reply.status_code == 503 and whole_reply.json()["error"]["code"] == (
        "server_shutdown")
    assert srv.engine.load()["busy_slots"] == 0


def test_the_shutdown_grace_flag_is_checked_before_loading():
    err = io.StringIO()
    assert main(["serve", "--shutdown-grace", "-1"], stdout=io.StringIO(), stderr=err) == 1
    assert "--shutdown-grace must be >= 0" in err.getvalue()
    out = io.StringIO()
    assert main(["serve", "--help"], stdout=out, stderr=io.StringIO()) == 0
    assert "--shutdown-grace" in out.getvalue()


CHILD = textwrap.dedent("""
    import sys, time
    from turbospark_jax.io.tokenizer import Tokenizer
    from turbospark_jax.server.build import make_server
    from turbospark_jax.testing.tokenizers import byte_level_bpe
    from turbospark_jax.testing.toy import toy_attention_producer

    tok = Tokenizer.from_tokenizers(byte_level_bpe(), bos="<|bos|>", eos="<|eos|>",
                                    pad="<|pad|>")
    srv = make_server(toy_attention_producer(vocab=tok.vocab_size, capacity=200, donate=True),
                      tok, model_name="toy", slots=2)
    run_once = srv.engine.run_once

    def slow():  # a reply takes long enough to be in flight when the signal comes
        time.sleep(0.02)
        run_once()

    srv.engine.run_once = slow
    srv.run(port=int(sys.argv[1]), log_level="warning", shutdown_grace=float(sys.argv[2]))
    print("returned", flush=True)
""")


def test_a_real_sigterm_drains_then_exits():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(port), "60"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        body = {"model": "toy", "prompt": "x = ", "max_tokens": 60, "temperature": 0,
                "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions",
                                                           json=body) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.kill(child.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while True:  # stopping: no new work, the stream in flight carries on
                health = httpx.get(url + "/health", timeout=5)
                if health.status_code == 503:
                    assert health.json()["status"] == "stopping"
                    break
                assert time.monotonic() < deadline
                time.sleep(0.01)
            refused = httpx.post(url + "/v1/completions", json={**body, "stream": False},
                                 timeout=5)
            assert refused.status_code == 503
            rest = [first, *(line for line in lines if line.startswith("data: "))]
        assert rest[-1] == "data: [DONE]"
        finish = json.loads(rest[-2][6:])["choices"][0]["finish_reason"]
        assert finish == "length"  # it finished within the grace period
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        assert "returned" in out
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
