"""Speculative decoding on the newer families as targets: a recurrent target committed from
its per-row tape (Qwen3.5) and a sliding-window ring (Gemma 4), through the device rounds and
the host rounds alike, stay token for token and bit for bit plain greedy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax import CompletionRequest, run_raw_completion
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
from turbospark_jax.models.gemma4 import config as GC
from turbospark_jax.models.gemma4 import model as G
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.speculative.drafters import NGramDrafter, OracleDrafter
from turbospark_jax.speculative.pair import SpeculativePair

VOCAB = 64


def _qwen35() -> BlockProducer:
    config = Q.FAMILY.parse_config(dict(
        model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_hidden_layers=3, layer_types=[QC.LINEAR, QC.FULL, QC.LINEAR], initializer_range=0.1,
    ))
    model = Q.FAMILY.build(config, jnp.float32, "list")
    params = model.init_params(jax.random.PRNGKey(0))
    return BlockProducer(model, params, capacity=96, width=6, steps_per_call=8)


def _gemma4() -> BlockProducer:
    config = GC.Gemma4Config.from_hf_dict(dict(
        model_type="gemma4_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_hidden_layers=3, layer_types=[GC.SLIDING, GC.FULL, GC.FULL], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=4,
        initializer_range=0.1,
    ))
    model = G.Gemma4Model(config, jnp.float32, ring_margin=8)
    return BlockProducer(model, model.init_params(jax.random.PRNGKey(1)), capacity=96,
                         width=6, steps_per_call=8)


TARGETS = {"qwen3_5": _qwen35(), "gemma4": _gemma4()}
PROMPT = [3, 9, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
GREEDY = CompletionRequest(prompt_ids=PROMPT, max_tokens=40, record_logits=True)
PLAIN = {name: run_raw_completion(t, GREEDY) for name, t in TARGETS.items()}


@pytest.mark.parametrize("device", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_speculative_greedy_is_plain_greedy_bit_for_bit(target, drafter, device):
    t, plain = TARGETS[target], PLAIN[target]
    d = NGramDrafter(VOCAB) if drafter == "ngram" else OracleDrafter(
        VOCAB, PROMPT + plain.token_ids, 0.8)
    pair = SpeculativePair(t, d, device_rounds=device)
    got = run_raw_completion_speculative(pair, dataclasses.replace(GREEDY, draft_len=5))
    assert got.speculative.on_device == device
    assert got.token_ids == plain.token_ids
    assert np.array_equal(got.logits.view(np.uint32), plain.logits.view(np.uint32))
    assert got.fed_ids == plain.fed_ids
    if drafter == "oracle":
        assert got.speculative.mean_acceptance_length > 2.0  # the rounds did keep proposals


def test_a_verify_wider_than_the_block_still_commits_from_the_tape_or_re_verifies():
    """Draft length 8 on a width-6 Qwen3.5 target: a verify of 9 rows runs in two blocks and
    the tape keeps only the second, so rounds that keep rows of the first re-verify them
    (the producer says which it can keep); greedy stays plain greedy bit for bit."""
    t, plain = TARGETS["qwen3_5"], PLAIN["qwen3_5"]
    assert not t.retaining_rollback_keeps(9, 6) and t.retaining_rollback_keeps(9, 7)
    assert t.retaining_rollback_keeps(9, 0) and t.retaining_rollback_keeps(6, 6)
    pair = SpeculativePair(t, OracleDrafter(VOCAB, PROMPT + plain.token_ids, 0.8),
                           device_rounds=False)
    assert pair.retaining_rollback_keeps(9, 7) and not pair.retaining_rollback_keeps(9, 3)
    got = run_raw_completion_speculative(pair, dataclasses.replace(GREEDY, draft_len=8))
    assert got.token_ids == plain.token_ids
    assert np.array_equal(got.logits.view(np.uint32), plain.logits.view(np.uint32))
    assert got.fed_ids == plain.fed_ids
