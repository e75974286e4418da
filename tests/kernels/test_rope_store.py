"""The fused RoPE kernel (q/k norm + RoPE + queries in the attention layout + in-place cache
writes): the same function as the XLA expression it replaces, rows that never mix, writes of
the live rows only, and a model that runs it agreeing with one that does not. Then the same
work inside the attention kernel (``rope_store_attention``): bitwise the two launches.

On a CPU the kernel runs in the Pallas interpreter; on a GPU these tests run the compiled
Triton kernel (``JAX_PLATFORMS=cuda python -m pytest tests/kernels/test_rope_store.py``).
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.kernels.attention import cached_attention_arranged
from turbospark_jax.kernels.layers import rope_cos_sin, rope_inv_freq
from turbospark_jax.kernels.plan import KernelPlan
from turbospark_jax.kernels.rope_store import (
    FUSED_ROWS,
    rope_store,
    rope_store_attention,
    rope_store_xla,
    supported,
)
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, unstack_layers

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
H, KV, HD, CAP = 8, 2, 32, 48
ROWS = 4 * (H // KV)  # the query rows a 4-row block fills in each KV head


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _inputs(seed, dtype, width=4, first=10, capacity=CAP, parts=0):
    """A block's q/k/v projection (``parts`` float32 partial sums of it, or finished),
    rotary tables at positions ``first..``, caches and q/k norm scales."""
    rng = np.random.default_rng(seed)
    shape = (width, (H + 2 * KV) * HD)
    qkv = _normal(rng, (parts, *shape), jnp.float32) if parts else _normal(rng, shape, dtype)
    pos = first + jnp.arange(width, dtype=jnp.int32)
    inv, scale = rope_inv_freq(HD, 10000.0, None, 4096)
    cos, sin = rope_cos_sin(pos, inv, scale, dtype)
    caches = (_normal(rng, (capacity, KV, HD), dtype), _normal(rng, (capacity, KV, HD), dtype))
    norms = {"q_norm": _normal(rng, HD, dtype), "k_norm": _normal(rng, HD, dtype)}
    return qkv, cos, sin, pos, caches, norms


def _run(qkv, cos, sin, write_at, caches, norms, xla=False):
    if xla:
        return rope_store_xla(qkv, cos, sin, write_at, *caches, H, **norms)
    return rope_store(qkv, cos, sin, write_at, *caches, H, **norms, interpret=INTERPRET)


def _bits(x):
    return np.asarray(x).view(np.uint16 if x.dtype == jnp.bfloat16 else np.uint32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_matches_xla_and_writes_only_live_rows(dtype, qk_norm):
    qkv, cos, sin, pos, caches, norms = _inputs(0, dtype)
    norms = norms if qk_norm else {}
    live = 3
    rows = jnp.arange(4, dtype=jnp.int32)
    write_at = jnp.where(rows < live, pos, CAP + rows)
    before = [np.asarray(c) for c in caches]
    got = _run(qkv, cos, sin, write_at, caches, norms)
    want = _run(qkv, cos, sin, write_at, caches, norms, xla=True)
    tol = 0.07 if dtype == jnp.bfloat16 else 1e-5  # an ulp where a mean rounds across
    # Padding query rows are never written by the kernel: compare the real ones.
    pairs = [(got[0][:, :ROWS], want[0][:, :ROWS]), (got[1], want[1]), (got[2], want[2])]
    for g, w in pairs:
        assert g.shape == w.shape and g.dtype == dtype
        assert np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32)).max() < tol
    # Cache rows other than the live ones keep their contents exactly; v is copied exactly.
    untouched = np.ones(CAP, bool)
    untouched[np.asarray(pos[:live])] = False
    for new, old in zip(got[1:], before, strict=True):
        assert np.array_equal(np.asarray(new)[untouched], old[untouched])
    v_new = qkv.reshape(4, H + 2 * KV, HD)[:live, H + KV :]
    assert np.array_equal(np.asarray(got[2])[np.asarray(pos[:live])], np.asarray(v_new))


@settings(max_examples=10, deadline=None)
@given(row=st.integers(0, 3), seed=st.integers(0, 3))
def test_rows_never_mix(row, seed):
    """A row's rotated queries and written key are bitwise the same whatever its neighbours
    hold."""
    qkv, cos, sin, pos, caches, norms = _inputs(seed, jnp.bfloat16)
    out = _run(qkv, cos, sin, pos, caches, norms)
    noisy = _run(qkv.at[jnp.arange(4) != row].set(3.0), cos, sin, pos, caches, norms)
    g = H // KV
    mine = slice(row * g, (row + 1) * g)
    assert np.array_equal(_bits(out[0][:, mine]), _bits(noisy[0][:, mine]))
    at = int(pos[row])
    assert np.array_equal(_bits(out[1][at]), _bits(noisy[1][at]))


def test_control_rows_never_mix_check_can_fail():
    """The check above can fail: one ulp in each of the row's own k values shows."""
    qkv, cos, sin, pos, caches, norms = _inputs(1, jnp.bfloat16)
    out = _run(qkv, cos, sin, pos, caches, norms)
    bits = np.asarray(qkv).view(np.uint16).copy()
    bits[2, H * HD : (H + KV) * HD] += 1
    nudged = _run(jnp.asarray(bits.view(jnp.bfloat16)), cos, sin, pos, caches, norms)
    at = int(pos[2])
    assert not np.array_equal(_bits(out[1][at]), _bits(nudged[1][at]))


