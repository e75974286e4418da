"""The quantized-KV forms of the GPU kernels lower for CUDA on the CPU (``jax.export`` runs
Pallas' Triton lowering, where a kernel the GPU would refuse usually fails: an int8 or float8
load, a rounding the Triton lowering lacks, a scale ref of one dimension). Running them is
the GPU's: ``JAX_PLATFORMS=cuda python -m pytest tests/quant/test_kv_kernels.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from turbospark_jax.kernels import attention as pallas_attention
from turbospark_jax.kernels import rope_store as pallas_rope_store
from turbospark_jax.quant import kv as kv_quant
from turbospark_jax.testing.cuda_export import cuda_text

BF16 = jnp.bfloat16
S = jax.ShapeDtypeStruct
SCALES = S((2048, 2), jnp.float32)
POS3 = S((3,), jnp.int32)


def _cache(kv_dtype):
    return S((2048, 2, 64), kv_quant.stored_dtype(kv_dtype, BF16))


def _kernels(kv_dtype):
    cache = _cache(kv_dtype)
    qkv, rope = S((3, 12 * 64), BF16), S((3, 64), BF16)
    return {
        "attention, row-invariant, 1 row": (
            lambda q, k, v, ks, vs, p: pallas_attention.cached_attention(
                q, k, v, p, row_invariant=True, k_scale=ks, v_scale=vs),
            S((1, 8, 64), BF16), cache, cache, SCALES, SCALES, S((1,), jnp.int32)),
        "attention, 300 rows, not row-invariant": (
            lambda q, k, v, ks, vs, p: pallas_attention.cached_attention(
                q, k, v, p, k_scale=ks, v_scale=vs),
            S((300, 8, 64), BF16), cache, cache, SCALES, SCALES, S((300,), jnp.int32)),
        "rope and cache write": (
            lambda x, c, s, at, k, v, ks, vs: pallas_rope_store.rope_store(
                x, c, s, at, k, v, 8, k_scale=ks, v_scale=vs),
            qkv, rope, rope, POS3, cache, cache, SCALES, SCALES),
        "rope and cache write inside the split attention kernel, folding in its last split": (
            lambda x, c, s, at, k, v, ks, vs: pallas_rope_store.rope_store_attention(
                x, c, s, at, k, v, at, 8, k_scale=ks, v_scale=vs)[0],
            qkv, rope, rope, POS3, cache, cache, SCALES, SCALES),
        "rope and cache write inside the folding attention, partial sums, q/k norm": (
            lambda x, c, s, at, k, v, ks, vs, n: pallas_rope_store.rope_store_attention(
                x, c, s, at, k, v, at, 8, n, n, max_keys=512, k_scale=ks, v_scale=vs)[0],
            S((4, 3, 12 * 64), jnp.float32), rope, rope, POS3, cache, cache, SCALES, SCALES,
            S((64,), BF16)),
    }


CASES = [(kv_dtype, name) for kv_dtype in kv_quant.KV_DTYPES for name in _kernels(kv_dtype)]


@pytest.mark.parametrize(("kv_dtype", "name"), CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_quantized_kernel_lowers_for_cuda(kv_dtype, name):
    fn, *args = _kernels(kv_dtype)[name]
    assert "xla.gpu.triton" in cuda_text(fn, *args)
