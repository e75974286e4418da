"""A constrained token's draw as one device call (``driver.draw_step``): the mask goes up
packed in bits (``Constraint.allowed_words``) and is unpacked on the device; the token, the
recorded row and the history are bitwise what masking on the host and ``sampling.sample``
give, greedy and sampled, across random masks (with controls: a mask off by one bit or one
place draws other tokens); a constrained token costs one ``produce`` and one draw, and
nothing else of the old per-token calls."""

import jax
import numpy as np
import pytest

import turbospark_jax as tsj
from turbospark_jax.core import sampling
from turbospark_jax.core.constraints import ConstraintSpec
from turbospark_jax.generation import driver
from turbospark_jax.generation.completion import CompletionRequest, add_to_history
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.testing.tokenizers import byte_level_bpe
from turbospark_jax.testing.toy import toy_attention_producer

VOCAB = 1000  # more ids than the candidate search ranks, so its branch runs
SETTINGS = {
    "greedy": {},
    "greedy_penalized": {"repetition_penalty": 1.3, "presence_penalty": 0.5},
    "sampled": {"temperature": 1.0},
    "top_k": {"temperature": 0.7, "top_k": 20},
    "top_p": {"temperature": 1.2, "top_p": 0.9},
    "wide_top_k_min_p": {"temperature": 0.9, "top_k": 500, "min_p": 0.05,
                         "frequency_penalty": 0.3},
}


def packed(allowed: np.ndarray) -> np.ndarray:
    """``allowed`` packed as ``Constraint.allowed_words`` packs a mask."""
    return np.packbits(np.pad(allowed, (0, -allowed.size % 32)), bitorder="little").view("<u4")


def old_draw(logits, allowed, params, history, key, index):
    """The host draw before ``draw_step``: mask, sample, read the token, add it."""
    row = driver.masked_logits(logits, allowed)
    token = int(sampling.sample(row, params, history, sampling.token_key(key, index)))
    return token, np.asarray(row), add_to_history(history, token)


def new_draw(logits, words, params, history, key, index):
    plan = sampling.draw_plan(params, logits.shape[0])
    token, finite, free, after, row = driver.draw_step(logits, words, params, history, key,
                                                       index, plan=plan, recorded=True)
    assert bool(finite)
    if plan == "greedy":  # free: the mask allows the unmasked greedy token
        plain = sampling.sample(logits, params, history, key)
        assert bool(free) == bool(np.unpackbits(words.view(np.uint8),
                                                bitorder="little")[int(plain)])
    return int(token), np.asarray(row), after


def cases(seed: int, count: int):
    """Random logits (ties included), masks of every density, histories and indices."""
    rng = np.random.default_rng(seed)
    for n in range(count):
        logits = rng.normal(0, 3, VOCAB).astype(np.float32)
        logits[rng.integers(0, VOCAB, 8)] = logits.max()  # ties at the top
        allowed = rng.random(VOCAB) < [0.002, 0.05, 0.5, 0.97][n % 4]
        allowed[rng.integers(0, VOCAB)] = True
        seen = rng.integers(0, VOCAB, 30)
        history = sampling.History.from_prompt(seen[:10], VOCAB)
        for t in seen[10:]:
            history = add_to_history(history, int(t))
        yield jax.numpy.asarray(logits), allowed, history, int(rng.integers(0, 500))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_packed_draw_equals_the_host_draw_bitwise(name):
    params = sampling.SamplingConfig(**SETTINGS[name]).to_params()
    key = sampling.request_key(11)
    off_by_one_bit = shifted = 0
    for logits, allowed, history, index in cases(len(name), 24):
        token, row, after = old_draw(logits, allowed, params, history, key, index)
        got, got_row, got_after = new_draw(logits, packed(allowed), params, history, key, index)
        assert got == token
        assert np.array_equal(got_row, row)
        assert np.array_equal(got_after.counts, after.counts)
        assert np.array_equal(got_after.seen, after.seen)
        # controls: the drawn id's bit cleared, and the mask moved one id along
        wrong = allowed.copy()
        wrong[token] = False
        if wrong.any():
            off_by_one_bit += new_draw(logits, packed(wrong), params, history, key,
                                       index)[0] != token
        shifted += new_draw(logits, packed(np.roll(allowed, 1)), params, history, key,
                            index)[0] != token
    assert off_by_one_bit > 0 and shifted > 0


def test_unmasked_and_non_finite_draws():
    params = sampling.SamplingConfig(temperature=1.0).to_params()
    key = sampling.request_key(3)
    logits, _, history, index = next(cases(5, 1))
    token = int(sampling.sample(logits, params, history, sampling.token_key(key, index)))
    got, finite, free, _, row = driver.draw_step(logits, None, params, history, key, index,
                                           plan="sampled", recorded=False)
    assert int(got) == token and bool(finite) and bool(free) and row is None
    bad = logits.at[7].set(np.nan)
    assert not bool(driver.draw_step(bad, None, params, history, key, index, plan="sampled",
                                     recorded=False)[1])


@pytest.fixture(scope="module")
def toy_tokenizer():
    return Tokenizer.from_tokenizers(byte_level_bpe(300), bos="<|bos|>", eos="<|eos|>",
                                     pad="<|pad|>")


