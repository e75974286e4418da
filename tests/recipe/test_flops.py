"""Model FLOPs utilisation: the per-token count against the parameters themselves, the peak
table, and the card's line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import init_params
from turbospark_recipe import flops


@pytest.mark.parametrize("tied", [True, False])
def test_flops_per_token_counts_every_matrix_product(tied: bool) -> None:
    config = DenseConfig(model_type="qwen3", vocab_size=300, hidden_size=32, intermediate_size=80,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, tie_word_embeddings=tied)
    params = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0), jnp.float32))
    leaves = jax.tree_util.tree_leaves_with_path(params)
    # Every weight but the norms' scales (stacked per layer here, so not told apart by rank)
    # multiplies an activation, except the embedding's gather; a tied head multiplies by the
    # embedding table once more.
    names = [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]
    matmul = sum(int(np.prod(leaf.shape)) for name, leaf in names
                 if "norm" not in name and "embed_tokens" not in name)
    if tied:
        matmul += config.vocab_size * config.hidden_size
    seq = 64
    attention = 6 * 3 * seq * 4 * 8
    assert flops.training_flops_per_token(config, params, seq) == 6 * matmul + attention


def test_mfu_only_where_the_peak_is_known() -> None:
    assert flops.mfu(1000.0, 1e9, "cpu") is None
    assert flops.mfu(1e6, 1e8, "NVIDIA H200") == pytest.approx(1e14 / 989.4e12)
