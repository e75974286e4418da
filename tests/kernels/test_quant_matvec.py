"""The CUDA-core product of a few rows and quantized weights (``kernels/quant_matvec.py``) in
the Pallas interpreter (compiled on a GPU, ``JAX_PLATFORMS=cuda``), its lowering for CUDA, and
the plan that takes it (``exact=False`` on a GPU).

The kernel is not exact against any other product: it sums in its own order and never rounds a
dequantized weight to the model's dtype. So against ``x @ dequantize(w)`` it is held to a
float32 tolerance (scaled by ``|x| @ |w|``), with a perturbed weight as the control that must
miss it; only its own rows (one alone, the same row among others) and its bit conversions
(against ``astype``, every stored code) are compared bit for bit."""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import plan as row_kernels
from turbospark_jax.kernels import quant_matvec as qm
from turbospark_jax.kernels.plan import KernelPlan, kernel_plan
from turbospark_jax.kernels.rowinv import sum_parts
from turbospark_jax.quant.weights import Quantization, dequantize, quantize, quantize_leaf
from turbospark_jax.testing.cuda_export import cuda_text

ON_GPU = jax.default_backend() == "gpu"  # the compiled kernels there, the interpreter here
IMPL = "pallas" if ON_GPU else "interpret"
K, N = 256, 96
#: small tiles, so a product walks several steps, segments and (padded) column blocks
TILES = qm.QuantMatvecTiles(block_k=64, block_n=64, splits=2)
SCHEMES = [("int8", None), ("int4", 128), ("int4", 32), ("fp8", None), ("fp8-block", None)]
F32 = jnp.float32


def _weight(scheme, group, k=K, n=N, dtype=F32, seed=0):
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * 0.05
    return jax.tree.map(jnp.asarray, quantize(w, scheme, group=group, dtype=dtype))


def _rows(m, k=K, dtype=F32, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), dtype)


def _within_float32(out, x, w):
    """Whether ``out`` is ``x @ dequantize(w)`` (float64) to float32 rounding: within
    ``1e-5 * (|x| @ |w|)`` per element."""
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(dequantize(w, F32), np.float64)
    return bool(np.all(np.abs(np.asarray(out, np.float64) - x64 @ w64)
                       <= 1e-5 * (np.abs(x64) @ np.abs(w64))))


@pytest.mark.parametrize("scheme, group", SCHEMES)
def test_the_product_is_x_times_the_dequantized_matrix(scheme, group):
    w = _weight(scheme, group, n=256 if scheme == "fp8-block" else N)
    x = _rows(3)
    parts = qm.quant_matmul(x, w, parts=True, impl=IMPL, tiles=TILES)
    assert parts.shape == (2, 3, w.n) and parts.dtype == F32
    out = qm.quant_matmul(x, w, impl=IMPL, tiles=TILES)
    assert np.array_equal(out, sum_parts(parts, F32))
    assert _within_float32(out, x, w)
    # the control: one stored value changed by one step misses the tolerance
    q = np.asarray(w.q).copy()
    q.view(np.uint8)[5, 7] ^= 0x10 if scheme == "int4" else 0x20
    other = dataclasses.replace(w, q=jnp.asarray(q))
    assert not _within_float32(out, x, other)


@pytest.mark.parametrize("scheme, group", [("int8", None), ("int4", 64), ("fp8", None)])
def test_bfloat16_rows_and_the_default_tiles(scheme, group):
    w = _weight(scheme, group, dtype=jnp.bfloat16)
    x = _rows(1, dtype=jnp.bfloat16)
    out = qm.quant_matmul(x, w, impl=IMPL)  # tiles_for's choice
    assert out.dtype == jnp.bfloat16
    ref = np.asarray(x, np.float64) @ np.asarray(dequantize(w, F32), np.float64)
    bound = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(dequantize(w, F32)))
    assert np.all(np.abs(np.asarray(out, np.float64) - ref) <= 2**-8 * np.abs(ref) + 1e-5 * bound)


@pytest.mark.parametrize("scheme, group", [("int4", 64), ("fp8", None)])
def test_a_row_alone_gets_the_bits_it_gets_among_others(scheme, group):
    """The kernel's own order is a function of the weight's shape, not of the row count: a
    decode step and a verify of up to MAX_ROWS rows agree bitwise."""
    w = _weight(scheme, group)
    block = _rows(qm.MAX_ROWS)
    for fn in (lambda x: qm.quant_matmul(x, w, impl=IMPL, tiles=TILES),
               lambda x: qm.quant_swiglu(x, w, w, impl=IMPL)):
        together = np.asarray(fn(block))
        for r in (0, 5):
            assert np.array_equal(np.asarray(fn(block[r : r + 1]))[0], together[r])
        assert not np.array_equal(together[0], together[5])  # the control: rows differ


