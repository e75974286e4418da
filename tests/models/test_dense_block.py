"""The block contract of :meth:`DenseModel.block_forward`, checked bitwise on one program.

One jitted program of width W = 4 per model. Feeding a sequence one live row per call and
feeding it in chunks of up to 4 live rows must give bitwise-equal logits and caches
(``np.array_equal``); padding rows must write nothing; a skipped head must leave the cache as
a computed one does. Each equality has a control showing the check can fail.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.core.state import tree_bitwise_equal
from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.kernels.layers import attend
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import (
    DenseCache,
    DenseModel,
    init_params,
    stack_layers,
    unstack_layers,
)
from turbospark_jax.testing.fixtures import jitted_block

W = 4
CAPACITY = 16
SEQ = 13

CONFIGS = {
    "llama_gqa": DenseConfig(
        model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ),
    "qwen3_window": DenseConfig(
        model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=12,
        sliding_window=5, layer_types=("full_attention", "sliding_attention"),
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def setup(request: pytest.FixtureRequest) -> tuple[DenseModel, Any, np.ndarray]:
    config = CONFIGS[request.param]
    model = DenseModel(config, jnp.float32)
    params = init_params(config, jax.random.PRNGKey(0), jnp.float32)
    # Non-trivial norm scales, so a wrong norm cannot hide behind ones.
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: a * 1.3 if p[-1].key.endswith("norm") else a * 5.0, params
    )
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=SEQ)
    return model, params, tokens


def _run(model: DenseModel, params: Any, tokens: np.ndarray, chunks: list[int]) -> tuple[
    np.ndarray, DenseCache
]:
    """Feed ``tokens`` in chunks (each <= W live rows) through the W-wide program."""
    cache = model.init_cache(CAPACITY)
    rows, start = [], 0
    for n in chunks:
        block = np.zeros(W, np.int32)
        block[:n] = tokens[start : start + n]
        positions = np.arange(start, start + W, dtype=np.int32)
        logits, cache = jitted_block(
            model, params, cache, jnp.asarray(block), jnp.asarray(positions), jnp.int32(n),
            jnp.bool_(True),
        )
        rows.append(np.asarray(logits[:n]))
        start += n
    assert start == len(tokens)
    return np.concatenate(rows), cache


@pytest.mark.parametrize("chunks", [[4, 4, 4, 1], [3, 1, 4, 2, 3], [2, 2, 4, 4, 1]])
def test_chunked_equals_one_row_at_a_time_bitwise(setup: Any, chunks: list[int]) -> None:
    model, params, tokens = setup
    one_by_one, cache_1 = _run(model, params, tokens, [1] * SEQ)
    chunked, cache_c = _run(model, params, tokens, chunks)
    assert np.array_equal(chunked, one_by_one)
    assert tree_bitwise_equal(cache_c, cache_1)
    # Control: a different token at one position changes later logits, so the check can fire.
    other = tokens.copy()
    other[5] = (other[5] + 1) % model.vocab_size
    changed, _ = _run(model, params, other, chunks)
    assert not np.array_equal(changed, one_by_one)


def test_padding_rows_write_nothing(setup: Any) -> None:
    model, params, tokens = setup
    # Fill the cache with a sentinel so any write, even of zeros, is visible.
    cache = jax.tree.map(lambda a: jnp.full_like(a, 7.0), model.init_cache(CAPACITY))
    before = jax.tree.map(np.asarray, cache)
    live = 2
    _, after = jitted_block(
        model, params, cache, jnp.asarray(tokens[:W], jnp.int32),
        jnp.arange(3, 3 + W, dtype=jnp.int32), jnp.int32(live), jnp.bool_(True),
    )
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        new = np.asarray(new)
        written = np.zeros(CAPACITY, bool)
        written[3 : 3 + live] = True
        assert np.array_equal(new[:, ~written], old[:, ~written])  # padding rows: untouched
        assert not np.any(new[:, written] == 7.0)  # live rows: written


def test_padding_rows_past_capacity_are_dropped(setup: Any) -> None:
    model, params, tokens = setup
    cache = model.init_cache(CAPACITY)
    positions = jnp.arange(CAPACITY - 1, CAPACITY - 1 + W, dtype=jnp.int32)  # 3 rows past end
    logits, after = jitted_block(
        model, params, cache, jnp.asarray(tokens[:W], jnp.int32), positions, jnp.int32(1),
        jnp.bool_(True),
    )
    assert np.all(np.isfinite(np.asarray(logits[0])))
    k = np.asarray(after.k)
    assert np.any(k[:, CAPACITY - 1] != 0) and not np.any(k[:, : CAPACITY - 1])


def test_headless_block_leaves_same_cache(setup: Any) -> None:
    model, params, tokens = setup
    args = (jnp.asarray(tokens[:W], jnp.int32), jnp.arange(W, dtype=jnp.int32), jnp.int32(W))
    cache = model.init_cache(CAPACITY)
    logits_on, cache_on = jitted_block(model, params, cache, *args, jnp.bool_(True))
    logits_off, cache_off = jitted_block(model, params, cache, *args, jnp.bool_(False))
    assert tree_bitwise_equal(cache_on, cache_off)
    assert logits_off.dtype == jnp.float32 and logits_off.shape == (W, model.vocab_size)
    assert not np.any(np.asarray(logits_off))
    assert np.any(np.asarray(logits_on))


def test_block_agrees_with_forward(setup: Any) -> None:
    model, params, tokens = setup
    chunked, _ = _run(model, params, tokens, [4, 4, 4, 1])
    with jax.default_matmul_precision("highest"):
        full = np.asarray(jax.jit(model.forward)(params, jnp.asarray(tokens[None], jnp.int32)))
    np.testing.assert_allclose(chunked, full[0], atol=1e-5, rtol=0)


def test_unrolled_layers_agree_with_scan(setup: Any) -> None:
    model, params, tokens = setup
    unrolled = DenseModel(model.config, model.dtype, scan_layers=False)
    a, cache_a = _run(model, params, tokens, [4, 4, 4, 1])
    b, cache_b = _run(unrolled, params, tokens, [4, 4, 4, 1])
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    # The unrolled model keeps one buffer per layer; stacked, they hold the same rows.
    assert cache_b.per_layer and not cache_a.per_layer
    assert cache_b.capacity == cache_a.capacity
    np.testing.assert_allclose(np.asarray(cache_a.k), np.stack(cache_b.k), atol=1e-5, rtol=0)


def test_bad_plan_and_cache_layout_are_refused(setup: Any) -> None:
    model, params, _ = setup
    with pytest.raises(BadInputError, match="plan must be a KernelPlan"):
        DenseModel(model.config, model.dtype, plan="flash")
    per_layer = DenseModel(model.config, model.dtype, scan_layers=False).init_cache(CAPACITY)
    with pytest.raises(BadInputError, match="per-layer cache"):
        model.block_forward(params, per_layer, jnp.zeros((4,), jnp.int32),
                            jnp.arange(4, dtype=jnp.int32), jnp.int32(4), jnp.bool_(True))


def test_listed_layers_agree_with_stacked(setup: Any) -> None:
    model, params, tokens = setup
    listed = unstack_layers(params)
    assert isinstance(listed["layers"], list) and len(listed["layers"]) == 2
    assert tree_bitwise_equal(stack_layers(listed), params)
    a, cache_a = _run(model, params, tokens, [4, 4, 4, 1])
    b, cache_b = _run(model, listed, tokens, [4, 4, 4, 1])
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(cache_a.v), np.asarray(cache_b.v), atol=1e-5, rtol=0)


def test_bfloat16_block_runs_in_bfloat16() -> None:
    config = CONFIGS["llama_gqa"]
    model = DenseModel(config, jnp.bfloat16)
    params = init_params(config, jax.random.PRNGKey(1), jnp.bfloat16)
    logits, cache = jax.jit(model.block_forward)(
        params, model.init_cache(CAPACITY), jnp.arange(W, dtype=jnp.int32),
        jnp.arange(W, dtype=jnp.int32), jnp.int32(W), jnp.bool_(True),
    )
    assert logits.dtype == jnp.float32 and cache.k.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(logits)))


def test_sliced_attention_matches_unsliced() -> None:
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(8, 4, 6)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(10, 2, 6)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(10, 2, 6)), jnp.float32)
    q_pos = jnp.arange(2, 10, dtype=jnp.int32)
    k_pos = jnp.arange(10, dtype=jnp.int32)
    run = jax.jit(attend, static_argnames=("window", "query_block"))
    whole = run(q, k, v, q_pos, k_pos, window=3)
    sliced = run(q, k, v, q_pos, k_pos, window=3, query_block=4)
    np.testing.assert_allclose(np.asarray(sliced), np.asarray(whole), atol=1e-6, rtol=0)


def test_config_rejects_bad_heads() -> None:
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):
        DenseConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                    num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=2)
    with pytest.raises(ModelLoadError, match="even"):
        DenseConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                    num_hidden_layers=1, num_attention_heads=2, head_dim=5)


def test_model_and_config_are_hashable_statics() -> None:
    config = CONFIGS["qwen3_window"]
    same = DenseConfig.from_hf_dict(config.to_hf_dict())
    assert same == config and hash(same) == hash(config)
    assert hash(DenseModel(config, jnp.bfloat16)) == hash(DenseModel(same, "bfloat16"))
