"""The session pool: reuse never changes output, sessions never share a state, slots churn as
an LRU, turns on one slot are serialized, and bad input is refused with a SessionError.

Every equality is bitwise (token ids, and logits compared as uint32) against the same turns
served from a fresh state. Each guarantee has a control that must make its check fail: a
producer whose reuse claims one token too many, a pool that forgets to reset an evicted slot,
a pool that does not lock its slots.

Shapes stay fixed: prompts grow by a fixed number of tokens per turn (no stop tokens), so a
hypothesis example varies token values and the schedule, not the programs that run.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark_jax import (
    Completion,
    CompletionRequest,
    FinishReason,
    SamplingConfig,
    run_raw_completion,
)
from turbospark_jax.core.kv_prefix import common_prefix, reusable_prefix
from turbospark_jax.core.protocols import LogitProducer
from turbospark_jax.core.state import FedRecord
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, SessionError
from turbospark_jax.sessions.session_pool import SessionPool
from turbospark_jax.speculative.drafters import NGramDrafter
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_jax.testing.conformance import perturbed
from turbospark_jax.testing.fixtures import SnapshotReference, multi_turn_producers

V = 32
FIRST, USER, REPLY = 5, 3, 4  # tokens in a first prompt, a user message, a reply

PRODUCERS = multi_turn_producers(V)
ATT = PRODUCERS["attention_donating"]


# -- conversations ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Script:
    """One session's side of a conversation.

    first: the first prompt; users[k]: the user message of turn k + 1; retok[k]: how the
    reply of turn k comes back in the next prompt: ``None`` as generated, ``j`` with every
    token from ``j`` on replaced (a re-tokenization that diverges at ``j``, same length).
    """

    first: tuple[int, ...]
    users: tuple[tuple[int, ...], ...]
    retok: tuple[int | None, ...]


@dataclasses.dataclass
class Served:
    """One served turn."""

    session: str
    prompt: list[int]
    completion: Completion
    reused: int
    slot: int | None = None
    evicted: bool | None = None


Serve = Callable[[str, list[int], int], Served]


def request(prompt: Sequence[int], turn: int) -> CompletionRequest:
    return CompletionRequest(
        prompt_ids=list(prompt), max_tokens=REPLY, sampling=SamplingConfig(temperature=1.0),
        seed=turn, record_logits=True,
    )


def converse(serve: Serve, scripts: dict[str, Script], schedule: Sequence[str]) -> list[Served]:
    """Serve ``schedule`` (session names, in turn order); each prompt extends the session's
    previous prompt with its reply (as ``retok`` says) and the next user message."""
    out: list[Served] = []
    last: dict[str, Served] = {}
    for name in schedule:
        script, k = scripts[name], sum(1 for s in out if s.session == name)
        if k == 0:
            prompt = list(script.first)
        else:
            prev = last[name]
            reply = list(prev.completion.token_ids)
            j = script.retok[(k - 1) % len(script.retok)]
            if j is not None:
                reply = reply[:j] + [(t + 1) % V for t in reply[j:]]
            prompt = prev.prompt + reply + list(script.users[(k - 1) % len(script.users)])
        served = serve(name, prompt, k)
        out.append(served)
        last[name] = served
    return out


def fresh_server(producer: LogitProducer) -> Serve:
    def serve(name: str, prompt: list[int], k: int) -> Served:
        c = run_raw_completion(producer, request(prompt, k))
        return Served(name, prompt, c, c.usage.reused_tokens)

    return serve


def pool_server(pool: SessionPool, **kwargs) -> Serve:
    def serve(name: str, prompt: list[int], k: int) -> Served:
        turn = pool.generate(name, request(prompt, k), **kwargs)
        u = turn.usage
        assert u.prompt_tokens == len(prompt)
        assert u.prefilled_tokens == len(prompt) - u.reused_tokens
        return Served(name, prompt, turn, u.reused_tokens, u.slot, u.evicted)

    return serve


def first_difference(got: list[Served], want: list[Served]) -> str | None:
    """Where two servings of one conversation differ (None: bitwise the same)."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.prompt != w.prompt:
            return f"turn {i}: prompts differ"
        if g.completion.token_ids != w.completion.token_ids:
            return f"turn {i}: tokens {g.completion.token_ids} != {w.completion.token_ids}"
        gl, wl = g.completion.logits, w.completion.logits
        if gl.shape != wl.shape or not np.array_equal(gl.view(np.uint32), wl.view(np.uint32)):
            return f"turn {i}: logits differ"
    return None


