"""A greedy burst of rounds with a loop-free drafter (n-gram lookup, the oracle, a draft model,
the Gemma 4 assistant) that does not record the target rows runs as a loop of known trip count
(``rounds.FIXED_ROUNDS`` iterations, a round each while the burst's condition holds), which a
GPU runs without reading a predicate back: its rounds, tokens, rows and states are those of
the ``while_loop`` form (sampled too, when asked for), a call ends after at most FIXED_ROUNDS
rounds, and only those bursts take the form by default."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.core import sampling
from turbospark_jax.core.state import tree_bitwise_equal
from turbospark_jax.speculative import pair as pair_module
from turbospark_jax.speculative import rounds
from turbospark_jax.speculative.drafters import DraftModelDrafter, NGramDrafter, OracleDrafter
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_jax.testing.cuda_export import cuda_text
from turbospark_jax.testing.toy import toy_attention_producer, toy_recurrent_producer

V = 32
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = sampling.SamplingParams.greedy()
SAMPLED = sampling.SamplingParams.make(temperature=0.9, top_k=12)
KEY = sampling.request_key(5)


def make_pair(target_kind, drafter_kind):
    make = toy_attention_producer if target_kind == "attention" else toy_recurrent_producer
    target = make(vocab=V, capacity=200, width=16, steps_per_call=8)
    if drafter_kind == "n-gram":
        drafter = NGramDrafter(V, max_n=3)
    elif drafter_kind == "draft model":
        drafter = DraftModelDrafter(toy_attention_producer(vocab=V, capacity=200, width=16,
                                                           seed=5))
    else:  # a reference that repeats the prompt: most proposals are wrong after a while
        drafter = OracleDrafter(V, PROMPT * 8, 0.8, seed=3)
    return SpeculativePair(target, drafter)


def run_all(p, budgets, remaining, stop_ids=(), record_logits=False, params=GREEDY):
    """Calls of ``budgets`` (the last repeated) until the request's tokens are out, each
    from the last token the one before emitted: tokens, rows (when recorded), each call's
    rounds and the final state."""
    logits, state = p.prefill_chunk_priming_drafter(p.init_state(), PROMPT, 0, None)
    pending, history = int(np.argmax(np.asarray(logits))), sampling.History.from_prompt(PROMPT, V)
    tokens, rows, per_call = [], [], []
    while len(tokens) < remaining:
        b = budgets[min(len(per_call), len(budgets) - 1)]
        burst, state = p.device_rounds(
            state, pending, draft_len=2, budget=b, params=params, history=history, key=KEY,
            gen_index=1 + len(tokens), remaining=remaining - len(tokens), stop_ids=stop_ids,
            record_logits=record_logits)
        tokens += burst.tokens
        if record_logits:
            rows.append(np.asarray(burst.logits))
        per_call.append(burst.rounds)
        history = burst.history
        if burst.finish:
            break
        pending = burst.tokens[-1]
    return tokens, np.concatenate(rows) if rows else None, per_call, state


def forced(spec, fixed=None, bounded=None):
    """``spec`` with its form forced: ``fixed`` the fixed / ``while_loop`` form, ``bounded`` a
    sampled judge's rows side by side / its loop (``None``: as chosen)."""
    if fixed is not None:
        spec = dataclasses.replace(spec, fixed=fixed)
    if bounded is not None:
        spec = dataclasses.replace(spec, bounded=bounded)
    return spec


def use_form(monkeypatch, fixed, bounded=None):
    """``None``: the default choice; ``True`` / ``False``: the fixed / ``while_loop`` form
    (``bounded``: a sampled judge's rows side by side / its loop)."""
    monkeypatch.setattr(pair_module, "compiled_rounds", lambda spec, donate: rounds.compiled_rounds(
        forced(spec, fixed, bounded), donate))


