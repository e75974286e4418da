"""Prefix reuse for a model that cannot rewind (a recurrent state, as Qwen3.5's): the slot keeps
a copy of the state one token short of a prompt's end, so the same prompt again, or a session's
growing prompt, restarts from it; the reply is bitwise what the request gets served alone.

The engine is driven step by step (``Engine.run_once``); the control perturbs the kept copy
and expects the comparison to fail."""

import jax
import numpy as np

from turbospark_jax.core.sampling import SamplingConfig
from turbospark_jax.generation.completion import CompletionRequest
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.requests import Done, ServeRequest
from turbospark_jax.testing.toy import toy_recurrent_producer

VOCAB = 40


def engine():
    producer = toy_recurrent_producer(vocab=VOCAB, dim=16, capacity=128, width=4, donate=True)
    return Engine(producer, slots=2, prefill_rows=2, prefill_chunk=8, warm_up=False)


def request(prompt, session=None, seed=5, max_tokens=6):
    completion = CompletionRequest(prompt_ids=list(prompt), max_tokens=max_tokens, seed=seed,
                                   sampling=SamplingConfig(temperature=0.8), record_logits=True)
    return ServeRequest(completion=completion, session_id=session, top_logprobs=2)


def serve(eng, req):
    events = []
    eng.submit(req, events.append)
    while not eng.idle:
        eng.run_once()
    assert isinstance(events[-1], Done), events[-1]
    return events[-1]


def alone(req):
    return serve(engine(), req)


def same(a, b):
    ca, cb = a.completion, b.completion
    return ca.token_ids == cb.token_ids and np.array_equal(ca.logits, cb.logits) and [
        (e.token, e.logprob, e.top) for e in a.logprobs] == [
        (e.token, e.logprob, e.top) for e in b.logprobs]


PROMPT = [3, 9, 1, 17, 22, 5, 5, 30, 2, 11, 8, 4, 19]  # over one prefill chunk


def test_the_same_prompt_again_reuses_all_but_its_last_token():
    eng = engine()
    fresh = alone(request(PROMPT))
    runs = [serve(eng, request(PROMPT)) for _ in range(3)]
    assert [r.completion.usage.reused_tokens for r in runs] == [0] + [len(PROMPT) - 1] * 2
    assert all(same(r, fresh) for r in runs)


def test_a_sessions_growing_prompt_reuses_the_last_prompt():
    eng = engine()
    first = serve(eng, request(PROMPT, session="s"))
    history = [*PROMPT, *first.completion.token_ids, 7, 13]
    second = serve(eng, request(history, session="s", seed=6))
    assert second.completion.usage.slot == first.completion.usage.slot
    assert second.completion.usage.reused_tokens == len(PROMPT) - 1
    assert same(second, alone(request(history, seed=6)))
    other = serve(eng, request([1, 2, *PROMPT], session="s"))  # shares no prefix: fresh
    assert other.completion.usage.reused_tokens == 0
    assert same(other, alone(request([1, 2, *PROMPT])))


def test_control_a_perturbed_kept_state_fails_the_check():
    eng = engine()
    first = serve(eng, request(PROMPT, session="s"))
    slot = eng.slots[first.completion.usage.slot]
    ids, state = slot.saved
    slot.saved = (ids, jax.tree.map(lambda x: x + 1e-3 if x.dtype == np.float32 else x, state))
    again = serve(eng, request(PROMPT, session="s"))
    assert again.completion.usage.reused_tokens == len(PROMPT) - 1
    assert not same(again, alone(request(PROMPT)))
