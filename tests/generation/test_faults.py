"""Fault campaign: what a user sees when something breaks mid-generation, and what survives.

* non-finite logits at a chosen step, inside a device decode burst and inside a verify (host
  speculative rounds) or a device speculative round: the completion ends with
  ``FinishReason.ERROR`` and the non-finite message, the tokens before stay (speculative
  greedy emits exactly what plain greedy emits before the fault), nothing crashes;
* a tokenizer that raises mid-stream: the exception surfaces unchanged; a tokenizer that does
  not know a generated id: an ERROR finish; either way no state is offered that is not exact;
* a consumer that abandons a stream half way: the pool slot is clean, the session reusable;
* an exception in one session-pool turn while other sessions run on other threads: they
  finish bitwise as if served alone, the failing session's slot is clean;
* a context the device cannot hold: refused up front, naming the bytes.

The poisoned model: the toy attention model with one embedding row set to NaN, so feeding
that token (and only that) yields non-finite logits; every row before it is bitwise the clean
model's. Corrupted model folders are in ``test_faults_loading.py``.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from turbospark_jax import (
    CompletionRequest,
    FinishReason,
    SamplingConfig,
    run_raw_completion,
    stream_completion,
)
from turbospark_jax.core.state import copy_state, tree_bitwise_equal
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, ContextOverflowError
from turbospark_jax.generation import speculative_loop as speculative
from turbospark_jax.generation.completion import NON_FINITE_LOGITS
from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
from turbospark_jax.sessions.chat import ChatSession
from turbospark_jax.sessions.session_pool import SessionPool
from turbospark_jax.speculative.drafters import DraftModelDrafter, NGramDrafter
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_jax.testing.toy import (
    ToyAttentionModel,
    toy_attention_producer,
    toy_recurrent_producer,
)

V = 32
MAX_TOKENS = 24
CLEAN = {
    "attention": toy_attention_producer(vocab=V, capacity=96, width=8, steps_per_call=8),
    "recurrent": toy_recurrent_producer(vocab=V, capacity=96, width=8, steps_per_call=8),
}
ATT = CLEAN["attention"]


def poisoned(token: int, kind: str = "attention", *, donate: bool = False) -> BlockProducer:
    """The clean toy with the embedding of ``token`` set to NaN."""
    clean = CLEAN[kind]
    params = dict(clean.params)
    params["embed"] = params["embed"].at[token].set(jnp.nan)
    return BlockProducer(clean.model, params, capacity=96, width=8, steps_per_call=8,
                         donate=donate)


def greedy(prompt: list[int], **extra) -> CompletionRequest:
    return CompletionRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, record_logits=True,
                             burst=8, **extra)


def expected_failure(prompt: list[int], clean_tokens: list[int], token: int) -> list[int]:
    """What plain greedy emits on the poisoned model: up to and including the first emitted
    ``token`` (feeding it fails), nothing when the prompt holds it."""
    if token in prompt:
        return []
    return clean_tokens[: clean_tokens.index(token) + 1]


prompts = st.lists(st.integers(1, V - 1), min_size=3, max_size=6)


# -- non-finite logits -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(CLEAN))
@given(prompt=prompts, step=st.integers(0, MAX_TOKENS - 2))
def test_non_finite_logits_inside_a_device_decode_burst(kind, prompt, step):
    clean = run_raw_completion(CLEAN[kind], greedy(prompt))
    token = clean.token_ids[step]
    got = run_raw_completion(poisoned(token, kind), greedy(prompt))
    want = expected_failure(prompt, clean.token_ids, token)
    assert got.finish_reason is FinishReason.ERROR and got.error == NON_FINITE_LOGITS
    assert got.token_ids == want  # the tokens before the fault stay
    assert got.state is None and got.fed_ids == ()
    if want:  # and the logits behind them are the clean model's, bitwise
        assert np.array_equal(got.logits.view(np.uint32),
                              clean.logits[: len(want)].view(np.uint32))


def _pairs(kind: str, target: BlockProducer, token: int) -> dict[str, SpeculativePair]:
    make = toy_attention_producer if kind == "attention" else toy_recurrent_producer
    same = DraftModelDrafter(poisoned(token, kind))  # a drafter that fails at the same token
    other = DraftModelDrafter(make(vocab=V, capacity=96, width=8, seed=5))
    return {
        f"{name}-{loop}": SpeculativePair(target, drafter, device_rounds=loop == "device")
        for name, drafter in (("ngram", NGramDrafter(V, max_n=2)), ("same", same),
                              ("other", other))
        for loop in ("device", "host")
    }


@pytest.mark.parametrize("kind", sorted(CLEAN))
@given(prompt=prompts, step=st.integers(0, MAX_TOKENS - 2), draft_len=st.integers(1, 6))
def test_non_finite_logits_inside_verify_and_device_rounds(kind, prompt, step, draft_len):
    """Recurrent target: speculative greedy emits exactly what plain greedy emits before the
    fault (rows before a non-finite one are exact; the rollback restores by value).

    Attention target: a prefix of it. A rejected proposal whose K/V went non-finite reaches
    every row of its verify block and, as a dead row after the rollback, every later read:
    attention weighs a masked row by exactly 0, and 0 x NaN is NaN. So the loop may end one
    round earlier than plain decoding would have, keeping every token of the rounds before.
    """
    clean = run_raw_completion(CLEAN[kind], greedy(prompt))
    token = clean.token_ids[step]
    target = poisoned(token, kind)
    plain = run_raw_completion(target, greedy(prompt))
    for name, pair in _pairs(kind, target, token).items():
        got = run_raw_completion_speculative(pair, greedy(prompt, draft_len=draft_len))
        assert got.finish_reason is FinishReason.ERROR, name
        assert got.error == NON_FINITE_LOGITS, name
        assert got.state is None
        n = len(got.token_ids)
        if kind == "recurrent":
            assert got.token_ids == plain.token_ids, name
        else:
            assert got.token_ids == plain.token_ids[:n], name
        if n:  # the target rows behind the tokens that stay are plain decoding's, bitwise
            assert np.array_equal(got.logits.view(np.uint32),
                                  plain.logits[:n].view(np.uint32)), name


def test_control_judging_past_the_first_non_finite_row_loses_tokens(monkeypatch):
    """The control: a host loop that drops a whole round when any verified row is non-finite
    (as it did before) emits fewer tokens than plain greedy before the fault."""
    prompt = [3, 1, 4]
    clean = run_raw_completion(CLEAN["recurrent"], greedy(prompt))
    token = clean.token_ids[10]
    target = poisoned(token, "recurrent")
    plain = run_raw_completion(target, greedy(prompt))
    pair = SpeculativePair(target, DraftModelDrafter(CLEAN["recurrent"]), device_rounds=False)

    def all_or_nothing(rows, drafted):
        live = jnp.arange(rows.shape[0]) <= drafted
        return jnp.where(jnp.all(jnp.isfinite(rows) | ~live[:, None]), drafted + 1, 0)

    monkeypatch.setattr(speculative, "_leading_finite_rows", all_or_nothing)
    got = run_raw_completion_speculative(pair, greedy(prompt, draft_len=6))
    assert got.finish_reason is FinishReason.ERROR
    assert len(got.token_ids) < len(plain.token_ids)


# -- tokenizers that fail ----------------------------------------------------------------------


class CharTokenizer:
    """One character per id: ``$`` (0) is the eos and ends a turn; a chat template of its own."""

    CHARS = "$abcdefghijklmnopqrstuvwxyz .,?!"
    eos_token_id = 0
    chat_template = "(rendered in Python)"

    def encode(self, text, add_special_tokens=True):
        return [self.CHARS.index(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.CHARS[i] for i in ids)

    def id_to_token(self, i):
        return self.CHARS[i] if 0 <= i < len(self.CHARS) else None

    def token_to_id(self, token):
        return self.CHARS.index(token) if len(token) == 1 and token in self.CHARS else None

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return "".join(f"{m['role'][0]}{m['content']}$" for m in messages) + "a"


class RaisingTokenizer(CharTokenizer):
    """Raises on the ``fail_at``-th decode call (counting from 1), and on every one after."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.calls = fail_at, 0

    def decode(self, ids, skip_special_tokens=False):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError(f"tokenizer failed on call {self.calls}")
        return super().decode(ids, skip_special_tokens)


