"""Batched serving never changes anyone's output: each request's tokens and logits are bitwise
what it gets alone, for any neighbours, arrival times, prompt lengths, reused prefixes and slot
index, with prompts prefilled a few at a time in chunks between decode steps.

The engine is driven step by step (``Engine.run_once``, no thread), so a test decides exactly
when each request arrives. The controls swap in a decode or prefill program that mixes rows (a
tiny batch-wide term in the logits) and expect the same check to fail.

Decode buckets (a program over the lowest ``b`` rows, rows swapped to keep the busy ones low)
are checked with :class:`RowByRowToy`: the toy whose block runs row by row under ``vmap``, so
its rows keep their bits for any row count, as the row-invariant kernels keep a real model's.
The plain toy's dots do not (XLA's CPU dot sums a single row another way), so it keeps the one
bucket of every row; the bucket control is a program that reads its row count.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.custom_batching import custom_vmap

from turbospark_jax.core.sampling import SamplingConfig
from turbospark_jax.engine.batching import (
    BatchedDecoder,
    buckets,
    decode_step,
    prefill_step,
    rows_agree_in_batches,
)
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, OverloadedError
from turbospark_jax.generation.completion import CompletionRequest, FinishReason
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.requests import Done, Failed, ServeRequest
from turbospark_jax.server.slots import (
    SlotRecord,
    choose_slot,
    row_to_free,
    row_to_take,
    swap_rows,
)
from turbospark_jax.speculative.drafters import NGramDrafter
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_jax.testing.toy import ToyAttentionModel

VOCAB, SLOTS, CAPACITY = 64, 4, 96
# Two prompts prefilled per call, 10 tokens each (7 rounded up to the width 5): a long prompt
# takes many ticks, and prompts queue for the prefill.
PREFILL = {"prefill_rows": 2, "prefill_chunk": 7}
MODEL = ToyAttentionModel(vocab=VOCAB, dim=16)
PARAMS = MODEL.init_params(jax.random.PRNGKey(3))


def producer(width: int = 5) -> BlockProducer:
    return BlockProducer(MODEL, PARAMS, capacity=CAPACITY, width=width, steps_per_call=8,
                         donate=True)


def _mixing_step(model, params, stack, rows, active, **variant):
    """The control: a decode program whose rows see each other (one batch-wide term)."""
    stack, rows, out = decode_step(model, params, stack, rows, active, **variant)
    shared = jnp.sum(jnp.where(active[:, None], out.logits, 0.0), axis=0) * 1e-3
    return stack, rows, out.replace(logits=out.logits + shared)


class MixingDecoder(BatchedDecoder):
    step_fn = staticmethod(_mixing_step)


def _mixing_prefill(model, params, stack, rows, index, tokens, counts, final, **variant):
    """The prefill control: the first tokens' logits see each other."""
    stack, rows, out = prefill_step(model, params, stack, rows, index, tokens, counts, final,
                                    **variant)
    shared = jnp.sum(jnp.where(final[:, None], out.logits, 0.0), axis=0) * 1e-3
    return stack, rows, out.replace(logits=out.logits + shared)


class MixingPrefill(BatchedDecoder):
    prefill_fn = staticmethod(_mixing_prefill)


class RowByRowToy(ToyAttentionModel):
    """The toy attention model whose block, under ``vmap``, runs each row on its own (a loop
    over the rows of one unmapped body): a row's bits then never depend on how many rows are
    mapped, which is what the decode buckets need of a model."""

    def block_forward(self, params, cache, tokens, positions, live, need_head, **kw):
        plain = functools.partial(ToyAttentionModel.block_forward, self, **kw)
        forward = custom_vmap(plain)

        @forward.def_vmap
        def each_row(axis_size, in_batched, *args):
            leaves, tree = jax.tree.flatten(args)
            mapped = jax.tree.leaves(in_batched)

            def one(row):
                it = iter(row)
                return plain(*jax.tree.unflatten(
                    tree, [next(it) if m else x for x, m in zip(leaves, mapped, strict=True)]))

            out = jax.lax.map(one, [x for x, m in zip(leaves, mapped, strict=True) if m])
            return out, jax.tree.map(lambda _: True, out)

        return forward(params, cache, tokens, positions, live, need_head)


