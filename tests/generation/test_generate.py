"""The generation loop on the scripted and toy producers: sampling, bursts, bookkeeping,
finish reasons and bad input."""

import subprocess
import sys

import numpy as np
import pytest

from turbospark_jax import (
    CompletionRequest,
    FinishReason,
    SamplingConfig,
    run_raw_completion,
    stream_completion,
)
from turbospark_jax.core.protocols import ChunkedPrefillRunner
from turbospark_jax.core.state import copy_state, tree_bitwise_equal
from turbospark_jax.errors import BadInputError, ContextOverflowError
from turbospark_jax.generation.completion import BurstSizer
from turbospark_jax.testing.scripted import ScriptedLogitProducer
from turbospark_jax.testing.toy import toy_attention_producer, toy_recurrent_producer

V = 32
TOY = toy_attention_producer(vocab=V, capacity=96, width=4, steps_per_call=8)
TOY_DONATING = toy_attention_producer(vocab=V, capacity=96, width=4, steps_per_call=8,
                                      donate=True)
RNN = toy_recurrent_producer(vocab=V, capacity=96, width=4, steps_per_call=8)


def forcing(tokens, vocab=V):
    """Scripted logits whose argmax is each of ``tokens`` in turn (one step for the prompt
    chunk, then one per decode step)."""
    steps = []
    for t in tokens:
        row = np.linspace(0.0, 1.0, vocab).astype(np.float32)
        row[t] = 10.0
        steps.append(row)
    return ScriptedLogitProducer(steps)


def test_greedy_follows_the_script_and_records_fed_ids():
    p = forcing([5, 6, 7, 8])
    c = run_raw_completion(p, CompletionRequest(prompt_ids=[1, 2, 3], max_tokens=4))
    assert c.token_ids == [5, 6, 7, 8]
    assert c.finish_reason is FinishReason.LENGTH
    # the last sampled token is not fed
    assert c.fed_ids == (1, 2, 3, 5, 6, 7)
    assert c.usage.prompt_tokens == 3 and c.usage.generated_tokens == 4


def test_stop_token_is_generated_not_fed():
    p = forcing([5, 9, 7])
    c = run_raw_completion(p, CompletionRequest(prompt_ids=[1], max_tokens=8, stop_token_ids=[9]))
    assert c.token_ids == [5, 9] and c.finish_reason is FinishReason.STOP_TOKEN
    assert c.fed_ids == (1, 5)


def test_top1_equals_greedy_and_filters_pick_only_allowed_ids():
    logits = np.array([0.0, 3.0, 2.9, 2.8, -1.0, 1.0], np.float32)
    prompt = [0]
    greedy = run_raw_completion(
        ScriptedLogitProducer([logits] * 3), CompletionRequest(prompt_ids=prompt, max_tokens=3)
    ).token_ids
    assert greedy == [1, 1, 1]
    for seed in range(12):
        top1 = run_raw_completion(
            ScriptedLogitProducer([logits] * 3),
            CompletionRequest(prompt_ids=prompt, max_tokens=3, seed=seed,
                              sampling=SamplingConfig(temperature=2.0, top_k=1)),
        ).token_ids
        assert top1 == greedy
        top3 = run_raw_completion(
            ScriptedLogitProducer([logits] * 3),
            CompletionRequest(prompt_ids=prompt, max_tokens=3, seed=seed,
                              sampling=SamplingConfig(temperature=5.0, top_k=3)),
        ).token_ids
        assert set(top3) <= {1, 2, 3}
        nucleus = run_raw_completion(
            ScriptedLogitProducer([logits] * 3),
            CompletionRequest(prompt_ids=prompt, max_tokens=3, seed=seed,
                              sampling=SamplingConfig(temperature=1.0, top_p=0.5)),
        ).token_ids
        assert set(nucleus) <= {1, 2}


SAMPLED = SamplingConfig(temperature=0.9, top_k=20, top_p=0.95, min_p=0.01,
                         repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.05)


