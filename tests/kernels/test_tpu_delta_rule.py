"""The TPU's delta-rule walk (``kernels/tpu_delta_rule.py``) in Pallas' TPU interpreter on the
CPU: close to the rule written out row by row, a row's bits the same alone as in a block
(against a perturbed control), and, as the exact path of a Qwen3.5 model under the
interpreted TPU plan, close to the XLA loop with chunked == token by token bitwise (with its
control); and its lowering for a TPU through ``jax.export``. Nothing here ran on a TPU."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from tests.kernels.test_delta_rule_kernel import (
    PROMPT,
    _keeps_one_more,
    check_close_to_the_xla_loop,
    kernel_and_xla,
)
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import tpu_delta_rule as tdr
from turbospark_jax.testing import conformance as C

IMPL = "tpu_interpret"
WIDTH, KEY_HEADS, HEADS, DK, DV = 5, 2, 4, 16, 32  # a width that is no power of two


def _inputs(width: int = WIDTH, seed: int = 0) -> dict[str, jax.Array]:
    """What the XLA preamble hands the walk: unit q (scaled) and k per key head, v, a
    decay ``g < 0`` and a strength in (0, 1) per value head, and a state."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)

    def unit(x: jax.Array) -> jax.Array:
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    return dict(
        q=unit(jax.random.normal(ks[0], (width, KEY_HEADS, DK))) * DK**-0.5,
        k=unit(jax.random.normal(ks[1], (width, KEY_HEADS, DK))),
        v=jax.random.normal(ks[2], (width, HEADS, DV)),
        g=-jax.random.uniform(ks[3], (width, HEADS), maxval=2.0),
        beta=jax.nn.sigmoid(jax.random.normal(ks[4], (width, HEADS))),
        state=jax.random.normal(ks[5], (HEADS, DK, DV)),
    )


def _reference(x: dict[str, jax.Array], live: int) -> tuple[np.ndarray, ...]:
    """The rule in numpy, one row at a time (float64)."""
    f64 = {name: np.asarray(a, np.float64) for name, a in x.items()}
    r = HEADS // KEY_HEADS
    q, k = (np.repeat(f64[name], r, axis=1) for name in ("q", "k"))
    s, width = f64["state"], q.shape[0]
    out, tape = np.zeros((width, HEADS, DV)), []
    for row in range(live):
        s = s * np.exp(f64["g"][row])[:, None, None]
        delta = (f64["v"][row] - np.einsum("hkv,hk->hv", s, k[row])) * f64["beta"][row][:, None]
        s = s + k[row][:, :, None] * delta[:, None, :]
        out[row] = np.einsum("hkv,hk->hv", s, q[row])
        tape.append(s)
    return out, s, np.stack(tape) if tape else np.zeros((0, *s.shape))


@pytest.mark.parametrize("live", [0, 3, WIDTH])
def test_the_walk_follows_the_rule_row_by_row(live: int) -> None:
    x = _inputs()
    old = jnp.full((WIDTH + 2, HEADS, DK, DV), 7.0, jnp.float32)  # a marker past the live rows
    out, state, tape = tdr.tpu_delta_rule(**x, live=jnp.int32(live), tape=old, impl=IMPL)
    want_out, want_state, want_tape = _reference(x, live)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_allclose(state, want_state, atol=1e-5)
    np.testing.assert_allclose(tape[:live], want_tape, atol=1e-5)
    assert np.all(np.asarray(tape)[live:] == 7.0) and tape.shape == old.shape
    assert not np.any(np.asarray(out)[live:])  # padding rows read as zeros
    bare, _, none = tdr.tpu_delta_rule(**x, live=jnp.int32(live), impl=IMPL)
    assert none is None and np.array_equal(bare, out)


