"""The row-invariant RMSNorm kernel (kernels/row_norm.py): close to ``layers.rms_norm``
(and the residual sum bitwise XLA's ``residual + x``), a row's bits the same for any number of
rows and any position, a control showing that bitwise check can fail, the ``[W, H, hd]`` form,
and the bad inputs it refuses.

On a CPU the kernel runs in the Pallas interpreter; on a GPU these tests run the compiled
Triton kernel (``JAX_PLATFORMS=cuda python -m pytest tests/kernels/test_row_norm.py``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.layers import rms_norm
from turbospark_jax.kernels.row_norm import row_rms_norm

IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
EPS = 1e-6
ROWS = 40
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
#: Tolerances against ``layers.rms_norm``: the kernel sums the squares in another order.
TOL = {"bfloat16": {"rtol": 1e-2, "atol": 1e-2}, "float32": {"rtol": 1e-6, "atol": 1e-6}}


@functools.cache
def _inputs(dtype: str, d: int, seed: int = 0):
    """``x``, ``weight``, ``residual``: the residual's rows at scales from 2^-12 to 2^12, so its
    sum with ``x`` meets operands of very different exponents."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, d))
    scales = 2.0 ** rng.integers(-12, 13, size=(ROWS, 1))
    residual = rng.standard_normal((ROWS, d)) * scales
    weight = 1.0 + 0.5 * rng.standard_normal(d)
    return tuple(jnp.asarray(a, DTYPES[dtype]) for a in (x, weight, residual))


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _close(got, want, dtype: str) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("scaled", [False, True])
def test_matches_layers_rms_norm(dtype, d, scaled):
    x, weight, residual = _inputs(dtype, d)
    weight = weight if scaled else None
    _close(row_rms_norm(x, weight, EPS, impl=IMPL), rms_norm(x, weight, EPS), dtype)
    h, normed = row_rms_norm(x, weight, EPS, residual=residual, impl=IMPL)
    want_h = residual + x
    assert np.array_equal(_bits(h), _bits(want_h))  # one rounding, as XLA's add
    _close(normed, rms_norm(want_h, weight, EPS), dtype)


def test_residual_sum_is_the_correctly_rounded_sum():
    """XLA's bfloat16 ``residual + x`` (which the kernel's sum is compared to above) is the
    float32 sum rounded once to bfloat16: the same definition the kernel computes by."""
    x, _, residual = _inputs("bfloat16", 96)
    exact = (np.asarray(residual, np.float32) + np.asarray(x, np.float32)).astype(jnp.bfloat16)
    assert np.array_equal(_bits(residual + x), _bits(exact))


@pytest.mark.parametrize("dtype", DTYPES)
def test_xla_impl_is_the_plain_expression(dtype):
    """Bitwise the same as the expression jitted on its own (eager ops round differently:
    XLA fuses the jitted norm)."""
    x, weight, residual = _inputs(dtype, 96)
    plain = jax.jit(lambda x, w: rms_norm(x, w, EPS))
    assert np.array_equal(_bits(row_rms_norm(x, weight, EPS, impl="xla")),
                          _bits(plain(x, weight)))
    fused = jax.jit(lambda r, x, w: (r + x, rms_norm(r + x, w, EPS)))
    got = row_rms_norm(x, weight, EPS, residual=residual, impl="xla")
    for a, b in zip(got, fused(residual, x, weight), strict=True):
        assert np.array_equal(_bits(a), _bits(b))


def _norm_bits(dtype: str, d: int, add: bool, start: int, stop: int, eps: float = EPS) -> list:
    """Bits of the results for rows ``start:stop`` of the inputs, called on those alone:
    ``(h, normed)`` with the residual ``add``ed, ``[normed]`` without."""
    x, weight, residual = _inputs(dtype, d)
    if not add:
        return [_bits(row_rms_norm(x[start:stop], weight, eps, impl=IMPL))]
    out = row_rms_norm(x[start:stop], weight, eps, residual=residual[start:stop], impl=IMPL)
    return [_bits(o) for o in out]


def _failures(norm) -> list:
    """Row counts whose rows differ from the same rows of the 40-row call, and row 20 if its
    one-row call differs from row 20 there; ``norm(start, stop)`` gives a list of bits."""
    full = norm(0, ROWS)
    bad = [m for m in (1, 3, 16, 33)
           if not all(np.array_equal(a, b[:m]) for a, b in zip(norm(0, m), full, strict=True))]
    if not all(np.array_equal(a[0], b[20]) for a, b in zip(norm(20, 21), full, strict=True)):
        bad.append(("row", 20))
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "add"), [(96, True), (128, False)])
def test_rows_do_not_depend_on_the_row_count(dtype, d, add):
    """D=96 runs padded to 128 columns, with the residual; D=128 as it is, without."""
    assert _failures(functools.partial(_norm_bits, dtype, d, add)) == []


