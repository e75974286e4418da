"""The DeltaNet row kernel (``kernels/delta_rule.py``: the conv, norms, gates and delta rule of
a block's live rows in one launch) in the Pallas interpreter: close to the layer written out
row by row, and, as the exact path of a Qwen3.5 model (``Qwen35Model.interpreted()``), close to
the XLA loop and every bitwise guarantee of that path, each with its control."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.delta_rule import GateColumns, delta_net_rows
from turbospark_jax.kernels.plan import KernelPlan
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.testing import conformance as C
from turbospark_jax.testing.cuda_export import export_for_cuda

L, F = QC.LINEAR, QC.FULL
VOCAB, WIDTH, CAPACITY = 48, 5, 40  # a width that is no power of two
CONFIG = QC.Qwen35Config(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
    linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=(L, F, L))
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
TAPS = 4


def _layer(width: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0
           ) -> tuple[dict[str, Any], GateColumns]:
    """A layer's kernel inputs: the conv window, projected rows ([qkv | z | b | a]), the conv
    weights, the decay parameters and a state."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    channels = 2 * hk * dk + hv * dv
    return dict(
        buf=jax.random.normal(ks[0], (TAPS - 1 + width, channels)),
        proj=jax.random.normal(ks[1], (width, channels + hv * dv + 2 * hv)),
        conv_weight=jax.random.normal(ks[2], (TAPS, channels)) * 0.5,
        a_log=jnp.log(jax.random.uniform(ks[3], (hv,), minval=1.0, maxval=16.0)),
        dt_bias=jnp.ones((hv,)),
        state=jax.random.normal(ks[4], (hv, dk, dv)),
    ), GateColumns(channels + hv * dv, channels + hv * dv + hv, hv // hk)


def _reference(layer: dict[str, Any], gates: GateColumns, live: int, hk: int
               ) -> tuple[np.ndarray, ...]:
    """The layer written out in numpy, one row at a time (float64)."""
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    buf, proj, weight = f64(layer["buf"]), f64(layer["proj"]), f64(layer["conv_weight"])
    s = f64(layer["state"])
    hv, dk, dv = s.shape
    width, r = proj.shape[0], hv // hk
    out, tape = np.zeros((width, hv, dv)), []
    for row in range(width):
        if row < live:
            x = (buf[row : row + TAPS] * weight).sum(axis=0)
            x = x / (1 + np.exp(-x))  # SiLU
            q, k = x[: hk * dk].reshape(hk, dk), x[hk * dk : 2 * hk * dk].reshape(hk, dk)
            q = np.repeat(q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), r, 0) * dk**-0.5
            k = np.repeat(k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6), r, 0)
            v = x[2 * hk * dk :].reshape(hv, dv)
            col = np.arange(hv) // r * gates.stride + np.arange(hv) % r
            a, b = proj[row, gates.a_start + col], proj[row, gates.b_start + col]
            g = -np.exp(f64(layer["a_log"])) * np.log1p(np.exp(a + f64(layer["dt_bias"])))
            s = s * np.exp(g)[:, None, None]
            delta = (v - np.einsum("hkv,hk->hv", s, k)) / (1 + np.exp(-b))[:, None]
            s = s + k[:, :, None] * delta[:, None, :]
            out[row] = np.einsum("hkv,hk->hv", s, q)
        tape.append(s)
    return out.reshape(width, -1), s, np.stack(tape)


@pytest.mark.parametrize("width, live, hk", [(5, 0, 2), (5, 3, 2), (5, 5, 1), (3, 1, 2)])
def test_kernel_follows_the_layer_row_by_row(width: int, live: int, hk: int) -> None:
    layer, gates = _layer(width, hk, 4, 16, 32)
    # The tape's rows past the live count keep what they held: a marker here.
    old = jnp.full((width + 2, 4, 16, 32), 7.0, jnp.float32)
    out, state, tape = delta_net_rows(**layer, live=jnp.int32(live), tape=old, key_heads=hk,
                                      gates=gates, interpret=True)
    want_out, want_state, want_tape = _reference(layer, gates, live, hk)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_allclose(state, want_state, atol=1e-5)
    np.testing.assert_allclose(tape[:live], want_tape[:live], atol=1e-5)
    assert np.all(np.asarray(tape)[live:] == 7.0) and tape.shape == old.shape
    assert not np.any(np.asarray(out)[live:])  # padding rows read as zeros
    bare, _, none = delta_net_rows(**layer, live=jnp.int32(live), key_heads=hk, gates=gates,
                                   interpret=True)
    assert none is None and np.array_equal(bare, out)


def test_a_tape_shorter_than_the_block_is_refused() -> None:
    layer, gates = _layer(5, 2, 4, 16, 32)
    with pytest.raises(BadInputError, match="a tape of 4 rows cannot hold a block of 5"):
        delta_net_rows(**layer, live=jnp.int32(5), tape=jnp.zeros((4, 4, 16, 32)), key_heads=2,
                       gates=gates, interpret=True)


def test_kernel_rows_one_call_each_equal_one_call_for_all_bitwise() -> None:
    """Each row fed alone (its conv window and projected row first in a block of the same
    width, live 1) gives the bits the whole block gives."""
    layer, gates = _layer(5, 2, 2, 16, 16, seed=1)
    run = lambda state, **parts: delta_net_rows(  # noqa: E731
        **{**layer, "state": state, **parts}, key_heads=2, gates=gates, interpret=True)
    whole, end, _ = run(layer["state"], live=jnp.int32(5))
    s, outs = layer["state"], []
    for r in range(5):
        buf = jnp.zeros_like(layer["buf"]).at[:TAPS].set(layer["buf"][r : r + TAPS])
        proj = jnp.zeros_like(layer["proj"]).at[0].set(layer["proj"][r])
        o, s, _ = run(s, buf=buf, proj=proj, live=jnp.int32(1))
        outs.append(o[0])
    assert np.array_equal(np.stack(outs), whole) and np.array_equal(s, end)
    # Control: the same walk from a state with one element off by about 1e-3 of itself
    # differs (a last-bit change can round away in the outputs).
    bad = np.array(layer["state"]).reshape(-1)
    bad[0] = (bad[:1].view(np.uint32) ^ np.uint32(1 << 13)).view(np.float32)[0]
    other, _, _ = run(jnp.asarray(bad.reshape(layer["state"].shape)), live=jnp.int32(5))
    assert not np.array_equal(other, whole)


