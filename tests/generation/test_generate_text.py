"""The generation loop with a real ``tokenizers`` tokenizer: stop strings across token
boundaries (Korean, emoji, a stop string over three tokens), held-back text while streaming,
streaming == non-streaming, and the fed record for every finish reason."""

import numpy as np
import pytest

from turbospark_jax import (
    CompletionRequest,
    FinishReason,
    run_raw_completion,
    stream_completion,
)
from turbospark_jax.testing.scripted import ScriptedLogitProducer
from turbospark_jax.testing.tokenizers import byte_level_bpe, byte_token_ids

TOK = byte_level_bpe()
V = TOK.get_vocab_size()
EOS = TOK.token_to_id("<|eos|>")
PROMPT = TOK.encode("x = ").ids


def forcing(ids):
    """Scripted logits that make greedy decoding produce ``ids``: one step for the prompt
    chunk, then one per decode step."""
    steps = []
    for t in ids:
        row = np.zeros(V, np.float32)
        row[t] = 5.0
        steps.append(row)
    return ScriptedLogitProducer(steps)


def generate(text_or_ids, stop_strings=(), include=False, max_tokens=64, stop_ids=()):
    ids = byte_token_ids(TOK, text_or_ids.encode()) if isinstance(text_or_ids, str) else list(
        text_or_ids)
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=max_tokens,
                            stop_strings=list(stop_strings), include_stop_string=include,
                            stop_token_ids=list(stop_ids))
    whole = run_raw_completion(forcing(ids), req, tokenizer=TOK)
    stream = stream_completion(forcing(ids), req, tokenizer=TOK)
    deltas = [e.text for e in stream]
    assert "".join(deltas) == whole.text == stream.result.text
    assert all("\ufffd" not in d for d in deltas)
    return whole, deltas, ids


# (generated text, stop strings, expected text, expected finish)
TABLE = [
    ("hello world", ["wor"], "hello ", FinishReason.STOP_STRING),
    ("hello world", ["word"], "hello world", FinishReason.LENGTH),  # near miss
    ("안녕하세요 세계", ["하세"], "안녕", FinishReason.STOP_STRING),  # 3-byte chars: 6 tokens
    ("안녕하세요 세계", ["하세x"], "안녕하세요 세계", FinishReason.LENGTH),
    ("ok 🙂 done", ["🙂"], "ok ", FinishReason.STOP_STRING),  # one 4-byte char: 4 tokens
    ("abcabd", ["abd", "bca"], "a", FinishReason.STOP_STRING),  # earliest match wins
    ("abcd", ["bc", "bcd"], "a", FinishReason.STOP_STRING),  # overlapping prefixes
    ("end\n\nnext", ["\n\n"], "end", FinishReason.STOP_STRING),
]


@pytest.mark.parametrize("text,stops,expected,finish", TABLE)
def test_stop_string_table(text, stops, expected, finish):
    c, _, _ = generate(text, stops, max_tokens=len(byte_token_ids(TOK, text.encode())))
    assert c.text == expected
    assert c.finish_reason is finish
    if finish is FinishReason.STOP_STRING:
        assert c.stop_string in stops


def test_stop_string_over_three_tokens_is_held_back_while_streaming():
    # "세" is three byte tokens; the stop string is the whole character plus "계".
    _, deltas, _ = generate("안녕 세계!", ["세계"], max_tokens=20)
    assert "".join(deltas) == "안녕 "
    # nothing that could still become the stop string was released early
    assert not any("세" in d for d in deltas)


def test_include_stop_string():
    c, _, _ = generate("hello world", ["wor"], include=True, max_tokens=11)
    assert c.text == "hello wor"


def test_fed_record_for_every_finish_reason():
    ids = byte_token_ids(TOK, b"hello world")
    # length: every generated token but the last is fed
    c, _, _ = generate(ids, max_tokens=5)
    assert c.finish_reason is FinishReason.LENGTH
    assert c.fed_ids == (*PROMPT, *ids[:4])
    # stop token: generated, not fed, no text
    c, _, _ = generate([*ids[:3], EOS, *ids[3:]], stop_ids=[EOS])
    assert c.finish_reason is FinishReason.STOP_TOKEN and c.token_ids[-1] == EOS
    assert c.fed_ids == (*PROMPT, *ids[:3]) and c.text == "hel"
    # stop string: the token completing it is the last generated, and not fed
    c, _, _ = generate(ids, ["lo w"])
    assert c.finish_reason is FinishReason.STOP_STRING
    assert c.fed_ids == (*PROMPT, *c.token_ids[:-1])
    # error: the state (and so its record) is not offered for reuse
    bad = forcing(ids[:2])
    c = run_raw_completion(bad, CompletionRequest(prompt_ids=PROMPT, max_tokens=9),
                           tokenizer=TOK)
    assert c.finish_reason is FinishReason.ERROR and c.state is None and c.fed_ids == ()


def test_detokenized_stream_of_real_tokens_equals_decode():
    text = "def f(x):\n    return '안녕 🙂'\n"
    ids = TOK.encode(text).ids
    c, deltas, _ = generate(ids, max_tokens=len(ids))
    assert c.text == TOK.decode(ids) == "".join(deltas)