class ShortTokenizer(CharTokenizer):
    """Knows only the first ``size`` ids: a model vocabulary padded past the tokenizer's."""

    def __init__(self, size: int) -> None:
        self.size = size

    def id_to_token(self, i):
        return super().id_to_token(i) if i < self.size else None


CHAR = CharTokenizer()
PROMPT = [1, 2, 3, 4]


@pytest.mark.parametrize("fail_at", [1, 4, 8])
def test_a_raising_tokenizer_surfaces_and_leaves_the_state_handed_in(fail_at):
    """The exception is the caller's tokenizer's, so it surfaces unchanged (at the start, while
    the prompt is read as context, or mid-stream); no completion comes back, and the state
    handed in to a non-donating producer is still the same value."""
    follow = [*PROMPT, 5]
    clean = run_raw_completion(ATT, greedy(follow), tokenizer=CHAR)
    first = run_raw_completion(ATT, greedy(PROMPT))
    kept = copy_state(first.state)
    seen = []
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        for event in stream_completion(ATT, greedy(follow), tokenizer=RaisingTokenizer(fail_at),
                                       state=first.state):
            seen.append(event.text)
    assert clean.text.startswith("".join(seen))
    assert tree_bitwise_equal(first.state, kept)
    again = run_raw_completion(ATT, greedy(follow), tokenizer=CHAR, state=first.state)
    assert again.token_ids == clean.token_ids and again.text == clean.text