def test_the_gated_product_and_weights_side_by_side():
    gate, up = _weight("int4", 32, seed=2), _weight("int4", 32, seed=3)
    x = _rows(2)
    gated = qm.quant_swiglu(x, gate, up, impl=IMPL, tiles=TILES)
    g = np.asarray(x, np.float64) @ np.asarray(dequantize(gate), np.float64)
    u = np.asarray(x, np.float64) @ np.asarray(dequantize(up), np.float64)
    assert np.allclose(gated, g / (1 + np.exp(-g)) * u, rtol=1e-4, atol=1e-6)
    # a q/k/v-like tuple: one launch, each product's columns as its own product's
    narrow = _weight("int4", 32, n=32, seed=4)
    both = qm.quant_matmul(x, (gate, narrow), impl=IMPL, tiles=TILES)
    assert both.shape == (2, N + 32)
    assert np.array_equal(both[:, :N], qm.quant_matmul(x, gate, impl=IMPL, tiles=TILES))
    assert np.array_equal(both[:, N:], qm.quant_matmul(x, narrow, impl=IMPL,
                                                      tiles=TILES))


def test_odd_shapes_are_padded():
    """K and N that fill no whole tile (a per-channel weight's K is padded with zero rows,
    its N with zero columns)."""
    for scheme in ("int8", "fp8"):
        w = _weight(scheme, None, k=200, n=50)
        x = _rows(3, k=200)
        assert _within_float32(qm.quant_matmul(x, w, impl=IMPL, tiles=TILES), x, w)
    w = _weight("int4", 32, k=96, n=22)
    x = _rows(1, k=96)
    assert _within_float32(qm.quant_matmul(x, w, impl=IMPL, tiles=TILES), x, w)


def test_the_bit_conversions_are_exact_for_every_code():
    codes = np.arange(256, dtype=np.uint8)
    for native in (False, True):
        signed = jnp.asarray(codes.view(np.int8))
        assert np.array_equal(qm._int8(signed, native), signed.astype(F32))
        for zero in (0.0, 8.0, 15.0):
            assert np.array_equal(qm._small_int(jnp.asarray(codes), jnp.float32(zero), native),
                                  codes.astype(np.float32) - zero)
        fp8 = codes.view(ml_dtypes.float8_e4m3fn)
        finite = ~np.isnan(fp8.astype(np.float32))  # e4m3fn's two NaN codes are never stored
        got = np.asarray(qm._fp8(jnp.asarray(fp8), native))[finite]
        want = fp8.astype(np.float32)[finite]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # -0.0 included


def test_bad_calls_are_refused():
    w = _weight("int8", None)
    with pytest.raises(BadInputError, match=f"at most {qm.MAX_ROWS} rows"):
        qm.quant_matmul(_rows(qm.MAX_ROWS + 1), w, impl=IMPL)
    with pytest.raises(BadInputError, match="is not a quantized weight"):
        qm.quant_matmul(_rows(1), jnp.ones((K, N)), impl=IMPL)
    stacked = quantize_leaf(np.ones((2, K, N), np.float32), K, 1, Quantization("int8"), F32)
    with pytest.raises(BadInputError, match="stacked quantized weight"):
        qm.quant_matmul(_rows(1), stacked, impl=IMPL)
    odd_groups = dataclasses.replace(_weight("int4", 32, k=96), group=48,
                                     scale=jnp.ones((2, N), F32), zero=jnp.zeros((2, N),
                                                                                 jnp.uint8))
    with pytest.raises(BadInputError, match="groups of 48 rows"):
        qm.quant_matmul(_rows(1, k=96), odd_groups, impl=IMPL)
    assert not QUANT_PLAN.quant_rows(_rows(1, k=96), (odd_groups,))  # the plan keeps rowinv
    with pytest.raises(BadInputError, match="needs equal K"):
        qm.quant_matmul(_rows(1, k=128), w, impl=IMPL)
    with pytest.raises(BadInputError, match="share one dtype"):
        qm.quant_matmul(_rows(1, dtype=jnp.bfloat16), w, impl=IMPL)
    with pytest.raises(BadInputError, match="impl 'xla'"):
        qm.quant_matmul(_rows(1), w, impl="xla")
    with pytest.raises(BadInputError, match="one shape"):
        qm.quant_swiglu(_rows(1), w, _weight("int8", None, n=64), impl=IMPL)
    with pytest.raises(BadInputError, match="block_k must be a power of two"):
        qm.QuantMatvecTiles(block_k=96)
    with pytest.raises(BadInputError, match=r"splits must be None or 1\.\.8"):
        qm.QuantMatvecTiles(splits=0)


