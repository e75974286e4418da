"""The RMSNorm in a product's prologue (models/pallas_norm_matvec.py): a decode step's row
normed inside the q/k/v matvec and the gated MLP matvec comes out bitwise as the norm kernel
followed by the plain kernels would give it, and as the same row of a wider call (a verify,
a prefill chunk) does; controls show the bitwise checks can fail; bad inputs are refused.

On a CPU the kernels run in the Pallas interpreter; on a GPU these tests run them compiled
(``JAX_PLATFORMS=cuda python -m pytest tests/test_pallas_norm_matvec.py``), where the
compiler's own layouts are what the fixed sum tree has to survive.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.models import rowinv
from turbospark_jax.models.pallas_norm_matvec import norm_matvec_parts, norm_swiglu, refusal
from turbospark_jax.models.pallas_row_norm import add_parts_rms_norm, halving_sum, row_rms_norm

IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
EPS = 1e-6
WIDTHS = (128, 64)  # a merged product's two weights (q/k/v-like), side by side
F = 256


@functools.cache
def _operands(dtype: str, d: int, seed: int = 0):
    """Rows ``[5, D]`` at scales 2^-6..2^6, partial sums of two deltas ``[S, 5, D]``, a norm
    weight, two product weights and a gate/up pair."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    residual = jnp.asarray(rng.standard_normal((5, d)) * 2.0 ** rng.integers(-6, 7, (5, 1)), dt)
    deltas = (jnp.asarray(rng.standard_normal((2, 5, d)), jnp.float32),
              jnp.asarray(rng.standard_normal((3, 5, d)), jnp.float32))
    weight = jnp.asarray(1 + 0.3 * rng.standard_normal(d), dt)
    ws = tuple(jnp.asarray(rng.standard_normal((d, n)) * d**-0.5, dt) for n in WIDTHS)
    gate, up = (jnp.asarray(rng.standard_normal((d, F)) * d**-0.5, dt) for _ in range(2))
    return residual, deltas, weight, ws, gate, up


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _normed_by_the_norm_kernel(residual, deltas, weight, eps=EPS):
    """``(h, normed)``: the deltas before the last added as XLA adds them, the last one and
    the norm by the norm kernel, its sum of squares the halving tree (``tree=True``)."""
    if not deltas:
        return residual, row_rms_norm(residual, weight, eps, impl=IMPL, tree=True)
    h = residual
    for p in deltas[:-1]:
        h = h + rowinv.sum_parts(p, h.dtype)
    return add_parts_rms_norm(h, deltas[-1], weight, eps, impl=IMPL, tree=True)


def _fused_parts(residual, deltas, weight, ws, row, eps=EPS):
    return norm_matvec_parts(residual[row:row + 1], tuple(p[:, row:row + 1] for p in deltas),
                             weight, eps, ws, impl=IMPL)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [128, 512])
