"""Tests for turbospark_jax.core.detokenize and the fixture tokenizers it is exercised with."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from turbospark_jax.core.detokenize import IncrementalDetokenizer
from turbospark_jax.errors import BadInputError
from turbospark_jax.testing import tokenizers as fixtures
from turbospark_jax.testing.tokenizers import byte_fallback_bpe, byte_level_bpe, byte_token_ids

BYTE_LEVEL = byte_level_bpe()
BYTE_FALLBACK = byte_fallback_bpe()
TOKENIZERS = {"byte_level": BYTE_LEVEL, "fallback": BYTE_FALLBACK}
# Tests take the tokenizer's name, so a failure report does not print a whole vocabulary.
BOTH = pytest.mark.parametrize("kind", list(TOKENIZERS))
FFFD = "\ufffd"


def stream(
    tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, skip: bool = True
) -> tuple[list[str], str]:
    """Push every id, then flush; returns (what each push returned, everything emitted)."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces = [detok.push(i) for i in ids]
    out = "".join(pieces) + detok.flush()
    assert out == detok.text
    assert detok.token_ids == ids
    return pieces, out


class ByteTokenizer:
    """A minimal ``TokenizerLike``: one id per byte, decoded with Python's UTF-8 codec."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        del skip_special_tokens
        return bytes(ids).decode("utf-8", errors="replace")

    def id_to_token(self, id: int, /) -> str | None:
        return f"<{id}>" if 0 <= id < 256 else None


# -- examples -----------------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("char", ["한", "🙂", "é", "中"])
def test_a_character_split_over_tokens_waits_until_complete(kind: str, char: str) -> None:
    tok = TOKENIZERS[kind]
    ids = byte_token_ids(tok, char.encode())
    pieces, out = stream(tok, ids)
    assert pieces == [""] * (len(ids) - 1) + [char]
    assert out == char


@BOTH
def test_text_before_an_unfinished_character_is_not_held(kind: str) -> None:
    tok = TOKENIZERS[kind]
    ids = byte_token_ids(tok, "ab한".encode())
    pieces, _ = stream(tok, ids)
    assert pieces == ["a", "b", "", "", "한"]


@BOTH
def test_flush_releases_an_unfinished_character_as_the_decoder_writes_it(kind: str) -> None:
    tok = TOKENIZERS[kind]
    ids = byte_token_ids(tok, "x한".encode()[:3])  # "x" and two of 한's three bytes
    pieces, out = stream(tok, ids)
    assert pieces == ["x", "", ""]
    assert out == "x" + tok.decode(ids[1:])
    assert out.endswith(FFFD)
    # (A whole-sequence decode agrees for byte-level BPE; ByteFallback turns every byte of an
    # invalid run into U+FFFD, the already finished "x" included.)
    assert (out == tok.decode(ids)) == (tok is BYTE_LEVEL)


def test_the_byte_level_fixture_splits_multibyte_characters() -> None:
    enc = BYTE_LEVEL.encode("안녕하세요 🙂")
    assert enc.ids != [] and BYTE_LEVEL.decode(enc.ids) == "안녕하세요 🙂"
    assert any(BYTE_LEVEL.decode([i]).endswith(FFFD) for i in enc.ids)


def test_the_byte_fallback_fixture_spells_rare_characters_in_bytes() -> None:
    enc = BYTE_FALLBACK.encode("게 🦀")
    assert {"<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"} <= set(enc.tokens)
    assert BYTE_FALLBACK.decode(enc.ids) == "게 🦀"


def test_prompt_context_keeps_the_first_tokens_leading_space() -> None:
    prompt = BYTE_FALLBACK.encode("Say:").ids
    reply = BYTE_FALLBACK.encode(" hi there").ids
    # Alone, a sentencepiece decoder drops the first token's space ...
    assert stream(BYTE_FALLBACK, reply)[1] == "hi there"
    # ... after the prompt it is kept.
    assert stream(BYTE_FALLBACK, reply, prompt=prompt)[1] == " hi there"
    full = BYTE_FALLBACK.decode(prompt + reply)
    assert full == "Say: hi there"


def test_a_prompt_ending_in_special_tokens_still_gives_the_reply_its_space() -> None:
    """Found by the property below: a prompt whose last ids are all skipped special tokens
    (here five ``<unk>``) leaves the usual context window empty of text; the detokenizer must
    reach back past them."""
    unk = 0
    prompt = [*BYTE_FALLBACK.encode("Say:").ids, *[unk] * 7]
    reply = BYTE_FALLBACK.encode(" 0").ids
    assert BYTE_FALLBACK.decode(prompt + reply) == "Say: 0"
    assert stream(BYTE_FALLBACK, reply, prompt=prompt)[1] == " 0"


def test_array_ids_are_accepted() -> None:
    prompt = np.array(BYTE_LEVEL.encode("Say:").ids)
    reply = BYTE_LEVEL.encode(" 안녕").ids
    detok = IncrementalDetokenizer(BYTE_LEVEL, prompt)
    out = "".join(detok.push(token) for token in jnp.array(reply)) + detok.flush()
    assert out == " 안녕"


def test_a_prompt_ending_inside_a_character_leaves_it_to_the_reply() -> None:
    data = "ok한".encode()
    ids = byte_token_ids(BYTE_LEVEL, data)
    assert stream(BYTE_LEVEL, ids[-1:], prompt=ids[:-1])[1] == "한"


def test_a_skipped_special_token_does_not_eat_the_next_space() -> None:
    eos = 2
    ids = [*BYTE_FALLBACK.encode("hi").ids, eos, *BYTE_FALLBACK.encode(" there").ids]
    assert BYTE_FALLBACK.decode(ids) == "hi there"
    pieces, out = stream(BYTE_FALLBACK, ids)
    assert out == "hi there"
    assert pieces[len(BYTE_FALLBACK.encode("hi").ids)] == ""  # the special token shows nothing


@BOTH
def test_skip_special_tokens(kind: str) -> None:
    tok = TOKENIZERS[kind]
    bos, eos = (1, 2) if kind == "fallback" else (0, 1)
    body = tok.encode("hi 한").ids
    ids = [bos, *body, eos]
    assert stream(tok, ids, skip=True)[1] == tok.decode(ids, skip_special_tokens=True)
    shown = stream(tok, ids, skip=False)[1]
    assert shown == tok.decode(ids, skip_special_tokens=False)
    assert tok.id_to_token(eos) in shown and tok.id_to_token(eos) not in stream(tok, ids)[1]


def test_invalid_ids_and_misuse_raise() -> None:
    detok = IncrementalDetokenizer(BYTE_LEVEL)
    with pytest.raises(BadInputError, match="vocabulary"):
        detok.push(BYTE_LEVEL.get_vocab_size())
    with pytest.raises(BadInputError, match="vocabulary"):
        detok.push(-1)
    with pytest.raises(BadInputError, match="integer"):
        detok.push("a")  # type: ignore[arg-type]
    with pytest.raises(BadInputError, match="integer"):
        detok.push(3.0)  # type: ignore[arg-type]
    with pytest.raises(BadInputError, match="prompt id"):
        IncrementalDetokenizer(BYTE_LEVEL, [5, 10**6])
    assert detok.token_ids == []  # a rejected id leaves the detokenizer as it was
    assert detok.push(70) == BYTE_LEVEL.decode([70])
    assert detok.flush() == ""
    assert detok.flush() == ""
    with pytest.raises(BadInputError, match="flush"):
        detok.push(70)


def test_fixture_tokenizers_are_deterministic_and_fresh() -> None:
    before = (BYTE_LEVEL.to_str(), BYTE_FALLBACK.to_str())
    fixtures._byte_level_json.cache_clear()
    fixtures._byte_fallback_json.cache_clear()
    again = byte_level_bpe(), byte_fallback_bpe()
    assert (again[0].to_str(), again[1].to_str()) == before
    assert again[0] is not byte_level_bpe()  # every call hands out its own object
    assert [BYTE_LEVEL.id_to_token(i) for i in range(3)] == list(fixtures.BYTE_LEVEL_SPECIALS)
    assert BYTE_FALLBACK.id_to_token(3) == "<0x00>" and BYTE_FALLBACK.id_to_token(258) == "<0xFF>"
    with pytest.raises(BadInputError, match="vocab_size"):
        byte_level_bpe(vocab_size=100)
    with pytest.raises(BadInputError, match="corpus"):
        byte_level_bpe(corpus="not a list")


# -- properties ---------------------------------------------------------------------------------

# Characters of every UTF-8 length, with the scripts and emoji models actually emit.
CHARS = st.one_of(
    st.sampled_from(list("ab Z0.,\n?한국어안녕요게🙂🎉👍🏽‍❤éñü中文日本Жλ")),
    # Any character but U+FFFD itself, which would read as an unfinished one.
    st.characters(codec="utf-8", exclude_characters=FFFD),
)
SEGMENT_TEXT = st.text(CHARS, min_size=1, max_size=6)


@st.composite
def valid_id_sequences(draw: st.DrawFn, tok: Tokenizer) -> list[int]:
    """Ids that decode to valid UTF-8 but need not be the canonical tokenization.

    Segments are tokenized normally or spelled byte by byte (so characters are cut at any
    byte), and special tokens may sit between segments.
    """
    ids: list[int] = []
    for _ in range(draw(st.integers(0, 6))):
        segment = draw(st.sampled_from(["encode", "bytes", "special"]))
        if segment == "special":
            ids.append(draw(st.integers(0, 2)))  # ids 0..2 are special in both fixtures
            continue
        text = draw(SEGMENT_TEXT)
        if segment == "encode":
            ids += tok.encode(text, add_special_tokens=False).ids
        else:
            ids += byte_token_ids(tok, text.encode())
    return ids


@pytest.mark.parametrize("skip", [True, False])
@BOTH
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streamed_text_equals_decode_of_valid_sequences(
    kind: str, skip: bool, data: st.DataObject
) -> None:
    tok = TOKENIZERS[kind]
    ids = data.draw(valid_id_sequences(tok))
    pieces, out = stream(tok, ids, skip=skip)
    assert out == tok.decode(ids, skip_special_tokens=skip)
    assert not any(FFFD in piece for piece in pieces)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, BYTE_LEVEL.get_vocab_size() - 1), max_size=24))
def test_byte_level_streamed_text_equals_decode_of_any_ids(ids: list[int]) -> None:
    # Invalid UTF-8 included: byte-level decoding is local, so the split never shows.
    assert stream(BYTE_LEVEL, ids)[1] == BYTE_LEVEL.decode(ids)


@BOTH
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_reply_after_prompt_reads_as_in_the_whole_conversation(
    kind: str, data: st.DataObject
) -> None:
    tok = TOKENIZERS[kind]
    prompt = data.draw(valid_id_sequences(tok))
    reply = data.draw(valid_id_sequences(tok))
    whole, head = tok.decode(prompt + reply), tok.decode(prompt)
    assert whole.startswith(head)
    pieces, out = stream(tok, reply, prompt=prompt)
    assert out == whole[len(head) :]
    assert not any(FFFD in piece for piece in pieces)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=24))
def test_any_tokenizer_like_works(data: bytes) -> None:
    tok = ByteTokenizer()
    _, out = stream(tok, list(data))  # type: ignore[arg-type]
    assert out == data.decode("utf-8", errors="replace")
