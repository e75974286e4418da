"""Data-parallel serving: a router over two replica engines answers every request bitwise as
one engine alone does, keeps a named session on the replica holding its KV, and sends other
requests to the best prefix match, else the least loaded replica.

The two replicas share the suite's one CPU device (an engine does not care where its producer
runs); ``test_replicas_on_their_own_devices`` runs ``load_server(replicas=2)`` on two simulated
devices in a subprocess.
"""

import os
import subprocess
import sys
import threading

import httpx
import jax
import pytest

from tests.engine.test_batching import MODEL, PREFILL, producer, request, same, serve
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, UnavailableError
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.parallel.replicas import replicas_one_per_device
from turbospark_jax.server.build import load_server, make_server
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.requests import Failed, ServeRequest
from turbospark_jax.server.router import ReplicaRouter
from turbospark_jax.testing.live_server import running
from turbospark_jax.testing.tokenizers import byte_level_bpe
from turbospark_jax.testing.toy import ToyAttentionModel

SLOTS = 2


def router(producers=None):
    producers = producers or [producer(), producer()]
    return ReplicaRouter([Engine(p, slots=SLOTS, **PREFILL) for p in producers])


def single():
    return Engine(producer(), slots=SLOTS, **PREFILL)


def ask(prompt, session=None, seed=0, setting=1):
    return ServeRequest(request(prompt, setting=setting, seed=seed), session_id=session)


A, B, C = [3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26]


def test_routing_pins_sessions_and_answers_as_one_engine():
    r = router()
    # Idle and sharing nothing: the lowest index, then the least loaded.
    assert r.route(ask(A)) == 0
    first = [(0, ask(A, seed=1)), (0, ask(B, seed=2)), (0, ask(C, session="s", seed=3))]
    got = serve(r, first)
    for (_, req), done in zip(first, got, strict=True):
        assert same(done, serve(single(), [(0, req)])[0])
    assert [e.holds("s") for e in r.engines] == [True, False]
    assert [e.prefix_match([*B, 1]) for e in r.engines] == [0, len(B)]
    # A prompt another replica has fed goes there; a held session stays on its replica even
    # when another has its prompt's prefix and less load.
    assert r.route(ask([*B, 1, 2])) == 1
    assert r.route(ask([*B, 1, 2], session="s")) == 0
    assert r.route(ask([*A, 1], session="new")) == 0  # a new session: by prefix
    later = [(0, ask([*B, 1, 2], seed=4)), (0, ask([*B, 1, 2], session="s", seed=5)),
             (0, ask([40, 41], seed=7)), (0, ask([*C, 30], session="s2", seed=6))]
    got = serve(r, later)
    for (_, req), done in zip(later, got, strict=True):
        assert same(done, serve(single(), [(0, req)])[0])
    assert got[0].completion.usage.reused_tokens == len(B)  # reused on replica 1
    assert [e.holds("s") for e in r.engines] == [True, False]
    # [40, 41] shares nothing and the loads tie: replica 0; then "s2" (whose prompt only a
    # slot of another named session has fed) finds replica 0 busier.
    assert [e.holds("s2") for e in r.engines] == [False, True]


def test_control_a_replica_with_other_weights_answers_differently():
    """The check above can fail: a replica whose weights differ in one seed gives other
    logits for the request it serves."""
    other = BlockProducer(MODEL, MODEL.init_params(jax.random.PRNGKey(4)), capacity=96,
                          width=5, steps_per_call=8, donate=True)
    r = router([producer(), other])
    req = [(0, ask(A, seed=1)), (0, ask(B, seed=2))]
    got = serve(r, req)
    assert same(got[0], serve(single(), [req[0]])[0])
    assert not same(got[1], serve(single(), [req[1]])[0])


def test_router_refusals():
    with pytest.raises(BadInputError, match="one or more"):
        ReplicaRouter([])
    small = BlockProducer(MODEL, producer().params, capacity=48, width=5)
    with pytest.raises(BadInputError, match="same model shape"):
        router([producer(), small])
    r = router()
    with pytest.raises(BadInputError, match="ServeRequest"):
        r.submit("hello", lambda ev: None)
    for e in r.engines:
        e.start()
        e.stop()
    with pytest.raises(UnavailableError, match="replica 0: the server is shutting down"):
        r.submit(ask(A), lambda ev: None)
    assert all(e.idle for e in r.engines)
    r.engines[1].start()
    try:
        assert r.route(ask(A)) == 1  # the stopped replica is skipped
    finally:
        r.engines[1].stop()


