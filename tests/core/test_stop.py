"""Tests for turbospark_jax.core.stop: stop strings across pushes, held-back text,
leftmost-longest."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark_jax.core.stop import StopMatcher
from turbospark_jax.errors import BadInputError


def reference(text: str, stops: list[str], include_stop: bool) -> tuple[str, str | None]:
    """The non-streaming answer: cut at the leftmost match, longest on ties."""
    for start in range(len(text)):
        hits = [s for s in stops if text.startswith(s, start)]
        if hits:
            stop = max(hits, key=len)
            return text[:start] + (stop if include_stop else ""), stop
    return text, None


def stream(
    pieces: list[str], stops: list[str], include_stop: bool = False
) -> tuple[list[str], str, StopMatcher]:
    """Push ``pieces`` until a stop, then flush; returns (emits per push, all output, matcher)."""
    matcher = StopMatcher(stops, include_stop=include_stop)
    emits = []
    for piece in pieces:
        emit, stopped = matcher.push(piece)
        emits.append(emit)
        assert stopped == matcher.stopped
        if stopped:
            break
    final = matcher.flush()
    return emits, "".join(emits) + final, matcher


@pytest.mark.parametrize(
    ("text", "stops", "want", "matched"),
    [
        ("hello world", ["world"], "hello ", "world"),
        ("hello wor", ["world"], "hello wor", None),  # near miss at the end
        ("hello worlD", ["world"], "hello worlD", None),  # near miss, one char off
        ("aab", ["ab"], "a", "ab"),  # a failed start overlapping the real one
        ("abcd", ["ab", "abc", "bcd"], "", "abc"),  # same start: the longest
        ("xbcd", ["ab", "abc", "bcd"], "x", "bcd"),
        ("abd", ["ab", "abc", "bcd"], "", "ab"),
        ("xabcd", ["bcd", "abc"], "x", "abc"),  # earliest beats listed first
        ("abcde", ["abcdf", "bc"], "a", "bc"),  # a longer candidate that fails
        ("stop", ["stop"], "", "stop"),
        ("no stops here", [], "no stops here", None),
        ("안녕하세요 세계", ["세계"], "안녕하세요 ", "세계"),
        ("안녕하세", ["세계"], "안녕하세", None),
        ("hi 🙂🙃 there", ["🙃"], "hi 🙂", "🙃"),
        ("a🙂b", ["🙂b", "🙂c"], "a", "🙂b"),
        ("line\n\nnext", ["\n\n"], "line", "\n\n"),
    ],
)
def test_trigger_and_near_miss_table(
    text: str, stops: list[str], want: str, matched: str | None
) -> None:
    assert reference(text, stops, False) == (want, matched)  # the table agrees with the spec
    for pieces in ([text], list(text)):  # one push, and one code point per push
        _, out, matcher = stream(pieces, stops)
        assert (out, matcher.matched) == (want, matched)
        _, out, matcher = stream(pieces, stops, include_stop=True)
        assert out == want + (matched or "")


def test_stop_string_over_three_pushes() -> None:
    matcher = StopMatcher(["<|end|>"])
    assert matcher.push("Hello <") == ("Hello ", False)
    assert matcher.push("|en") == ("", False)
    assert matcher.held == "<|en"
    assert matcher.push("d|> and more") == ("", True)
    assert matcher.matched == "<|end|>"
    assert matcher.text == "Hello "
    # Nothing after the stop is ever emitted.
    assert matcher.push("later") == ("", True)
    assert matcher.flush() == ""


def test_include_stop_emits_the_stop_string_and_nothing_after() -> None:
    matcher = StopMatcher(["<|end|>"], include_stop=True)
    assert matcher.push("Hi <|e") == ("Hi ", False)
    assert matcher.push("nd|>tail") == ("<|end|>", True)
    assert matcher.text == "Hi <|end|>"


def test_held_text_released_when_near_miss_resolves() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.push("a</") == ("a", False)
    assert matcher.held == "</"
    assert matcher.push("b") == ("</b", False)
    assert matcher.held == ""
    # A near miss whose tail starts a new candidate releases only the part that cannot match.
    assert matcher.push(" <</") == (" <", False)
    assert matcher.held == "</"
    assert matcher.push("s>") == ("", True)
    assert matcher.text == "a</b <"


def test_flush_releases_the_held_part() -> None:
    matcher = StopMatcher(["<|im_end|>"])
    assert matcher.push("done <|im") == ("done ", False)
    assert matcher.flush() == "<|im"
    assert matcher.matched is None and not matcher.stopped
    assert matcher.text == "done <|im"
    assert matcher.flush() == ""
    with pytest.raises(BadInputError, match="flush"):
        matcher.push("more")


def test_a_match_waits_while_a_longer_or_earlier_one_can_still_complete() -> None:
    # "ab" has matched, but "abc" starts at the same place and could still complete.
    matcher = StopMatcher(["ab", "abc"], include_stop=True)
    assert matcher.push("xab") == ("x", False)
    assert matcher.push("c") == ("abc", True)
    assert matcher.matched == "abc"
    # The same pending match, settled by a character that rules "abc" out.
    matcher = StopMatcher(["ab", "abc"], include_stop=True)
    assert matcher.push("ab") == ("", False)
    assert matcher.push("d") == ("ab", True)
    # ... or by the end of generation.
    matcher = StopMatcher(["ab", "abc"], include_stop=True)
    assert matcher.push("ab") == ("", False)
    assert matcher.flush() == "ab"
    assert matcher.matched == "ab"
    # "bc" is complete, but "abcd" starts earlier and could still complete.
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.push("abc") == ("", False)
    assert matcher.push("x") == ("a", True)
    assert matcher.matched == "bc"


def test_korean_and_emoji_split_across_pushes() -> None:
    _, out, matcher = stream(["감사", "합니", "다. 다음", "은"], ["다음"])
    assert (out, matcher.matched) == ("감사합니다. ", "다음")
    emits, out, matcher = stream(["ok 👍", "🏽 fine 🙂", "🙃!"], ["🙂🙃"])
    assert (out, matcher.matched) == ("ok 👍🏽 fine ", "🙂🙃")
    assert emits[1] == "🏽 fine "  # the 🙂 is held until 🙃 completes the stop


@pytest.mark.parametrize(
    ("stops", "fragment"),
    [([""], "non-empty"), (["ok", ""], "non-empty"), ("</s>", "collection"), ([3], "str")],
)
def test_bad_stop_strings_raise(stops: object, fragment: str) -> None:
    with pytest.raises(BadInputError, match=fragment):
        StopMatcher(stops)  # type: ignore[arg-type]


def test_push_rejects_non_text() -> None:
    with pytest.raises(BadInputError, match="str"):
        StopMatcher(["x"]).push(b"bytes")  # type: ignore[arg-type]


def test_duplicates_are_ignored() -> None:
    assert StopMatcher(["a", "b", "a"]).stop_strings == ("a", "b")


ALPHABET = "ab c한🙂"
texts = st.text(alphabet=ALPHABET, max_size=30)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=4)


@st.composite
def split_text(draw: st.DrawFn) -> list[str]:
    text = draw(texts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(pieces=split_text(), stops=stop_lists, include_stop=st.booleans())
def test_streaming_equals_non_streaming(
    pieces: list[str], stops: list[str], include_stop: bool
) -> None:
    text = "".join(pieces)
    matcher = StopMatcher(stops, include_stop=include_stop)
    received = emitted = ""
    for piece in pieces:
        emit, stopped = matcher.push(piece)
        received += piece
        emitted += emit
        if stopped:
            break
        # Whatever is held could still start a stop string; everything else was released.
        held = matcher.held
        assert emitted + held == received
        assert held == "" or any(len(s) > len(held) and s.startswith(held) for s in stops)
    out = emitted + matcher.flush()
    assert out == matcher.text
    assert (out, matcher.matched) == reference(text, stops, include_stop)
