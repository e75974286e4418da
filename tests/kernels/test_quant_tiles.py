"""The row-invariant kernels read a quantized weight at its stored width and dequantize each
tile in registers, the matvec kernels (decode, verify) and the matmul kernels (a prefill's
wide rows) alike, so a row's product is bitwise the same in either, for every scheme: in the
Pallas interpreter here and in the compiled kernels on a GPU (``JAX_PLATFORMS=cuda``). In the
interpreter it is also the product with the dequantized matrix in memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.kernels.quant_tiles import fits_tiles
from turbospark_jax.kernels.rowinv import rowinv_matmul, rowinv_swiglu, schedule_for
from turbospark_jax.quant.weights import dequantize, quantize

ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas" if ON_GPU else "interpret"
DTYPE = jnp.bfloat16 if ON_GPU else jnp.float32
K = 512
SCHEMES = [("int8", None, 96), ("int4", 128, 96), ("int4", 32, 96), ("fp8", None, 96),
           ("fp8-block", None, 256)]


def _weight(scheme, group, n, seed=0):
    w = np.random.default_rng(seed).standard_normal((K, n)).astype(np.float32) * 0.05
    return jax.tree.map(jnp.asarray, quantize(w, scheme, group=group, dtype=DTYPE))


@pytest.mark.parametrize("scheme, group, n", SCHEMES)
def test_matvec_reads_quantized_tiles_as_dequantized(scheme, group, n):
    w = _weight(scheme, group, n)
    assert fits_tiles(w, 128)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, K)), DTYPE)
    schedule = schedule_for(K, n)
    in_place = rowinv_matmul(x, w, impl=IMPL, kernel="matvec", schedule=schedule)
    plain = rowinv_matmul(x, dequantize(w), impl=IMPL, kernel="matvec", schedule=schedule)
    wide = rowinv_matmul(x, w, impl=IMPL, kernel="matmul", schedule=schedule)
    assert np.array_equal(in_place, wide)
    gated = rowinv_swiglu(x, w, w, impl=IMPL, kernel="matvec")
    assert np.array_equal(gated, rowinv_swiglu(x, w, w, impl=IMPL, kernel="matmul"))
    if not ON_GPU:  # the interpreter's tile product; see docs/decisions/0019
        assert np.array_equal(in_place, plain)
        assert np.array_equal(gated, rowinv_swiglu(x, dequantize(w), dequantize(w),
                                                   impl=IMPL, kernel="matvec"))


def test_quantized_beside_plain_weight_in_one_launch():
    w = _weight("int4", 64, 96)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, K)), DTYPE)
    both = rowinv_matmul(x, (w, dequantize(w)), impl=IMPL, kernel="matvec")
    assert np.array_equal(both[:, :96], both[:, 96:])


def test_control_another_quantization_differs():
    """The check can fail: the same matrix quantized in int8 and in fp8."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, K)), DTYPE)
    a = rowinv_matmul(x, _weight("int8", None, 96), impl=IMPL, kernel="matvec")
    b = rowinv_matmul(x, _weight("fp8", None, 96), impl=IMPL, kernel="matvec")
    assert not np.array_equal(a, b)