def test_a_raising_tokenizer_in_a_pool_turn_leaves_the_slot_clean():
    p = toy_attention_producer(vocab=V, capacity=96, width=8, donate=True)
    pool = SessionPool(p, 1)
    pool.generate("s", greedy(PROMPT), tokenizer=CHAR)
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        pool.generate("s", greedy([*PROMPT, 5]), tokenizer=RaisingTokenizer(4))
    info = pool.slot_table()[0]
    assert (info.owner, info.busy, info.fed_tokens) == ("s", False, 0)
    assert pool.state_of("s") is None
    again = pool.generate("s", greedy([*PROMPT, 5]), tokenizer=CHAR)
    fresh = run_raw_completion(p, greedy([*PROMPT, 5]), tokenizer=CHAR)
    assert again.usage.reused_tokens == 0
    assert np.array_equal(again.logits.view(np.uint32), fresh.logits.view(np.uint32))


@pytest.mark.parametrize("fail_at", [2, 9])
def test_a_raising_tokenizer_in_a_chat_turn_leaves_the_history(fail_at):
    """Failing while the turn is checked (2) leaves the slot as the last turn left it; failing
    mid-turn (9) leaves it fresh. Either way the state there is exact, and the history stays."""
    producer = toy_attention_producer(vocab=V, capacity=96, width=8, donate=True)
    chat = ChatSession(producer, CHAR, session_id="c", max_tokens=6)
    first = chat.send("hi")
    before = chat.messages
    chat.tokenizer = RaisingTokenizer(fail_at)
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        chat.send("more")
    assert chat.messages == before
    stored = chat.pool.state_of("c")
    if fail_at == 2:
        assert producer.fed_record(stored).to_host().ids == first.fed_ids
    else:
        assert stored is None and chat.pool.slot_table()[0].fed_tokens == 0
    chat.tokenizer = CHAR
    again = chat.send("more")
    fresh = ChatSession(producer, CHAR, max_tokens=6)
    fresh.send("hi")
    assert again.token_ids == fresh.send("more").token_ids


