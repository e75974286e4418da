"""Chat sessions: the whole history is rendered and re-tokenized every turn, the previous reply
comes back from its TEXT, and reuse (keyed on what was fed) never changes a reply.

Two tokenizers: a character tokenizer where every reply round-trips exactly unless the model
generates the turn-start marker (so reuse runs through the whole reply), and a byte-level BPE
fixture where a random model's bytes rarely re-tokenize as generated (so reuse stops inside
the reply). Replies, token ids and logits (as uint32) must equal serving every turn fresh.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark_jax import Completion, SamplingConfig
from turbospark_jax.core.kv_prefix import common_prefix, reusable_prefix
from turbospark_jax.errors import (
    BadInputError,
    ContextOverflowError,
    SessionError,
    UnsupportedCapabilityError,
)
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.sessions.chat import ChatSession, default_stop_ids
from turbospark_jax.sessions.session_pool import SessionPool
from turbospark_jax.speculative.drafters import NGramDrafter
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_jax.testing.conformance import perturbed
from turbospark_jax.testing.fixtures import SnapshotReference, multi_turn_producers
from turbospark_jax.testing.tokenizers import byte_level_bpe
from turbospark_jax.testing.toy import toy_attention_producer


class CharTokenizer:
    """One character per id: ``⏹`` (0) ends a turn and is the eos, ``⏵`` (1) starts one,
    then 30 plain characters. Both markers are special (left out of decoded text), so a reply
    round-trips exactly unless the model generates ``⏵`` inside it."""

    CHARS = "⏹⏵abcdefghijklmnopqrstuvwxyz .,?"
    eos_token_id = 0
    chat_template = "(rendered in Python: apply_chat_template below)"

    def __init__(self, returns_ids: bool = False) -> None:
        self.returns_ids = returns_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        del add_special_tokens
        return [self.CHARS.index(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.CHARS[i] for i in ids if not (skip_special_tokens and i < 2))

    def id_to_token(self, i: int) -> str | None:
        return self.CHARS[i] if 0 <= i < len(self.CHARS) else None

    def token_to_id(self, token: str) -> int | None:
        return self.CHARS.index(token) if len(token) == 1 and token in self.CHARS else None

    def apply_chat_template(self, messages, add_generation_prompt: bool = True):
        text = "".join(f"⏵{m['role'][0]}{m['content']}⏹" for m in messages)
        text += "⏵a" if add_generation_prompt else ""
        return self.encode(text) if self.returns_ids else text


CHAR = CharTokenizer()
V = len(CharTokenizer.CHARS)  # 32: the same toy and dense programs as test_session_pool
BPE_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
BPE = Tokenizer.from_tokenizers(
    byte_level_bpe(), bos="<|bos|>", eos="<|eos|>", pad="<|pad|>", chat_template=BPE_TEMPLATE
)

PRODUCERS = multi_turn_producers(V)
ATT = PRODUCERS["attention_donating"]
ATT_BPE = toy_attention_producer(vocab=BPE.vocab_size, capacity=256, width=4, steps_per_call=8,
                                 donate=True)
SAMPLED = SamplingConfig(temperature=1.0)


def chat_pair(producer, tokenizer, **settings_):
    """The same conversation twice: served with reuse, and fresh every turn."""
    reuse = ChatSession(producer, tokenizer, session_id="reuse", system="be brief",
                        record_logits=True, **settings_)
    fresh = ChatSession(producer, tokenizer, session_id="fresh", system="be brief",
                        record_logits=True, **settings_)
    return reuse, fresh


def send_fresh(chat: ChatSession, text: str) -> Completion:
    if chat.pool.slot_of(chat.session_id) is not None:
        chat.pool.drop(chat.session_id)
    return chat.send(text)


def difference(got: Completion, want: Completion) -> str | None:
    """How two servings of one turn differ (None: bitwise the same)."""
    if got.prompt_ids != want.prompt_ids:
        return "prompts differ"
    if got.text != want.text or got.token_ids != want.token_ids:
        return f"replies differ: {got.text!r} vs {want.text!r}"
    a, b = got.logits, want.logits
    if a.shape != b.shape or not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
        return "logits differ"
    return None


def converse(reuse: ChatSession, fresh: ChatSession, messages: list[str]):
    """Send ``messages`` to both; return (turns with reuse, first difference or None)."""
    turns, problem = [], None
    for text in messages:
        got, want = reuse.send(text), send_fresh(fresh, text)
        turns.append(got)
        problem = problem or difference(got, want)
    return turns, problem


def reuse_problems(turns: list[Completion], rewindable: bool = True) -> list[str]:
    """Reuse must be the common prefix of the previous turn's FED ids and the new prompt (for
    a state that cannot rewind: all of the record, else a prompt-end snapshot, else 0)."""
    problems = []
    snapshots = SnapshotReference()
    for i in range(len(turns)):
        if i:
            fed = turns[i - 1].fed_ids
            prompt = turns[i].prompt_ids
            expected = (reusable_prefix(fed, None, prompt) if rewindable
                        else snapshots.reuse(fed, prompt))
            if turns[i].usage.reused_tokens != expected:
                problems.append(
                    f"turn {i}: reused {turns[i].usage.reused_tokens}, expected {expected}")
        snapshots.served(turns[i].prompt_ids, turns[i].usage.reused_tokens)
    return problems


words = st.text(alphabet="abcdefghij ,", min_size=4, max_size=4)


@pytest.mark.parametrize("name", sorted(PRODUCERS))
@settings(max_examples=8)
@given(messages=st.lists(words, min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_char_chat_with_reuse_equals_fresh_and_reuses_whole_replies(name, messages, seed):
    producer = PRODUCERS[name]
    reuse, fresh = chat_pair(producer, CHAR, max_tokens=6, sampling=SAMPLED, seed=seed)
    turns, problem = converse(reuse, fresh, messages)
    assert problem is None
    assert reuse_problems(turns, producer.can_rewind) == []
    for prev, turn in itertools.pairwise(turns):
        fed = prev.fed_ids
        # The last generated token is never fed; a turn marker before it is dropped from the
        # reply's text, so the next prompt parts from the fed record there.
        if 1 not in prev.token_ids[:-1]:
            assert turn.usage.reused_tokens == len(fed)
        elif producer.can_rewind:
            assert turn.usage.reused_tokens < len(fed)


def test_control_reuse_claiming_one_more_breaks_chat_equality():
    reuse = ChatSession(perturbed(ATT, "reuse_claims_one_more"), CHAR, record_logits=True,
                        max_tokens=6, sampling=SAMPLED, seed=1)
    fresh = ChatSession(ATT, CHAR, record_logits=True, max_tokens=6, sampling=SAMPLED, seed=1)
    assert converse(reuse, fresh, ["hi a", "more", "bye "])[1] is not None


texts = st.text(alphabet="ab 안녕🙂é\n", min_size=1, max_size=6)


@settings(max_examples=6)
@given(messages=st.lists(texts, min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_byte_level_chat_with_reuse_equals_fresh(messages, seed):
    reuse, fresh = chat_pair(ATT_BPE, BPE, max_tokens=8, sampling=SAMPLED, seed=seed)
    turns, problem = converse(reuse, fresh, messages)
    assert problem is None
    assert reuse_problems(turns) == []


def test_byte_level_reply_re_tokenizes_differently_and_reuse_stops_inside_it():
    reuse, fresh = chat_pair(ATT_BPE, BPE, max_tokens=10, sampling=SAMPLED, seed=3)
    turns, problem = converse(reuse, fresh, ["hello", "how are you?", "안녕하세요"])
    assert problem is None
    first, second = turns[0], turns[1]
    generated = [t for t in first.token_ids if t not in default_stop_ids(BPE)]
    assert BPE.encode(first.text, add_special_tokens=False) != generated
    # reuse covers the previous prompt and stops inside the reply, where the two splits part
    assert len(first.prompt_ids) <= second.usage.reused_tokens < len(first.fed_ids)
    assert second.usage.reused_tokens == common_prefix(
        first.fed_ids, None, second.prompt_ids)
    assert second.usage.prefilled_tokens == len(second.prompt_ids) - second.usage.reused_tokens


def test_sessions_sharing_one_slot_evict_each_other_and_keep_their_replies():
    pool = SessionPool(ATT, 1)
    alone = {n: ChatSession(ATT, CHAR, session_id=n, max_tokens=5, record_logits=True,
                            sampling=SAMPLED, seed=7) for n in "ab"}
    shared = {n: ChatSession(pool, CHAR, session_id=n, max_tokens=5, record_logits=True,
                             sampling=SAMPLED, seed=7) for n in "ab"}
    for n, text in zip("abab", ["hi a", "hi b", "more", "more"], strict=True):
        got, want = shared[n].send(text), alone[n].send(text)
        assert difference(got, want) is None
        assert got.usage.evicted == (text != "hi a")
        assert got.usage.reused_tokens == 0 or not got.usage.evicted
    assert pool.evictions == 3 and pool.sessions() == {"b": 0}


def test_speculative_chat_equals_plain_greedy_chat():
    pair = SpeculativePair(ATT, NGramDrafter(V, max_n=3))
    spec = ChatSession(pair, CHAR, draft_len=3, max_tokens=6, record_logits=True)
    plain = ChatSession(ATT, CHAR, max_tokens=6, record_logits=True)
    for text in ["abc ", "abc ", "dcba"]:
        got, want = spec.send(text), plain.send(text)
        assert difference(got, want) is None
        assert got.speculative is not None
    assert got.usage.reused_tokens > 0


def test_stream_yields_the_reply_and_updates_the_history():
    chat = ChatSession(ATT_BPE, BPE, system="sys", max_tokens=8, sampling=SAMPLED, seed=5)
    stream = chat.stream("hello")
    deltas = [event.text for event in stream]
    turn = stream.result
    assert "".join(deltas) == turn.text
    assert chat.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": turn.text},
    ]
    assert turn.finish_reason.value in ("length", "stop_token")
    assert turn.summary().startswith(f"prompt {len(turn.prompt_ids)} tokens (reused 0")


def test_template_returning_ids_is_used_as_is():
    chat = ChatSession(ATT, CharTokenizer(returns_ids=True), max_tokens=3)
    turn = chat.send("abc")
    assert list(turn.prompt_ids) == CHAR.encode("⏵uabc⏹⏵a")


def test_a_closed_stream_leaves_the_history_and_frees_the_slot():
    chat = ChatSession(ATT, CHAR, session_id="s", max_tokens=6, sampling=SAMPLED, seed=2)
    chat.send("hi a")
    with chat.stream("more") as stream:
        next(iter(stream), None)
    assert [m["content"] for m in chat.messages] == ["hi a", chat.messages[1]["content"]]
    assert chat.pool.slot_table()[0].fed_tokens == 0
    assert chat.send("more").usage.reused_tokens == 0


class _Forwarding:
    """A tokenizer wrapper whose members come through ``__getattr__`` (Python 3.12's
    ``isinstance`` against a runtime-checkable protocol would not see them)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_forwarding_tokenizer_is_taken_and_one_lacking_a_member_refused():
    chat = ChatSession(ATT, _Forwarding(CHAR), max_tokens=3, seed=1)
    assert chat.send("hi").text == ChatSession(ATT, CHAR, max_tokens=3, seed=1).send("hi").text

    class Lacking(_Forwarding):  # control: no apply_chat_template
        def __getattr__(self, name):
            if name == "apply_chat_template":
                raise AttributeError(name)
            return super().__getattr__(name)

    with pytest.raises(BadInputError, match="tokenizer must provide"):
        ChatSession(ATT, Lacking(CHAR))


