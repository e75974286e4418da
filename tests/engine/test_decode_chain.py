"""Decode bursts chained on the device (``launch_decode``, ``continue_decode``, ``collect``):
a chain gives the bits of bursts read one by one, stops where a stop id or non-finite logits
stop it, refuses what does not continue it, and the generation loop queues each burst
before it reads the one before."""

import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax import CompletionRequest, FinishReason, run_raw_completion
from turbospark_jax.core import sampling
from turbospark_jax.core.state import copy_state, tree_bitwise_equal
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, ContextOverflowError
from turbospark_jax.testing.toy import toy_attention_producer, toy_recurrent_producer

V = 32
PROMPT = [3, 1, 4, 1, 5]
SAMPLED = sampling.SamplingParams.make(temperature=0.9, top_k=12)


def producers():
    return [toy_attention_producer(vocab=V, capacity=96, width=4, steps_per_call=8,
                                   donate=True),
            toy_recurrent_producer(vocab=V, capacity=96, width=4, steps_per_call=8)]


def prefilled(p):
    logits, state = p.prefill_chunk(p.init_state(), PROMPT, 0)
    return int(np.argmax(np.asarray(logits))), state


def one_by_one(p, first, sizes, params, stop_ids=()):
    """Bursts of ``sizes`` read back one at a time (each starting from the last token the one
    before sampled): tokens, logits rows and the final state."""
    _, state = prefilled(p)
    tok, history, key = first, sampling.History.from_prompt(PROMPT, V), sampling.request_key(7)
    tokens, rows = [], []
    for n in sizes:
        burst, state = p.decode(state, tok, n, params=params, history=history, key=key,
                                gen_index=1 + len(tokens), stop_ids=stop_ids)
        tokens += burst.tokens
        rows.append(np.asarray(burst.logits))
        history = burst.history
        if burst.finish or not burst.tokens:
            break
        tok = burst.tokens[-1]
    return tokens, np.concatenate(rows), state


def chained(p, first, sizes, params, stop_ids=()):
    """The same bursts, each chained onto the one before before that one is read."""
    _, state = prefilled(p)
    key = sampling.request_key(7)
    launched, state = p.launch_decode(
        state, first, sizes[0], params=params, history=sampling.History.from_prompt(PROMPT, V),
        key=key, gen_index=1, stop_ids=stop_ids)
    handles = [launched]
    for n in sizes[1:]:
        launched, state = p.continue_decode(state, launched, n)
        handles.append(launched)
    bursts = [p.collect(h) for h in handles]
    return bursts, state


@pytest.mark.parametrize("p", producers(), ids=["attention", "recurrent"])
@pytest.mark.parametrize("params", [sampling.SamplingParams.greedy(), SAMPLED],
                         ids=["greedy", "sampled"])
def test_a_chain_gives_the_bits_of_bursts_read_one_by_one(p, params):
    first, _ = prefilled(p)
    sizes = [8, 3, 8, 5]
    tokens, rows, state = one_by_one(p, first, sizes, params)
    bursts, chained_state = chained(p, first, sizes, params)
    assert [len(b.tokens) for b in bursts] == sizes
    assert [t for b in bursts for t in b.tokens] == tokens
    chain_rows = np.concatenate([np.asarray(b.logits) for b in bursts])
    assert np.array_equal(chain_rows.view(np.uint32), rows.view(np.uint32))
    assert tree_bitwise_equal(chained_state, state)
    assert int(p.fed_record(chained_state).count) == len(PROMPT) + sum(sizes)


def test_a_chain_fed_another_index_differs():
    """Control: the comparison above sees a burst that samples with other token keys."""
    p = producers()[0]
    first, _ = prefilled(p)
    tokens, _, _ = one_by_one(p, first, [8, 8], SAMPLED)
    _, state = prefilled(p)
    burst, _ = p.decode(state, first, 8, params=SAMPLED,
                        history=sampling.History.from_prompt(PROMPT, V),
                        key=sampling.request_key(7), gen_index=2)
    assert burst.tokens != tokens[:8]


@pytest.mark.parametrize("p", producers(), ids=["attention", "recurrent"])
def test_a_burst_chained_after_a_stop_runs_no_step(p):
    first, _ = prefilled(p)
    free, _, _ = one_by_one(p, first, [8, 8], sampling.SamplingParams.greedy())
    stop = free[5]  # ends the first burst at its first occurrence
    at = free.index(stop)
    bursts, state = chained(p, first, [8, 8, 8], sampling.SamplingParams.greedy(),
                            stop_ids=[stop])
    assert bursts[0].tokens == free[: at + 1] and bursts[0].finish == 1  # STOPPED_ON_TOKEN
    assert bursts[1].tokens == [] and bursts[2].tokens == []
    # the stop id is not fed, and nothing after it
    assert int(p.fed_record(state).count) == len(PROMPT) + at + 1