ROW_MODEL = RowByRowToy(vocab=VOCAB, dim=16)


class RecordingDecoder(BatchedDecoder):
    """Records every decode call's row count and every row swap."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.bucket_calls, self.swaps = [], []

    def step(self, active, **kw):
        self.bucket_calls.append(self.bucket_for(active))
        return super().step(active, **kw)

    def swap_rows(self, i, j):
        self.swaps.append((i, j))
        super().swap_rows(i, j)


class BucketedDecoder(RecordingDecoder):
    """Decode buckets for the row-by-row toy (whose rows agree across them, though it has no
    row-invariant kernels to say so)."""

    rows_agree = staticmethod(lambda model: True)


def _bucket_step(model, params, stack, rows, active, *extra, **variant):
    """The bucket control: a decode program whose logits read how many rows it runs."""
    stack, rows, out = decode_step(model, params, stack, rows, active, *extra, **variant)
    return stack, rows, out.replace(logits=out.logits * (1 + 1e-3 * active.shape[0]))


class BucketSensitive(BucketedDecoder):
    step_fn = staticmethod(_bucket_step)


def engine(decoder=BatchedDecoder, **kw):
    model = ROW_MODEL if issubclass(decoder, BucketedDecoder) else MODEL
    made = BlockProducer(model, PARAMS, capacity=CAPACITY, width=5, steps_per_call=8,
                         donate=True)
    return Engine(made, slots=SLOTS, decoder=decoder, **PREFILL, **kw)


SETTINGS = [
    SamplingConfig(),
    SamplingConfig(temperature=0.9),
    SamplingConfig(temperature=1.2, top_k=8, top_p=0.9, min_p=0.05),
    SamplingConfig(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.3),
]


def request(prompt, setting=0, seed=0, max_tokens=10, stops=()):
    return CompletionRequest(prompt_ids=list(prompt), max_tokens=max_tokens, seed=seed,
                             sampling=SETTINGS[setting], record_logits=True,
                             stop_token_ids=list(stops), prefill_chunk_size=5)


def serve(engine, arrivals):
    """Run ``arrivals`` (``(step, ServeRequest)`` pairs) to the end; return the Done events in
    the order given and the slot each ran in. After every tick each engine's busy slots hold
    the lowest rows (``engine`` may be a replica router)."""
    results = {}
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    step = 0
    while pending or not engine.idle:
        while pending and pending[0][1][0] <= step:
            i, (_, req) = pending.pop(0)
            engine.submit(req, lambda ev, i=i: results.setdefault(i, []).append(ev))
        engine.run_once()
        for one in getattr(engine, "engines", [engine]):
            busy = sorted(s.row for s in one.slots if s.busy)
            assert busy == list(range(len(busy))), busy
        step += 1
    ends = [results[i][-1] for i in range(len(arrivals))]
    assert all(isinstance(e, Done) for e in ends), ends
    return ends


def alone(req, decoder=BatchedDecoder):
    eng = engine(decoder)
    done = serve(eng, [(0, req)])[0]
    if issubclass(decoder, BucketedDecoder):
        assert set(eng.decoder.bucket_calls) <= {1}  # alone: the one-row program
    return done


def same(a, b):
    ca, cb = a.completion, b.completion
    return ca.token_ids == cb.token_ids and np.array_equal(ca.logits, cb.logits) and [
        (e.token, e.logprob, e.top) for e in a.logprobs] == [
        (e.token, e.logprob, e.top) for e in b.logprobs]


#: Shared openings (a short and a long one), so later requests reuse earlier ones' rows.
OPENINGS = [[], [7, 3, 9, 1, 12, 40, 2, 2], list(range(10, 40))]


@st.composite
def workloads(draw):
    n = draw(st.integers(2, 6))
    out = []
    for _ in range(n):
        opening = draw(st.sampled_from(OPENINGS))
        opening = opening[: draw(st.one_of(st.just(len(opening)), st.integers(0, len(opening))))]
        # Up to 80 tokens: eight prefill calls, arriving while others decode.
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=50))
        req = request(opening + tail, setting=draw(st.integers(0, len(SETTINGS) - 1)),
                      seed=draw(st.integers(0, 2**32)), max_tokens=draw(st.integers(1, 12)))
        top = draw(st.one_of(st.none(), st.integers(0, 3)))
        session = draw(st.sampled_from([None, None, "a", "b"]))
        out.append((draw(st.integers(0, 20)),
                    ServeRequest(completion=req, top_logprobs=top, session_id=session)))
    return out


@settings(max_examples=8)
@given(workloads())
def test_each_request_bitwise_equal_to_serving_it_alone(arrivals):
    together = serve(engine(), arrivals)
    for (_, req), got in zip(arrivals, together, strict=True):
        assert same(got, alone(req)), got.completion.usage


@settings(max_examples=8)
@given(workloads())
def test_each_request_bitwise_equal_to_serving_it_alone_in_any_bucket(arrivals):
    """The same fuzzed mixes with decode buckets: each request runs in whichever bucket its
    neighbours make, in rows that move as they come and go, and gets its one-row bits."""
    eng = engine(BucketedDecoder)
    together = serve(eng, arrivals)
    for (_, req), got in zip(arrivals, together, strict=True):
        assert same(got, alone(req, BucketedDecoder)), got.completion.usage
    busy = [s.row for s in eng.slots if s.busy]
    assert sorted(s.row for s in eng.slots) == list(range(SLOTS)) and not busy


def test_buckets_follow_the_live_rows():
    assert buckets(1) == (1,) and buckets(2) == (1, 2) and buckets(8) == (1, 2, 4, 8)
    assert buckets(6) == (1, 2, 4, 6) and len(buckets(64)) == 7
    assert not rows_agree_in_batches(MODEL)  # XLA's dots: one bucket of every row
    assert BatchedDecoder(producer(), SLOTS, **PREFILL).buckets == (SLOTS,)
    decoder = BucketedDecoder(producer(), SLOTS, **PREFILL)
    assert decoder.buckets == (1, 2, 4)
    picks = [decoder.bucket_for(np.array(a, bool)) for a in
             ([1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0])]
    assert picks == [1, 2, 4, 4, 1]


def test_a_row_moved_down_mid_generation_keeps_its_bits():
    """The request in row 0 ends first: the one in row 1 is swapped down to row 0 between two
    decode steps and carries on in the one-row program, bitwise as alone."""
    eng = engine(BucketedDecoder)
    short = ServeRequest(completion=request([3, 1, 4], setting=1, seed=4, max_tokens=3))
    long = ServeRequest(completion=request([2, 7, 1, 8, 2, 8], setting=2, seed=9,
                                           max_tokens=12))
    got = serve(eng, [(0, short), (0, long)])
    assert got[1].completion.usage.slot == 1 and [sorted(w) for w in eng.decoder.swaps] == [[0, 1]]
    calls = eng.decoder.bucket_calls
    assert calls[0] == 2 and calls[-1] == 1 and calls == sorted(calls, reverse=True)
    for g, r in zip(got, [short, long], strict=True):
        assert same(g, alone(r, BucketedDecoder))


def test_a_reused_prefix_above_the_live_rows_moves_down_with_its_slot():
    """A slot whose prompt a new request extends sits above the busy rows: it is swapped down
    to the first idle row, and its fed record and reuse go with it."""
    eng = engine(BucketedDecoder)
    first = [request([5, 6, 7, 8, 9], max_tokens=2), request([9, 9, 1, 2], max_tokens=2),
             request([30, 31, 32], max_tokens=2)]
    serve(eng, [(0, ServeRequest(completion=r)) for r in first])
    home = next(s for s in eng.slots if s.fed_ids[:5] == (5, 6, 7, 8, 9))
    assert home.row >= 2  # the first finisher is swapped above the others
    other = ServeRequest(completion=request([40, 41, 42], seed=1, max_tokens=20))
    grown = ServeRequest(completion=request([5, 6, 7, 8, 9, 3], setting=1, seed=2,
                                            max_tokens=4))
    events = {}
    eng.submit(other, lambda ev: events.setdefault("other", []).append(ev))
    eng.run_once()  # the unrelated request holds row 0 from here on
    moved_from, eng.decoder.swaps = home.row, []
    eng.submit(grown, lambda ev: events.setdefault("grown", []).append(ev))
    eng.run_once()
    assert home.busy and home.row == 1 and sorted(eng.decoder.swaps[0]) == [1, moved_from]
    while not eng.idle:
        eng.run_once()
    done = events["grown"][-1]
    assert done.completion.usage.slot == home.index and done.completion.usage.reused_tokens == 5
    assert same(done, alone(grown, BucketedDecoder))
    assert same(events["other"][-1], alone(other, BucketedDecoder))


class FailingSwap(BucketedDecoder):
    """A swap that fails once when armed (a device fault); the engine's next decoder is
    another instance, so the switch is the class's."""

    armed = False

    def swap_rows(self, i, j):
        if FailingSwap.armed:
            FailingSwap.armed = False
            raise RuntimeError("the device went away")
        super().swap_rows(i, j)


