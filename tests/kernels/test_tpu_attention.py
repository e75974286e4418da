"""The TPU's row-invariant attention (kernels/tpu_attention.py) in Pallas' TPU interpreter on
the CPU: a query row's bits are the same at every row count and position (rows whose tile
walks more key blocks than they see, and rows a sliding window hides a leading block from,
included), against a control (a perturbed query row changes that row alone); values within
float tolerance of the reference attention; the plan's dispatch; a dense model that runs it
agrees across program widths (its products on the TPU kernel too). Nothing here ran on a
TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import layers
from turbospark_jax.kernels import plan as kplan
from turbospark_jax.kernels.plan import KernelPlan
from turbospark_jax.kernels.tpu_attention import key_block_for, supported, tpu_attention
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel
from turbospark_jax.testing import conformance

IMPL = "tpu_interpret"
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
#: Two key blocks; the queries sit across the first block's end.
CAPACITY, KV, HEADS, HD, ROWS = 256, 2, 4, 32, 40
Q_POSITIONS = np.arange(110, 110 + ROWS)


@functools.cache
def _operands(dtype: str):
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), DTYPES[dtype])
               for shape in ((ROWS, HEADS, HD), (CAPACITY, KV, HD), (CAPACITY, KV, HD)))
    return q, k, v, jnp.asarray(Q_POSITIONS, jnp.int32), jnp.arange(CAPACITY, dtype=jnp.int32)


def _attend(q, k, v, qp, kp, window):
    return np.asarray(tpu_attention(q, k, v, qp, kp, window, impl=IMPL))


@pytest.mark.parametrize("window", [None, 20], ids=["causal", "window"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_rows_bits_do_not_depend_on_the_row_count(dtype, window):
    q, k, v, qp, kp = _operands(dtype)
    full = _attend(q, k, v, qp, kp, window)
    for m in (1, 3, 8, 13, ROWS):
        assert np.array_equal(_attend(q[:m], k, v, qp[:m], kp, window), full[:m]), m
    # a row alone, from either side of the block boundary (with the window, the rows past
    # position 147 see nothing of the first block, which their tile's other rows see)
    for r in (0, 17, 18, 39):
        alone = _attend(q[r : r + 1], k, v, qp[r : r + 1], kp, window)
        assert np.array_equal(alone[0], full[r]), r


def test_control_a_perturbed_query_row_changes_that_row_alone():
    q, k, v, qp, kp = _operands("float32")
    full = _attend(q, k, v, qp, kp, None)
    moved = _attend(q.at[5, 1, 3].add(1.0), k, v, qp, kp, None)
    changed = [r for r in range(ROWS) if not np.array_equal(moved[r], full[r])]
    assert changed == [5]


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 2e-6), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("window", [None, 20])
def test_values_within_float_tolerance_of_the_reference(dtype, tol, window):
    q, k, v, qp, kp = _operands(dtype)
    got = _attend(q, k, v, qp, kp, window).astype(np.float32)
    want = np.asarray(layers.attend(q, k, v, qp, kp, window)).astype(np.float32)
    assert np.abs(got - want).max() <= tol


def test_a_row_that_sees_no_key_is_zeros():
    q, k, v, _, kp = _operands("float32")
    out = _attend(q[:2], k, v, jnp.asarray([-1, 3], jnp.int32), kp, None)
    assert np.array_equal(out[0], np.zeros_like(out[0])) and np.all(np.isfinite(out))


def test_blocks_and_what_the_plan_sends_to_the_kernel():
    assert key_block_for(2048) == 128 and key_block_for(200) == 200
    assert supported(128, None) and supported(256, 512)
    assert not supported(64, None)  # a head not a whole lane block: XLA's tiled form
    assert not supported(128, jnp.asarray(512))  # a traced window: XLA's tiled form
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((3, 2, 128), (128, 1, 128), (128, 1, 128)))
    qp, kp = jnp.asarray([4, 9, 60], jnp.int32), jnp.arange(128, dtype=jnp.int32)
    plan = KernelPlan.interpreted(target="tpu")
    assert np.array_equal(np.asarray(kplan.attend(plan, q, k, v, qp, kp, None)),
                          _attend(q, k, v, qp, kp, None))


def test_bad_inputs_are_refused():
    q, k, v, qp, kp = _operands("float32")
    with pytest.raises(BadInputError, match="impl must be one of"):
        tpu_attention(q, k, v, qp, kp, impl="interpret")
    with pytest.raises(BadInputError, match="tpu_attention takes"):
        tpu_attention(q, k[:, :1], v, qp, kp, impl=IMPL)
    with pytest.raises(BadInputError, match="share one dtype"):
        tpu_attention(q, k.astype(jnp.bfloat16), v, qp, kp, impl=IMPL)
    with pytest.raises(BadInputError, match="window must be a positive int"):
        tpu_attention(q, k, v, qp, kp, 0, impl=IMPL)


@pytest.mark.parametrize(("heads", "head_dim"), [(4, 12), (2, 128)],
                         ids=["xla attention", "tpu attention"])
def test_a_dense_model_under_the_tpu_plan_agrees_across_program_widths(heads, head_dim):
    """A width-1 producer (token-by-token prefill, decode) and a width-16 one (chunked
    prefill, a verify of four rows) give bitwise equal logits and state, every product on the
    interpreted TPU kernel; attention on it where the heads have 128 dimensions, in XLA's
    tiled form where they have 12. (The control, XLA's own kernels failing this check in
    float32, is in tests/models/test_dense_widths_agree.py.)"""
    config = DenseConfig(model_type="qwen3", vocab_size=96, hidden_size=48,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=heads // 2, head_dim=head_dim,
                         tie_word_embeddings=True)
    model = DenseModel(config, jnp.float32, plan=KernelPlan.interpreted(target="tpu"))
    params = model.init_params(jax.random.PRNGKey(3))
    decoder, prefiller = (BlockProducer(model, params, capacity=256, width=w, steps_per_call=2)
                          for w in (1, 16))
    prompt = [5, 17, 3, 88, 41, 41, 9, 60, 2, 77, 14, 30, 65, 8, 51, 23, 90, 1, 36, 70]
    conformance.check_widths_agree(decoder, prefiller, prompt, [7, 9], [12, 45, 3, 80])