@pytest.mark.parametrize("vocab", [296, 300, 333])
def test_packed_words_are_the_mask(toy_tokenizer, vocab):
    """The words hold exactly the mask's ids, for a model vocabulary below, at and past the
    tokenizer's (bits past it clear), the end spelled by the stop ids once complete."""
    stop = toy_tokenizer.eos_token_id
    c = ConstraintSpec.regex("[a-c]+").bind(toy_tokenizer, vocab, [stop])
    for text in ("", "ab"):
        for t in toy_tokenizer.encode(text, add_special_tokens=False):
            c.advance(t)
        words = c.allowed_words()
        assert words.dtype == np.dtype("<u4") and words.shape == (-(-vocab // 32),)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        assert not bits[vocab:].any()
        assert bits[:vocab].astype(bool).tolist() == [c.allows(t) for t in range(vocab)]
        assert bits[stop] == (text != "")
        unpacked = jax.jit(sampling.unpack_mask, static_argnums=1)(words, vocab)
        assert np.array_equal(np.asarray(unpacked), c.allowed_mask())


class _CountingJax:
    """``jax`` as the driver sees it, counting its reads back (``device_get``)."""

    def __init__(self, reads: list[int]) -> None:
        self._reads = reads

    def __getattr__(self, name):
        if name == "device_get":
            def counted(x):
                self._reads.append(1)
                return jax.device_get(x)
            return counted
        return getattr(jax, name)


@pytest.mark.parametrize("settings", [{}, {"sampling": tsj.SamplingConfig(temperature=0.9),
                                           "seed": 4}])
def test_a_constrained_token_is_one_produce_and_one_draw(toy_tokenizer, monkeypatch,
                                                         settings):
    """Token by token (optimistic bursts off): each token after the first costs one
    ``produce`` and one ``draw_step``, read back once; the old per-token calls (a host
    mask, ``masked_logits``, ``sampling.sample``, ``add_to_history``) are never made."""
    producer = toy_attention_producer(vocab=300, capacity=128, steps_per_call=8, seed=2)
    counts = {"produce": 0, "draw": 0, "other": 0}
    reads: list[int] = []

    def counting(name, real):
        def call(*args, **kwargs):
            if not (args and isinstance(args[0], jax.core.Tracer)):  # not a compiled loop's
                counts[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(driver, "optimistic", lambda *a: False)
    monkeypatch.setattr(type(producer), "produce", counting("produce", type(producer).produce))
    monkeypatch.setattr(driver, "draw_step", counting("draw", driver.draw_step))
    for name in ("masked_logits", "add_to_history"):
        monkeypatch.setattr(driver, name, counting("other", getattr(driver, name)))
    monkeypatch.setattr(sampling, "sample", counting("other", sampling.sample))
    monkeypatch.setattr(driver.Constraint, "allowed_mask",
                        counting("other", driver.Constraint.allowed_mask))
    monkeypatch.setattr(driver, "jax", _CountingJax(reads))
    req = CompletionRequest(prompt_ids=[40, 41, 42, 43], max_tokens=20, stop_token_ids=(),
                            constraint=ConstraintSpec.regex("[a-z_ ]+"), **settings)
    c = tsj.run_raw_completion(producer, req, tokenizer=toy_tokenizer)
    n = len(c.token_ids)
    assert n == 20
    # the first token is drawn from the prefill's logits; each later one after a produce
    assert counts == {"produce": n - 1, "draw": n, "other": 0}
    assert len(reads) == n


def _complete(producer, tokenizer, spec, optimistic, monkeypatch, **extra):
    with monkeypatch.context() as m:
        if not optimistic:
            m.setattr(driver, "optimistic", lambda *a: False)
        req = CompletionRequest(prompt_ids=[40, 41, 42], max_tokens=48, stop_token_ids=(),
                                constraint=spec, **extra)
        return tsj.run_raw_completion(producer, req, tokenizer=tokenizer)


@pytest.mark.parametrize("pattern", ["[^q]+", "[a-z_ ]+"])
def test_penalized_greedy_bursts_equal_token_by_token(toy_tokenizer, monkeypatch, pattern):
    """Greedy with penalties: bursts kept whole hand on the burst's own history, refused ones
    one update of the kept tokens; the tokens equal the token-by-token path's (a control
    without the penalties draws others)."""
    producer = toy_attention_producer(vocab=300, capacity=128, steps_per_call=16, seed=3)
    spec = ConstraintSpec.regex(pattern)
    penalized = {"sampling": tsj.SamplingConfig(repetition_penalty=1.5, presence_penalty=0.7,
                                                frequency_penalty=0.4)}
    want = _complete(producer, toy_tokenizer, spec, False, monkeypatch, **penalized)
    got = _complete(producer, toy_tokenizer, spec, True, monkeypatch, **penalized)
    assert np.array_equal(np.asarray(got.token_ids), np.asarray(want.token_ids))
    plain = _complete(producer, toy_tokenizer, spec, True, monkeypatch)
    assert not np.array_equal(np.asarray(plain.token_ids), np.asarray(want.token_ids))


def test_a_model_that_breaks_every_token_takes_masked_steps(toy_tokenizer, monkeypatch):
    """Where the model broke the constraint at a burst's first token, the next burst would
    be one step: a masked step (produce and one draw) is taken instead, and its draw says
    whether the model kept the constraint, so bursts come back once it does."""
    producer = toy_attention_producer(vocab=300, capacity=128, steps_per_call=16, seed=3)
    calls = {"decode": 0, "produce": 0}
    for name in calls:
        real = getattr(type(producer), name)

        def counted(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(type(producer), name, counted)
    spec = ConstraintSpec.regex("[a-z_ ]+")
    got = _complete(producer, toy_tokenizer, spec, True, monkeypatch)
    # one device step a token at most (the first comes from the prefill), mostly produce
    assert calls["decode"] + calls["produce"] <= len(got.token_ids)
    assert calls["produce"] > 4 * calls["decode"] > 0
    want = _complete(producer, toy_tokenizer, spec, False, monkeypatch)
    assert np.array_equal(np.asarray(got.token_ids), np.asarray(want.token_ids))