def test_a_failed_swap_at_admission_loses_no_request():
    """A swap that fails while a request is admitted is a fault of the scheduler (the thread
    ends and answers every request with it): the request is still there to be answered."""
    eng = engine(FailingSwap)
    serve(eng, [(0, ServeRequest(completion=request([k, 2, 3], max_tokens=2)))
                for k in (4, 5, 6)])
    eng.submit(ServeRequest(completion=request([40, 41], max_tokens=20)), lambda ev: None)
    eng.run_once()
    events = []
    eng.submit(ServeRequest(completion=request([4, 2, 3, 9], max_tokens=3)), events.append)
    FailingSwap.armed = True  # the slot that fed [4, 2, 3] sits above the first idle row
    with pytest.raises(RuntimeError, match="the device went away"):
        eng.run_once()
    assert eng.load()["waiting"] == 1 and eng.load()["busy_slots"] == 1
    with eng._cond:
        eng._end_all("the scheduler failed", shutdown=False)
    assert isinstance(events[-1], Failed) and events[-1].message == "the scheduler failed"


def test_a_model_on_the_row_invariant_kernels_keeps_its_bits_in_every_bucket():
    """A dense model on the row-invariant Pallas kernels (compiled on a GPU, in the
    interpreter on a CPU) gets buckets of its own accord, and two requests served together,
    one moved down when the other ends, are bitwise what each gets alone in the one-row
    program. (The interpreter's tile products are XLA dots: on a CPU this speaks for the
    kernels' schedule under ``vmap``; run on a GPU it checks the hardware's.)"""
    from turbospark_jax.kernels.plan import KernelPlan
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel, unstack_layers
    from turbospark_jax.testing.fixtures import backend_plan

    plan = backend_plan() if jax.default_backend() == "gpu" else KernelPlan.interpreted()
    config = DenseConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    model = DenseModel(config, jnp.float32, scan_layers=False, plan=plan)
    params = unstack_layers(model.init_params(jax.random.PRNGKey(1)))

    def dense_engine():
        made = BlockProducer(model, params, capacity=48, width=4, steps_per_call=8,
                             donate=True)
        return Engine(made, slots=SLOTS, decoder=RecordingDecoder, **PREFILL)

    assert rows_agree_in_batches(model)
    reqs = [ServeRequest(completion=request([3, 1, 4], setting=1, seed=4, max_tokens=3)),
            ServeRequest(completion=request([2, 7, 1, 8, 2], setting=2, seed=9, max_tokens=8))]
    eng = dense_engine()
    assert eng.decoder.buckets == (1, 2, 4)
    together = serve(eng, [(0, r) for r in reqs])
    assert 2 in eng.decoder.bucket_calls and eng.decoder.bucket_calls[-1] == 1
    assert eng.decoder.swaps  # the long one moved down to row 0
    for got, req in zip(together, reqs, strict=True):
        assert same(got, serve(dense_engine(), [(0, req)])[0])