class ReferenceLRU:
    """The slot policy, written plainly: own slot, else a free one, else least recently used;
    a slot changing owner starts fresh. Predicts slot, eviction and reuse of every turn."""

    def __init__(self, slots: int, rewindable: bool) -> None:
        self.owner: list[str | None] = [None] * slots
        self.last = [0] * slots
        self.fed: list[tuple[int, ...]] = [()] * slots
        self.snapshots = [SnapshotReference() for _ in range(slots)]
        self.clock = 0
        self.rewindable = rewindable

    def turn(self, name: str, prompt: list[int]) -> tuple[int, bool, int]:
        if name in self.owner:
            slot = self.owner.index(name)
            evicted = False
        else:
            slot = min(range(len(self.owner)),
                       key=lambda i: (self.owner[i] is not None, self.last[i]))
            evicted = self.owner[slot] is not None and bool(self.fed[slot])
            self.owner[slot], self.fed[slot] = name, ()
            self.snapshots[slot] = SnapshotReference()
        self.clock += 1
        self.last[slot] = self.clock
        if self.rewindable:
            reused = reusable_prefix(self.fed[slot], None, prompt)
        else:
            reused = self.snapshots[slot].reuse(self.fed[slot], prompt)
        self.snapshots[slot].served(prompt, reused)
        return slot, evicted, reused

    def store(self, slot: int, fed: Sequence[int]) -> None:
        self.fed[slot] = tuple(fed)


def lru_mismatches(served: list[Served], slots: int, rewindable: bool) -> list[str]:
    ref = ReferenceLRU(slots, rewindable)
    problems = []
    for i, s in enumerate(served):
        slot, evicted, reused = ref.turn(s.session, s.prompt)
        if (s.slot, s.evicted, s.reused) != (slot, evicted, reused):
            problems.append(
                f"turn {i} ({s.session}): got slot/evicted/reused {(s.slot, s.evicted, s.reused)}"
                f", expected {(slot, evicted, reused)}"
            )
        ref.store(slot, s.completion.fed_ids)
    return problems


# -- controls ---------------------------------------------------------------------------------


class ForgetfulPool(SessionPool):
    """Control: hands a slot to a new owner WITHOUT resetting it (the previous session's state
    stays for the new one to continue from)."""

    def _assign(self, slot, session_id):
        if slot.owner == session_id:
            return False
        evicted = slot.owner is not None and bool(slot.fed_ids)
        slot.owner = session_id
        return evicted


class TrustsCount(BlockProducer):
    """Control producer: reuse trusts the state's cursor instead of comparing fed ids, the
    bug the seed warns about. Harmless while a slot only ever serves one session."""

    def __init__(self, inner: BlockProducer) -> None:
        self.__dict__.update(inner.__dict__)

    def try_reuse_prefix(self, state, prompt_ids, *, injected=None):
        del injected
        n = min(int(state.fed.count), len(prompt_ids) - 1)
        return n, state.replace(fed=state.fed.replace(count=jnp.int32(n)))


# -- strategies -------------------------------------------------------------------------------

token = st.integers(0, V - 1)
COMMON_FIRST = (7, 7, 1, 2, 3)  # sessions often share a first prompt: identical histories


