"""The delta-rule row kernel (``kernels/delta_rule.py``) in the Pallas interpreter: close to
the XLA row loop, and, as the exact path of a Qwen3.5 model (``Qwen35Model.interpreted``),
every bitwise guarantee of that path, each with its control."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.delta_rule import delta_rule_rows, tape_rows
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.testing import conformance as C

L, F = QC.LINEAR, QC.FULL
VOCAB, WIDTH, CAPACITY = 48, 5, 40  # a width that is no power of two: the kernel pads it
CONFIG = QC.Qwen35Config(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
    linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=(L, F, L))
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]


def _rows(width: int, heads: int, dk: int, dv: int, seed: int = 0) -> tuple[jax.Array, ...]:
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (width, heads, dk))) * dk**-0.5
    k = unit(jax.random.normal(ks[1], (width, heads, dk)))
    v = jax.random.normal(ks[2], (width, heads, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (width, heads)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (width, heads)))
    state = jax.random.normal(ks[5], (heads, dk, dv))
    return q, k, v, g, beta, state


def _reference(q, k, v, g, beta, state, live):
    """The rule written out in numpy, one row at a time (float64)."""
    s = np.asarray(state, np.float64)
    out = np.zeros(v.shape, np.float64)
    tape = []
    for r in range(q.shape[0]):
        if r < live:
            s = s * np.exp(np.asarray(g[r], np.float64))[:, None, None]
            read = np.einsum("hkv,hk->hv", s, np.asarray(k[r], np.float64))
            delta = (np.asarray(v[r], np.float64) - read) * np.asarray(beta[r])[:, None]
            s = s + np.asarray(k[r], np.float64)[:, :, None] * delta[:, None, :]
            out[r] = np.einsum("hkv,hk->hv", s, np.asarray(q[r], np.float64))
        tape.append(s)
    return out, s, np.stack(tape)


@pytest.mark.parametrize("width, live", [(5, 0), (5, 3), (5, 5), (16, 16), (3, 1)])
def test_kernel_follows_the_rule_row_by_row(width: int, live: int) -> None:
    args = _rows(width, 3, 16, 32)
    # The tape's rows past the live count keep what they held: a marker here.
    old = jnp.full((tape_rows(width) + 2, 3, 16, 32), 7.0, jnp.float32)
    out, state, tape = delta_rule_rows(*args, jnp.int32(live), tape=old, interpret=True)
    want_out, want_state, want_tape = _reference(*args, live)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_allclose(state, want_state, atol=1e-5)
    np.testing.assert_allclose(tape[:live], want_tape[:live], atol=1e-5)
    assert np.all(np.asarray(tape)[live:] == 7.0) and tape.shape == old.shape
    assert not np.any(np.asarray(out)[live:])  # padding rows read as zeros
    bare, _, none = delta_rule_rows(*args, jnp.int32(live), interpret=True)
    assert none is None and np.array_equal(bare, out)


def test_a_tape_shorter_than_the_kernels_block_is_refused() -> None:
    args = _rows(5, 3, 16, 32)
    with pytest.raises(BadInputError, match="a tape of 5 rows; blocks of 5 rows need 16"):
        delta_rule_rows(*args, jnp.int32(5), tape=jnp.zeros((5, 3, 16, 32)), interpret=True)


def test_kernel_rows_one_call_each_equal_one_call_for_all_bitwise() -> None:
    q, k, v, g, beta, state = _rows(5, 2, 16, 16, seed=1)
    whole, end, _ = delta_rule_rows(q, k, v, g, beta, state, jnp.int32(5), interpret=True)
    s, outs = state, []
    for r in range(5):
        one = [jnp.zeros_like(x).at[0].set(x[r]) for x in (q, k, v, g, beta)]
        o, s, _ = delta_rule_rows(*one, s, jnp.int32(1), interpret=True)
        outs.append(o[0])
    assert np.array_equal(np.stack(outs), whole) and np.array_equal(s, end)
    # Control: the same walk from a state with one element off by about 1e-3 of itself
    # differs (a last-bit change can round away in the outputs).
    bad = np.array(state).reshape(-1)
    bad[0] = (bad[:1].view(np.uint32) ^ np.uint32(1 << 13)).view(np.float32)[0]
    other, _, _ = delta_rule_rows(q, k, v, g, beta, jnp.asarray(bad.reshape(state.shape)),
                                  jnp.int32(5), interpret=True)
    assert not np.array_equal(other, whole)


@pytest.fixture(scope="module")
def producers() -> tuple[BlockProducer, BlockProducer]:
    """The same params on the kernel (interpreted) and on the XLA loop."""
    xla = Q.Qwen35Model(CONFIG, max_width=WIDTH).for_mesh()  # the XLA loop on any backend
    params = xla.init_params(jax.random.PRNGKey(0))
    kernel = xla.interpreted()
    make = lambda m: BlockProducer(m, params, capacity=CAPACITY, width=WIDTH,  # noqa: E731
                                   steps_per_call=4)
    return make(kernel), make(xla)


def test_kernel_path_is_close_to_the_xla_loop(producers: Any) -> None:
    kernel, xla = producers
    got, kstate = kernel.prefill_chunk(kernel.init_state(), PROMPT, 0)
    want, xstate = xla.prefill_chunk(xla.init_state(), PROMPT, 0)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for a, b in zip(kstate.cache.recurrent, xstate.cache.recurrent, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_kernel_path_chunked_equals_token_by_token(producers: Any) -> None:
    kernel, _ = producers
    C.check_chunked_matches_sequential(kernel, PROMPT, [2, 7, 8])
    C.check_prefill_matches_produce(kernel, PROMPT[:6])
    with pytest.raises(C.ConformanceError):
        C.check_chunked_matches_sequential(C.perturbed(kernel, "chunk_logits_bit"), PROMPT,
                                           [2, 7, 8])


def test_kernel_path_verify_rows_equal_decode(producers: Any) -> None:
    kernel, _ = producers
    C.check_verify_matches_decode(kernel, PROMPT[:6], PROMPT[6:11])
    with pytest.raises(C.ConformanceError):
        C.check_verify_matches_decode(C.perturbed(kernel, "verify_row_bit"), PROMPT[:6],
                                      PROMPT[6:11])


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_kernel_path_rollback_retaining_equals_decoding_the_kept_rows(
        producers: Any, keep: int) -> None:
    kernel, _ = producers
    prefix, feed = PROMPT[:7], PROMPT[7:11]
    C.check_rollback_retaining_matches_decode(kernel, prefix, feed, keep, 5)
    # Control: a producer that keeps one row more than asked fails the same check.
    with pytest.raises(C.ConformanceError):
        C.check_rollback_retaining_matches_decode(_keeps_one_more(kernel), prefix, feed, keep,
                                                  5)


def _keeps_one_more(producer: BlockProducer) -> Any:
    class KeepsOneMore:
        def __getattr__(self, name: str) -> Any:
            return getattr(producer, name)

        def rollback_retaining(self, state: Any, point: Any, keep_rows: int) -> Any:
            return producer.rollback_retaining(state, point, keep_rows + 1)

    return KeepsOneMore()


def test_a_row_walk_outside_the_two_pins_is_refused() -> None:
    with pytest.raises(BadInputError, match="_rows must be None or one of xla, interpret"):
        Q.Qwen35Model(CONFIG, _rows="triton")


def test_the_kernel_tape_and_the_loop_tape() -> None:
    """The kernel walks a power-of-two block of at least 16 rows, so its tape holds that many;
    the XLA loop's holds ``max_width``."""
    model = Q.Qwen35Model(CONFIG, max_width=WIDTH)
    assert model.interpreted().tape_rows() == tape_rows(WIDTH) == 16
    assert model.for_mesh().tape_rows() == WIDTH
    assert model.interpreted().for_mesh() == model.for_mesh()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU walks the rows on the kernel")
def test_off_a_gpu_the_rows_walk_on_the_xla_loop(producers: Any) -> None:
    _, xla = producers
    plain = BlockProducer(Q.Qwen35Model(CONFIG, max_width=WIDTH), xla.params,
                          capacity=CAPACITY, width=WIDTH, steps_per_call=4)
    assert plain.model.tape_rows() == WIDTH
    got, _ = plain.prefill_chunk(plain.init_state(), PROMPT, 0)
    want, _ = xla.prefill_chunk(xla.init_state(), PROMPT, 0)
    assert np.array_equal(got, want)
