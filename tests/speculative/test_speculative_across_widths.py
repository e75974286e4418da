"""Speculative greedy decoding equals plain greedy decoding bit for bit when verify and decode
are *different* programs: under a row-invariant kernel plan the plain loop decodes at width 1 and
prefills in wide blocks, while the speculative target verifies ``k + 1`` rows in a program of
its own width (issue 19's third check, on the CPU). The control: the same comparison with
XLA's kernels, whose programs of two widths round differently in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax import CompletionRequest, run_raw_completion
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel
from turbospark_jax.speculative.drafters import DraftModelDrafter, NGramDrafter
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_jax.testing.fixtures import backend_plan

VOCAB = 96
PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 77, 14, 30, 65, 8, 51, 23, 90, 1, 36, 70, 5, 17, 3]
REQUEST = CompletionRequest(prompt_ids=PROMPT, max_tokens=24, record_logits=True,
                            stop_token_ids=())
DRAFT_LEN = 3


def _model(kernels: str, seed: int = 0) -> tuple[DenseModel, object]:
    # an untied head: a random tied one mostly repeats the token it was fed
    cfg = DenseConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=48,
                      intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=12, tie_word_embeddings=False)
    model = DenseModel(cfg, jnp.float32, plan=backend_plan(kernels == "rowinv"))
    return model, model.init_params(jax.random.PRNGKey(seed))


def _producer(kernels: str, width: int, prefill_width: int | None = None,
              seed: int = 0) -> BlockProducer:
    model, params = _model(kernels, seed)
    return BlockProducer(model, params, capacity=96, width=width, steps_per_call=4,
                         prefill_width=prefill_width)


def _speculative(kernels: str, drafter: str, loop: str) -> object:
    target = _producer(kernels, DRAFT_LEN + 1, None)
    draft = (NGramDrafter(VOCAB, max_n=3) if drafter == "ngram"
             else DraftModelDrafter(_producer("xla", 2, seed=4)))  # width 2: on the device
    pair = SpeculativePair(target, draft, device_rounds=loop == "device")
    return run_raw_completion_speculative(pair, dataclasses.replace(REQUEST, draft_len=DRAFT_LEN))


def _bits(completion) -> np.ndarray:
    return np.asarray(completion.logits, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def plain_rowinv():
    """Plain greedy decoding at width 1, the prompt in blocks of up to 16 rows."""
    return run_raw_completion(_producer("rowinv", 1, 16), REQUEST)


@pytest.mark.parametrize("loop", ["device", "host"])
@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_speculative_at_its_own_width_equals_plain_at_width_one(plain_rowinv, drafter, loop):
    got = _speculative("rowinv", drafter, loop)
    stats = got.speculative
    assert stats.on_device == (loop == "device")
    assert 0 < stats.accepted < stats.drafted  # some proposals kept, some rejected
    assert len(set(plain_rowinv.token_ids)) > 5
    assert got.token_ids == plain_rowinv.token_ids
    np.testing.assert_array_equal(_bits(got), _bits(plain_rowinv))
    assert got.fed_ids == plain_rowinv.fed_ids


def test_control_xla_kernels_at_two_widths_differ():
    plain = run_raw_completion(_producer("xla", 1), REQUEST)
    got = _speculative("xla", "ngram", "device")
    assert not np.array_equal(_bits(got), _bits(plain))


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_short_context_rounds_verify_in_the_bounded_program(plain_rowinv, drafter,
                                                            key_bounds_seen):
    """With the target's short-context bound in force (``BlockModel.bounds_keys``, declared
    here on the CPU, whose XLA attention ignores it), the device rounds verify in the program
    bounded by ``short_decode_keys`` (the hint reaches the target's attention) and still equal
    plain greedy decoding bit for bit."""
    got = _speculative("rowinv", drafter, "device")
    assert got.speculative.on_device and 512 in key_bounds_seen
    assert got.token_ids == plain_rowinv.token_ids
    np.testing.assert_array_equal(_bits(got), _bits(plain_rowinv))