def test_a_burst_chained_after_non_finite_logits_runs_no_step():
    base = producers()[0]
    params = dict(base.params)
    params["head"] = params["head"].at[0, 0].set(jnp.inf)
    p = BlockProducer(base.model, params, capacity=96, width=4, steps_per_call=8)
    _, state = p.prefill_chunk(p.init_state(), PROMPT, 0)
    greedy = sampling.SamplingParams.greedy()
    launched, state = p.launch_decode(state, 2, 8, params=greedy,
                                      history=sampling.History.empty(V),
                                      key=sampling.request_key(0), gen_index=1)
    queued, state = p.continue_decode(state, launched, 8)
    assert p.collect(launched).finish == 2  # NON_FINITE
    after = p.collect(queued)
    assert after.tokens == [] and after.finish == 0
    assert int(p.fed_record(state).count) == len(PROMPT) + 1


def test_continue_decode_refuses_what_does_not_continue_the_burst():
    p, other = producers()
    _, state = prefilled(p)
    greedy = sampling.SamplingParams.greedy()
    args = dict(params=greedy, history=sampling.History.empty(V),
                key=sampling.request_key(0), gen_index=1)
    launched, state = p.launch_decode(state, 2, 8, **args)
    _, other_state = prefilled(other)
    foreign, other_state = other.launch_decode(other_state, 2, 4, **args)
    kept = copy_state(state)
    with pytest.raises(BadInputError, match="this producer launched"):
        p.continue_decode(state, foreign, 4)
    with pytest.raises(BadInputError, match="this producer launched"):
        p.continue_decode(state, "burst", 4)
    with pytest.raises(BadInputError, match="the state its launch returned"):
        p.continue_decode(kept, launched, 4)
    for bad in (0, 9, 2.5, True):
        with pytest.raises(BadInputError, match="steps"):
            p.continue_decode(state, launched, bad)
    with pytest.raises(BadInputError, match="this producer launched"):
        p.collect(foreign)
    # the refusals left the chain intact: it still continues and reads back
    queued, state = p.continue_decode(state, launched, 8)
    assert len(p.collect(launched).tokens) == 8 and len(p.collect(queued).tokens) == 8


def test_continue_decode_refuses_a_burst_past_the_context():
    p = toy_attention_producer(vocab=V, capacity=24, width=4, steps_per_call=8)
    _, state = prefilled(p)
    launched, state = p.launch_decode(state, 2, 8, params=sampling.SamplingParams.greedy(),
                                      history=sampling.History.empty(V),
                                      key=sampling.request_key(0), gen_index=1)
    # reach 13; 8 more would end at 21 + the padding rows of a block: refused before 24
    queued, state = p.continue_decode(state, launched, 8)
    with pytest.raises(ContextOverflowError, match="overflows"):
        p.continue_decode(state, queued, 8)
    assert len(p.collect(queued).tokens) == 8


def test_continue_decode_refuses_consumed_buffers():
    p = producers()[0]  # donating
    _, state = prefilled(p)
    launched, state = p.launch_decode(state, 2, 8, params=sampling.SamplingParams.greedy(),
                                      history=sampling.History.empty(V),
                                      key=sampling.request_key(0), gen_index=1)
    p.collect(launched)
    state_after = p.prefill_chunk(state, [1], len(PROMPT) + 8)[1]  # consumes them
    del state_after
    with pytest.raises(BadInputError, match="consumed"):
        p.continue_decode(state, launched, 4)


def record_calls(monkeypatch, obj, names):
    """The list ``obj``'s methods ``names`` append their names to, in call order."""
    calls = []
    for name in names:
        real = getattr(obj, name)

        def recorded(*args, _name=name, _real=real, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(obj, name, recorded)
    return calls


def test_the_loop_queues_each_burst_before_it_reads_the_one_before(monkeypatch):
    p = toy_attention_producer(vocab=V, capacity=96, width=4, steps_per_call=8)
    calls = record_calls(monkeypatch, p, ("launch_decode", "continue_decode", "collect"))
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=20, burst=8)
    c = run_raw_completion(p, req)
    assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 20
    # token 1 from the prefill; 19 more in bursts of 8, 8 and 3, each queued before the
    # one before is read, none asked for past max_tokens
    assert calls == ["launch_decode", "continue_decode", "collect", "continue_decode",
                     "collect", "collect"]