def test_control_a_bucket_reading_program_fails_the_check():
    reqs = [(0, ServeRequest(completion=request([3, 1, 4, 1, 5], seed=1))),
            (0, ServeRequest(completion=request([2, 7, 1, 8], setting=1, seed=2)))]
    together = serve(engine(BucketSensitive), reqs)
    refs = [alone(r, BucketSensitive) for _, r in reqs]
    assert not any(same(g, r) for g, r in zip(together, refs, strict=True))


def test_every_slot_index_gives_the_same_result():
    """A request placed in each row in turn (the rows before it busy with others)."""
    target = request([5, 9, 2, 33, 7], setting=1, seed=11, max_tokens=12)
    ref = alone(ServeRequest(completion=target, top_logprobs=2))
    for slot in range(SLOTS):
        fillers = [(0, ServeRequest(completion=request([i + 1] * (3 + i), setting=i % 4,
                                                       seed=i, max_tokens=30)))
                   for i in range(slot)]
        got = serve(engine(), [*fillers, (0, ServeRequest(completion=target, top_logprobs=2))])
        assert got[-1].completion.usage.slot == slot
        assert same(got[-1], ref)


@pytest.mark.parametrize(("decoder", "second_at"), [(MixingDecoder, 2), (MixingPrefill, 0)])
def test_control_a_row_mixing_program_fails_the_check(decoder, second_at):
    reqs = [(0, ServeRequest(completion=request([3, 1, 4, 1, 5], seed=1))),
            (second_at, ServeRequest(completion=request([2, 7, 1, 8], setting=1, seed=2)))]
    together = serve(engine(decoder), reqs)
    refs = [alone(r, decoder) for _, r in reqs]
    assert not all(same(g, r) for g, r in zip(together, refs, strict=True))


