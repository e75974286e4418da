"""The fused glue kernels (add + RMSNorm; q/k norm + RoPE + cache writes): the same function as
the XLA expressions they replace, rows that never mix, in-place writes of the live rows only,
and a model that runs them agreeing with one that does not.

On a CPU the kernels run in the Pallas interpreter; on a GPU these tests run the compiled
Triton kernels (``JAX_PLATFORMS=cuda python -m pytest tests/test_pallas_glue.py``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark_jax.block_program import BlockProducer
from turbospark_jax.models import pallas_glue as glue
from turbospark_jax.models.dense import DenseConfig, DenseModel, unstack_layers
from turbospark_jax.models.layers import rope_cos_sin, rope_inv_freq

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    # One bf16 ulp of the largest values (a mean taken in another order can round across).
    tol = 0.07 if dtype == jnp.bfloat16 else 1e-5
    err = np.abs(got - want).max()
    assert err < tol, err


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_xla(dtype, with_delta):
    rng = np.random.default_rng(0)
    x, d, w = _normal(rng, (5, 64), dtype), _normal(rng, (5, 64), dtype), _normal(rng, 64, dtype)
    delta = d if with_delta else None
    got = glue.add_rms_norm(x, delta, w, 1e-6, interpret=INTERPRET)
    want = glue.add_rms_norm_xla(x, delta, w, 1e-6)
    for g, v in zip(got, want, strict=True):
        assert g.dtype == dtype
        _close(g, v, dtype)
    # The sum is one rounding of x + d either way.
    assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))


def _rope_inputs(seed, width, heads, kv_heads, head_dim, capacity, dtype, first=10):
    rng = np.random.default_rng(seed)
    q = _normal(rng, (width, heads, head_dim), dtype)
    k = _normal(rng, (width, kv_heads, head_dim), dtype)
    v = _normal(rng, (width, kv_heads, head_dim), dtype)
    pos = first + jnp.arange(width, dtype=jnp.int32)
    inv, scale = rope_inv_freq(head_dim, 10000.0, None, 4096)
    cos, sin = rope_cos_sin(pos, inv, scale, dtype)
    k_cache = _normal(rng, (capacity, kv_heads, head_dim), dtype)
    v_cache = _normal(rng, (capacity, kv_heads, head_dim), dtype)
    norms = (_normal(rng, head_dim, dtype), _normal(rng, head_dim, dtype))
    return q, k, v, cos, sin, pos, k_cache, v_cache, norms


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_matches_xla_and_writes_only_live_rows(dtype, qk_norm):
    width, capacity, live = 4, 48, 3
    q, k, v, cos, sin, pos, kc, vc, norms = _rope_inputs(0, width, 8, 2, 32, capacity, dtype)
    rows = jnp.arange(width, dtype=jnp.int32)
    write_at = jnp.where(rows < live, pos, capacity + rows)
    extra = {"q_norm": norms[0], "k_norm": norms[1]} if qk_norm else {}
    before_k, before_v = np.asarray(kc), np.asarray(vc)
    got = glue.rope_store(q, k, v, cos, sin, write_at, kc, vc, **extra, interpret=INTERPRET)
    want = glue.rope_store_xla(q, k, v, cos, sin, write_at, kc, vc, **extra)
    for g, w in zip(got, want, strict=True):
        _close(g, w, dtype)
    # Rows other than the live ones keep their old contents exactly; v is copied exactly.
    untouched = np.ones(capacity, bool)
    untouched[np.asarray(pos[:live])] = False
    for new, old in ((got[1], before_k), (got[2], before_v)):
        assert np.array_equal(np.asarray(new)[untouched], old[untouched])
    assert np.array_equal(np.asarray(got[2])[np.asarray(pos[:live])], np.asarray(v[:live]))


@settings(max_examples=10, deadline=None)
@given(row=st.integers(0, 3), seed=st.integers(0, 3))
def test_rope_store_rows_never_mix(row, seed):
    """A row's rotated q and written k are bitwise the same whatever its neighbours hold."""
    q, k, v, cos, sin, pos, kc, vc, norms = _rope_inputs(seed, 4, 8, 2, 32, 48, jnp.bfloat16)
    extra = {"q_norm": norms[0], "k_norm": norms[1]}
    out = glue.rope_store(q, k, v, cos, sin, pos, kc, vc, **extra, interpret=INTERPRET)
    others = jnp.arange(4) != row
    noisy = glue.rope_store(q.at[others].set(3.0), k.at[others].set(-2.0), v, cos, sin, pos,
                            kc, vc, **extra, interpret=INTERPRET)
    at = int(pos[row])
    assert np.array_equal(np.asarray(out[0][row]).view(np.uint16),
                          np.asarray(noisy[0][row]).view(np.uint16))
    assert np.array_equal(np.asarray(out[1][at]).view(np.uint16),
                          np.asarray(noisy[1][at]).view(np.uint16))


def test_control_rows_never_mix_check_can_fail():
    """The check above can fail: changing the row itself (one ulp of each of its k values)
    shows."""
    q, k, v, cos, sin, pos, kc, vc, _ = _rope_inputs(1, 4, 8, 2, 32, 48, jnp.bfloat16)
    out = glue.rope_store(q, k, v, cos, sin, pos, kc, vc, interpret=INTERPRET)
    bits = np.asarray(k).view(np.uint16).copy()
    bits[2] += 1
    nudged = jnp.asarray(bits.view(jnp.bfloat16))
    other = glue.rope_store(q, nudged, v, cos, sin, pos, kc, vc, interpret=INTERPRET)
    at = int(pos[2])
    assert not np.array_equal(np.asarray(out[1][at]).view(np.uint16),
                              np.asarray(other[1][at]).view(np.uint16))


def test_supported_shapes():
    assert glue.supported(2048, 32, 8, 64) and glue.supported(1024, 16, 8, 128)
    assert not glue.supported(896, 14, 2, 64)  # Qwen2.5-0.5B: not powers of two
    assert not glue.supported(64, 4, 2, 8)


def test_model_with_glue_agrees_with_xla_model():
    """The same listed model gives the same prompt logits with the kernels as without."""
    cfg = DenseConfig(model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, tie_word_embeddings=True)
    mode = "interpret" if INTERPRET else "auto"
    plain = DenseModel(cfg, jnp.float32, scan_layers=False, attention="xla", glue="xla")
    fused = DenseModel(cfg, jnp.float32, scan_layers=False, attention="xla", glue=mode)
    params = unstack_layers(plain.init_params(jax.random.PRNGKey(3)))
    logits = []
    for model in (plain, fused):
        producer = BlockProducer(model, params, capacity=32, width=4, steps_per_call=4)
        state = producer.init_state()
        out, state = producer.prefill_chunk(state, [3, 1, 4, 1, 5, 9, 2], 0)
        logits.append(np.asarray(out))
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-4, rtol=0)
