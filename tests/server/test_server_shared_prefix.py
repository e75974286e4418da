"""A prefix shared across slots: a request whose own slot holds less of its prompt than another
slot starts from a copy of that slot's row (rewound to the shared prompt rows), or for a model
that cannot rewind from that slot's kept copy. Its reply is bitwise what it gets served alone,
it reports the shared rows as cached, and the slot it copied from carries on unchanged.

The engine is driven step by step (``Engine.run_once``). The controls corrupt the copied row or
the kept copy and expect the comparison to fail; with sharing off nothing is cached."""

import jax
import numpy as np

from tests.server.test_server_choices import PRODUCERS, SLOTS, same
from turbospark_jax.core.sampling import SamplingConfig
from turbospark_jax.engine.batching import BatchedDecoder
from turbospark_jax.generation.completion import CompletionRequest
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.metrics import ServerMetrics
from turbospark_jax.server.requests import Done, EngineObserver, ServeRequest
from turbospark_jax.server.slots import SlotRecord, choose_donor, choose_kept

COMMON = [3, 9, 1, 17, 22, 5, 5, 30, 2, 11, 8, 4, 19, 6, 6, 21, 33, 7]  # over two chunks
A, B, C = [*COMMON, 12, 13], [*COMMON, 25, 26, 27], [*COMMON, 1]


class Shared(EngineObserver):
    """Records what the engine reports as reused from another slot."""

    def __init__(self):
        self.tokens = []

    def prefix_shared(self, tokens):
        self.tokens.append(tokens)


def engine(kind="attention", decoder=BatchedDecoder, shares=True, observer=None):
    eng = Engine(PRODUCERS[kind](), slots=SLOTS, prefill_rows=2, prefill_chunk=8,
                 decoder=decoder, observer=observer, warm_up=False)
    eng._shares_prefixes = shares
    return eng


def request(prompt, session=None, seed=5, max_tokens=8):
    completion = CompletionRequest(prompt_ids=list(prompt), max_tokens=max_tokens, seed=seed,
                                   sampling=SamplingConfig(temperature=0.9), record_logits=True)
    return ServeRequest(completion=completion, session_id=session, top_logprobs=2)


def serve(eng, arrivals):
    """Run ``arrivals`` (``(tick, ServeRequest)`` pairs) to the end; their Done events."""
    events = [[] for _ in arrivals]
    tick = 0
    while tick <= max(t for t, _ in arrivals) or not eng.idle:
        for (at, req), sink in zip(arrivals, events, strict=True):
            if at == tick:
                eng.submit(req, sink.append)
        eng.run_once()
        tick += 1
    ends = [e[-1] for e in events]
    assert all(isinstance(d, Done) for d in ends), ends
    return ends


def alone(req, kind="attention"):
    return serve(engine(kind), [(0, req)])[0]


def test_another_session_starts_from_a_busy_slots_prefix():
    """Session b arrives while session a decodes: b copies a's row, reuses the common prompt
    rows, and both are bitwise what they are alone (a's continuation after the copy too)."""
    seen = Shared()
    eng = engine(observer=seen)
    ra, rb = request(A, "a", seed=1, max_tokens=12), request(B, "b", seed=2)
    a, b = serve(eng, [(0, ra), (4, rb)])
    assert a.completion.usage.slot != b.completion.usage.slot
    assert a.completion.usage.reused_tokens == 0
    assert b.completion.usage.reused_tokens == len(COMMON)
    assert seen.tokens == [len(COMMON)]
    assert same(a, alone(ra)) and same(b, alone(rb))


def test_the_metrics_count_the_shared_tokens():
    metrics = ServerMetrics()
    eng = engine(observer=metrics)
    serve(eng, [(0, request(A, "a", max_tokens=12)), (4, request(B, "b"))])
    text = metrics.render(eng.load()).decode()
    assert f"turbospark_shared_prompt_tokens_total {float(len(COMMON))}" in text
    assert "turbospark_shared_prefix_requests_total 1.0" in text
    assert f"turbospark_cached_prompt_tokens_total {float(len(COMMON))}" in text


def test_idle_slots_share_and_a_session_keeps_its_own_prefix():
    eng = engine()
    ra = request(A, "a", seed=1)
    a = serve(eng, [(0, ra)])[0]
    # An anonymous request and a new session: each takes a slot that holds nothing and
    # starts from a's rows.
    rc, rd = request(C, seed=3), request(B, "d", seed=4)
    c, d = serve(eng, [(0, rc), (0, rd)])
    assert len({a.completion.usage.slot, c.completion.usage.slot,
                d.completion.usage.slot}) == 3
    assert c.completion.usage.reused_tokens == len(COMMON)
    assert d.completion.usage.reused_tokens == len(COMMON)
    assert same(c, alone(rc)) and same(d, alone(rd))
    # a's next turn reuses its whole last prompt from its own slot, untouched by the copies.
    history = [*A, *a.completion.token_ids, 9]
    rn = request(history, "a", seed=6)
    nxt = serve(eng, [(0, rn)])[0]
    assert nxt.completion.usage.slot == a.completion.usage.slot
    assert nxt.completion.usage.reused_tokens == len(A)
    assert same(nxt, alone(rn))