def test_bad_settings_and_misuse_are_refused():
    with pytest.raises(BadInputError, match="unknown request setting"):
        ChatSession(ATT, CHAR, max_token=5)
    with pytest.raises(BadInputError, match="unknown request setting"):
        ChatSession(ATT, CHAR, prompt_ids=[1])
    with pytest.raises(ContextOverflowError):
        ChatSession(ATT, CHAR, max_tokens=500)
    with pytest.raises(BadInputError, match="cannot draft"):
        ChatSession(ATT, CHAR, draft_len=2)
    with pytest.raises(UnsupportedCapabilityError, match="no chat template"):
        ChatSession(ATT_BPE, Tokenizer.from_tokenizers(byte_level_bpe()))
    chat = ChatSession(ATT, CHAR, max_tokens=4, seed=1)
    with pytest.raises(BadInputError, match="unknown request setting"):
        chat.send("hi", temperature=1.0)
    with pytest.raises(BadInputError, match="must be a str"):
        chat.send(["hi"])
    stale = chat.stream("one")
    chat.send("two")
    with pytest.raises(SessionError, match="moved on"):
        next(stale)
    running = chat.stream("three")
    next(iter(running), None)
    with pytest.raises(SessionError, match="already running a turn"):
        chat.send("four")
    with pytest.raises(SessionError, match="running a turn"):
        chat.reset()
    running.close()
    chat.reset()
    assert chat.messages == [] and chat.pool.sessions() == {}
    assert default_stop_ids(CHAR) == (0,)
    assert default_stop_ids(BPE) == (BPE.eos_token_id,)