@st.composite
def scripts(draw: st.DrawFn, names: str) -> dict[str, Script]:
    out = {}
    for name in names:
        first = draw(st.one_of(st.just(COMMON_FIRST),
                               st.tuples(*[token] * FIRST)))
        users = draw(st.lists(st.tuples(*[token] * USER), min_size=1, max_size=3))
        retok = draw(st.lists(st.one_of(st.none(), st.integers(0, REPLY - 1)),
                              min_size=1, max_size=3))
        out[name] = Script(first, tuple(users), tuple(retok))
    return out


# -- reuse never changes output ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRODUCERS))
@settings(max_examples=10)
@given(data=st.data())
def test_interleaved_sessions_equal_fresh_serving_and_follow_lru(name, data):
    """More sessions than slots, turns interleaved by hypothesis: every turn is bitwise what a
    fresh state gives; slot, eviction and reuse are what the LRU policy predicts."""
    producer = PRODUCERS[name]
    convo = data.draw(scripts("abc"))
    schedule = data.draw(st.lists(st.sampled_from("abc"), min_size=3, max_size=7))
    pool = SessionPool(producer, 2)
    served = converse(pool_server(pool), convo, schedule)
    want = converse(fresh_server(producer), convo, schedule)
    assert first_difference(served, want) is None
    assert lru_mismatches(served, 2, producer.can_rewind) == []
    assert pool.evictions == sum(bool(s.evicted) for s in served)


def test_one_session_reuses_and_equals_fresh():
    convo = {"a": Script(COMMON_FIRST, ((4, 5, 6), (9, 9, 9)), (None, 2))}
    served = converse(pool_server(SessionPool(ATT, 1)), convo, "aaaa")
    assert first_difference(served, converse(fresh_server(ATT), convo, "aaaa")) is None
    # turn 1 gets back its whole fed record, turn 2's reply diverged at token 2
    assert served[1].reused == FIRST + REPLY - 1
    assert served[2].reused == len(served[1].prompt) + 2
    assert all(s.slot == 0 and not s.evicted for s in served)


def test_control_reuse_claiming_one_more_breaks_equality():
    convo = {"a": Script(COMMON_FIRST, ((4, 5, 6),), (None,))}
    bad = SessionPool(perturbed(ATT, "reuse_claims_one_more"), 1)
    served = converse(pool_server(bad), convo, "aaa")
    assert first_difference(served, converse(fresh_server(ATT), convo, "aaa")) is not None


def test_pool_reset_protects_even_a_producer_that_trusts_counts():
    """A count-trusting producer is exact while each slot serves one session; it stays exact
    under churn only because a slot changing owner starts fresh. The control pool that
    forgets to reset makes session b continue from a's state, and the outputs change."""
    convo = {n: Script(first, ((4, 5, 6),), (None,))
             for n, first in (("a", (1, 2, 3, 4, 5)), ("b", (9, 8, 7, 6, 5)))}
    schedule = "abab"
    want = converse(fresh_server(ATT), convo, schedule)
    good = converse(pool_server(SessionPool(TrustsCount(ATT), 1)), convo, schedule)
    assert first_difference(good, want) is None
    forgetful = converse(pool_server(ForgetfulPool(TrustsCount(ATT), 1)), convo, schedule)
    assert first_difference(forgetful, want) is not None


# -- sessions never share a state ------------------------------------------------------------


def sharing_problems(pool: SessionPool) -> list[str]:
    """Serve two sessions with IDENTICAL histories on one slot, alternating. Each turn must
    evict the other and reuse nothing, though the other's fed record is a prefix of its
    prompt; the slot table must name the session that ran last."""
    convo = {n: Script(COMMON_FIRST, ((4, 5, 6),), (None,)) for n in "ab"}
    served = converse(pool_server(pool), convo, "abab")
    problems = []
    for i, s in enumerate(served[1:], start=1):
        if not s.evicted or s.reused != 0:
            problems.append(f"turn {i} ({s.session}): evicted={s.evicted}, reused={s.reused}")
    if pool.sessions() != {"b": 0}:
        problems.append(f"slot table {pool.sessions()}")
    return problems