def test_tiles_depend_on_the_shape_alone():
    assert qm.tiles_for(4096, 4096).splits == 4  # 64 column blocks -> 256 programs
    assert qm.tiles_for(4096, 14336).splits == 2
    assert qm.tiles_for(14336, 4096).splits == 4
    assert qm.tiles_for(4096, 14336, gated=True).splits == 1
    assert qm.tiles_for(64, 64).splits == 1  # too short a K to split
    w, x = _weight("int8", None), _rows(1)
    unsplit = qm.quant_matmul(x, w, parts=True, impl=IMPL, tiles=qm.QuantMatvecTiles())
    assert unsplit.shape[0] == qm.tiles_for(K, N).splits == 2  # None: tiles_for's splits


# -- the plan --------------------------------------------------------------------------------

PALLAS = "compiled" if ON_GPU else "interpret"
QUANT_PLAN = KernelPlan(row_invariant=True, pallas=PALLAS, quant_matvec=True)
EXACT_PLAN = KernelPlan(row_invariant=True, pallas=PALLAS)


@pytest.mark.parametrize(("backend", "exact", "quant"), [
    ("gpu", False, True), ("gpu", True, False), ("cpu", False, False), ("cpu", True, False),
    ("tpu", False, False), ("tpu", True, False)])
def test_only_the_gpu_plan_of_exact_false_takes_the_kernel(backend, exact, quant):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = kernel_plan(backend, exact, True)
    assert got.quant_matvec is quant
    assert kernel_plan(backend, exact, False).quant_matvec is False  # XLA's kernels
    assert not got.parallel().quant_matvec
    with pytest.raises(BadInputError, match="quant_matvec must be True or False"):
        KernelPlan(quant_matvec="yes")


def _kernels_in(fn, *args):
    text = str(jax.make_jaxpr(fn)(*args))
    return "quant_matvec" in text, "rowinv" in text


def test_the_plan_routes_few_rows_of_quantized_weights_to_the_kernel():
    w, plain = _weight("int4", 64), jnp.ones((K, N), F32)
    one, wide = _rows(1), _rows(qm.MAX_ROWS + 1)
    for plan, x, weight, want in [
            (QUANT_PLAN, one, w, (True, False)),
            (QUANT_PLAN, _rows(qm.MAX_ROWS), w, (True, False)),
            (QUANT_PLAN, wide, w, (False, True)),        # a prefill block: tensor cores
            (QUANT_PLAN, one, plain, (False, True)),     # bfloat16 stays where it streams
            (EXACT_PLAN, one, w, (False, True))]:  # the exact plan
        assert _kernels_in(lambda x, w, p=plan: row_kernels.matmul(p, x, w), x, weight) == want
        assert _kernels_in(lambda x, w, p=plan: row_kernels.matmul_parts(p, x, w),
                           x, weight) == want
        assert _kernels_in(lambda x, w, p=plan: row_kernels.swiglu(p, x, w, w),
                           x, weight) == want
    # a tuple with a plain weight in it, and a tied head's [N, K] table, stay on rowinv
    assert _kernels_in(lambda x: row_kernels.matmul(QUANT_PLAN, x, (w, plain)), one) == (
        False, True)
    assert _kernels_in(lambda x: row_kernels.matmul(QUANT_PLAN, x, plain.T, w_layout="nk"),
                       one) == (False, True)


def test_the_plan_gives_the_kernels_result():
    w = _weight("fp8", None)
    x = _rows(2)
    got = row_kernels.matmul(QUANT_PLAN, x, w, out_dtype=F32)
    assert np.array_equal(got, qm.quant_matmul(x, w, out_dtype=F32, impl=IMPL))
    assert _within_float32(got, x, w)


# -- lowering for CUDA -----------------------------------------------------------------------

BF16 = jnp.bfloat16


