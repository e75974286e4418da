"""The tensor-core RMSNorm (models/pallas_norm_prologue.py): its 16-row-tile kernel
(``add_parts_norm_tiles``) and the matvec kernels that form it as they load ``x``
(``rowinv_norm_matvec``, ``rowinv_norm_swiglu``) give the same bits, a row's bits do not
depend on the row count, it is close to ``layers.rms_norm``, controls show the bitwise checks
can fail, and bad inputs are refused.

On a CPU the kernels run in the Pallas interpreter; on a GPU these tests run the compiled
Triton kernels (``JAX_PLATFORMS=cuda python -m pytest tests/test_pallas_norm_prologue.py``),
which is where the fused and separate forms' agreement is the claim that matters.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.models.layers import rms_norm
from turbospark_jax.models.pallas_row_norm import add_parts_norm_tiles, add_parts_rms_norm
from turbospark_jax.models.rowinv import (
    Schedule,
    rowinv_matmul,
    rowinv_norm_matvec,
    rowinv_norm_swiglu,
    rowinv_swiglu,
    schedule_for,
)

IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
EPS = 1e-6
ROWS = 40


@functools.cache
def _inputs(d: int, parts: int, dtype=jnp.bfloat16, seed: int = 0):
    """``residual [ROWS, d]`` at row scales from 2^-6 to 2^6, the delta's float32 partial sums
    ``[parts, ROWS, d]`` and a norm weight ``[d]``."""
    rng = np.random.default_rng(seed)
    scales = 2.0 ** rng.integers(-6, 7, size=(ROWS, 1))
    residual = jnp.asarray(rng.standard_normal((ROWS, d)) * scales, dtype)
    delta = jnp.asarray(rng.standard_normal((parts, ROWS, d)), jnp.float32)
    weight = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), dtype)
    return residual, delta, weight


def _weights(k: int, n: int, seed: int = 2) -> jnp.ndarray:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, jnp.bfloat16)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _same(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


# -- the tile kernel --------------------------------------------------------------------------

@pytest.mark.parametrize("d", [128, 200, 384])
def test_tile_norm_is_the_norm_and_its_residual_is_the_exact_sum(d):
    residual, delta, weight = _inputs(d, 3)
    h, normed = add_parts_norm_tiles(residual, delta, weight, EPS, impl=IMPL)
    want_h, _ = add_parts_rms_norm(residual, delta, weight, EPS, impl=IMPL)
    assert _same(h, want_h)  # the residual's sum is the other norm kernel's, bitwise
    np.testing.assert_allclose(np.asarray(normed, np.float32),
                               np.asarray(rms_norm(h, weight, EPS), np.float32),
                               rtol=1e-2, atol=1e-2)


def test_tile_norm_sum_of_squares_loses_nothing_to_bfloat16_operands():
    """The squares' tile goes into the tensor cores as three bfloat16 pieces that add up to it
    exactly: the normed rows match a float64 norm to bfloat16's rounding, including rows whose
    squares need more than bfloat16's 8 bits."""
    residual, delta, weight = _inputs(256, 1)
    h, normed = add_parts_norm_tiles(residual, delta, weight, EPS, impl=IMPL)
    h64 = np.asarray(h, np.float64)
    inverse = 1.0 / np.sqrt(np.mean(h64 * h64, axis=1, keepdims=True) + EPS)
    want = np.asarray(weight, np.float64) * np.asarray(
        jnp.asarray(h64 * inverse, jnp.bfloat16), np.float64)
    np.testing.assert_allclose(np.asarray(normed, np.float64), want, rtol=2**-7, atol=0)


@pytest.mark.parametrize("rows", [(0, 1), (7, 12), (3, 40), (16, 33)])
def test_tile_norm_rows_do_not_depend_on_the_row_count(rows):
    residual, delta, weight = _inputs(384, 2)
    h, normed = add_parts_norm_tiles(residual, delta, weight, EPS, impl=IMPL)
    a, b = rows
    h_part, normed_part = add_parts_norm_tiles(residual[a:b], delta[:, a:b], weight, EPS,
                                               impl=IMPL)
    assert _same(normed_part, normed[a:b]) and _same(h_part, h[a:b])


def test_control_parts_in_another_order_give_other_bits():
    """Control: the partial sums' order is part of the result, so the checks can fail. The
    second and third sums cancel exactly; added after them the first survives whole, added
    before them it is rounded away at their magnitude."""
    residual, delta, weight = _inputs(128, 3)
    delta = jnp.stack([delta[0], delta[1] * 2.0**24, -delta[1] * 2.0**24])
    ahead, _ = add_parts_norm_tiles(residual, delta, weight, EPS, impl=IMPL)
    behind, _ = add_parts_norm_tiles(residual, delta[::-1], weight, EPS, impl=IMPL)
    assert not _same(ahead, behind)


# -- the norm inside the products -------------------------------------------------------------

CASES = [  # (rows, K, N, partial sums in): one and several segments, K past whole tiles
    (1, 256, 192, 1),
    (1, 1024, 96, 4),
    (3, 384, 64, 2),
    (16, 1024, 128, 4),
    (5, 200, 64, 3),
]


