"""The conformance suite on the toy producers (attention with a KV cache, and a recurrent
model that rolls back by value), with hypothesis choosing prompts and splits, and a control for
every check showing it can fail."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turbospark_jax.core.kv_prefix import reusable_prefix
from turbospark_jax.testing import conformance as C
from turbospark_jax.testing.toy import toy_attention_producer, toy_recurrent_producer

VOCAB = 32
PRODUCERS = {
    "attention": toy_attention_producer(vocab=VOCAB, capacity=48, width=4, steps_per_call=4),
    "recurrent": toy_recurrent_producer(vocab=VOCAB, capacity=48, width=4, steps_per_call=4),
    "attention_donating": toy_attention_producer(
        vocab=VOCAB, capacity=48, width=4, steps_per_call=4, donate=True
    ),
}
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)


@st.composite
def prompt_and_cuts(draw):
    prompt = draw(tokens)
    cuts = draw(st.lists(st.integers(1, max(1, len(prompt) - 1)), max_size=5))
    return prompt, cuts


@pytest.fixture(params=sorted(PRODUCERS))
def producer(request):
    return PRODUCERS[request.param]


@given(case=prompt_and_cuts())
def test_chunked_equals_sequential(producer, case):
    C.check_chunked_matches_sequential(producer, *case)


@given(prompt=tokens)
def test_prefill_advances_like_produce(producer, prompt):
    C.check_prefill_matches_produce(producer, prompt[:8])


@given(prefix=tokens, feed=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9))
def test_verify_rows_equal_decode(producer, prefix, feed):
    C.check_verify_matches_decode(producer, prefix, feed)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("produce"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=1)),
        st.tuples(st.just("prefill"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=1)),
        st.tuples(st.just("chunk"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)),
        st.tuples(st.just("verify"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)),
    ),
    max_size=4,
)


@given(before=ops, after=ops, probe=st.integers(0, VOCAB - 1))
def test_rollback_restores(producer, before, after, probe):
    C.check_rollback_restores(producer, before, after, probe)


@given(
    first=tokens,
    generated=st.lists(st.integers(0, VOCAB - 1), max_size=4),
    keep=st.integers(0, 24),
    tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
)
def test_reuse_equals_fresh(producer, first, generated, keep, tail):
    second = (first + generated)[:keep] + tail
    n = C.check_reuse_matches_fresh(producer, first, generated, second)
    fed = first + generated
    assert n == reusable_prefix(fed, None, second, rewindable=producer.can_rewind)


def test_attention_reuse_hits_and_recurrent_only_on_full_match():
    first, generated = [1, 2, 3, 4, 5], [6, 7]
    att = PRODUCERS["attention"]
    assert C.check_reuse_matches_fresh(att, first, generated, [1, 2, 3, 9, 9]) == 3
    rec = PRODUCERS["recurrent"]
    assert C.check_reuse_matches_fresh(rec, first, generated, [1, 2, 3, 9, 9]) == 0
    assert C.check_reuse_matches_fresh(rec, first, generated, [1, 2, 3, 4, 5, 6, 7, 8]) == 7


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
CHECKS = {
    "chunk_logits_bit": lambda p: C.check_chunked_matches_sequential(p, PROMPT, [2, 7]),
    "chunk_skips_position": lambda p: C.check_chunked_matches_sequential(p, PROMPT, [2, 7]),
    "prefill_corrupts_state": lambda p: C.check_prefill_matches_produce(p, PROMPT[:4]),
    "verify_row_bit": lambda p: C.check_verify_matches_decode(p, PROMPT[:4], PROMPT[4:8]),
    "rollback_off_by_one": lambda p: C.check_rollback_restores(
        p, [("chunk", PROMPT[:5])], [("verify", PROMPT[5:8])], 3
    ),
    "reuse_claims_one_more": lambda p: C.check_reuse_matches_fresh(
        p, PROMPT, [7], [*PROMPT[:6], 8, 8]
    ),
}


@pytest.mark.parametrize("control", sorted(C.CONTROLS))
def test_every_check_catches_its_control(producer, control):
    assert set(CHECKS) == set(C.CONTROLS)
    CHECKS[control](producer)  # the honest producer passes
    with pytest.raises(C.ConformanceError):
        CHECKS[control](C.perturbed(producer, control))