@pytest.mark.parametrize("producer", [TOY, RNN], ids=["attention", "recurrent"])
def test_output_is_bitwise_independent_of_burst_length(producer):
    base = CompletionRequest(prompt_ids=[3, 1, 4, 1, 5], max_tokens=21, sampling=SAMPLED,
                             seed=7, record_logits=True)
    runs = [run_raw_completion(producer, CompletionRequest(**{**base.__dict__, "burst": k}))
            for k in (1, 3, 8, None)]
    for other in runs[1:]:
        assert other.token_ids == runs[0].token_ids
        assert np.array_equal(other.logits.view(np.uint32), runs[0].logits.view(np.uint32))
        assert other.fed_ids == runs[0].fed_ids


def test_adaptive_burst_sizes_from_the_measured_rate():
    fixed = BurstSizer(5)
    fixed.observed(100, 0.001)
    assert fixed.next() == 5
    sizer = BurstSizer(None)
    assert sizer.next() == BurstSizer.FIRST
    sizer.observed(40, 0.05)  # 800 tokens/s: 200 tokens in a quarter second
    assert sizer.next() == 200
    sizer.observed(1000, 0.01)  # far faster: capped
    assert sizer.next() == BurstSizer.MOST
    slow = BurstSizer(None)
    slow.observed(3, 1.0)  # 3 tokens/s: never below the first size
    assert slow.next() == BurstSizer.FIRST
    odd = BurstSizer(None)
    odd.observed(61, 0.25)  # 61 tokens in 0.25 s: rounded down to the decode programs' chunk
    assert odd.next() == 56 and odd.next() % BurstSizer.GRAIN == 0


def test_device_bursts_equal_host_token_by_token_decoding():
    """The device burst and produce() per token run the same program: same tokens, same
    logits bits."""

    class HostOnly(ChunkedPrefillRunner):
        """The toy without its device decoder: the loop decodes token by token."""

        def __init__(self, inner):
            self._inner = inner
            for name in ("init_state", "fed_record", "check_state", "try_reuse_prefix",
                         "rewind_floor", "rewind", "produce", "produce_prefill",
                         "prefill_chunk"):
                setattr(self, name, getattr(inner, name))

        vocab_size = property(lambda self: self._inner.vocab_size)
        max_positions = property(lambda self: self._inner.max_positions)
        can_rewind = property(lambda self: self._inner.can_rewind)
        init_state = fed_record = produce = prefill_chunk = None  # set per instance

    req = CompletionRequest(prompt_ids=[2, 7, 1, 8], max_tokens=12, sampling=SAMPLED, seed=3,
                            record_logits=True)
    device = run_raw_completion(TOY, req)
    host = run_raw_completion(HostOnly(TOY), req)
    assert host.token_ids == device.token_ids
    assert np.array_equal(host.logits.view(np.uint32), device.logits.view(np.uint32))
    assert host.fed_ids == device.fed_ids


def test_seeded_determinism_and_seed_sensitivity():
    req = CompletionRequest(prompt_ids=[1, 2, 3], max_tokens=16,
                            sampling=SamplingConfig(temperature=1.5), seed=11)
    a = run_raw_completion(TOY, req).token_ids
    b = run_raw_completion(TOY, req).token_ids
    c = run_raw_completion(TOY, CompletionRequest(**{**req.__dict__, "seed": 12})).token_ids
    assert a == b
    assert a != c


def test_fed_record_is_exact_on_the_toy_for_length_and_stop_token():
    req = CompletionRequest(prompt_ids=[1, 2, 3], max_tokens=10)
    c = run_raw_completion(TOY, req)
    assert c.fed_ids == (1, 2, 3, *c.token_ids[:-1])
    stop = c.token_ids[4]
    s = run_raw_completion(TOY, CompletionRequest(prompt_ids=[1, 2, 3], max_tokens=10,
                                                  stop_token_ids=[stop]))
    k = c.token_ids.index(stop)
    assert s.token_ids == c.token_ids[: k + 1]
    assert s.finish_reason is FinishReason.STOP_TOKEN
    assert s.fed_ids == (1, 2, 3, *s.token_ids[:-1])