def test_without_sharing_nothing_is_cached_from_another_slot():
    eng = engine(shares=False)
    serve(eng, [(0, request(A, "a"))])
    b = serve(eng, [(0, request(B, "b"))])[0]
    assert b.completion.usage.reused_tokens == 0


class CorruptCopy(BatchedDecoder):
    """The control: the copied row's floats are nudged."""

    def copy_row(self, source, target):
        super().copy_row(source, target)
        state = self.take_row(target)
        self.put_row(target, jax.tree.map(
            lambda x: x + 1e-3 if x.dtype == np.float32 else x, state))


def test_control_a_corrupted_copy_fails_the_check():
    eng = engine(decoder=CorruptCopy)
    ra, rb = request(A, "a", seed=1, max_tokens=12), request(B, "b", seed=2)
    a, b = serve(eng, [(0, ra), (4, rb)])
    assert b.completion.usage.reused_tokens == len(COMMON)
    assert same(a, alone(ra))  # the donor is untouched either way
    assert not same(b, alone(rb))


def test_a_model_that_cannot_rewind_starts_from_another_slots_kept_copy():
    seen = Shared()
    eng = engine("recurrent", observer=seen)
    ra = request(A, "a", seed=1)
    a = serve(eng, [(0, ra)])[0]
    longer = request([*A, 4, 4], "b", seed=2)  # extends a's prompt (a's kept copy's ids)
    b = serve(eng, [(0, longer)])[0]
    assert b.completion.usage.slot != a.completion.usage.slot
    assert b.completion.usage.reused_tokens == len(A) - 1
    assert seen.tokens == [len(A) - 1]
    assert same(b, alone(longer, "recurrent"))
    # A prompt that leaves a's prompt before its end cannot use the copy: fed afresh.
    rc = request(B, "c", seed=3)
    c = serve(eng, [(0, rc)])[0]
    assert c.completion.usage.reused_tokens == 0 and same(c, alone(rc, "recurrent"))
    # a's own next turn still restarts from its own copy.
    history = [*A, *a.completion.token_ids]
    nxt = serve(eng, [(0, request(history, "a", seed=6))])[0]
    assert nxt.completion.usage.slot == a.completion.usage.slot
    assert nxt.completion.usage.reused_tokens == len(A) - 1
    assert same(nxt, alone(request(history, seed=6), "recurrent"))


def test_control_a_perturbed_kept_copy_of_another_slot_fails_the_check():
    eng = engine("recurrent")
    a = serve(eng, [(0, request(A, "a", seed=1))])[0]
    slot = eng.slots[a.completion.usage.slot]
    ids, state = slot.saved
    slot.saved = (ids, jax.tree.map(lambda x: x + 1e-3 if x.dtype == np.float32 else x, state))
    longer = request([*A, 4, 4], "b", seed=2)
    b = serve(eng, [(0, longer)])[0]
    assert b.completion.usage.reused_tokens == len(A) - 1
    assert not same(b, alone(longer, "recurrent"))


def test_the_donor_rule_compares_image_identities():
    ids = [1, 2, 7, 7, 7, 3, 4]
    pic = {2: 11, 3: 11, 4: 11}  # an image over the three 7s
    other = {2: 12, 3: 12, 4: 12}
    marks = tuple(pic.get(i, 0) for i in range(len(ids)))
    text, imaged = SlotRecord(0, fed_ids=tuple(ids)), SlotRecord(1, fed_ids=tuple(ids),
                                                                  fed_marks=marks)
    holdings = [(s, s.fed_ids, s.fed_marks) for s in (text, imaged)]
    prompt = [*ids, 5]
    assert choose_donor(holdings, prompt, pic, beyond=0) == (imaged, len(ids))
    assert choose_donor(holdings, prompt, other, beyond=0) == (text, 2)  # up to the image
    assert choose_donor(holdings, prompt, None, beyond=0) == (text, len(ids))
    assert choose_donor(holdings, prompt, other, beyond=2) is None  # the own row holds as much


def test_the_kept_copy_rule_prefers_the_longest_then_the_own_slot():
    slots = [SlotRecord(0, saved=((1, 2), "own")), SlotRecord(1, saved=((1, 2, 3), "long")),
             SlotRecord(2, saved=((1, 2), "tie")), SlotRecord(3, saved=((9,), "other"))]
    assert choose_kept(slots, slots[0], [1, 2, 3, 4]) is slots[1]
    assert choose_kept(slots, slots[0], [1, 2, 3]) is slots[0]  # a copy never covers it all
    assert choose_kept(slots, slots[2], [1, 2, 5]) is slots[2]
    assert choose_kept(slots, slots[0], [5, 5]) is None
