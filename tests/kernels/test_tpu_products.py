"""The TPU's row-invariant product (kernels/tpu_products.py) in Pallas' TPU interpreter on the
CPU: a row's bits are the same at every row count and position, against controls (XLA's own
dot at another row count changes a row; a perturbed row changes that row alone); the values
are within float tolerance of ``x @ w``; the products' dispatch under the TPU plan.

Nothing here runs on a TPU: the interpreter checks the kernel's K order and its wiring, the
lowering tests (``test_tpu_lowering.py``) that Mosaic takes it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import plan as kplan
from turbospark_jax.kernels.plan import KernelPlan
from turbospark_jax.kernels.row_norm import row_rms_norm
from turbospark_jax.kernels.rowinv import rowinv_matmul, rowinv_swiglu, swiglu_gating
from turbospark_jax.kernels.tpu_products import (
    MAX_ROW_TILE,
    k_block_for,
    row_tile_for,
    tpu_matmul,
)
from turbospark_jax.quant.weights import dequantize, quantize

IMPL = "tpu_interpret"
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
#: K over two blocks, padded to whole lanes; N over three lane blocks, the last padded.
K, N = 700, 300
WIDTHS = (1, 3, 8, 16)


@functools.cache
def _operands(dtype: str, rows: int = 16, k: int = K, n: int = N, nk: bool = False):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((rows, k)), DTYPES[dtype])
    w = rng.standard_normal((n, k) if nk else (k, n)) / np.sqrt(k)
    return x, jnp.asarray(w, DTYPES[dtype])


def _tpu(x, w, **kwargs):
    return np.asarray(tpu_matmul(x, w, impl=IMPL, **kwargs))


def test_blocks_follow_k_alone_and_row_tiles_the_dtype():
    assert [k_block_for(k) for k in (100, 128, 700, 896, 2048, 1536)] == [
        128, 128, 384, 128, 512, 512]  # 700: 768 columns in two blocks; 896: seven lanes
    assert [row_tile_for(m, jnp.float32) for m in (1, 8, 9, 300)] == [8, 8, 16, MAX_ROW_TILE]
    assert [row_tile_for(m, jnp.bfloat16) for m in (1, 16, 17)] == [16, 16, 32]


@pytest.mark.parametrize("nk", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_row_count(dtype, nk):
    x, w = _operands(dtype, nk=nk)
    layout = "nk" if nk else "kn"
    full = _tpu(x, w, w_layout=layout)
    for m in WIDTHS:
        assert np.array_equal(_tpu(x[:m], w, w_layout=layout), full[:m]), m
    # a row alone, from the middle of the call: the same bits as in place
    for r in (5, 15):
        assert np.array_equal(_tpu(x[r : r + 1], w, w_layout=layout)[0], full[r]), r


def test_a_wide_call_with_tall_row_tiles_keeps_each_rows_bits():
    x, w = _operands("float32", rows=300)
    full = _tpu(x, w)  # two row tiles of 256 rows
    assert np.array_equal(_tpu(x[:1], w), full[:1])
    assert np.array_equal(_tpu(x[299:], w), full[299:])
    assert np.array_equal(_tpu(x[:40], w), full[:40])  # one tile of 64 rows


def test_control_xlas_own_dot_changes_a_row_with_the_row_count():
    """The check above has teeth: XLA's CPU dot of these operands gives row 0 other bits at
    one row than at sixteen (a matrix-vector path of its own), where the kernel does not."""
    x, w = _operands("float32")
    precise = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
    assert not np.array_equal(np.asarray(precise(x[:1], w))[0], np.asarray(precise(x, w))[0])
    assert np.array_equal(_tpu(x[:1], w)[0], _tpu(x, w)[0])


def test_control_a_perturbed_row_changes_that_row_alone():
    x, w = _operands("float32", rows=8)
    full = _tpu(x, w)
    moved = _tpu(x.at[2, 100].add(1.0), w)
    changed = [r for r in range(8) if not np.array_equal(moved[r], full[r])]
    assert changed == [2]


@pytest.mark.parametrize(("dtype", "out"), [("float32", "float32"), ("bfloat16", "bfloat16"),
                                            ("bfloat16", "float32")])
def test_values_within_float_tolerance_of_the_product(dtype, out):
    x, w = _operands(dtype)
    got = _tpu(x, w, out_dtype=DTYPES[out]).astype(np.float64)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # float32 accumulation over K terms, then (bfloat16 out) one rounding to 8 bits
    bound = K * np.finfo(np.float32).eps * (np.abs(np.asarray(x, np.float64))
                                            @ np.abs(np.asarray(w, np.float64)))
    if out == "bfloat16":
        bound = bound + np.abs(exact) * 2.0**-8
    assert np.all(np.abs(got - exact) <= bound)


def test_rowinv_matmul_dispatches_the_tpu_kernel():
    x, w = _operands("bfloat16")
    _, w2 = _operands("bfloat16", n=64)
    both = np.asarray(rowinv_matmul(x[:3], (w, w2), impl=IMPL, label="qkv"))
    assert np.array_equal(both, np.concatenate([_tpu(x[:3], w), _tpu(x[:3], w2)], axis=1))
    parts = np.asarray(rowinv_matmul(x[:3], w, impl=IMPL, parts=True))
    assert parts.shape == (1, 3, N)
    assert np.array_equal(parts[0], _tpu(x[:3], w, out_dtype=jnp.float32))
    _, table = _operands("bfloat16", nk=True)
    assert np.array_equal(np.asarray(rowinv_matmul(x[:1], table, w_layout="nk", impl=IMPL)),
                          _tpu(x[:1], table, w_layout="nk"))


def test_quantized_weights_are_dequantized_before_the_kernel():
    x, w = _operands("bfloat16")
    q = jax.tree.map(jnp.asarray, quantize(np.asarray(w, np.float32)[:, :256], "int8"))
    got = np.asarray(rowinv_matmul(x[:2], q, impl=IMPL))
    assert np.array_equal(got, _tpu(x[:2], dequantize(q, jnp.bfloat16)))


def test_the_gated_product_is_the_two_products_then_the_gating():
    x, gate = _operands("bfloat16", n=256)
    up = gate[::-1]
    got = np.asarray(rowinv_swiglu(x[:3], gate, up, impl=IMPL))
    want = swiglu_gating(jnp.asarray(_tpu(x[:3], gate)), jnp.asarray(_tpu(x[:3], up)),
                         jnp.bfloat16)
    assert np.array_equal(got, np.asarray(want))
    assert np.array_equal(np.asarray(rowinv_swiglu(x[:1], gate, up, impl=IMPL)), got[:1])


def test_the_tpu_plan_runs_its_products_on_the_kernel():
    plan = KernelPlan.interpreted(target="tpu")
    x, w = _operands("float32")
    assert np.array_equal(np.asarray(kplan.matmul(plan, x[:3], w)), _tpu(x[:3], w))


def test_bad_inputs_are_refused():
    x, w = _operands("float32")
    with pytest.raises(BadInputError, match="impl='tpu' needs a TPU"):
        rowinv_matmul(x, w, impl="tpu")
    with pytest.raises(BadInputError, match="impl must be one of tpu, tpu_interpret"):
        tpu_matmul(x, w, impl="interpret")
    with pytest.raises(BadInputError, match="needs equal K"):
        tpu_matmul(x, w.T, impl=IMPL)
    with pytest.raises(BadInputError, match="x and w alike"):
        tpu_matmul(x, w.astype(jnp.bfloat16), impl=IMPL)
    with pytest.raises(BadInputError, match="w_layout must be"):
        tpu_matmul(x, w, w_layout="kk", impl=IMPL)
    with pytest.raises(BadInputError, match="label must be"):
        tpu_matmul(x, w, impl=IMPL, label="a-b")
    with pytest.raises(BadInputError, match="has no TPU form"):  # the norm has no TPU kernel
        row_rms_norm(x, None, 1e-6, impl=IMPL)