def test_identical_histories_under_different_ids_never_share_a_state():
    assert sharing_problems(SessionPool(ATT, 1)) == []


def test_control_forgetful_pool_shares_states():
    assert sharing_problems(ForgetfulPool(ATT, 1))


def test_identical_histories_in_two_slots_each_reuse_their_own():
    pool = SessionPool(ATT, 2)
    convo = {n: Script(COMMON_FIRST, ((4, 5, 6),), (None,)) for n in "ab"}
    served = converse(pool_server(pool), convo, "abab")
    assert [s.slot for s in served] == [0, 1, 0, 1]
    assert [s.reused for s in served[2:]] == [FIRST + REPLY - 1] * 2
    assert pool.sessions() == {"a": 0, "b": 1}
    assert not any(s.evicted for s in served) and pool.evictions == 0
    assert pool.fed_ids_of("a") == served[2].completion.fed_ids
    table = pool.slot_table()
    assert [(t.owner, t.fed_tokens, t.busy) for t in table] == [
        ("a", len(served[2].completion.fed_ids), False),
        ("b", len(served[3].completion.fed_ids), False),
    ]


# -- speculative turns -----------------------------------------------------------------------


def test_speculative_turns_through_the_pool_equal_plain_greedy_fresh():
    pair = SpeculativePair(ATT, NGramDrafter(V, max_n=3))
    convo = {n: Script(first, ((4, 5, 6), (1, 2, 3)), (None, 1))
             for n, first in (("a", COMMON_FIRST), ("b", (3, 1, 4, 1, 5)))}
    schedule = "aabab"
    greedy = CompletionRequest(prompt_ids=[0], max_tokens=REPLY, record_logits=True)

    def plain(name, prompt, k):
        c = run_raw_completion(ATT, dataclasses.replace(greedy, prompt_ids=prompt))
        return Served(name, prompt, c, 0)

    def spec(name, prompt, k):
        t = pool.generate(name, dataclasses.replace(greedy, prompt_ids=prompt, draft_len=3))
        assert t.speculative is not None
        return Served(name, prompt, t, t.usage.reused_tokens, t.usage.slot, t.usage.evicted)

    pool = SessionPool(pair, 1)
    served = converse(spec, convo, schedule)
    assert first_difference(served, converse(plain, convo, schedule)) is None
    assert served[1].reused > 0
    assert [s.evicted for s in served] == [False, False, True, True, True]


# -- errors leave the slot fresh; bad input is refused --------------------------------------


@dataclasses.dataclass(frozen=True)
class TupleState:
    """The state of :class:`Guarded`: the ids fed so far."""

    fed: tuple[int, ...] = ()