def test_chunk_size_never_changes_the_output():
    prompt = list(np.random.RandomState(1).randint(0, V, 29))
    outs = [
        run_raw_completion(TOY, CompletionRequest(prompt_ids=prompt, max_tokens=6,
                                                  prefill_chunk_size=k, record_logits=True))
        for k in (1, 5, 64)
    ]
    for o in outs[1:]:
        assert o.token_ids == outs[0].token_ids
        assert np.array_equal(o.logits, outs[0].logits)


def test_reuse_continues_a_previous_state():
    first = run_raw_completion(TOY_DONATING, CompletionRequest(prompt_ids=[4, 5, 6], max_tokens=5))
    prompt2 = [4, 5, 6, *first.token_ids[:3], 9]
    again = run_raw_completion(TOY_DONATING, CompletionRequest(prompt_ids=prompt2, max_tokens=5,
                                                               record_logits=True),
                               state=first.state)
    fresh = run_raw_completion(TOY_DONATING, CompletionRequest(prompt_ids=prompt2, max_tokens=5,
                                                               record_logits=True))
    assert again.usage.reused_tokens == 6 and again.usage.prefilled_tokens == 1
    assert fresh.usage.reused_tokens == 0
    assert again.token_ids == fresh.token_ids
    assert np.array_equal(again.logits, fresh.logits)


def test_non_finite_logits_end_with_error_and_no_state():
    bad = np.zeros(V, np.float32)
    bad[3] = np.nan
    p = ScriptedLogitProducer([forcing([5]).__dict__["_steps"][0], bad])
    c = run_raw_completion(p, CompletionRequest(prompt_ids=[1], max_tokens=5))
    assert c.finish_reason is FinishReason.ERROR and "non-finite" in c.error
    assert c.token_ids == [5] and c.state is None


def test_non_finite_logits_inside_a_device_burst():
    import jax.numpy as jnp

    params = dict(TOY.params)
    params["head"] = params["head"].at[0, 0].set(jnp.inf)
    from turbospark_jax.engine.producer import BlockProducer

    poisoned = BlockProducer(TOY.model, params, capacity=96, width=4, steps_per_call=8)
    c = run_raw_completion(poisoned, CompletionRequest(prompt_ids=[1, 2], max_tokens=5))
    assert c.finish_reason is FinishReason.ERROR and c.state is None


def test_exhausted_script_is_an_error_finish():
    c = run_raw_completion(forcing([5, 6]), CompletionRequest(prompt_ids=[1], max_tokens=5))
    assert c.finish_reason is FinishReason.ERROR and "scripted steps" in c.error
    assert c.token_ids == [5, 6]