@given(size=st.integers(2, V - 1), prompt=st.lists(st.integers(1, 1), min_size=2, max_size=4))
def test_a_generated_id_the_tokenizer_does_not_know_ends_with_an_error(size, prompt):
    clean = run_raw_completion(ATT, greedy(prompt), tokenizer=CHAR)
    got = run_raw_completion(ATT, greedy(prompt), tokenizer=ShortTokenizer(size))
    unknown = [i for i, t in enumerate(clean.token_ids) if t >= size]
    if not unknown:
        assert got.token_ids == clean.token_ids and got.text == clean.text
        return
    k = unknown[0]
    assert got.finish_reason is FinishReason.ERROR and got.state is None
    assert f"generated token {clean.token_ids[k]}" in got.error
    assert got.token_ids == clean.token_ids[: k + 1]
    assert clean.text.startswith(got.text)


def test_a_prompt_id_the_tokenizer_does_not_know_is_bad_input_before_any_work():
    first = run_raw_completion(ATT, greedy(PROMPT))
    with pytest.raises(BadInputError, match="tokenizer's vocabulary"):
        stream_completion(ATT, greedy([*PROMPT, 20]), tokenizer=ShortTokenizer(10),
                          state=first.state)


# -- abandoned streams -------------------------------------------------------------------------


@pytest.mark.parametrize("after", [0, 1, 3])
def test_a_closed_pool_stream_leaves_the_slot_clean_and_the_session_reusable(after):
    p = toy_attention_producer(vocab=V, capacity=96, width=8, donate=True)
    pool = SessionPool(p, 2)
    first = pool.generate("s", greedy(PROMPT), tokenizer=CHAR)
    follow = [*PROMPT, *first.token_ids, 5]
    stream = pool.stream("s", greedy(follow), tokenizer=CHAR)
    for _ in range(after):
        next(stream)
    stream.close()
    info = pool.slot_table()[pool.slot_of("s")]
    assert not info.busy and info.owner == "s"
    # closed before it started, the turn never took the state; after, the slot starts fresh
    assert info.fed_tokens == (len(first.fed_ids) if after == 0 else 0)
    stored = pool.state_of("s")
    if stored is not None:  # whatever is offered matches its fed record
        assert p.fed_record(stored).to_host().ids == pool.fed_ids_of("s")
    again = pool.generate("s", greedy(follow), tokenizer=CHAR)
    fresh = run_raw_completion(p, greedy(follow), tokenizer=CHAR)
    assert again.token_ids == fresh.token_ids
    assert np.array_equal(again.logits.view(np.uint32), fresh.logits.view(np.uint32))


def test_a_closed_raw_stream_offers_nothing_and_a_closed_chat_turn_changes_nothing():
    stream = stream_completion(ATT, greedy(PROMPT), tokenizer=CHAR)
    next(stream)
    stream.close()
    assert stream.result is None
    chat = ChatSession(ATT, CHAR, max_tokens=8)
    chat.send("hi")
    before = chat.messages
    with chat.stream("more") as turn:
        next(turn)
    assert chat.messages == before


# -- one session fails while others run --------------------------------------------------------