def test_control_the_row_check_sees_a_row_count_dependence():
    """The check can fail: a norm whose epsilon grows with the row count is caught."""
    def norm(start, stop):
        return _norm_bits("float32", 96, False, start, stop, eps=1e-3 * (stop - start))

    assert _failures(norm) == [1, 3, 16, 33, ("row", 20)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_control_one_input_bit_changes_its_row_only(dtype):
    """The bitwise comparisons are not vacuous: flipping the lowest bit of one element of row
    7 changes row 7's output bits and no other row's."""
    x, weight, _ = _inputs(dtype, 96)
    raw = _bits(x).copy()
    raw[7, 5] ^= 1
    flipped = jnp.asarray(raw.view(np.asarray(x).dtype))
    before = _bits(row_rms_norm(x, weight, EPS, impl=IMPL))
    after = _bits(row_rms_norm(flipped, weight, EPS, impl=IMPL))
    assert not np.array_equal(after[7], before[7])
    assert np.array_equal(np.delete(after, 7, axis=0), np.delete(before, 7, axis=0))


def test_heads_layout_equals_flat_rows():
    """``[W, H, hd]`` (a per-head q/k norm) gives the ``[W * H, hd]`` call's rows."""
    x, weight, residual = _inputs("bfloat16", 64)
    heads = x.reshape(5, 8, 64)
    got = row_rms_norm(heads, weight, EPS, impl=IMPL)
    assert got.shape == (5, 8, 64)
    assert np.array_equal(_bits(got).reshape(ROWS, 64),
                          _bits(row_rms_norm(x, weight, EPS, impl=IMPL)))
    h, normed = row_rms_norm(heads, weight, EPS, residual=residual.reshape(5, 8, 64), impl=IMPL)
    want_h, want = row_rms_norm(x, weight, EPS, residual=residual, impl=IMPL)
    assert h.shape == normed.shape == (5, 8, 64)
    assert np.array_equal(_bits(h).reshape(ROWS, 64), _bits(want_h))
    assert np.array_equal(_bits(normed).reshape(ROWS, 64), _bits(want))


X = jnp.ones((4, 64), jnp.bfloat16)
W = jnp.ones((64,), jnp.bfloat16)
BAD = {
    "scalar x": (jnp.ones((), jnp.bfloat16), None, {}),
    "empty x": (jnp.ones((0, 64), jnp.bfloat16), None, {}),
    "not an array": ([1.0, 2.0], None, {}),
    "int dtype": (jnp.ones((4, 64), jnp.int32), None, {}),
    "float64 dtype": (np.ones((4, 64), np.float64), None, {}),
    "weight shape": (X, jnp.ones((32,), jnp.bfloat16), {}),
    "weight 2-D": (X, jnp.ones((1, 64), jnp.bfloat16), {}),
    "weight dtype": (X, jnp.ones((64,), jnp.float32), {}),
    "residual shape": (X, W, {"residual": jnp.ones((3, 64), jnp.bfloat16)}),
    "residual dtype": (X, W, {"residual": jnp.ones((4, 64), jnp.float32)}),
    "bad impl": (X, W, {"impl": "triton"}),
    "eps traced": (X, W, {"eps": jnp.float32(1e-6)}),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_are_refused(case):
    x, weight, kwargs = BAD[case]
    kwargs = dict(kwargs)
    eps = kwargs.pop("eps", EPS)
    with pytest.raises(BadInputError):
        row_rms_norm(x, weight, eps, **kwargs)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the kernel runs on a GPU")
def test_pallas_impl_off_a_gpu_is_refused():
    with pytest.raises(BadInputError, match="interpret"):
        row_rms_norm(X, W, EPS, impl="pallas")


# -- the residual's delta as unfinished partial sums (add_parts_rms_norm) ----------------------

def _parts(d: int, count: int, rows: int = ROWS, seed: int = 1) -> jnp.ndarray:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((count, rows, d)) * 3, jnp.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("count", [1, 3])
def test_parts_fused_equal_the_sum_then_the_norm(dtype, d, count):
    """The kernel that adds the partial sums itself gives the bits of ``sum_parts`` followed
    by the residual norm: the same additions in the same order."""
    from turbospark_jax.kernels.row_norm import add_parts_rms_norm
    from turbospark_jax.kernels.rowinv import sum_parts

    _, weight, residual = _inputs(dtype, d)
    parts = _parts(d, count)
    h, normed = add_parts_rms_norm(residual, parts, weight, EPS, impl=IMPL)
    want_h, want = row_rms_norm(sum_parts(parts, residual.dtype), weight, EPS,
                                residual=residual, impl=IMPL)
    assert np.array_equal(_bits(h), _bits(want_h)) and np.array_equal(_bits(normed), _bits(want))
    # rows do not depend on the row count here either
    h5, normed5 = add_parts_rms_norm(residual[7:12], parts[:, 7:12], weight, EPS, impl=IMPL)
    assert np.array_equal(_bits(normed5), _bits(normed[7:12]))
    assert np.array_equal(_bits(h5), _bits(h[7:12]))


def test_parts_in_another_order_give_other_bits():
    """Control: the order of the additions is part of the result (float32 addition does not
    associate), so the bitwise check above can fail."""
    from turbospark_jax.kernels.row_norm import add_parts_rms_norm

    _, weight, residual = _inputs("float32", 64)
    parts = _parts(64, 3) * jnp.asarray([1.0, 1e8, -1e8])[:, None, None]
    ahead, _ = add_parts_rms_norm(residual, parts, weight, EPS, impl=IMPL)
    behind, _ = add_parts_rms_norm(residual, parts[::-1], weight, EPS, impl=IMPL)
    assert not np.array_equal(_bits(ahead), _bits(behind))


def test_parts_bad_input_is_refused():
    from turbospark_jax.kernels.row_norm import add_parts_rms_norm

    _, weight, residual = _inputs("bfloat16", 64)
    parts = _parts(64, 2)
    for bad in (parts.astype(jnp.bfloat16), parts[:, :5], parts[0], parts[:0]):
        with pytest.raises(BadInputError, match="parts"):
            add_parts_rms_norm(residual, bad, weight, EPS, impl=IMPL)
    with pytest.raises(BadInputError, match="residual"):
        add_parts_rms_norm(residual.astype(jnp.int32), parts, weight, EPS, impl=IMPL)