def test_live_server_with_two_replicas_answers_as_one():
    tok = Tokenizer.from_tokenizers(byte_level_bpe(), bos="<|bos|>", eos="<|eos|>",
                                    pad="<|pad|>")
    model = ToyAttentionModel(vocab=tok.vocab_size, dim=16)
    params = model.init_params(jax.random.PRNGKey(0))

    def toy():
        return BlockProducer(model, params, capacity=96, width=4, steps_per_call=8, donate=True)

    options = {"model_name": "toy", "slots": SLOTS, "stop_token_ids": (1,), "prefill_chunk": 8}
    bodies = [{"model": "toy", "prompt": f"{w} = {i}\n" * (1 + i % 2), "max_tokens": 5 + i,
               "temperature": [0, 0.9][i % 2], "seed": i, "logprobs": 2}
              for i, w in enumerate(["alpha", "beta", "gamma", "delta", "eps", "zeta"])]
    with running(make_server(toy(), tok, **options)) as url:
        alone = [httpx.post(url + "/v1/completions", json=b, timeout=60).json() for b in bodies]
    pair = make_server([toy(), toy()], tok, **options)
    together = [None] * len(bodies)
    with running(pair) as url:

        def post(i):
            together[i] = httpx.post(url + "/v1/completions", json=bodies[i], timeout=60).json()

        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        session = {"model": "toy", "prompt": "omega = 1\n", "max_tokens": 4, "temperature": 0,
                   "session_id": "conv"}
        turn = httpx.post(url + "/v1/completions", json=session, timeout=60).json()
        home = [e.holds("conv") for e in pair.engine.engines]
        follow = {**session, "prompt": session["prompt"] + turn["choices"][0]["text"] + "x"}
        again = httpx.post(url + "/v1/completions", json=follow, timeout=60).json()
        assert [e.holds("conv") for e in pair.engine.engines] == home and sum(home) == 1
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        health = httpx.get(url + "/health").json()
        assert health["replicas"] == 2 and health["slots"] == 2 * SLOTS
    for a, t in zip(alone, together, strict=True):
        assert a["choices"][0]["token_ids"] == t["choices"][0]["token_ids"]
        assert a["choices"][0]["logprobs"] == t["choices"][0]["logprobs"]


_TWO_DEVICES = """
import jax
import numpy as np
from turbospark_jax.generation.completion import CompletionRequest
from turbospark_jax.parallel.replicas import replicas_one_per_device
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.requests import Done, ServeRequest
from turbospark_jax.server.router import ReplicaRouter
from turbospark_jax.testing.toy import ToyAttentionModel

model = ToyAttentionModel(vocab=64, dim=16)
params = model.init_params(jax.random.PRNGKey(3))
args = {"capacity": 32, "width": 4, "steps_per_call": 4}


def serve(engine, requests):
    ends = {}
    for i, req in enumerate(requests):
        engine.submit(req, lambda ev, i=i: ends.__setitem__(i, ev))
    while not engine.idle:
        engine.run_once()
    assert all(isinstance(ends[i], Done) for i in range(len(requests))), ends
    return [ends[i].completion for i in range(len(requests))]


engines = [Engine(p, slots=1, prefill_chunk=4)
           for p in replicas_one_per_device(model, params, 2, **args)]
assert [e.device for e in engines] == jax.local_devices()[:2]
reqs = [ServeRequest(CompletionRequest(prompt_ids=[3 + i, 4, 5], max_tokens=4, seed=i,
                                       record_logits=True)) for i in range(2)]
got = serve(ReplicaRouter(engines), reqs)
for e in engines:  # each replica served one request, on its own device
    stack = {d for x in jax.tree.leaves(e.decoder.stack) for d in x.devices()}
    assert stack == {e.device} and e.slots[0].last_used == 1, e.device
(alone,) = [Engine(p, slots=1, prefill_chunk=4)
            for p in replicas_one_per_device(model, params, 1, **args)]
for req, c in zip(reqs, got, strict=True):
    (want,) = serve(alone, [req])
    assert c.token_ids == want.token_ids and np.array_equal(c.logits, want.logits)
print("ok")
"""


def test_replicas_on_their_own_devices_answer_as_one():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _TWO_DEVICES], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_more_replicas_than_devices_are_refused_before_loading():
    with pytest.raises(BadInputError, match="must be from 1 to the 1 devices"):
        load_server(None, replicas=2)
    with pytest.raises(BadInputError, match="replicas=0"):
        replicas_one_per_device(MODEL, producer().params, 0, capacity=96)


def test_drain_over_replicas_shares_one_deadline():
    """Every replica stops admitting at once; with no scheduler running, the grace period
    of 0 cuts off each replica's request (one each) and frees their slots."""
    r = router()
    events = []
    for prompt in (A, B):
        r.submit(ask(prompt), events.append)
    r.run_once()
    assert sum(e.load()["running"] for e in r.engines) == 2
    assert r.drain(0) == 2 and r.stopping and r.idle
    failed = [e for e in events if isinstance(e, Failed)]
    assert len(failed) == 2 and all(e.shutdown for e in failed)
    assert [e.load()["running"] for e in r.engines] == [0, 0]
    with pytest.raises(UnavailableError):
        r.submit(ask(C), events.append)
