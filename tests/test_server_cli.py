"""``turbospark-jax serve``: its flags are checked before anything loads (one line, status 1)."""

import io

import pytest

from turbospark_jax.cli import main


@pytest.mark.parametrize(("argv", "words"), [
    (["--session-slots", "0"], "--session-slots must be >= 1"),
    (["--context", "1"], "--context must be >= 2"),
    (["--ngram", "0"], "--ngram must be >= 1"),
    (["--speculative", "--ngram", "2"], "choose one drafter"),
    (["--width", "0"], "--width must be >= 1"),
    (["--prefill-rows", "0"], "--prefill-rows must be >= 1"),
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--ngram", "2"], "one replica only"),
])
def test_bad_serve_flags_fail_before_loading(argv, words):
    err = io.StringIO()
    assert main(["serve", *argv], stdout=io.StringIO(), stderr=err) == 1
    assert words in err.getvalue() and err.getvalue().count("\n") == 1


def test_serve_help_names_the_endpoints():
    out = io.StringIO()
    assert main(["serve", "--help"], stdout=out, stderr=io.StringIO()) == 0
    assert "/v1/chat/completions" in out.getvalue() and "--session-slots" in out.getvalue()