def test_a_row_alone_equals_the_row_in_a_block_bitwise() -> None:
    """Each row fed alone, in a block of one row and in a block of the full width with one
    live row, gives the bits the whole block gives."""
    x = _inputs(seed=1)
    whole, end, _ = tdr.tpu_delta_rule(**x, live=jnp.int32(WIDTH), impl=IMPL)
    for width in (1, WIDTH):
        s, outs = x["state"], []
        for r in range(WIDTH):
            rows = {name: jnp.zeros_like(a[:width]).at[0].set(a[r])
                    for name, a in x.items() if name != "state"}
            o, s, _ = tdr.tpu_delta_rule(**rows, state=s, live=jnp.int32(1), impl=IMPL)
            outs.append(o[0])
        assert np.array_equal(np.stack(outs), whole) and np.array_equal(s, end), width
    # Control: the same walk from a state with one element off by about 1e-3 of itself
    # differs (a last-bit change can round away in the outputs).
    bad = np.array(x["state"]).reshape(-1)
    bad[0] = (bad[:1].view(np.uint32) ^ np.uint32(1 << 13)).view(np.float32)[0]
    other, _, _ = tdr.tpu_delta_rule(**{**x, "state": jnp.asarray(bad.reshape(HEADS, DK, DV))},
                                     live=jnp.int32(WIDTH), impl=IMPL)
    assert not np.array_equal(other, whole)


def test_bad_operands_are_refused() -> None:
    x = _inputs()
    with pytest.raises(BadInputError, match="impl must be one of tpu, tpu_interpret"):
        tdr.tpu_delta_rule(**x, live=jnp.int32(1), impl="interpret")
    with pytest.raises(BadInputError, match=r"tpu_delta_rule takes q and k \[W, Hk, dk\]"):
        tdr.tpu_delta_rule(**{**x, "k": x["k"][:, :1]}, live=jnp.int32(1), impl=IMPL)
    with pytest.raises(BadInputError, match="must hold the block's 5 rows"):
        tdr.tpu_delta_rule(**x, live=jnp.int32(1), tape=jnp.zeros((4, HEADS, DK, DV)),
                           impl=IMPL)


def test_which_heads_a_tpu_takes() -> None:
    assert tdr.supported(128, 128) and tdr.supported(64, 256)
    assert not tdr.supported(DK, DV) and not tdr.supported(12, 128)


@pytest.fixture(scope="module")
def producers() -> tuple[BlockProducer, BlockProducer]:
    """A tiny Qwen3.5 model (the GPU kernel's tests', heads as above) on the TPU walk,
    interpreted, and on the XLA loop."""
    tpu, xla = kernel_and_xla("tpu")
    assert tpu.model.row_walk == IMPL and xla.model.row_walk == "xla"
    config = tpu.model.config
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (DK, DV)
    return tpu, xla


def test_the_tpu_walk_is_close_to_the_xla_loop(producers: Any) -> None:
    check_close_to_the_xla_loop(*producers)


def test_the_tpu_walk_chunked_equals_token_by_token(producers: Any) -> None:
    tpu, _ = producers
    C.check_chunked_matches_sequential(tpu, PROMPT, [2, 7, 8])
    with pytest.raises(C.ConformanceError):
        C.check_chunked_matches_sequential(C.perturbed(tpu, "chunk_logits_bit"), PROMPT,
                                           [2, 7, 8])


def test_the_tpu_walk_keeps_each_rows_state_for_a_rollback(producers: Any) -> None:
    """The tape the kernel writes row by row is what a rollback that keeps rows reads."""
    tpu, _ = producers
    C.check_rollback_retaining_matches_decode(tpu, PROMPT[:7], PROMPT[7:11], 3, 5)
    with pytest.raises(C.ConformanceError):  # control: one row more kept than asked
        C.check_rollback_retaining_matches_decode(_keeps_one_more(tpu), PROMPT[:7],
                                                  PROMPT[7:11], 3, 5)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("width, key_heads", [(1, 16), (16, 8)])
def test_the_walk_lowers_for_a_tpu(width: int, key_heads: int) -> None:
    """Mosaic's lowering (``jax.export`` for a TPU, on the CPU) takes the kernel at
    Qwen3.5's head sizes, a decode row and a 16-row block, with a tape, one or two value
    heads per key head."""
    heads, dk, dv, f32 = 16, 128, 128, jnp.float32
    args = [S((width, key_heads, dk), f32), S((width, key_heads, dk), f32),
            S((width, heads, dv), f32), S((width, heads), f32), S((width, heads), f32),
            S((heads, dk, dv), f32), S((), jnp.int32), S((16, heads, dk, dv), f32)]
    program = jax.jit(lambda *a: tdr.tpu_delta_rule(*a, impl="tpu"))
    text = export.export(program, platforms=["tpu"])(*args).mlir_module()
    assert text.count("tpu_custom_call") == 1 and 'kernel_name = "tpu_delta_rule"' in text
