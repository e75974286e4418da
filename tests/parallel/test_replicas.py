"""Data parallel serving: sessions pinned to replicas, each answering as one producer does.

The replicas here share the suite's one CPU device (the pool does not care where a producer
runs); ``tests/parallel/test_sharding.py`` runs replicas on separate simulated devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax import CompletionRequest
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, SessionError
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel
from turbospark_jax.parallel.replicas import ReplicaPool, replicas_on_devices
from turbospark_jax.sessions.session_pool import SessionPool

CFG = DenseConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
MODEL = DenseModel(CFG, jnp.float32)
PARAMS = MODEL.init_params(jax.random.PRNGKey(0))


def producer():
    return BlockProducer(MODEL, PARAMS, capacity=48, width=4, steps_per_call=4)


def turns(pool, session, prompts):
    out, history = [], []
    for p in prompts:
        history = [*history, *p]
        c = pool.generate(session, CompletionRequest(prompt_ids=history, max_tokens=5,
                                                     record_logits=True))
        out.append((list(c.token_ids), np.asarray(c.logits)))
        history = [*history, *c.token_ids]
    return out


CONVERSATIONS = {f"s{i}": [[1 + i, 2, 3], [4, 5 + i], [7, 8]] for i in range(5)}


def test_sessions_are_balanced_pinned_and_answer_as_one_producer():
    pool = ReplicaPool([producer(), producer()], slots=2)
    single = SessionPool(producer(), slots=5)
    for session, prompts in CONVERSATIONS.items():
        want = turns(single, session, prompts[:1])
        got = turns(pool, session, prompts[:1])
        assert got[0][0] == want[0][0]
        assert np.array_equal(got[0][1].view(np.uint32), want[0][1].view(np.uint32))
    assert pool.load() == [3, 2]
    pinned = {s: pool.replica_of(s) for s in CONVERSATIONS}
    assert pinned == {"s0": 0, "s1": 1, "s2": 0, "s3": 1, "s4": 0}
    # Later turns stay on the replica, and reuse the KV rows kept there.
    for session, prompts in CONVERSATIONS.items():
        want = turns(single, session, prompts)
        got = turns(pool, session, prompts)
        for (gt, gl), (wt, wl) in zip(got, want, strict=True):
            assert gt == wt and np.array_equal(gl.view(np.uint32), wl.view(np.uint32))
        assert pool.replica_of(session) == pinned[session]
    # Replica 0 holds three sessions in two slots: one was evicted, yet stayed pinned there.
    assert pool.pools[0].evictions > 0
    assert {pool.replica_of(s) for s in ("s0", "s2", "s4")} == {0}


def test_drop_unpins_and_frees_the_replica():
    pool = ReplicaPool([producer(), producer()], slots=1)
    pool.generate("a", CompletionRequest(prompt_ids=[1, 2], max_tokens=2))
    pool.generate("b", CompletionRequest(prompt_ids=[1, 2], max_tokens=2))
    pool.drop("a")
    assert pool.replica_of("a") is None and pool.load() == [0, 1]
    pool.generate("c", CompletionRequest(prompt_ids=[3], max_tokens=2))
    assert pool.replica_of("c") == 0
    with pytest.raises(SessionError, match="has run no turn"):
        pool.drop("a")


def test_refusals():
    with pytest.raises(SessionError, match="at least one producer"):
        ReplicaPool([], slots=1)
    pool = ReplicaPool([producer()], slots=1)
    with pytest.raises(BadInputError):  # a bad request pins nothing
        pool.stream("x", CompletionRequest(prompt_ids=[], max_tokens=2))
    assert pool.replica_of("x") is None
    with pytest.raises(SessionError):
        pool.replica_of(None)
    with pytest.raises(SessionError, match="positive divisor"):
        replicas_on_devices(MODEL, PARAMS, group_size=2, devices=jax.devices()[:1],
                            capacity=16)


def test_replicas_on_devices_serve_the_same_output():
    """One replica per device (a mesh of one): the output equals a plain producer's."""
    (replica,) = replicas_on_devices(MODEL, PARAMS, capacity=48, width=4, steps_per_call=4)
    request = CompletionRequest(prompt_ids=[5, 6, 7], max_tokens=4, record_logits=True)
    got = ReplicaPool([replica], slots=1).generate("s", request)
    want = SessionPool(producer(), slots=1).generate("s", request)
    assert list(got.token_ids) == list(want.token_ids)
    assert np.array_equal(np.asarray(got.logits), np.asarray(want.logits))