@pytest.mark.parametrize("m,k,n,count", CASES)
def test_norm_matvec_is_the_tile_norm_then_the_product(m, k, n, count):
    residual, delta, weight = _inputs(k, count)
    residual, delta = residual[:m], delta[:, :m]
    ws = (_weights(k, n), _weights(k, 32, seed=3))
    schedule = schedule_for(k, n + 32)
    h, parts = rowinv_norm_matvec(residual, delta, weight, EPS, ws, impl=IMPL,
                                  schedule=schedule, label="qkv")
    want_h, normed = add_parts_norm_tiles(residual, delta, weight, EPS, impl=IMPL)
    want = rowinv_matmul(normed, ws, impl=IMPL, schedule=schedule, parts=True)
    assert _same(h, want_h) and _same(parts, want)


@pytest.mark.parametrize("m,k,count", [(1, 256, 1), (2, 1024, 4), (16, 384, 2), (7, 200, 3)])
def test_norm_swiglu_is_the_tile_norm_then_the_gated_product(m, k, count):
    residual, delta, weight = _inputs(k, count)
    residual, delta = residual[:m], delta[:, :m]
    gate, up = _weights(k, 160), _weights(k, 160, seed=4)
    h, gated = rowinv_norm_swiglu(residual, delta, weight, EPS, gate, up, impl=IMPL)
    want_h, normed = add_parts_norm_tiles(residual, delta, weight, EPS, impl=IMPL)
    assert _same(h, want_h) and _same(gated, rowinv_swiglu(normed, gate, up, impl=IMPL))


def test_a_row_keeps_its_bits_from_one_row_to_a_prefill():
    """Row 9 alone (the fused matvec kernel), among 5 rows (the same kernel, masked) and
    among 40 (the tile kernel, then the matrix kernel): the same bits of ``h`` and of the
    products."""
    k = 1024
    residual, delta, weight = _inputs(k, 4)
    ws, gate, up = _weights(k, 128), _weights(k, 96, seed=5), _weights(k, 96, seed=6)
    schedule = schedule_for(k, 128)
    outs = []
    for a, b in ((9, 10), (7, 12), (0, ROWS)):
        r, p = residual[a:b], delta[:, a:b]
        h, parts = rowinv_norm_matvec(r, p, weight, EPS, ws, impl=IMPL, schedule=schedule)
        _, gated = rowinv_norm_swiglu(r, p, weight, EPS, gate, up, impl=IMPL)
        row = 9 - a
        finished = np.asarray(jnp.sum(parts, axis=0))  # any fixed finish, the same for all
        outs.append((h[row], finished[row], gated[row]))
    for got in outs[1:]:
        assert all(_same(x, y) for x, y in zip(got, outs[0], strict=True))


def test_control_the_prologue_check_sees_a_changed_weight():
    """Control: one changed bit of the norm's weight reaches the fused product's result."""
    k = 256
    residual, delta, weight = _inputs(k, 2)
    ws = (_weights(k, 64),)
    h, parts = rowinv_norm_matvec(residual[:1], delta[:, :1], weight, EPS, ws, impl=IMPL)
    nudged = weight.at[5].set(jnp.nextafter(weight[5], jnp.asarray(9.0, weight.dtype)))
    h2, parts2 = rowinv_norm_matvec(residual[:1], delta[:, :1], nudged, EPS, ws, impl=IMPL)
    assert _same(h, h2) and not _same(parts, parts2)


# -- bad inputs -------------------------------------------------------------------------------

def test_bad_inputs_are_refused_by_name():
    residual, delta, weight = _inputs(256, 2)
    w = _weights(256, 64)
    with pytest.raises(BadInputError, match="bfloat16 or float16"):
        add_parts_norm_tiles(residual.astype(jnp.float32), delta,
                             weight.astype(jnp.float32), EPS, impl=IMPL)
    with pytest.raises(BadInputError, match="weight"):
        add_parts_norm_tiles(residual, delta, None, EPS, impl=IMPL)
    with pytest.raises(BadInputError, match="parts"):
        add_parts_norm_tiles(residual, delta[:, :5], weight, EPS, impl=IMPL)
    with pytest.raises(BadInputError, match="residual must be"):
        rowinv_norm_matvec(residual[None], delta[:, None], weight, EPS, w, impl=IMPL)
    with pytest.raises(BadInputError, match="w must be"):
        rowinv_norm_matvec(residual, delta, weight, EPS, _weights(128, 64), impl=IMPL)
    with pytest.raises(BadInputError, match="tiles of 128"):
        rowinv_norm_matvec(residual, delta, weight, EPS, w, impl=IMPL,
                           schedule=Schedule(k_tile=64))
    with pytest.raises(BadInputError, match="gate and up"):
        rowinv_norm_swiglu(residual, delta, weight, EPS, w, _weights(256, 32), impl=IMPL)
    with pytest.raises(BadInputError, match="label"):
        rowinv_norm_swiglu(residual, delta, weight, EPS, w, w, impl=IMPL, label="a b")
    with pytest.raises(BadInputError, match="impl"):
        rowinv_norm_matvec(residual, delta, weight, EPS, w, impl="cuda")