@pytest.mark.parametrize("scheme, group", [("int8", None), ("int4", 128), ("fp8-block", None)])
@pytest.mark.parametrize("native", [False, True])
def test_the_kernel_lowers_for_cuda(scheme, group, native):
    """Pallas' Triton lowering takes both kernels at one row and at several (what Triton
    makes of it on the hardware the GPU's run of the probe and the benchmarks shows)."""
    w = _weight(scheme, group, k=512, n=256, dtype=BF16)
    tiles = qm.QuantMatvecTiles(splits=2, native_convert=native)
    for rows in (1, 5):
        x = jax.ShapeDtypeStruct((rows, 512), BF16)
        text = cuda_text(lambda x, w: qm._quant_matmul(x, (w,), tiles, False, "q"), x, w)
        assert "xla.gpu.triton" in text and "quant_matvec_q" in text
        assert "griddepcontrol.launch_dependents" in text  # PDL, as the decode kernels do
        text = cuda_text(lambda x, w: qm._quant_swiglu(x, w, w, tiles, False, "g"), x, w)
        assert "xla.gpu.triton" in text and "stablehlo.dot_general" not in text


# -- a whole model under the plan ------------------------------------------------------------


def test_a_quantized_model_decodes_on_the_kernel_and_verify_rows_equal_decode(monkeypatch):
    """A tiny quantized dense model under the plan, every kernel interpreted: its decode
    (products handed on as partial sums, the gated product, the quantized tied head) is
    the XLA plan's to float32 rounding, and a verify of a few rows, which runs the same kernel,
    gives each row the bits of decoding it alone. The 24-token prefill runs the tensor-core
    kernels' interpreted form, so its last row need not agree bitwise with a decode step."""
    from turbospark_jax.core.state import copy_state
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.models.dense import model as dense
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.testing.fixtures import quantized

    config = DenseConfig(model_type="llama", vocab_size=64, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    spec = Quantization("int4", group=32, embeddings=True)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 64, 24)]
    feed = [7, 30, 2, 51]

    def run(plan, width):
        model = dense.DenseModel(config, F32, scan_layers=False, plan=plan)
        params = dense.unstack_layers(quantized(dense.FAMILY, config, model.init_params(
            jax.random.PRNGKey(2)), spec, F32))
        producer = BlockProducer(model, params, capacity=64, width=width, steps_per_call=1)
        _, state = producer.prefill_chunk(producer.init_state(), prompt, 0)
        steps, s = [], copy_state(state)
        for i, token in enumerate(feed):
            logits, s = producer.produce(s, token, len(prompt) + i)
            steps.append(np.asarray(logits))
        return np.stack(steps), producer, state

    calls = []
    for name, real in (("quant_matmul", qm.quant_matmul), ("quant_swiglu", qm.quant_swiglu)):
        def counted(*args, name=name, real=real, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(qm, name, counted)
    with jax.default_matmul_precision("highest"):
        want, _, _ = run(KernelPlan(), 1)
        assert not calls
        got, producer, state = run(QUANT_PLAN, len(feed))
        rows, _ = producer.verify(state, feed, len(prompt))
    assert set(calls) == {"quant_matmul", "quant_swiglu"}
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    assert np.array_equal(np.asarray(rows), got)


@pytest.mark.parametrize("width", [1, 5, 64])
def test_a_quantized_decode_step_lowers_with_every_product_in_the_kernel(width, monkeypatch):
    """The block program of a quantized dense model under the GPU's non-exact plan, lowered
    for CUDA: at decode and verify widths every product (q/k/v, o, the gated MLP, down, the
    quantized tied head) is a quant_matvec launch and XLA has no product left; a prefill
    block's rows run the row-invariant kernels instead."""
    from turbospark_jax.models.dense import model as dense
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.testing.fixtures import quantized

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the products check it
    config = DenseConfig(model_type="llama", vocab_size=256, hidden_size=128,
                         intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    plan = KernelPlan(row_invariant=True, pallas="compiled", quant_matvec=True)
    model = dense.DenseModel(config, BF16, scan_layers=False, plan=plan)
    params = dense.unstack_layers(quantized(dense.FAMILY, config, model.init_params(
        jax.random.PRNGKey(0)), Quantization("int8", embeddings=True), BF16))
    cache = jax.eval_shape(lambda: model.init_cache(256))
    rows = jax.ShapeDtypeStruct((width,), jnp.int32)
    text = cuda_text(lambda p, c, t, pos, live, head: model.block_forward(
        p, c, t, pos, live, head), params, cache, rows, rows,
        jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.bool_))
    names = set(re.findall(r'name = "(quant_matvec\w*|rowinv\w*)"', text))
    if width <= qm.MAX_ROWS:
        assert names == {f"quant_matvec_{p}" for p in ("qkv", "o", "gate_up", "down", "head")}
    else:
        assert not any(n.startswith("quant_matvec") for n in names) and names
    assert "stablehlo.dot_general" not in text
