"""The GPU kernels over a quantized KV cache, in the Pallas interpreter on a CPU (compiled
on a GPU: ``JAX_PLATFORMS=cuda python -m pytest tests/quant/test_kv_kernels.py``).

The RoPE-and-cache-write kernel quantizes each new row in registers and writes bitwise what
its XLA form writes; the attention kernels dequantize each tile they load, so over a
quantized cache they give bitwise what they give over the dequantized rows; the fused
RoPE-store-and-attention kernel gives bitwise its two launches. The dense model's GPU graph
(:meth:`~turbospark_jax.kernels.plan.KernelPlan.interpreted`) with a quantized cache gives
bitwise the same logits at every width and stays near the XLA plan's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.kernels.attention import cached_attention, cached_attention_arranged
from turbospark_jax.kernels.layers import rope_cos_sin, rope_inv_freq
from turbospark_jax.kernels.plan import KernelPlan
from turbospark_jax.kernels.rope_store import rope_store, rope_store_attention, rope_store_xla
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, unstack_layers
from turbospark_jax.quant import kv as kv_quant

pytestmark = pytest.mark.usefixtures("full_precision_products")

INTERPRET = jax.default_backend() != "gpu"
H, KV, HD, CAP = 4, 2, 32, 512  # two key splits
KV_DTYPES = ("int8", "fp8")


def _bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _same(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def _inputs(kv_dtype, dtype=jnp.bfloat16, width=4, first=470, seed=0):
    """A block's q/k/v projection at positions ``first..``, its rotary tables and a quantized
    cache whose rows before ``first`` hold earlier rows."""
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((width, (H + 2 * KV) * HD)), dtype)
    pos = first + jnp.arange(width, dtype=jnp.int32)
    inv, scale = rope_inv_freq(HD, 10000.0, None, 4096)
    cos, sin = rope_cos_sin(pos, inv, scale, dtype)
    earlier = [jnp.asarray(rng.standard_normal((CAP, KV, HD)), dtype) for _ in range(2)]
    (k, ks), (v, vs) = (kv_quant.quantize(x, kv_dtype) for x in earlier)
    return qkv, cos, sin, pos, (k, v), {"k_scale": ks, "v_scale": vs}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_store_quantizes_its_rows_and_writes_only_live_ones(kv_dtype, dtype):
    """The kernel stores :func:`~turbospark_jax.quant.kv.quantize` of the rows it writes
    into an unquantized cache, and what its XLA form stores: bitwise in the interpreter (one
    compiler); compiled, a value may sit one step apart where Triton's division rounds the
    quotient otherwise than XLA's. Dead rows keep their values and scales."""
    qkv, cos, sin, pos, caches, scales = _inputs(kv_dtype, dtype)
    live = 3
    rows = jnp.arange(4, dtype=jnp.int32)
    write_at = jnp.where(rows < live, pos, CAP + rows)
    got = rope_store(qkv, cos, sin, write_at, *caches, H, interpret=INTERPRET, **scales)
    assert len(got) == 5 and got[0].dtype == dtype
    assert got[1].dtype == kv_quant.stored_dtype(kv_dtype, dtype)
    plain = rope_store(qkv, cos, sin, write_at, *_dequantized(caches, scales, dtype), H,
                       interpret=INTERPRET)
    at = np.asarray(pos[:live])
    for n in range(2):  # k, v
        values, scale = kv_quant.quantize(plain[1 + n][at], kv_dtype)
        if INTERPRET:
            assert _same(got[1 + n][at], values) and _same(got[3 + n][at], scale)
            continue
        np.testing.assert_allclose(np.asarray(got[3 + n][at]), np.asarray(scale), rtol=1e-6)
        # one step of the stored form at most: int8's is the scale, fp8's 32 scales at the
        # top of its range
        step = np.asarray(scale)[..., None] * (1 if kv_dtype == "int8" else 32)
        back = [np.asarray(kv_quant.dequantize(x, scale, jnp.float32))
                for x in (got[1 + n][at], values)]
        assert (np.abs(back[0] - back[1]) <= step * 1.01).all()
    if INTERPRET:
        want = rope_store_xla(qkv, cos, sin, write_at, *caches, H, **scales)
        for g, w in zip(got[1:], want[1:], strict=True):
            assert _same(g, w)
    untouched = np.ones(CAP, bool)
    untouched[at] = False
    before = (*caches, scales["k_scale"], scales["v_scale"])
    for new, old in zip(got[1:], before, strict=True):
        assert _same(np.asarray(new)[untouched], np.asarray(old)[untouched])
        assert not _same(np.asarray(new)[at], np.asarray(old)[at])