class Guarded(LogitProducer[TupleState]):
    """A host producer whose ``produce`` takes a while and counts overlapping entries per
    conversation (keyed on the first fed id), so tests can see two turns run on one state.

    It reuses through kv_prefix like any KV producer. ``poison`` makes the logits after that
    token non-finite; ``explode`` makes feeding that token raise; ``gate`` (an Event) makes
    produce wait until it is set."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.poison: int | None = None
        self.explode: int | None = None
        self.gate: threading.Event | None = None
        self.inside: dict[int, int] = {}
        self.overlaps = 0
        self.entered = threading.Event()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return V

    def init_state(self) -> TupleState:
        return TupleState()

    def fed_record(self, state) -> FedRecord:
        return FedRecord.from_ids(state.fed)

    def try_reuse_prefix(self, state, prompt_ids, *, injected=None):
        n = common_prefix(state.fed, None, prompt_ids, injected)
        return n, TupleState(state.fed[:n])

    def produce(self, state, token, position):
        key = state.fed[0] if state.fed else int(token)
        with self._lock:
            self.inside[key] = self.inside.get(key, 0) + 1
            self.overlaps += self.inside[key] > 1
        self.entered.set()
        try:
            if self.gate is not None:
                self.gate.wait(10)
            time.sleep(self.delay)
            if token == self.explode:
                raise RuntimeError("exploded")
            assert position == len(state.fed)
            fed = (*state.fed, int(token))
            seed = zlib.crc32(np.asarray(fed, np.int32).tobytes())
            logits = np.random.default_rng(seed).standard_normal(V).astype(np.float32)
            if token == self.poison:
                logits[0] = np.nan
            return jnp.asarray(logits), TupleState(fed)
        finally:
            with self._lock:
                self.inside[key] -= 1


def test_a_failed_turn_leaves_the_session_an_empty_slot():
    p = Guarded()
    pool = SessionPool(p, 1)
    first = pool.generate("s", request([1, 2, 3], 0))
    assert pool.slot_table()[0].fed_tokens == len(first.fed_ids) > 0
    p.poison = 9
    failed = pool.generate("s", request([1, 2, 3, 9], 0))
    assert failed.finish_reason is FinishReason.ERROR
    assert failed.usage.reused_tokens == 3
    assert pool.sessions() == {"s": 0} and pool.slot_table()[0].fed_tokens == 0
    assert pool.state_of("s") is None
    p.poison, p.explode = None, 8
    with pytest.raises(RuntimeError, match="exploded"):
        pool.generate("s", request([1, 2, 3, 8], 0))
    assert pool.slot_table()[0].busy is False and pool.slot_table()[0].fed_tokens == 0
    p.explode = None
    again = pool.generate("s", request([1, 2, 3, 4], 0))
    assert again.usage.reused_tokens == 0 and not again.usage.evicted


def test_state_of_is_a_copy_that_survives_donation():
    pool = SessionPool(ATT, 1)
    first = pool.generate("s", request([1, 2, 3, 4, 5], 0))
    copy = pool.state_of("s")
    run_raw_completion(ATT, request([1, 2, 3, 4, 5, 6], 1), state=copy)  # consumes the copy
    convo_prompt = [1, 2, 3, 4, 5, *first.token_ids, 7]
    again = pool.generate("s", request(convo_prompt, 1))
    fresh = run_raw_completion(ATT, request(convo_prompt, 1))
    assert again.usage.reused_tokens == FIRST + REPLY - 1
    assert np.array_equal(again.logits.view(np.uint32), fresh.logits.view(np.uint32))


@pytest.mark.parametrize("slots", [0, -1, True, 1.5, "2"])
def test_slot_counts_must_be_positive_integers(slots):
    with pytest.raises(SessionError, match="at least one slot"):
        SessionPool(ATT, slots)


def test_bad_arguments_are_refused_with_actionable_errors():
    with pytest.raises(SessionError, match="wait must be"):
        SessionPool(ATT, 1, wait=-1)
    with pytest.raises(BadInputError, match="not a LogitProducer"):
        SessionPool(object(), 1)
    pool = SessionPool(ATT, 2)
    first = pool.generate("a", request([1, 2, 3], 0))
    for ask in (pool.drop, pool.state_of, pool.fed_ids_of, pool.session_slot_evicted):
        with pytest.raises(SessionError, match="'ghost' holds no slot"):
            ask("ghost")
    with pytest.raises(SessionError, match="not be None"):
        pool.generate(None, request([1], 0))
    with pytest.raises(SessionError, match="hashable"):
        pool.generate(["a"], request([1], 0))
    with pytest.raises(BadInputError, match="cannot draft"):
        pool.generate("a", dataclasses.replace(request([1, 2], 0), draft_len=2))
    with pytest.raises(BadInputError, match="outside the vocabulary"):
        pool.generate("a", request([1, V], 0))
    # refused before any slot was taken: the state is intact and still reused
    assert pool.sessions() == {"a": 0} and not pool.session_slot_evicted("a")
    again = pool.generate("a", request([1, 2, 3, *first.token_ids], 1))
    assert again.usage.reused_tokens == 3 + REPLY - 1
    pool.drop("a")
    assert pool.sessions() == {} and pool.slot_of("a") is None


# -- concurrency: turns on one slot are serialized -------------------------------------------


class UnlockedPool(SessionPool):
    """Control: takes and returns slots without locking them."""

    def _claim(self, session_id, *, create):
        with self._cond:
            slot = self._owned(session_id) or min(
                self._slots, key=lambda s: (s.owner is not None, s.last_used))
            return slot, self._assign(slot, session_id)

    def _release(self, slot, *, store=None, reset=False):
        with self._cond:
            if store is not None and store.state is not None:
                slot.state, slot.fed_ids = store.state, tuple(store.fed_ids)
            elif reset:
                slot.state, slot.fed_ids = None, ()


def hammer(pool: SessionPool, sessions: str, threads_per_session: int = 3) -> list[object]:
    """Threads that all start at once, each running two turns of its session."""
    start = threading.Barrier(len(sessions) * threads_per_session)
    results: list[object] = []

    def worker(name: str, i: int) -> None:
        start.wait()
        for k in range(2):
            try:
                prompt = [ord(name) % V, 1, 2, i, k]
                results.append(pool.generate(name, request(prompt, k)))
            except Exception as e:  # collected: an assertion in a thread would be lost
                results.append(e)

    workers = [threading.Thread(target=worker, args=(n, i))
               for n in sessions for i in range(threads_per_session)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    return results


@pytest.mark.parametrize("slots", [1, 2])
def test_turns_on_one_slot_are_serialized(slots):
    p = Guarded(delay=0.002)
    results = hammer(SessionPool(p, slots), "ab")
    assert len(results) == 12 and all(not isinstance(r, Exception) for r in results)
    assert p.overlaps == 0


def test_control_unlocked_pool_runs_one_state_twice_at_once():
    p = Guarded(delay=0.002)
    hammer(UnlockedPool(p, 1), "a")
    assert p.overlaps > 0


def test_wait_zero_refuses_a_busy_slot_and_the_turn_in_flight_finishes():
    p = Guarded()
    p.gate = threading.Event()
    pool = SessionPool(p, 1, wait=0)
    box: list[object] = []
    runner = threading.Thread(target=lambda: box.append(pool.generate("s", request([1, 2], 0))))
    runner.start()
    assert p.entered.wait(10)
    with pytest.raises(SessionError, match="its slot is running another turn"):
        pool.generate("s", request([1, 2, 3], 0))
    with pytest.raises(SessionError, match="every slot is running another turn"):
        pool.generate("t", request([4, 5], 0))
    with pytest.raises(SessionError, match="refuses to wait"):
        pool.drop("s")
    assert pool.slot_table()[0].busy
    p.gate.set()
    runner.join(10)
    assert box and box[0].finish_reason is FinishReason.LENGTH
    assert pool.fed_ids_of("s") == box[0].fed_ids


def test_a_thread_never_waits_for_a_slot_it_holds_and_a_closed_stream_frees_it():
    pool = SessionPool(Guarded(), 1)
    stream = pool.stream("s", request([1, 2, 3], 0))
    next(stream)  # the turn now holds the slot
    with pytest.raises(SessionError, match="already runs a turn"):
        pool.generate("s", request([1, 2, 3], 0))
    with pytest.raises(SessionError, match="already runs a turn"):
        pool.generate("t", request([1, 2, 3], 0))  # the only slot is this thread's
    stream.close()
    info = pool.slot_table()[0]
    assert (info.owner, info.busy, info.fed_tokens) == ("s", False, 0)
    assert pool.generate("s", request([1, 2, 3], 0)).usage.reused_tokens == 0