@pytest.mark.parametrize("count", [0, 1, 2])
def test_norm_matvec_is_the_norm_kernel_then_the_matvec(dtype, d, count):
    residual, deltas, weight, ws, _, _ = _operands(dtype, d)
    deltas = deltas[:count]
    schedule = rowinv.schedule_for(d, sum(WIDTHS))
    _, normed = _normed_by_the_norm_kernel(residual, deltas, weight)
    # a five-row call (a verify's width: the matvec kernel) and a forty-row one (the matmul
    # kernel), whose rows a decode step must reproduce
    wide = rowinv.rowinv_matmul(normed, ws, parts=True, schedule=schedule, impl=IMPL)
    tall = rowinv.rowinv_matmul(jnp.tile(normed, (8, 1)), ws, schedule=schedule, impl=IMPL,
                                kernel="matmul", out_dtype=jnp.float32)
    for row in (0, 3):
        got = _fused_parts(residual, deltas, weight, ws, row)
        assert got.shape == (wide.shape[0], 1, sum(WIDTHS))
        assert np.array_equal(_bits(got), _bits(wide[:, row:row + 1]))
        assert np.array_equal(_bits(rowinv.sum_parts(got, jnp.float32))[0],
                              _bits(tall[row + 5]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("count", [1, 2])
def test_norm_swiglu_is_the_norm_kernel_then_the_gated_kernel(dtype, count):
    d = 256
    residual, deltas, weight, _, gate, up = _operands(dtype, d)
    deltas = deltas[:count]
    h_want, normed = _normed_by_the_norm_kernel(residual, deltas, weight)
    gated_want = rowinv.rowinv_swiglu(normed, gate, up, impl=IMPL)
    for row in (0, 4):
        h, gated = norm_swiglu(residual[row:row + 1], tuple(p[:, row:row + 1] for p in deltas),
                               weight, EPS, gate, up, impl=IMPL)
        assert np.array_equal(_bits(h), _bits(h_want[row:row + 1]))
        assert np.array_equal(_bits(gated), _bits(gated_want[row:row + 1]))


def test_control_the_checks_see_another_epsilon_and_another_delta_order():
    """The bitwise checks above can fail: the same row normed with another epsilon, or with
    its two deltas added in the other order, gives other partial sums."""
    residual, deltas, weight, ws, _gate, _up = _operands("bfloat16", 512)
    base = _bits(_fused_parts(residual, deltas, weight, ws, 0))
    assert not np.array_equal(base, _bits(_fused_parts(residual, deltas, weight, ws, 0, 1e-2)))
    swapped = _bits(_fused_parts(residual, deltas[::-1], weight, ws, 0))
    assert not np.array_equal(base, swapped)


def test_the_sum_of_squares_is_a_fixed_halving_tree():
    """``halving_sum`` adds the halves elementwise down to one value (the order spelled out
    here), which is not the left-to-right order: on these values the two differ."""
    rng = np.random.default_rng(3)
    v = (rng.standard_normal(64) * 2.0 ** rng.integers(-20, 20, 64)).astype(np.float32)
    tree = v.copy()
    while tree.size > 1:
        tree = tree[: tree.size // 2] + tree[tree.size // 2:]
    got = np.asarray(jax.jit(halving_sum)(jnp.asarray(v)))
    assert got.shape == () and got.view(np.uint32) == tree[0].view(np.uint32)
    left = np.float32(0)
    for x in v:
        left = np.float32(left + x)
    assert left.view(np.uint32) != tree[0].view(np.uint32)


@pytest.mark.parametrize(("shape", "dtype", "weight", "why"), [
    ((2, 256), "bfloat16", True, "one row"),
    ((1, 256), "float32", True, "exact squares"),
    ((1, 192), "bfloat16", True, "power of two"),
    ((1, 64), "bfloat16", True, "power of two"),
    ((1, 256), "bfloat16", False, "norm weight"),
])
def test_rows_the_prologue_cannot_take_are_refused_by_name(shape, dtype, weight, why):
    residual = jnp.ones(shape, dtype)
    w = jnp.ones(shape[1:], dtype) if weight else None
    assert why in refusal(residual, w)
    with pytest.raises(BadInputError, match=why):
        norm_matvec_parts(residual, (), w, EPS, jnp.ones((shape[1], 16), dtype), impl=IMPL)


def test_bad_operands_are_refused():
    residual, deltas, weight, ws, gate, up = _operands("bfloat16", 128)
    row = residual[:1]
    with pytest.raises(BadInputError, match="float32 partial sums"):
        norm_matvec_parts(row, (deltas[0][:, :2],), weight, EPS, ws, impl=IMPL)
    with pytest.raises(BadInputError, match="each weight"):
        norm_matvec_parts(row, (), weight, EPS, (ws[0].astype(jnp.float32),), impl=IMPL)
    with pytest.raises(BadInputError, match="non-empty tuple"):
        norm_matvec_parts(row, (), weight, EPS, (), impl=IMPL)
    with pytest.raises(BadInputError, match="eps"):
        norm_matvec_parts(row, (), weight, "small", ws, impl=IMPL)
    with pytest.raises(BadInputError, match="impl 'pallas'"):
        norm_matvec_parts(row, (), weight, EPS, ws, impl="xla")
    with pytest.raises(BadInputError, match="share one shape"):
        norm_swiglu(row, (), weight, EPS, gate, up[:, :128], impl=IMPL)
    with pytest.raises(BadInputError, match="label"):
        norm_swiglu(row, (), weight, EPS, gate, up, impl=IMPL, label="a b")
