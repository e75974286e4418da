"""The stored schemes: what quantizing keeps, how the stored form reads back, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.quant.weights import (
    Quantization,
    dequantize,
    pack_int4,
    quantize,
    quantize_leaf,
    take_rows,
    tied_logits,
    unpack_int4,
)

RNG = np.random.default_rng(0)
W = (RNG.standard_normal((256, 256)) * 0.02).astype(np.float32)

#: The largest error of a dequantized weight, relative to its column's (or group's) largest
#: magnitude: half a step of the scheme's grid.
BOUND = {"int8": 0.5 / 127, "int4": 0.5 / 15 * 2, "fp8": 2.0**-4, "fp8-block": 2.0**-4}


@pytest.mark.parametrize("scheme", sorted(BOUND))
def test_dequantized_error_within_half_a_step(scheme):
    w = quantize(W, scheme, group=64)
    back = np.asarray(dequantize(w, jnp.float32))
    err = np.abs(back - W) / np.abs(W).max(axis=0, keepdims=True)
    assert err.max() <= BOUND[scheme] * 1.01


def test_stored_bytes_are_the_schemes():
    k, n = W.shape
    assert quantize(W, "int8").stored_bytes == k * n + 4 * n
    assert quantize(W, "int4", group=128).stored_bytes == k * n // 2 + 5 * (k // 128) * n
    assert quantize(W, "fp8").stored_bytes == k * n + 4 * n


def test_int4_packs_two_columns_a_byte():
    nibbles = RNG.integers(0, 16, size=(4, 6)).astype(np.uint8)
    packed = pack_int4(nibbles)
    assert packed.shape == (4, 3)
    assert np.array_equal(packed[:, 1] & 0xF, nibbles[:, 2])
    assert np.array_equal(packed[:, 1] >> 4, nibbles[:, 3])
    assert np.array_equal(np.asarray(unpack_int4(packed)), nibbles)


def test_leaf_shapes_and_stacked_layers():
    leaf = RNG.standard_normal((3, 64, 4, 16)).astype(np.float32)  # [L, D, H, hd]
    w = quantize_leaf(leaf, 64, 1, Quantization("int8"), jnp.float32)
    assert w.shape == (3, 64, 4, 16)
    one = w[1]
    assert one.shape == (64, 4, 16) and one.reshape(64, -1).shape == (64, 64)
    assert np.array_equal(np.asarray(dequantize(one)), np.asarray(dequantize(w))[1])
    with pytest.raises(BadInputError, match="split"):
        one.reshape(32, 128)
    with pytest.raises(BadInputError, match="stacked"):
        w.reshape(3, 64, 64)


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_table_rows_are_the_dequantized_columns(scheme):
    table = quantize(W, scheme, group=64)  # as the head's [D, V] matrix
    tokens = jnp.asarray([[3, 0, 255], [7, 7, 128]])
    rows = np.asarray(take_rows(table, tokens, jnp.float32))
    full = np.asarray(dequantize(table, jnp.float32))
    assert rows.shape == (2, 3, 256)
    assert np.array_equal(rows, full.T[np.asarray(tokens)])
    h = jnp.asarray(RNG.standard_normal((2, 256)), jnp.float32)
    assert np.array_equal(np.asarray(tied_logits(h, table)),
                          np.asarray(jnp.matmul(h, full, preferred_element_type=jnp.float32)))


def test_x_matmul_quantized_weight():
    w = jax.tree.map(jnp.asarray, quantize(W, "int8"))
    x = jnp.ones((2, 256), jnp.float32)
    assert np.array_equal(np.asarray(x @ w), np.asarray(x @ dequantize(w, jnp.float32)))


@pytest.mark.parametrize("spec, match", [
    ("int3", "one of"), ("int8-g64", "int4"), ("int4-g48", "groups"), (8, "scheme name"),
])
def test_bad_specs_are_named(spec, match):
    with pytest.raises(BadInputError, match=match):
        Quantization.parse(spec)


def test_bad_matrices_are_refused():
    with pytest.raises(BadInputError, match="multiple of 128"):
        quantize(W[:100], "int4")
    with pytest.raises(BadInputError, match="non-finite"):
        quantize(np.full((128, 4), np.nan, np.float32), "int8")
    assert not Quantization("int4", 32).fits(48, 64)
    assert Quantization("int8").fits(48, 63)