def test_supported_shapes():
    assert supported(32, 8, 64) and supported(16, 8, 128)
    assert not supported(14, 2, 64)  # Qwen2.5-0.5B: not powers of two
    assert not supported(4, 2, 8)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_model_with_kernel_agrees_with_model_without(model_type):
    """The same listed model gives the same prompt logits with the kernel as without it."""
    cfg = DenseConfig(model_type=model_type, vocab_size=64, hidden_size=64,
                      intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    plan = KernelPlan(pallas="interpret" if INTERPRET else "compiled")
    plain = DenseModel(cfg, jnp.float32, scan_layers=False)
    fused = DenseModel(cfg, jnp.float32, scan_layers=False, plan=plan)
    params = unstack_layers(plain.init_params(jax.random.PRNGKey(3)))
    logits = []
    for model in (plain, fused):
        producer = BlockProducer(model, params, capacity=64, width=4, steps_per_call=4)
        out, _ = producer.prefill_chunk(producer.init_state(), [3, 1, 4, 1, 5, 9, 2], 0)
        logits.append(np.asarray(out))
    # On a GPU float32 matrix products run in TF32, and one q/k/v product rounds unlike three.
    np.testing.assert_allclose(logits[0], logits[1], atol=2e-2 if ON_GPU else 1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("count", [1, 3])
def test_partial_sums_give_the_bits_of_the_finished_projection(dtype, qk_norm, count):
    """Fed the projection as float32 partial sums, the kernel adds them itself: the queries
    and both caches come out bitwise as from ``sum_parts`` followed by the kernel."""
    from turbospark_jax.kernels.rowinv import sum_parts

    qkv, cos, sin, pos, caches, norms = _inputs(1, dtype)
    norms = norms if qk_norm else {}
    rng = np.random.default_rng(9)
    parts = jnp.asarray(rng.standard_normal((count, *qkv.shape)), jnp.float32)
    write_at = pos
    got = _run(parts, cos, sin, write_at, caches, norms)
    want = _run(sum_parts(parts, dtype), cos, sin, write_at, caches, norms)
    # padding query rows are never written: compare the real ones
    pairs = [(got[0][:, :ROWS], want[0][:, :ROWS]), (got[1], want[1]), (got[2], want[2])]
    for g, w in pairs:
        assert np.array_equal(_bits(g), _bits(w))


def _fused(qkv, cos, sin, write_at, caches, pos, norms, max_keys=None, window=None):
    return rope_store_attention(qkv, cos, sin, write_at, *caches, pos, H, **norms,
                                interpret=INTERPRET, max_keys=max_keys, window=window)


def _two_launches(qkv, cos, sin, write_at, caches, pos, norms, max_keys=None, window=None):
    """The RoPE-store kernel, then the row-invariant attention over the cache it wrote."""
    qr, k, v = rope_store(qkv, cos, sin, write_at, *caches, H, **norms, interpret=INTERPRET)
    out = cached_attention_arranged(qr, k, v, pos, heads=H, window=window,
                                    interpret=INTERPRET, row_invariant=True, max_keys=max_keys)
    return out, k, v


def _pallas_calls(fn, *args) -> set[str]:
    """The names of the Pallas kernels ``fn`` launches (its jaxpr's ``pallas_call``s)."""
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                # "name" in jax 0.10, "name_and_src_info" in some versions
                name = eqn.params.get("name_and_src_info", eqn.params.get("name"))
                names.add(getattr(name, "name", name))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


@pytest.mark.parametrize(("width", "first", "parts", "capacity", "max_keys", "kernel"), [
    (1, 10, 0, 256, None, "rope_store_attention"),     # a cache of one split
    (1, 300, 3, 2048, 512, "rope_store_attention"),    # a short decode's bound
    (5, 40, 2, 2048, 512, "rope_store_attention"),     # a verify's rows
    (16, 7, 0, 256, None, "rope_store_attention"),     # FUSED_ROWS rows
    (1, 1000, 3, 2048, None, "rope_store_attention_split_folding"),  # eight splits
    (5, 1500, 0, 2048, 1024, "rope_store_attention_split_folding"),  # past two splits' bound
])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rope_store_inside_the_attention_gives_the_two_launches_bits(
        width, first, parts, capacity, max_keys, kernel, qk_norm, dtype):
    """The RoPE-store's work inside the attention's first kernel (the folding kernel, or
    the split kernel whose last program folds) gives the attention's rows and both caches
    bitwise as the RoPE-store kernel followed by the attention, with the block's last row
    writing nothing (``write_at`` past the cache); the fused kernel is the one that ran."""
    qkv, cos, sin, pos, caches, norms = _inputs(3, dtype, width, first, capacity, parts)
    norms = norms if qk_norm else {}
    write_at = pos.at[-1].set(capacity + 1) if width > 1 else pos
    args = (qkv, cos, sin, write_at, caches, pos, norms)
    got = _fused(*args, max_keys=max_keys)
    want = _two_launches(*args, max_keys=max_keys)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(_bits(g), _bits(w))
    kernels = _pallas_calls(lambda *a: _fused(*a, max_keys=max_keys), *args)
    assert kernel in kernels and not {"rope_store", "cached_attention_fold"} & kernels
    if width > 1:  # the row that writes nothing left its cache row as it was
        row = int(pos[-1])
        assert np.array_equal(_bits(got[1][row]), _bits(caches[0][row]))


@pytest.mark.parametrize(("capacity", "max_keys"), [(256, None), (2048, None), (2048, 512)])
def test_rope_store_inside_the_attention_under_a_sliding_window(capacity, max_keys):
    """A sliding-window layer's attention, fused or not, gives the same bits (three rows,
    the window shorter than their context)."""
    qkv, cos, sin, pos, caches, norms = _inputs(6, jnp.bfloat16, 3, 200, capacity)
    args = (qkv, cos, sin, pos, caches, pos, norms)
    got = _fused(*args, max_keys=max_keys, window=37)
    want = _two_launches(*args, max_keys=max_keys, window=37)
    assert all(np.array_equal(_bits(g), _bits(w)) for g, w in zip(got, want, strict=True))
    wide = _fused(*args, max_keys=max_keys)  # control: the window matters here
    assert not np.array_equal(_bits(wide[0]), _bits(got[0]))


@pytest.mark.parametrize(("width", "first", "parts", "max_keys", "window"), [
    (1, 1000, 3, None, None),   # eight splits, unbounded
    (5, 1500, 0, 1024, None),   # past two splits' bound
    (3, 1200, 2, None, 37),     # a sliding window
    (16, 900, 0, None, None),   # FUSED_ROWS rows
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_fold_in_the_last_split_program_gives_the_fold_kernels_bits(
        width, first, parts, max_keys, window, dtype):
    """Each query tile's partials folded by its last split program (an atomic counter a
    tile) instead of the fold kernel: the rows and caches bitwise those of the RoPE-store,
    the split kernel and the fold kernel, no fold kernel launched; a second call (the
    counters are made and left at zero) agrees too."""
    qkv, cos, sin, pos, caches, norms = _inputs(4, dtype, width, first, 2048, parts)
    args = (qkv, cos, sin, pos, caches, pos, norms)
    run = functools.partial(_fused, max_keys=max_keys, window=window)
    apart = functools.partial(_two_launches, max_keys=max_keys, window=window)
    got, want = run(*args), apart(*args)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(_bits(g), _bits(w))
    kernels = _pallas_calls(run, *args)
    assert kernels == {"rope_store_attention_split_folding"}
    assert "cached_attention_fold" in _pallas_calls(apart, *args)
    again = run(qkv * 2, cos, sin, pos, caches, pos, norms)
    assert np.array_equal(_bits(again[0]), _bits(apart(qkv * 2, cos, sin, pos, caches, pos,
                                                       norms)[0]))
    # control: the comparison sees a key every row sees (inside the window too), changed
    key = int(pos[0]) - 10
    moved = run(qkv, cos, sin, pos, (caches[0].at[key].multiply(3), caches[1]), pos, norms)
    assert not np.array_equal(_bits(moved[0]), _bits(want[0]))


def test_rope_store_attention_launches_both_past_fused_rows():
    qkv, cos, sin, pos, caches, norms = _inputs(3, jnp.bfloat16, FUSED_ROWS + 1, 30, 256)
    args = (qkv, cos, sin, pos, caches, pos, norms)
    kernels = _pallas_calls(_fused, *args)
    assert not any(k.startswith("rope_store_attention") for k in kernels)
    assert "rope_store" in kernels
    got, want = _fused(*args), _two_launches(*args)
    assert all(np.array_equal(_bits(g), _bits(w)) for g, w in zip(got, want, strict=True))


def test_control_the_fused_comparison_can_fail():
    """The comparison above sees a change the size of one row's position: the fused kernel
    given the last row one position later differs from the two launches."""
    qkv, cos, sin, pos, caches, norms = _inputs(3, jnp.bfloat16, 5, 40, 256)
    got = _fused(qkv, cos, sin, pos, caches, pos.at[-1].add(1), norms)
    want = _two_launches(qkv, cos, sin, pos, caches, pos, norms)
    assert not np.array_equal(_bits(got[0]), _bits(want[0]))