BAD_REQUESTS = {
    "empty prompt": dict(prompt_ids=[]),
    "id outside vocab": dict(prompt_ids=[1, V]),
    "negative id": dict(prompt_ids=[-1]),
    "context overflow": dict(prompt_ids=[1] * 90, max_tokens=10),
    "negative temperature": dict(sampling=SamplingConfig(temperature=-1.0)),
    "nan temperature": dict(sampling=SamplingConfig(temperature=float("nan"))),
    "top_p zero": dict(sampling=SamplingConfig(temperature=1.0, top_p=0.0)),
    "top_p above one": dict(sampling=SamplingConfig(top_p=1.5)),
    "negative top_k": dict(sampling=SamplingConfig(top_k=-1)),
    "min_p above one": dict(sampling=SamplingConfig(min_p=1.5)),
    "max_tokens zero": dict(max_tokens=0),
    "infinite penalty": dict(sampling=SamplingConfig(frequency_penalty=float("inf"))),
    "nan penalty": dict(sampling=SamplingConfig(presence_penalty=float("nan"))),
    "stop id outside vocab": dict(stop_token_ids=[V + 3]),
    "stop strings without tokenizer": dict(stop_strings=["x"]),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_input_raises_and_leaves_state_untouched(name):
    p = toy_attention_producer(vocab=V, capacity=96, width=4, steps_per_call=8, donate=True)
    first = run_raw_completion(p, CompletionRequest(prompt_ids=[1, 2, 3], max_tokens=4))
    kept = copy_state(first.state)
    fields = {"prompt_ids": [1, 2, 3, 4], "max_tokens": 4, **BAD_REQUESTS[name]}
    with pytest.raises(BadInputError):
        run_raw_completion(p, CompletionRequest(**fields), state=first.state)
    assert tree_bitwise_equal(first.state, kept)  # still valid and unchanged
    if name == "context overflow":
        with pytest.raises(ContextOverflowError):
            stream_completion(p, CompletionRequest(**fields), state=first.state)


def test_stream_without_tokenizer_yields_every_token():
    stream = stream_completion(TOY, CompletionRequest(prompt_ids=[1, 2], max_tokens=7))
    events = list(stream)
    assert [t for e in events for t in e.token_ids] == stream.result.token_ids


@pytest.mark.parametrize("bad", [dict(prompt_ids=[]), dict(prompt_ids=[1, -2]),
                                 dict(prompt_ids=[1.0]), dict(max_tokens=0),
                                 dict(stop_token_ids=["a"]), dict(stop_strings="x"),
                                 dict(record_logits=1), dict(burst=0), dict(draft_len=9),
                                 dict(draft_len=-1), dict(seed=-1), dict(sampling={}),
                                 dict(sampling=SamplingConfig(top_p=0.0)), dict(injection=3)])
def test_a_request_checks_its_own_fields_when_it_is_made(bad):
    """No producer is needed to refuse a malformed request: it never exists, so nothing below
    the entry has to check it again. The control: the same fields well formed make one."""
    fields = {"prompt_ids": [1, 2], **bad}
    with pytest.raises(BadInputError):
        CompletionRequest(**fields)
    good = CompletionRequest(prompt_ids=np.array([1, 2]), stop_token_ids=[3], stop_strings=["x"])
    assert good.prompt_ids == (1, 2) and good.stop_token_ids == (3,)
    assert good.stop_strings == ("x",) and all(type(t) is int for t in good.prompt_ids)


def test_what_only_the_producer_can_say_is_checked_where_the_request_meets_it():
    """A well-formed request whose ids leave the producer's vocabulary is refused at the
    entry, before any state is touched; the control: the same request inside it runs."""
    state = TOY.init_state()
    for bad in (dict(prompt_ids=[1, TOY.vocab_size]), dict(stop_token_ids=[TOY.vocab_size])):
        request = CompletionRequest(**{"prompt_ids": [1, 2], "max_tokens": 2, **bad})
        with pytest.raises(BadInputError, match="vocabulary"):
            stream_completion(TOY, request, state=state)
    assert run_raw_completion(TOY, CompletionRequest(prompt_ids=[1, 2], max_tokens=2),
                              state=state).token_ids


def test_making_a_request_starts_no_jax_backend():
    """A request is checked when it is made, and that may happen before a program has set up
    its devices (a multi-host process builds its request at import, before it joins the run):
    the checks touch no JAX backend. The control: building device sampling params does."""
    probe = ("from jax._src import xla_bridge as xb\n"
             "from turbospark_jax.generation.completion import CompletionRequest\n"
             "from turbospark_jax.core.sampling import SamplingConfig\n"
             "CompletionRequest(prompt_ids=[3, 5], max_tokens=4,\n"
             "                  sampling=SamplingConfig(temperature=0.7, top_k=5))\n"
             "print(xb.backends_are_initialized())\n"
             "SamplingConfig(temperature=0.7).to_params()\n"
             "print(xb.backends_are_initialized())\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False", "True"]