class CountingDecoder(BatchedDecoder):
    """Records how many prompts each prefill call fed."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.fed_per_call = []

    def prefill(self, feeds, **kw):
        self.fed_per_call.append(len(feeds))
        return super().prefill(feeds, **kw)


def test_long_prompts_are_fed_in_chunks_between_decode_steps():
    """A stream in flight gets a token every tick while two long prompts arrive and prefill
    (ten tokens each a tick, both in the same call), and all three stay exact."""
    eng = engine(CountingDecoder)
    short = ServeRequest(completion=request([5, 6, 7], setting=1, seed=3, max_tokens=14))
    longs = [ServeRequest(completion=request([(3 * i + k) % VOCAB for k in range(60)],
                                             setting=2 * i, seed=i, max_tokens=3))
             for i in range(2)]
    ticks, events = [], {}
    eng.submit(short, lambda ev: (ticks.append(tick), events.setdefault(0, []).append(ev)))
    for tick in range(14):
        if tick == 2:
            for i, req in enumerate(longs, 1):
                eng.submit(req, lambda ev, i=i: events.setdefault(i, []).append(ev))
        eng.run_once()
    while not eng.idle:
        eng.run_once()
    assert set(ticks) == set(range(13))  # a token every tick, prefills or not
    assert eng.decoder.fed_per_call.count(2) == 6  # both long prompts, six calls together
    for i, req in enumerate([short, *longs]):
        assert same(events[i][-1], alone(req))


def test_prefix_reuse_and_session_slot():
    engine = Engine(producer(), slots=SLOTS, **PREFILL)
    first = request([1, 2, 3, 4, 5, 6], max_tokens=4)
    a = serve(engine, [(0, ServeRequest(completion=first, session_id="s"))])[0]
    history = [*first.prompt_ids, *a.completion.token_ids, 9]
    b = serve(engine, [(0, ServeRequest(completion=request(history, max_tokens=4),
                                        session_id="s"))])[0]
    assert b.completion.usage.slot == a.completion.usage.slot
    # Reuse stops where the prefill's rows end: the reply's rows came from the decode program.
    assert b.completion.usage.reused_tokens == len(first.prompt_ids)
    assert same(b, alone(ServeRequest(completion=request(history, max_tokens=4))))
    # Without a session the longest shared prefix wins.
    x = serve(engine, [(0, ServeRequest(completion=request([7, 7, 7, 7], max_tokens=2)))])[0]
    y = serve(engine, [(0, ServeRequest(completion=request([7, 7, 7, 7, 5], max_tokens=2)))])[0]
    assert x.completion.usage.slot != a.completion.usage.slot  # a named session's slot
    assert y.completion.usage.slot == x.completion.usage.slot
    assert y.completion.usage.reused_tokens == 4 and not y.completion.usage.evicted


def test_slot_choice_rule():
    slots = [SlotRecord(0, None, (1, 2, 3), 5), SlotRecord(1, "x", (1, 2, 3, 4), 1),
             SlotRecord(2, None, (), 0), SlotRecord(3, None, (7,), 2)]
    assert choose_slot(slots, None, [1, 2, 3, 9]).slot.index == 0  # longest open prefix
    assert choose_slot(slots, "x", [5]).slot.index == 1  # its own slot
    fresh = choose_slot(slots, None, [8, 8])
    assert fresh.slot.index == 2 and not fresh.evicts  # never used before any LRU
    slots[2].busy = True
    lru = choose_slot(slots, "y", [8, 8])
    assert lru.slot.index == 3 and lru.evicts  # least recently used open slot, evicted
    for s in slots:
        s.busy = s.index != 1
    taken = choose_slot(slots, "y", [8])
    assert taken.slot.index == 1 and taken.evicts  # only another session's slot is left
    slots[1].busy = True
    assert choose_slot(slots, None, [1]) is None


def test_busy_slots_keep_the_lowest_rows():
    """Taking a slot above the busy rows swaps it with the first idle row; freeing one below
    the highest busy row swaps it with that row; the records carry their rows."""
    slots = [SlotRecord(i) for i in range(4)]
    assert [s.row for s in slots] == [0, 1, 2, 3]
    slots[0].busy = True
    assert row_to_take(slots, slots[1]) is None  # already the first idle row
    other = row_to_take(slots, slots[3])
    assert other is slots[1]
    swap_rows(slots[3], other)
    slots[3].busy = True
    assert (slots[3].row, slots[1].row) == (1, 3)
    assert row_to_free(slots, slots[3]) is None  # the highest busy row
    assert row_to_free(slots, slots[0]) is slots[3]


def test_a_row_copy_writes_the_target_alone():
    """copy_row overwrites the target row's state with the source's, bit for bit, and leaves
    every other row's state and every row's controls as they were."""
    decoder = BatchedDecoder(producer(), SLOTS, **PREFILL)
    decoder.prefill([(1, [5, 6, 7, 8, 9, 10], False), (2, [11, 12], False)])
    before = jax.device_get((decoder.stack, decoder.controls))
    decoder.copy_row(1, 3)
    decoder.copy_row(2, 2)  # onto itself: nothing moves
    stack, controls = jax.device_get((decoder.stack, decoder.controls))
    for got, was in zip(jax.tree.leaves(stack), jax.tree.leaves(before[0]), strict=True):
        assert np.array_equal(got[:3], was[:3]) and np.array_equal(got[3], was[1])
    assert all(np.array_equal(x, y) for x, y in zip(
        jax.tree.leaves(controls), jax.tree.leaves(before[1]), strict=True))
    # The control: the copy changed row 3 (it held a fresh state, not row 1's).
    assert not all(np.array_equal(x[3], x[1]) for x in jax.tree.leaves(before[0]))
    with pytest.raises(BadInputError):
        decoder.copy_row(0, SLOTS)


def test_cancel_frees_the_slot_and_keeps_others_exact():
    engine = Engine(producer(), slots=SLOTS, **PREFILL)
    other = ServeRequest(completion=request([4, 4, 2], setting=2, seed=5, max_tokens=12))
    events = {}
    long = engine.submit(ServeRequest(completion=request([1, 2], max_tokens=40)),
                         lambda ev: events.setdefault("long", []).append(ev))
    engine.submit(other, lambda ev: events.setdefault("other", []).append(ev))
    for _ in range(4):
        engine.run_once()
    long.cancel()
    engine.run_once()
    assert sum(s.busy for s in engine.slots) == 1  # freed before the next step
    while not engine.idle:
        engine.run_once()
    assert "long" not in events or not any(isinstance(e, Done | Failed) for e in events["long"])
    assert same(events["other"][-1], alone(other))


def test_overload_is_refused_and_bad_input_touches_nothing():
    engine = Engine(producer(), slots=1, max_waiting=1)
    engine.submit(ServeRequest(completion=request([1])), lambda ev: None)
    engine.submit(ServeRequest(completion=request([2])), lambda ev: None)
    with pytest.raises(OverloadedError):
        engine.submit(ServeRequest(completion=request([3])), lambda ev: None)
    with pytest.raises(BadInputError):
        engine.submit(ServeRequest(completion=request([VOCAB + 1])), lambda ev: None)
    with pytest.raises(BadInputError):
        engine.submit(ServeRequest(completion=request([1], max_tokens=CAPACITY)), lambda ev: None)
    assert engine.load()["waiting"] == 2 and not any(s.fed_ids for s in engine.slots)


def test_speculative_greedy_requests_give_the_same_tokens():
    # The host rounds: the same block program as the prefill, so nothing new to compile.
    pair = SpeculativePair(producer(), NGramDrafter(VOCAB, max_n=3), device_rounds=False)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain = alone(ServeRequest(completion=dataclasses.replace(
        request(prompt, max_tokens=12), record_logits=False)))
    events = []
    engine = Engine(producer(), slots=SLOTS, speculative=pair)
    engine.submit(ServeRequest(completion=dataclasses.replace(
        request(prompt, max_tokens=12), record_logits=False)), events.append)
    import time

    deadline = time.monotonic() + 60
    while not events or not isinstance(events[-1], Done | Failed):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    done = events[-1]
    assert isinstance(done, Done) and done.completion.speculative is not None
    assert done.completion.token_ids == plain.completion.token_ids
    assert done.completion.finish_reason is FinishReason.LENGTH


def test_injected_embeddings_are_refused_where_they_cannot_go():
    """The prefill's embeddings input: a model that takes none refuses it, and rows that do
    not match their feed's tokens are named (nothing is fed either way)."""
    decoder = BatchedDecoder(producer(), SLOTS, **PREFILL)
    before = jax.tree.map(np.asarray, decoder.stack)
    rows = (np.ones((3,), np.int32), np.zeros((3, 16), np.float32))
    with pytest.raises(BadInputError, match="takes no injected embeddings"):
        decoder.prefill([(0, [1, 2, 3], True)], injected=[rows])
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(before), jax.tree.leaves(decoder.stack), strict=True))
    decoder.prefill([(0, [1, 2, 3], True)], injected=[None])  # nothing injected: plain