def _dequantized(caches, scales, dtype):
    return (kv_quant.dequantize(caches[0], scales["k_scale"], dtype),
            kv_quant.dequantize(caches[1], scales["v_scale"], dtype))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("row_invariant", "window"), [(True, None), (False, None), (True, 40)])
def test_attention_over_a_quantized_cache_is_attention_over_its_rows(kv_dtype, row_invariant,
                                                                      window):
    """Bitwise the kernel over the dequantized rows; the control, one scale changed by one
    part in a thousand, shows."""
    _, _, _, pos, caches, scales = _inputs(kv_dtype, seed=1)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((4, H, HD)), jnp.bfloat16)
    run = lambda c, **s: cached_attention(q, *c, pos, window=window,  # noqa: E731
                                          interpret=INTERPRET, row_invariant=row_invariant,
                                          **s)
    got = run(caches, **scales)
    assert got.dtype == jnp.bfloat16
    assert _same(got, run(_dequantized(caches, scales, jnp.bfloat16)))
    nudged = dict(scales, v_scale=scales["v_scale"].at[int(pos[0]) - 1, 0].multiply(1.001))
    assert not _same(got, run(caches, **nudged))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_rope_store_inside_attention_is_its_two_launches(kv_dtype):
    qkv, cos, sin, pos, caches, scales = _inputs(kv_dtype, seed=3)
    fused = rope_store_attention(qkv, cos, sin, pos, *caches, pos, H, interpret=INTERPRET,
                                 **scales)
    qr, *stored = rope_store(qkv, cos, sin, pos, *caches, H, interpret=INTERPRET, **scales)
    out = cached_attention_arranged(qr, stored[0], stored[1], pos, heads=H,
                                    interpret=INTERPRET, row_invariant=True,
                                    k_scale=stored[2], v_scale=stored[3])
    assert len(fused) == 5
    for g, w in zip(fused, (out, *stored), strict=True):
        assert _same(g, w)


# -- the dense model's GPU graph --------------------------------------------------------------

CONFIG = DenseConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, tie_word_embeddings=True)
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 256, 24)]


def _logits(plan, kv_dtype, width, prefill_width=None):
    model = DenseModel(CONFIG, jnp.float32, scan_layers=False, plan=plan, kv_dtype=kv_dtype)
    params = unstack_layers(DenseModel(CONFIG).init_params(jax.random.PRNGKey(0)))
    producer = BlockProducer(model, params, capacity=128, width=width,
                             prefill_width=prefill_width, steps_per_call=2)
    last, state = producer.prefill_chunk(producer.init_state(), PROMPT, 0)
    step, _ = producer.produce(state, 7, len(PROMPT))
    return np.asarray(last), np.asarray(step)


def test_gpu_graph_widths_agree_and_stay_near_xla():
    """The interpreted GPU graph over an int8 cache (RoPE-store inside the attention kernel at
    decode widths, the two launched apart for 16-row prefill blocks) gives bitwise the same
    logits at widths 1 and 4, near the XLA plan's with the same cache form (the two quantize
    rows rotated by different kernels, which may round a value across a step apart). The
    kernels take fp8 through the same code (the tests above run both)."""
    kv_dtype = "int8"
    gpu = KernelPlan.interpreted()
    one, four = _logits(gpu, kv_dtype, 1), _logits(gpu, kv_dtype, 4, 16)
    for a, b in zip(one, four, strict=True):
        assert _same(a, b)
    for g, w in zip(one, _logits(KernelPlan(), kv_dtype, 4), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-3)