@pytest.mark.parametrize("width, key_heads", [(1, 16), (16, 8)])
def test_kernel_lowers_for_a_gpu(width: int, key_heads: int) -> None:
    """Triton's lowering (run by ``jax.export`` for CUDA on the CPU) takes the kernel at
    Qwen3.5-0.8B's head sizes in bfloat16, with a tape, a decode row and a 16-row block, one
    or two value heads per key head."""
    heads, dk, dv, bf16 = 16, 128, 128, jnp.bfloat16
    channels = 2 * key_heads * dk + heads * dv
    r = heads // key_heads
    gates = GateColumns(channels + heads * dv, channels + heads * dv + heads, r)
    S = jax.ShapeDtypeStruct
    args = [S((TAPS - 1 + width, channels), bf16), S((width, channels + heads * dv + 2 * heads),
            bf16), S((TAPS, channels), bf16), S((heads,), bf16), S((heads,), bf16),
            S((heads, dk, dv), jnp.float32), S((), jnp.int32), S((16, heads, dk, dv),
                                                                 jnp.float32)]
    text = export_for_cuda(lambda *a: delta_net_rows(*a, key_heads=key_heads, gates=gates),
                           *args).mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1


def kernel_and_xla(target: str) -> tuple[BlockProducer, BlockProducer]:
    """The same params on the ``target`` backend's kernel walk (interpreted) and on the XLA
    loop."""
    xla = Q.Qwen35Model(CONFIG, max_width=WIDTH).for_mesh()  # the XLA loop on any backend
    params = xla.init_params(jax.random.PRNGKey(0))
    kernel = xla.interpreted(target)
    make = lambda m: BlockProducer(m, params, capacity=CAPACITY, width=WIDTH,  # noqa: E731
                                   steps_per_call=4)
    return make(kernel), make(xla)


def check_close_to_the_xla_loop(kernel: BlockProducer, xla: BlockProducer) -> None:
    """A prompt's logits and recurrent states on the kernel walk are within float32
    rounding of the XLA loop's."""
    got, kstate = kernel.prefill_chunk(kernel.init_state(), PROMPT, 0)
    want, xstate = xla.prefill_chunk(xla.init_state(), PROMPT, 0)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for a, b in zip(kstate.cache.recurrent, xstate.cache.recurrent, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.fixture(scope="module")
def producers() -> tuple[BlockProducer, BlockProducer]:
    return kernel_and_xla("gpu")


def test_kernel_path_is_close_to_the_xla_loop(producers: Any) -> None:
    check_close_to_the_xla_loop(*producers)


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


def test_a_plan_the_family_cannot_run_is_refused() -> None:
    with pytest.raises(BadInputError, match="plan must be a KernelPlan"):
        Q.Qwen35Model(CONFIG, plan="triton")
    with pytest.raises(BadInputError, match="no row-invariant kernels"):
        Q.Qwen35Model(CONFIG, plan=KernelPlan(row_invariant=True, pallas="compiled"))


def test_qwen3_next_layout_on_the_kernel_is_close_to_the_xla_loop() -> None:
    """Qwen3-Next's projections (b and a grouped per key head) and a 3-wide conv."""
    config = dataclasses.replace(CONFIG, model_type="qwen3_next", linear_conv_kernel_dim=3,
                                 num_hidden_layers=1, layer_types=(L,))
    xla = Q.Qwen35Model(config, max_width=WIDTH).for_mesh()
    params = xla.init_params(jax.random.PRNGKey(1))
    assert set(params["layers"][0]) >= {"in_proj", "conv1d"}
    got, want = (BlockProducer(m, params, capacity=CAPACITY, width=WIDTH, steps_per_call=4)
                 for m in (xla.interpreted(), xla))
    got, want = (p.prefill_chunk(p.init_state(), PROMPT[:8], 0)[0] for p in (got, want))
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_tape_holds_max_width_rows_on_either_walk() -> None:
    model = Q.Qwen35Model(CONFIG, max_width=WIDTH)
    for walk in (model.interpreted(), model.for_mesh()):
        assert walk.init_cache(8).recurrent_tape[0].shape == (WIDTH, 4, 16, 32)
    assert model.interpreted().for_mesh() == model.for_mesh()


def test_a_model_built_without_a_plan_walks_on_the_xla_loop(producers: Any) -> None:
    """The walk is the plan's, never probed from the backend: a model built without one
    (XLA's plan) walks on the XLA loop on any backend; loading resolves the backend's."""
    kernel, xla = producers
    assert kernel.model.row_walk == "interpret" and xla.model.row_walk == "xla"
    plain = BlockProducer(Q.Qwen35Model(CONFIG, max_width=WIDTH), xla.params,
                          capacity=CAPACITY, width=WIDTH, steps_per_call=4)
    assert plain.model.row_walk == "xla"
    got, _ = plain.prefill_chunk(plain.init_state(), PROMPT, 0)
    want, _ = xla.prefill_chunk(xla.init_state(), PROMPT, 0)
    assert np.array_equal(got, want)
