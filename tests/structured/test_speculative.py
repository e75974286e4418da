"""Constrained speculative decoding: drafts are checked against the constraint before the
verify, every verified row is masked and sampled as plain decoding does, so the tokens and the
masked rows equal plain constrained decoding's bit for bit, greedy and sampled (at the same
block width, as for unconstrained speculative decoding), with controls."""

import numpy as np
import pytest

import turbospark_jax as tsj
from tests.structured.test_generate import PERSON, PROMPT
from turbospark_jax.core.constraints import ConstraintSpec
from turbospark_jax.generation.completion import FinishReason
from turbospark_jax.generation.speculative_loop import _allowed_prefix


@pytest.fixture(scope="module")
def models():
    pair = tsj.load(drafter="ngram")
    return tsj.load(width=pair.producer.target.width), pair


@pytest.mark.parametrize("settings", [
    {"json_schema": PERSON},
    {"json_schema": PERSON, "temperature": 1.0, "seed": 3},
    {"regex": "(ab|cd)+x[0-9]{2}", "max_tokens": 24},
    {"grammar": 'start: "def " NAME "(" ")"\nNAME: /[a-z_]{1,8}/', "max_tokens": 24},
])
def test_constrained_rounds_equal_plain_bitwise(models, settings):
    plain, pair = models
    settings = {"max_tokens": 48, **settings}
    a = tsj.generate(plain, PROMPT, record_logits=True, **settings)
    b = tsj.generate(pair, PROMPT, record_logits=True, **settings)
    assert b.speculative is not None and b.speculative.rounds > 0  # rounds did run
    assert a.token_ids == b.token_ids and a.finish_reason is b.finish_reason
    assert a.finish_reason is FinishReason.CONSTRAINT_END
    assert np.array_equal(a.logits, b.logits)
    # controls: the rows are masked, and one ulp anywhere is caught
    assert np.isinf(b.logits).any()
    nudged = b.logits.copy()
    i = np.flatnonzero(np.isfinite(nudged[-1]))[0]
    nudged[-1, i] = np.nextafter(nudged[-1, i], np.float32(np.inf))
    assert not np.array_equal(a.logits, nudged)


def test_drafts_are_cut_at_the_first_forbidden_token(models):
    tok = models[0].tokenizer
    spec = ConstraintSpec.regex("[0-9]{4}")
    c = spec.bind(tok, tok.vocab_size, [tok.eos_token_id])
    ids = [tok.encode(s, add_special_tokens=False)[0] for s in ("1", "2", "x", "3")]
    kept, masks = _allowed_prefix(c.fork(), ids, (tok.eos_token_id,))
    assert kept == ids[:2] and len(masks) == 3  # the position of "x" is sampled under a mask
    assert not masks[2][ids[2]] and masks[2][ids[3]]
    assert c.allowed_mask()[ids[0]]  # the walk ran on a copy
    done = spec.bind(tok, tok.vocab_size, [tok.eos_token_id])
    four = tok.encode("1234", add_special_tokens=False)
    kept, masks = _allowed_prefix(done.fork(), [*four, ids[0]], ())
    assert kept == four and len(masks) == len(four)  # complete after them: nothing sampled
