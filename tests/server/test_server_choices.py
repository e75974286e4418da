"""Several choices a request (``n > 1``): the prompt is prefilled once, and each choice is
bitwise the same prompt served alone with its own seed (:func:`choice_seed`), on a model that
rewinds and on one that cannot. A cancel frees every choice's slot.

The engine is driven step by step (``Engine.run_once``). The control perturbs the first
choice's copy that the others start from and expects the comparison to fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.core.sampling import SamplingConfig
from turbospark_jax.errors import BadInputError
from turbospark_jax.generation.completion import CompletionRequest
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.requests import Delta, Done, ServeRequest, choice_seed
from turbospark_jax.testing.toy import toy_attention_producer, toy_recurrent_producer

VOCAB, SLOTS = 40, 3
PROMPT = [3, 9, 1, 17, 22, 5, 5, 30, 2, 11, 8, 4, 19]  # over one prefill chunk

PRODUCERS = {
    "attention": lambda: toy_attention_producer(vocab=VOCAB, dim=16, capacity=96, width=4,
                                                donate=True),
    "recurrent": lambda: toy_recurrent_producer(vocab=VOCAB, dim=16, capacity=96, width=4,
                                                donate=True),
}


def engine(kind):
    return Engine(PRODUCERS[kind](), slots=SLOTS, prefill_rows=2, prefill_chunk=8,
                  warm_up=False)


def request(prompt=PROMPT, seed=5, n=1, max_tokens=6):
    completion = CompletionRequest(prompt_ids=list(prompt), max_tokens=max_tokens, seed=seed,
                                   sampling=SamplingConfig(temperature=0.9), record_logits=True)
    return ServeRequest(completion=completion, top_logprobs=2, n=n)


def serve(eng, req):
    """Every event of ``req``, by choice; the engine runs until idle."""
    events = []
    eng.submit(req, events.append)
    while not eng.idle:
        eng.run_once()
    by_choice = {}
    for e in events:
        by_choice.setdefault(e.index, []).append(e)
    assert sorted(by_choice) == list(range(req.n))
    return by_choice


def done(events):
    assert isinstance(events[-1], Done), events[-1]
    return events[-1]


def same(a, b):
    ca, cb = a.completion, b.completion
    return ca.token_ids == cb.token_ids and np.array_equal(ca.logits, cb.logits) and [
        (e.token, e.logprob, e.top) for e in a.logprobs] == [
        (e.token, e.logprob, e.top) for e in b.logprobs]


def alone(kind, seed, prompt=PROMPT):
    return done(serve(engine(kind), request(prompt, seed=seed))[0])


def test_choice_seeds():
    assert choice_seed(5, 0) == 5
    seeds = {choice_seed(5, i) for i in range(1, 50)} | {choice_seed(6, i) for i in range(50)}
    assert len(seeds) == 99 and all(0 <= s < 2**64 for s in seeds)
    assert choice_seed(2**64 - 1, 3) == choice_seed(2**64 - 1, 3)
    with pytest.raises(BadInputError, match="seed"):
        choice_seed(-1, 1)


@pytest.mark.parametrize("kind", sorted(PRODUCERS))
@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[:1], PROMPT[:5]],
                         ids=["long", "one token", "short"])
def test_each_choice_is_the_prompt_served_alone_with_its_seed(kind, prompt):
    got = serve(engine(kind), request(prompt, n=SLOTS))
    for i in range(SLOTS):
        assert same(done(got[i]), alone(kind, choice_seed(5, i), prompt)), i
        text = [e for e in got[i] if isinstance(e, Delta)]
        assert sum(len(e.token_ids) for e in text) == len(done(got[i]).completion.token_ids)
    # The prompt was prefilled once: the other choices reuse all of it but its last token.
    reused = [done(got[i]).completion.usage.reused_tokens for i in range(SLOTS)]
    assert reused == [0] + [len(prompt) - 1] * (SLOTS - 1)
    tokens = {tuple(done(got[i]).completion.token_ids) for i in range(SLOTS)}
    assert len(tokens) > 1  # different seeds, different samples


def test_choices_beside_other_requests_and_waiting_for_slots():
    """More choices than free slots: the others wait for a slot, then start from the copy."""
    eng = engine("attention")
    events = {"other": [], "group": []}
    eng.submit(request([7, 7, 2], seed=1, max_tokens=9), events["other"].append)
    eng.run_once()
    eng.submit(request(n=SLOTS), events["group"].append)
    while not eng.idle:
        eng.run_once()
    other = serve(engine("attention"), request([7, 7, 2], seed=1, max_tokens=9))[0]
    assert same(done(events["other"]), done(other))
    for i in range(SLOTS):
        mine = done([e for e in events["group"] if e.index == i])
        assert same(mine, alone("attention", choice_seed(5, i))), i


def test_control_a_perturbed_copy_changes_the_other_choices(monkeypatch):
    keep = Engine._keep_for_choices

    def perturbed(self, job):
        keep(self, job)
        if job.group is not None and job.group.saved is not None and not job.group.__dict__.get(
                "hit"):
            job.group.saved = jax.tree.map(
                lambda x: x + jnp.asarray(0.01, x.dtype) if jnp.issubdtype(
                    x.dtype, jnp.floating) else x, job.group.saved)
            job.group.hit = True

    monkeypatch.setattr(Engine, "_keep_for_choices", perturbed)
    got = serve(engine("attention"), request(n=2))
    assert same(done(got[0]), alone("attention", 5))  # choice 0 feeds its own prompt
    assert not same(done(got[1]), alone("attention", choice_seed(5, 1)))


def test_cancel_frees_every_choice():
    eng = engine("attention")
    events = []
    ticket = eng.submit(request(n=SLOTS, max_tokens=40), events.append)
    for _ in range(6):
        eng.run_once()
    assert eng.load()["busy_slots"] == SLOTS
    ticket.cancel()
    eng.run_once()
    assert eng.idle and eng.load()["busy_slots"] == 0
    assert not any(isinstance(e, Done) for e in events)


def test_too_many_choices_are_refused_before_anything_runs():
    eng = engine("attention")
    with pytest.raises(BadInputError, match="n must be"):
        eng.submit(request(n=SLOTS + 1), lambda e: None)
    with pytest.raises(BadInputError, match="n must be"):
        eng.submit(request(n=0), lambda e: None)
    assert eng.idle and eng.max_choices == SLOTS
