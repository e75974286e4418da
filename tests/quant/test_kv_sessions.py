"""A quantized KV cache through the multi-turn machinery: the scales travel with their rows.

Session slots (a dense model: prefix reuse by moving the cursor back over quantized rows,
interleaved sessions on fewer slots than sessions) and prompt-end snapshots (Qwen3.5, whose
recurrent layers cannot rewind: a snapshot restored under quantized full-attention rows) give
bitwise what serving each turn from a fresh state gives; the control restores a snapshot of
another branch and is caught.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from tests.sessions.test_session_pool import (
    COMMON_FIRST,
    Script,
    converse,
    first_difference,
    fresh_server,
    pool_server,
)
from tests.sessions.test_snapshots import _branching_conversation, _NoLineage, _same, _turn
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.sessions.session_pool import SessionPool

V = 32


def _dense(kv_dtype):
    config = DenseConfig(model_type="qwen3", vocab_size=V, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8)
    model = DenseModel(config, kv_dtype=kv_dtype)
    return BlockProducer(model, model.init_params(jax.random.PRNGKey(1)), capacity=128,
                         width=4, steps_per_call=8, donate=True)


def _qwen35(kv_dtype):
    config = QC.Qwen35Config.from_hf_dict(dict(
        model_type="qwen3_5_text", vocab_size=V, hidden_size=32, intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_hidden_layers=3, layer_types=[QC.LINEAR, QC.FULL, QC.LINEAR],
        initializer_range=0.1,
    ))
    model = dataclasses.replace(Q.FAMILY.build(config, jnp.float32, "list"), kv_dtype=kv_dtype)
    return BlockProducer(model, model.init_params(jax.random.PRNGKey(0)), capacity=128,
                         width=4, steps_per_call=8, donate=True)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_session_slots_equal_fresh_serving(kv_dtype):
    producer = _dense(kv_dtype)
    convo = {"a": Script(COMMON_FIRST, ((4, 5, 6), (9, 9, 9)), (None, 2)),
             "b": Script((1, 2, 3, 4, 5), ((8, 1, 8),), (None,)),
             "c": Script((6, 5, 4, 3, 2), ((3, 3, 3),), (1,))}
    schedule = "abacab"
    pool = SessionPool(producer, 2)
    served = converse(pool_server(pool), convo, schedule)
    assert first_difference(served, converse(fresh_server(producer), convo, schedule)) is None
    assert any(s.reused for s in served) and pool.evictions
    state = pool.state_of("a") if pool.slot_of("a") is not None else pool.state_of("b")
    assert jax.tree.leaves(state.cache.k_scale)  # the slot's state carries the scales


def test_snapshots_restore_quantized_rows_and_the_control_is_caught():
    p = _qwen35("int8")
    first = [3, 1, 4, 1, 5, 9, 2, 6]
    one = _turn(p, first, None, 0)
    second = first + [(t + 1) % V for t in one.token_ids] + [7, 7]
    two = _turn(p, second, one.state, 1)
    assert two.usage.reused_tokens == len(first)  # restored from the prompt-end snapshot
    assert _same(two, _turn(p, second, None, 1))
    got, fresh = _branching_conversation(p)
    assert got.usage.reused_tokens == 17 and _same(got, fresh)
    blind = _NoLineage(p.model, p.params, capacity=128, width=4, steps_per_call=8)
    got, fresh = _branching_conversation(blind)
    assert got.usage.reused_tokens == 20 and not _same(got, fresh)
