"""Row-local pieces that are row-invariant on the CPU as they stand: a row's RoPE and its
sampling come out bitwise the same whatever the number of rows beside it and wherever it sits.

(RMSNorm in float32, the MLP's and attention's XLA matrix products, and the Pallas attention
kernel in the interpreter are *not* row-invariant on the CPU: see
``docs/decisions/0008-cpu-row-tiles.md``.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.core import sampling
from turbospark_jax.kernels.layers import apply_rope, rope_cos_sin, rope_inv_freq

ROWS, COUNTS, SINGLE = 80, (1, 3, 16, 17, 64), 70


def _failures(f, *arrays) -> list:
    """Row counts whose rows differ from the widest call's, and whether a one-row call on row
    ``SINGLE`` differs from that row of it."""
    full = np.asarray(f(*arrays))
    bad = [m for m in COUNTS if not np.array_equal(np.asarray(f(*[a[:m] for a in arrays])),
                                                    full[:m])]
    one = np.asarray(f(*[a[SINGLE : SINGLE + 1] for a in arrays]))[0]
    return bad + ([] if np.array_equal(one, full[SINGLE]) else ["single"])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rope_is_row_invariant(dtype):
    inv, scale = rope_inv_freq(32, 10000.0, None, 4096)

    @jax.jit
    def rope(q, positions):
        cos, sin = rope_cos_sin(positions, inv, scale, dtype)
        return apply_rope(q, cos, sin)

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((ROWS, 4, 32)), dtype)
    positions = jnp.asarray(rng.integers(0, 4000, ROWS), jnp.int32)
    assert _failures(rope, q, positions) == []


def _sampler(params: sampling.SamplingParams, vocab: int):
    history = sampling.History.empty(vocab)
    return jax.jit(jax.vmap(lambda row, key: sampling.sample(row, params, history, key)))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampling_is_row_invariant(temperature):
    vocab = 96
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((ROWS, vocab)) * 3, jnp.float32)
    keys = jax.vmap(lambda i: sampling.token_key(sampling.request_key(5), i))(jnp.arange(ROWS))
    params = sampling.SamplingParams.make(temperature=temperature, top_k=20, top_p=0.9)
    assert _failures(_sampler(params, vocab), logits, keys) == []


def test_control_the_row_check_fails_when_rows_mix():
    """The check can fail: a 'sampler' that adds the mean of all rows to each."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((ROWS, 8)), jnp.float32)
    assert _failures(jax.jit(lambda x: x + jnp.mean(x)), logits) != []
