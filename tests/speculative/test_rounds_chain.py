"""Speculative rounds chained on the device (``launch_rounds``, ``continue_rounds``,
``collect_rounds``): a chain gives the bits of calls read one by one, runs nothing after a
stop or once the request's tokens are out, refuses what does not continue it, and the
speculative loop queues each call before it reads the one before."""

import numpy as np
import pytest

from tests.engine.test_decode_chain import record_calls
from turbospark_jax import CompletionRequest, run_raw_completion_speculative
from turbospark_jax.core import sampling
from turbospark_jax.core.state import copy_state, tree_bitwise_equal
from turbospark_jax.errors import BadInputError, UnsupportedCapabilityError
from turbospark_jax.speculative.drafters import DraftModelDrafter, NGramDrafter
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_jax.testing.toy import toy_attention_producer

V = 32
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
SAMPLED = sampling.SamplingParams.make(temperature=0.9, top_k=12)
GREEDY = sampling.SamplingParams.greedy()
KEY = sampling.request_key(11)


def target():
    return toy_attention_producer(vocab=V, capacity=160, width=16, steps_per_call=8)


def pairs():
    return {
        "draft model": SpeculativePair(target(), DraftModelDrafter(toy_attention_producer(
            vocab=V, capacity=160, width=16, seed=5))),
        "n-gram": SpeculativePair(target(), NGramDrafter(V, max_n=3)),
    }


def primed(p):
    logits, state = p.prefill_chunk_priming_drafter(p.init_state(), PROMPT, 0, None)
    return int(np.argmax(np.asarray(logits))), state


def one_by_one(p, budgets, params, remaining, stop_ids=()):
    """Calls of ``budgets`` read back one at a time, each from the last token the one before
    emitted: tokens, logits rows, rounds and the final state."""
    first, state = primed(p)
    pending, history = first, sampling.History.from_prompt(PROMPT, V)
    tokens, rows, rounds = [], [], []
    for b in budgets:
        left = remaining - len(tokens)
        if left <= 0:
            break
        burst, state = p.device_rounds(state, pending, draft_len=3, budget=b, params=params,
                                       history=history, key=KEY, gen_index=1 + len(tokens),
                                       remaining=left, stop_ids=stop_ids)
        tokens += burst.tokens
        rows.append(np.asarray(burst.logits))
        rounds += burst.rounds
        history = burst.history
        if burst.finish:
            break
        pending = burst.tokens[-1]
    return tokens, np.concatenate(rows), rounds, state


def chained(p, budgets, params, remaining, stop_ids=()):
    first, state = primed(p)
    launched, state = p.launch_rounds(
        state, first, draft_len=3, budget=budgets[0], params=params,
        history=sampling.History.from_prompt(PROMPT, V), key=KEY, gen_index=1,
        remaining=remaining, stop_ids=stop_ids)
    handles = [launched]
    for b in budgets[1:]:
        launched, state = p.continue_rounds(state, launched, b)
        handles.append(launched)
    return [p.collect_rounds(h) for h in handles], state


