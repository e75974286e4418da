"""A greedy burst of rounds with a loop-free drafter (n-gram lookup, the oracle) runs as a
loop of known trip count (``rounds.FIXED_ROUNDS`` iterations, a round each while the burst's
condition holds), which a GPU runs without reading a predicate back: the rounds, tokens, rows
and states are those of the ``while_loop`` form, a call ends after at most FIXED_ROUNDS
rounds, and only greedy bursts of loop-free drafters take the form."""

import functools

import numpy as np
import pytest

from turbospark_jax import rounds, sampling
from turbospark_jax.drafters import DraftModelDrafter, NGramDrafter, OracleDrafter, SpeculativePair
from turbospark_jax.drafters import pair as pair_module
from turbospark_jax.state import tree_bitwise_equal
from turbospark_jax.testing.toy import toy_attention_producer, toy_recurrent_producer

V = 32
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = sampling.SamplingParams.greedy()
KEY = sampling.request_key(5)


def make_pair(target_kind, drafter_kind):
    make = toy_attention_producer if target_kind == "attention" else toy_recurrent_producer
    target = make(vocab=V, capacity=200, width=16, steps_per_call=8)
    if drafter_kind == "n-gram":
        drafter = NGramDrafter(V, max_n=3)
    else:  # a reference that repeats the prompt: most proposals are wrong after a while
        drafter = OracleDrafter(V, PROMPT * 8, 0.8, seed=3)
    return SpeculativePair(target, drafter)


def run_all(p, budgets, remaining, stop_ids=()):
    """Calls of ``budgets`` (the last repeated) until the request's tokens are out, each
    from the last token the one before emitted."""
    logits, state = p.prefill_chunk_priming_drafter(p.init_state(), PROMPT, 0, None)
    pending, history = int(np.argmax(np.asarray(logits))), sampling.History.from_prompt(PROMPT, V)
    tokens, rows, per_call = [], [], []
    while len(tokens) < remaining:
        b = budgets[min(len(per_call), len(budgets) - 1)]
        burst, state = p.device_rounds(
            state, pending, draft_len=2, budget=b, params=GREEDY, history=history, key=KEY,
            gen_index=1 + len(tokens), remaining=remaining - len(tokens), stop_ids=stop_ids)
        tokens += burst.tokens
        rows.append(np.asarray(burst.logits))
        per_call.append(burst.rounds)
        history = burst.history
        if burst.finish:
            break
        pending = burst.tokens[-1]
    return tokens, np.concatenate(rows), per_call, state


def as_while_loop(monkeypatch):
    monkeypatch.setattr(pair_module, "compiled_rounds",
                        functools.partial(rounds.compiled_rounds, fixed=False))


@pytest.mark.parametrize("target_kind", ["attention", "recurrent"])
@pytest.mark.parametrize("drafter_kind", ["n-gram", "oracle"])
def test_fixed_rounds_emit_the_while_loops_rounds(target_kind, drafter_kind, monkeypatch):
    budgets, remaining = [8, 5, 256], 150
    p = make_pair(target_kind, drafter_kind)  # one pair: its states carry its identity
    fixed = run_all(p, budgets, remaining)
    as_while_loop(monkeypatch)
    loop = run_all(p, budgets, remaining)
    assert fixed[0] == loop[0] and len(fixed[0]) == remaining
    assert np.array_equal(fixed[1].view(np.uint32), loop[1].view(np.uint32))
    assert [r for c in fixed[2] for r in c] == [r for c in loop[2] for r in c]
    assert tree_bitwise_equal(fixed[3], loop[3])
    # a fixed call runs at most FIXED_ROUNDS rounds; the loop's 256-token calls ran more
    assert max(len(c) for c in fixed[2]) == rounds.FIXED_ROUNDS
    assert max(len(c) for c in loop[2]) > rounds.FIXED_ROUNDS  # control


def test_fixed_rounds_after_a_stop_id_run_nothing(monkeypatch):
    p = make_pair("attention", "n-gram")
    free, _, _, _ = run_all(p, [256], 60)
    stop = free[20]
    at = free.index(stop)
    tokens, rows, per_call, state = run_all(p, [256], 60, stop_ids=[stop])
    assert tokens == free[: at + 1] and len(rows) == at + 1
    assert sum(len(c) for c in per_call) < rounds.FIXED_ROUNDS  # the rest ran nothing
    as_while_loop(monkeypatch)
    loop = run_all(p, [256], 60, stop_ids=[stop])
    assert loop[0] == tokens and loop[2] == per_call and tree_bitwise_equal(loop[3], state)


def test_only_greedy_bursts_of_loop_free_drafters_are_fixed():
    ngram = NGramDrafter(V, max_n=3).on_device()
    oracle = OracleDrafter(V, PROMPT, 0.5).on_device()
    draft = DraftModelDrafter(toy_attention_producer(vocab=V, capacity=64, width=4)).on_device()
    assert rounds.runs_fixed_rounds(ngram[0], True) and rounds.runs_fixed_rounds(oracle[0], True)
    assert not rounds.runs_fixed_rounds(ngram[0], False)  # the sampled judge stops on data
    assert not rounds.runs_fixed_rounds(draft[0], True)  # its draft loop stops on data