@pytest.mark.parametrize("target_kind", ["attention", "recurrent"])
@pytest.mark.parametrize("drafter_kind", ["n-gram", "oracle", "draft model"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_fixed_rounds_emit_the_while_loops_rounds(target_kind, drafter_kind, params,
                                                  monkeypatch):
    budgets, remaining = [8, 5, 256], 150
    p = make_pair(target_kind, drafter_kind)  # one pair: its states carry its identity
    use_form(monkeypatch, True)  # the default form here but for a sampled draft model
    fixed = run_all(p, budgets, remaining, params=params)
    use_form(monkeypatch, False, bounded=False)  # sampled: the judge's loop too
    loop = run_all(p, budgets, remaining, params=params)
    assert fixed[0] == loop[0] and len(fixed[0]) == remaining
    assert [r for c in fixed[2] for r in c] == [r for c in loop[2] for r in c]
    assert tree_bitwise_equal(fixed[3], loop[3])
    # a fixed call runs at most FIXED_ROUNDS rounds; the loop's 256-token calls ran more
    assert max(len(c) for c in fixed[2]) == rounds.FIXED_ROUNDS
    assert max(len(c) for c in loop[2]) > rounds.FIXED_ROUNDS  # control


@pytest.mark.parametrize("target_kind", ["attention", "recurrent"])
def test_fixed_rounds_record_the_while_loops_rows(target_kind, monkeypatch):
    """The fixed form is not the default with the rows recorded; asked for, it records
    the same bits."""
    p = make_pair(target_kind, "n-gram")
    use_form(monkeypatch, True)
    fixed = run_all(p, [8, 64], 100, record_logits=True)
    use_form(monkeypatch, False)
    loop = run_all(p, [8, 64], 100, record_logits=True)
    assert fixed[0] == loop[0] and len(fixed[1]) == len(fixed[0]) == 100
    assert np.array_equal(fixed[1].view(np.uint32), loop[1].view(np.uint32))
    assert [r for c in fixed[2] for r in c] == [r for c in loop[2] for r in c]
    assert tree_bitwise_equal(fixed[3], loop[3])


def test_fixed_rounds_after_a_stop_id_run_nothing(monkeypatch):
    p = make_pair("attention", "n-gram")
    free, _, _, _ = run_all(p, [256], 60)
    stop = free[20]
    at = free.index(stop)
    tokens, _, per_call, state = run_all(p, [256], 60, stop_ids=[stop])
    assert tokens == free[: at + 1]
    assert sum(len(c) for c in per_call) < rounds.FIXED_ROUNDS  # the rest ran nothing
    use_form(monkeypatch, False)
    loop = run_all(p, [256], 60, stop_ids=[stop])
    assert loop[0] == tokens and loop[2] == per_call and tree_bitwise_equal(loop[3], state)


def test_only_unrecorded_bursts_of_loop_free_rounds_are_fixed(monkeypatch):
    """Greedy bursts of loop-free drafters, and on an accelerator sampled ones of drafters
    whose sampled rounds hold no loop (n-gram lookup, the oracle), unless the rows are
    recorded."""
    from turbospark_jax.speculative.drafters.block import BlockDevice
    from turbospark_jax.speculative.drafters.mtp import MTPDevice

    ngram = NGramDrafter(V, max_n=3).on_device()[0]
    oracle = OracleDrafter(V, PROMPT, 0.5).on_device()[0]
    draft = DraftModelDrafter(toy_attention_producer(vocab=V, capacity=64, width=4)).on_device()[0]
    for drafter in (ngram, oracle, draft):
        assert rounds.runs_fixed_rounds(drafter, True, False)
        assert not rounds.runs_fixed_rounds(drafter, True, True)  # the rows recorded
        # sampled: the judge's loop stops on data unless bounded
        assert not rounds.RoundsSpec.choose(None, drafter, 4, greedy=False, record_logits=False,
                                            bounded=False).fixed
        assert not rounds.runs_fixed_rounds(drafter, False, True)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # whatever this machine is
    on_cpu = [rounds.runs_fixed_rounds(d, False, False) for d in (ngram, oracle, draft)]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    on_gpu = [rounds.runs_fixed_rounds(d, False, False) for d in (ngram, oracle, draft)]
    assert on_gpu == [True, True, False]  # the draft model: its sampled draft loop
    assert on_cpu == [False, False, False]  # a CPU shapes the judge's rows one by one
    # the host loop's forms of the catching-up drafters run until they reach the target: no
    # bound (control); the device rounds' forms are caught up before a chain (their tests)
    for device in (MTPDevice, BlockDevice):
        assert device.catches_up and "caught_up" in device.__dataclass_fields__


def test_the_default_form_is_the_fixed_one_for_a_greedy_draft_model(monkeypatch):
    """The greedy draft model's bursts take the fixed form by default (its draft loop is
    bounded): a call stops at FIXED_ROUNDS rounds, as the forced form's do."""
    p = make_pair("attention", "draft model")
    default = run_all(p, [256], 150)
    assert max(len(c) for c in default[2]) == rounds.FIXED_ROUNDS
    use_form(monkeypatch, False)
    loop = run_all(p, [256], 150)
    assert loop[0] == default[0] and tree_bitwise_equal(loop[3], default[3])


def test_a_call_recording_rows_emits_at_most_the_recorded_burst(monkeypatch):
    p = make_pair("attention", "n-gram")
    _, _, recorded_calls, _ = run_all(p, [256], 150, record_logits=True)
    use_form(monkeypatch, False)
    _, _, free_calls, _ = run_all(p, [256], 150)
    assert rounds.burst_limit(True) == rounds.RECORDED_BURST < rounds.MAX_BURST
    emitted = [sum(a + 1 for _, a in c) for c in recorded_calls]
    assert max(emitted) <= rounds.RECORDED_BURST + 2  # a round may pass the budget
    assert sum(a + 1 for _, a in free_calls[0]) > rounds.RECORDED_BURST + 2  # control


def test_sampled_ngram_bursts_on_an_accelerator_run_fixed_with_the_same_bits(monkeypatch):
    """Sampled rounds with no loop that stops on data (n-gram lookup on an accelerator: the
    judge shapes its rows side by side) take the fixed form; the tokens, rounds and states
    are those of ``while_loop`` bursts with the judge's loop."""
    p = make_pair("attention", "n-gram")
    use_form(monkeypatch, None, bounded=False)
    default = run_all(p, [8, 256], 150, params=SAMPLED)
    assert max(len(c) for c in default[2]) > rounds.FIXED_ROUNDS  # control: not fixed
    use_form(monkeypatch, None)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    bounded = run_all(p, [8, 256], 150, params=SAMPLED)
    assert max(len(c) for c in bounded[2]) == rounds.FIXED_ROUNDS
    assert bounded[0] == default[0] and len(bounded[0]) == 150
    assert [r for c in bounded[2] for r in c] == [r for c in default[2] for r in c]
    assert tree_bitwise_equal(bounded[3], default[3])


def _cache_copies(target, fixed: bool) -> int:
    """Copies of a cache-shaped buffer in the compiled burst of greedy n-gram rounds (the
    fixed form or the ``while_loop``), compiled for this backend."""
    import re

    captured = {}

    def compiled(spec, donate):
        program = rounds.compiled_rounds(forced(spec, fixed), donate)

        def run(*call):
            captured["text"] = program.lower(*call).compile().as_text()
            return program(*call)
        return run

    p = SpeculativePair(target, NGramDrafter(target.vocab_size, max_n=3))
    _, state = p.prefill_chunk_priming_drafter(p.init_state(), PROMPT, 0, None)
    shapes = {"f32[" + ",".join(map(str, leaf.shape)) + "]"
              for leaf in jax.tree.leaves(state.target.cache) if leaf.ndim >= 2}
    original = pair_module.compiled_rounds
    pair_module.compiled_rounds = compiled
    try:
        p.device_rounds(state, 1, draft_len=2, budget=32, params=GREEDY,
                        history=sampling.History.from_prompt(PROMPT, p.vocab_size), key=KEY,
                        gen_index=1, remaining=64, record_logits=False)
    finally:
        pair_module.compiled_rounds = original
    return sum(1 for line in captured["text"].split("\n")
               if re.search(r"= (f32\[[\d,]+\])\{[\d,]*\} copy\(", line)
               and re.search(r"= (f32\[[\d,]+\])", line).group(1) in shapes)


def test_the_fixed_form_copies_no_cache_of_a_dense_model():
    """The round runs inside a ``lax.cond``; XLA must still write a dense model's KV cache in
    place there, as in the ``while_loop``: no extra copy of a cache buffer a round (listed
    and stacked layers). The control: the toy target's cache, one buffer its two layers
    each write inside the round, is copied in the fixed form (and on a GPU in the other)."""
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel, unstack_layers

    config = DenseConfig(model_type="qwen3", vocab_size=V, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    for scan in (False, True):
        model = DenseModel(config, jnp.float32, scan_layers=scan)
        params = model.init_params(jax.random.PRNGKey(0))
        target = BlockProducer(model, params if scan else unstack_layers(params),
                               capacity=128, width=16)
        assert _cache_copies(target, True) == _cache_copies(target, False), scan
    # the control: the count sees a cache copied in the fixed form. On the CPU the
    # while_loop writes the toy's cache in place, so the forms differ there; a GPU build
    # copies it in both forms
    toy = toy_attention_producer(vocab=V, capacity=128, width=16)
    copies = _cache_copies(toy, True)
    assert copies > 0
    if jax.default_backend() == "cpu":
        assert copies > _cache_copies(toy, False)


@pytest.mark.parametrize("m", [0, 1, 3, 8])
def test_the_judge_with_its_rows_side_by_side_decides_and_draws_as_its_loop(m):
    """``judge(bounded=True)`` shapes every row at once; its tokens, count and history are
    the loop's bit for bit, for proposals drawn near and far from the target rows. The
    control: a changed row after the first moves the decisions."""
    from turbospark_jax.speculative.drafters.base import MAX_DRAFT

    rng = np.random.default_rng(m)
    rows = jnp.asarray(rng.normal(size=(MAX_DRAFT + 1, V)) * 3, jnp.float32)
    proposals = jnp.asarray(np.argmax(np.asarray(rows[:MAX_DRAFT]) + rng.normal(
        size=(MAX_DRAFT, V)), axis=1), jnp.int32)
    q = rounds.point_masses(proposals, jnp.int32(m), V)
    history = sampling.History.from_prompt(PROMPT, V)
    outs = []
    for bounded in (False, True):
        judge = jax.jit(functools.partial(rounds.judge, bounded=bounded))
        outs.append(judge(rows, q, proposals, jnp.int32(m), SAMPLED, history, KEY,
                          jnp.int32(7)))
    (loop_tokens, loop_count, loop_hist), (side_tokens, side_count, side_hist) = outs
    assert np.array_equal(np.asarray(loop_tokens), np.asarray(side_tokens))
    assert int(loop_count) == int(side_count)
    assert tree_bitwise_equal(loop_hist, side_hist)
    if m:  # control: the first row flattened to one token the proposal is not
        moved = rows.at[0].set(jnp.where(jnp.arange(V) == (proposals[0] + 1) % V, 50.0, -50.0))
        changed = jax.jit(functools.partial(rounds.judge, bounded=True))(
            moved, q, proposals, jnp.int32(m), SAMPLED, history, KEY, jnp.int32(7))
        assert int(changed[1]) == 1 and not np.array_equal(np.asarray(changed[0]),
                                                           np.asarray(side_tokens))


def test_a_draft_models_loop_is_bounded_exactly_when_its_burst_is_fixed(monkeypatch):
    """Inside a ``while_loop`` burst (sampled, or greedy with the rows recorded) a bounded
    draft loop's conditionals would each read back to the host, so the draft loop is bounded
    only in a burst of known trip count (``DraftSampler.bounded``), forced or chosen."""
    from turbospark_jax.speculative.bounded_loops import loop_within
    from turbospark_jax.speculative.drafters import base

    seen = []

    def spy(cond, body, init, most, bounded):
        seen.append(bounded)
        return loop_within(cond, body, init, most, bounded)

    monkeypatch.setattr(base, "loop_within", spy)
    p = make_pair("attention", "draft model")
    for params, record, fixed, form in ((GREEDY, False, None, True),
                                        (GREEDY, True, None, False),
                                        (SAMPLED, False, None, False),
                                        (SAMPLED, False, True, True)):
        use_form(monkeypatch, fixed)
        seen.clear()
        rounds.compiled_rounds.cache_clear()  # traced afresh: an earlier test's is cached
        run_all(p, [8], 8, params=params, record_logits=record)
        assert seen and set(seen) == {form}, (params, record, fixed, seen)


def lowered_rounds(pair, prompt, params=GREEDY, draft_len=2, cuda=False):
    """The StableHLO text of the burst ``pair.device_rounds`` runs after a prefill of
    ``prompt`` (its default form for ``params``), lowered for this backend or (``cuda``)
    exported for a GPU, and whether that form is the fixed one."""
    captured = {}
    if cuda:
        rounds.compiled_rounds.cache_clear()  # traced afresh, as on a GPU

    def compiled(spec, donate):
        program = rounds.compiled_rounds(spec, donate)
        captured["fixed"] = spec.fixed

        def run(*call):
            if cuda:  # traced as on a GPU: its kernels, and its random draws (the CPU
                # lowers their hash as a loop)
                backend = jax.default_backend
                jax.default_backend = lambda: "gpu"
                try:
                    captured["text"] = cuda_text(program, *call)
                finally:
                    jax.default_backend = backend
            else:
                captured["text"] = program.lower(*call).as_text()
            return program(*call)
        return run

    vocab = pair.vocab_size
    logits, state = pair.prefill_chunk_priming_drafter(pair.init_state(), prompt, 0, None)
    original = pair_module.compiled_rounds
    pair_module.compiled_rounds = compiled
    try:
        pair.device_rounds(state, int(np.argmax(np.asarray(logits))), draft_len=draft_len,
                           budget=8, params=params,
                           history=sampling.History.from_prompt(prompt, vocab), key=KEY,
                           gen_index=1, remaining=16, record_logits=False)
    finally:
        pair_module.compiled_rounds = original
    return captured["text"], captured["fixed"]


def _mtp_pair():
    from tests.speculative.test_mtp_drafter import PROMPT as MTP_PROMPT
    from tests.speculative.test_mtp_drafter import TARGET as MTP_TARGET
    from turbospark_jax.speculative.drafters import MTPDrafter

    return SpeculativePair(MTP_TARGET, MTPDrafter(MTP_TARGET)), MTP_PROMPT


def _block_pair():
    from tests.speculative.test_block_drafter import PROMPT as BLOCK_PROMPT
    from tests.speculative.test_block_drafter import TARGET as BLOCK_TARGET
    from tests.speculative.test_block_drafter import _drafter

    return SpeculativePair(BLOCK_TARGET, _drafter()), BLOCK_PROMPT


@pytest.mark.parametrize("kind", ["n-gram/attention", "oracle/recurrent",
                                  "draft model/attention", "draft model/recurrent", "mtp",
                                  "block"])
def test_greedy_fixed_bursts_hold_no_loop_that_stops_on_data(kind):
    """A greedy burst in the fixed form is compiled with its while loops recorded as CUDA
    graphs (``device_flags.fixed_rounds_options``), which hangs and breaks programs whose
    loops stop on data: every loop of every drafter's greedy fixed
    burst has a constant trip count. The control: the same draft model's sampled burst,
    whose draft loop and judge stop on data."""
    from tests.kernels.test_gpu_lowering import _constant_trip_loops

    if kind == "mtp":
        pair, prompt = _mtp_pair()
    elif kind == "block":
        pair, prompt = _block_pair()
    else:
        drafter_kind, target_kind = kind.split("/")
        pair, prompt = make_pair(target_kind, drafter_kind), PROMPT
    text, fixed = lowered_rounds(pair, prompt)
    assert fixed
    loops, constant = _constant_trip_loops(text)
    assert loops >= 1 and constant == loops, (loops, constant)
    if kind == "draft model/attention":
        text, fixed = lowered_rounds(pair, prompt, params=SAMPLED)
        loops, constant = _constant_trip_loops(text)
        assert not fixed and constant < loops