@pytest.mark.parametrize("name", ["draft model", "n-gram"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_chained_rounds_give_the_bits_of_calls_read_one_by_one(name, params):
    p = pairs()[name]
    budgets = [8, 5, 8, 8]
    tokens, rows, rounds, state = one_by_one(p, budgets, params, remaining=60)
    bursts, chained_state = chained(p, budgets, params, remaining=60)
    assert [t for b in bursts for t in b.tokens] == tokens and len(tokens) >= sum(budgets)
    got_rows = np.concatenate([np.asarray(b.logits) for b in bursts])
    assert np.array_equal(got_rows.view(np.uint32), rows.view(np.uint32))
    assert [r for b in bursts for r in b.rounds] == rounds
    assert tree_bitwise_equal(chained_state, state)


def test_chained_rounds_with_another_key_differ():
    """Control: the comparison above sees rounds judged with other keys."""
    p = pairs()["draft model"]
    tokens, _, _, _ = one_by_one(p, [8, 8], SAMPLED, remaining=60)
    first, state = primed(p)
    burst, _ = p.device_rounds(state, first, draft_len=3, budget=16, params=SAMPLED,
                               history=sampling.History.from_prompt(PROMPT, V),
                               key=sampling.request_key(12), gen_index=1, remaining=60)
    assert burst.tokens != tokens[: len(burst.tokens)]


def test_rounds_chained_after_a_stop_or_the_last_token_run_none():
    p = pairs()["draft model"]
    free, _, _, _ = one_by_one(p, [8, 8], GREEDY, remaining=60)
    stop = free[4]
    at = free.index(stop)
    bursts, state = chained(p, [8, 8, 8], GREEDY, remaining=60, stop_ids=[stop])
    assert bursts[0].tokens == free[: at + 1] and bursts[0].finish == 1  # STOPPED_ON_TOKEN
    assert bursts[1].tokens == [] and bursts[2].tokens == [] and bursts[1].rounds == ()
    assert int(p.fed_record(state).count) == len(PROMPT) + at + 1
    # a request with 6 tokens left: the first call emits them all, the chained one none
    bursts, state = chained(p, [16, 8], GREEDY, remaining=6)
    assert len(bursts[0].tokens) == 6 and bursts[1].tokens == []
    # fed: the prefill's token and the first five of the six (the last is never fed)
    assert int(p.fed_record(state).count) == len(PROMPT) + 6


def test_continue_rounds_refuses_what_does_not_continue_the_rounds():
    p, other = pairs().values()
    first, state = primed(p)
    args = dict(draft_len=3, params=GREEDY, history=sampling.History.empty(V), key=KEY,
                gen_index=1)
    launched, state = p.launch_rounds(state, first, budget=8, remaining=40, **args)
    o_first, o_state = primed(other)
    foreign, o_state = other.launch_rounds(o_state, o_first, budget=8, remaining=40, **args)
    with pytest.raises(BadInputError, match="this pair launched"):
        p.continue_rounds(state, foreign, 8)
    with pytest.raises(BadInputError, match="this pair launched"):
        p.collect_rounds(foreign)
    with pytest.raises(BadInputError, match="the state its launch returned"):
        p.continue_rounds(copy_state(state), launched, 8)
    for bad in (0, 2.5, "8"):
        with pytest.raises(BadInputError, match="budget"):
            p.continue_rounds(state, launched, bad)
    queued, state = p.continue_rounds(state, launched, 8)  # the chain is intact
    assert p.collect_rounds(launched).tokens and p.collect_rounds(queued).tokens
    # one token left: the rounds on their way may emit it; collect them first
    first, fresh = primed(p)
    last, fresh = p.launch_rounds(fresh, first, budget=8, remaining=1, **args)
    with pytest.raises(BadInputError, match="collect them first"):
        p.continue_rounds(fresh, last, 8)
    assert len(p.collect_rounds(last).tokens) == 1


def test_a_pair_without_device_rounds_refuses_to_launch_them():
    p = SpeculativePair(target(), NGramDrafter(V), device_rounds=False)
    first, state = primed(p)
    with pytest.raises(UnsupportedCapabilityError, match="device"):
        p.launch_rounds(state, first, draft_len=3, budget=8, params=GREEDY,
                        history=sampling.History.empty(V), key=KEY, gen_index=1, remaining=9)
    assert p.device_draft_limit() == 0
    with pytest.raises(BadInputError, match="this pair launched"):
        p.collect_rounds(None)


def test_the_loop_queues_each_call_before_it_reads_the_one_before(monkeypatch):
    p = pairs()["draft model"]
    calls = record_calls(monkeypatch, p, ("launch_rounds", "continue_rounds", "collect_rounds"))
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=40, burst=8, draft_len=3)
    c = run_raw_completion_speculative(p, req)
    assert len(c.token_ids) == 40 and c.speculative.on_device
    assert calls.count("launch_rounds") == 1 and calls[:3] == [
        "launch_rounds", "continue_rounds", "collect_rounds"]
    # every read but the last had the next call queued before it
    reads = [i for i, c in enumerate(calls) if c == "collect_rounds"]
    assert all(calls[i - 1] == "continue_rounds" for i in reads[:-1])