def test_an_exception_in_one_pool_turn_leaves_concurrent_sessions_unharmed():
    p = toy_attention_producer(vocab=V, capacity=96, width=8, donate=True)
    sampled = SamplingConfig(temperature=1.0)
    prompts = {"b": [2, 4, 6], "c": [7, 5, 3, 1]}

    def turns(name, tokenizer, pool, results, start):
        start.wait()
        prompt = list(prompts.get(name, [1, 2, 3]))
        for k in range(3):
            request = greedy(prompt, sampling=sampled, seed=k)
            try:
                turn = pool.generate(name, request, tokenizer=tokenizer)
            except RuntimeError as exc:
                results.append((name, k, exc))
                return
            results.append((name, k, turn))
            prompt = [*prompt, *turn.token_ids, 9]

    def serve(names, failing):
        pool = SessionPool(p, 3)
        results = []
        start = threading.Barrier(len(names))
        threads = [threading.Thread(target=turns, args=(
            n, RaisingTokenizer(4) if n == failing else CHAR, pool, results, start))
            for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return pool, {(n, k): r for n, k, r in results}

    pool, together = serve("abc", failing="a")
    assert isinstance(together[("a", 0)], RuntimeError)
    for name in "bc":
        _, alone = serve(name, failing=None)
        for k in range(3):
            got, want = together[(name, k)], alone[(name, k)]
            assert got.token_ids == want.token_ids and got.text == want.text
            assert np.array_equal(got.logits.view(np.uint32), want.logits.view(np.uint32))
    failed = pool.slot_table()[pool.slot_of("a")]
    assert (failed.busy, failed.fed_tokens) == (False, 0)


# -- memory ------------------------------------------------------------------------------------


def test_a_context_the_device_cannot_hold_is_refused_up_front_with_the_figures():
    model = ToyAttentionModel(vocab=V)
    with pytest.raises(ContextOverflowError) as info:
        BlockProducer(model, ATT.params, capacity=2**40)
    message = str(info.value)
    needed = 2 * 2 * 2**40 * 16 * 4 + 3 * 2**40 * 4  # K and V of 2 layers, the fed record
    assert f"{needed + 12:,} bytes" in message and "available" in message


@pytest.mark.parametrize("capacity", [1, 96, 1000])
def test_the_state_estimate_is_exact(capacity):
    p = BlockProducer(ATT.model, ATT.params, capacity=capacity)
    state = p.init_state()
    assert p.state_bytes == sum(x.nbytes for x in jax.tree.leaves(state))



# -- the context, speculatively ----------------------------------------------------------------


def test_a_request_that_fills_the_context_runs_through_device_rounds():
    """Device rounds refused, mid-stream, a request whose prompt and max_tokens fill the
    context exactly (their bound added a whole draft to what the request may still emit)."""
    target = toy_attention_producer(vocab=V, capacity=64, width=8)
    request = CompletionRequest(prompt_ids=[1, 2, 3, 1, 2, 3], max_tokens=58, draft_len=4)
    got = run_raw_completion_speculative(SpeculativePair(target, NGramDrafter(V, 3)), request)
    plain = run_raw_completion(target, dataclasses.replace(request, draft_len=0))
    assert got.speculative.on_device and got.finish_reason is FinishReason.LENGTH
    assert got.token_ids == plain.token_ids


@pytest.mark.parametrize("loop", ["device", "host"])
def test_a_draft_model_with_a_shorter_context_bounds_the_pair(loop):
    """A draft model holding fewer positions than the target overflowed mid-stream (host
    loop) or wrote past its cache (device loop); the pair's context is now the shorter."""
    target = toy_attention_producer(vocab=V, capacity=64, width=8)
    small = toy_attention_producer(vocab=V, capacity=16, width=8)
    pair = SpeculativePair(target, DraftModelDrafter(small), device_rounds=loop == "device")
    assert pair.max_positions == 16
    with pytest.raises(ContextOverflowError):
        stream_completion(pair, CompletionRequest(prompt_ids=[1, 2, 3] * 3, max_tokens=20,
                                                  draft_len=3))
    request = CompletionRequest(prompt_ids=[1, 2, 3] * 3, max_tokens=7, draft_len=3)
    got = run_raw_completion_speculative(pair, request)
    assert got.token_ids == run_raw_completion(target, dataclasses.replace(
        request, draft_len=0)).token_ids
