"""The MoE layers on grouped expert products (:mod:`turbospark_jax.kernels.grouped`).

* The routed experts (Qwen's ``[in, out]`` stacks and Gemma 4's fused ``[out, in]`` ones)
  equal the per-row math they replace (each row times its own gathered experts) within
  rounding.
* A row's bits inside a block of 37 rows, the others random, equal its bits alone
  (``np.array_equal``), for the XLA form and the interpreted Pallas form; controls: XLA's own
  product over all rows at two row counts, and a change to the row itself.
* A ``qwen3_moe`` model keeps its guarantees bitwise: chunked == token by token and verify ==
  decode under the CPU's row-invariant plan (bfloat16), with the conformance controls; and
  under the GPU's plan in the interpreter (the Pallas grouped kernels) a one-row decode
  program and a 16-row program agree row for row.
* A block's padding rows create no tiles: the experts the model hands the grouped products
  are ``-1`` past the live count, so only the live rows' selections are laid out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.kernels import grouped
from turbospark_jax.kernels.plan import XLA_PLAN, KernelPlan, grouped_impl
from turbospark_jax.models import moe
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, unstack_layers
from turbospark_jax.testing import conformance as C

E, K, D, F, ROWS = 8, 2, 64, 64, 37


@functools.cache
def _layer(dtype=jnp.float32, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"router": (E, D), "expert_gate": (E, D, F), "expert_up": (E, D, F),
              "expert_down": (E, F, D)}
    return {k: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), dtype)
            for k, s in shapes.items()}


def _rows(n: int, seed: int = 0, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n, D)), dtype)


def _per_row(x, weights, experts, gate, up, down, act):
    """The arithmetic the grouped products replace: each row times its own gathered
    experts, the terms added in expert order."""
    order = jnp.argsort(experts, axis=-1)
    experts = jnp.take_along_axis(experts, order, axis=-1)
    weights = jnp.take_along_axis(weights, order, axis=-1).astype(x.dtype)
    hi = jax.lax.Precision.HIGHEST
    g = jnp.einsum("td,tkdf->tkf", x, gate[experts], precision=hi)
    u = jnp.einsum("td,tkdf->tkf", x, up[experts], precision=hi)
    y = jnp.einsum("tkf,tkfd->tkd", act(g) * u, down[experts], precision=hi)
    return jnp.sum(y * weights[..., None], axis=1)


def _routing(x, w):
    return moe.top_k_softmax(moe.router_logits(x, w["router"]), moe.Routing(E, K, True))


def test_routed_experts_match_the_per_row_math():
    w = _layer()
    x = _rows(ROWS)
    probs, experts = _routing(x, w)
    want = _per_row(x, probs, experts, w["expert_gate"], w["expert_up"], w["expert_down"],
                    moe.silu)
    for impl in ("xla", "interpret"):
        got = moe.routed_experts(x, probs, experts, w["expert_gate"], w["expert_up"],
                                 w["expert_down"], impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    # Gemma 4's fused [out, in] stacks: the same experts stored as that checkpoint stores them
    gate_up = jnp.concatenate([w["expert_gate"], w["expert_up"]], axis=2).transpose(0, 2, 1)
    down = w["expert_down"].transpose(0, 2, 1)
    want = _per_row(x, probs, experts, w["expert_gate"], w["expert_up"], w["expert_down"],
                    moe.gelu_tanh)
    for impl in ("xla", "interpret"):
        got = moe.fused_routed_experts(x, probs, experts, gate_up, down, impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


_block = jax.jit(moe.moe_block, static_argnames=("routing", "row_invariant", "impl"))


def _row_in_blocks(impl: str, dtype, row: int = 3) -> tuple[np.ndarray, list[np.ndarray]]:
    """Row ``row`` alone, and the same row inside two 37-row blocks of other random rows
    (at two positions)."""
    w = _layer(dtype)
    x = _rows(ROWS, 0, dtype)
    run = functools.partial(_block, weights=w, routing=moe.Routing(E, K, True),
                            row_invariant=True, impl=impl)
    alone = np.asarray(run(x[row:row + 1])[0].astype(jnp.float32))
    inside = []
    for seed, at in ((1, 0), (2, 30)):
        block = _rows(ROWS, seed, dtype).at[at].set(x[row])
        inside.append(np.asarray(run(block)[at].astype(jnp.float32)))
    return alone, inside


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_block(impl, dtype):
    alone, inside = _row_in_blocks(impl, dtype)
    assert all(np.array_equal(alone, got) for got in inside)


def test_control_the_check_sees_a_row_count_dependent_product():
    """The same check on XLA's own product over all rows (no tiles) fails on the CPU: one
    row alone sums otherwise than among 37."""
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU's matrix-vector path is what this control shows")
    w = _layer()["expert_gate"][0]
    dot = jax.jit(lambda a: jnp.dot(a, w, precision=jax.lax.Precision.HIGHEST))
    x = _rows(ROWS)
    full = np.asarray(dot(x))
    assert any(not np.array_equal(np.asarray(dot(x[r:r + 1]))[0], full[r])
               for r in range(ROWS))


def test_control_a_change_to_the_row_is_seen():
    w = _layer()
    x = _rows(ROWS)
    run = functools.partial(_block, weights=w, routing=moe.Routing(E, K, True),
                            row_invariant=True, impl="xla")
    assert not np.array_equal(np.asarray(run(x[3:4])),
                              np.asarray(run(x[3:4].at[0, 5].add(2.0**-12))))


# -- a qwen3_moe model ------------------------------------------------------------------------

CONFIG = DenseConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=D,
                     intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_experts=E, num_experts_per_tok=K,
                     moe_intermediate_size=F, norm_topk_prob=True)
PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 77, 14, 30, 65, 8, 51, 23]
FEED = [12, 45, 3, 80]


@functools.cache
def _params(dtype: str):
    model = DenseModel(CONFIG, jnp.dtype(dtype), scan_layers=False)
    params = model.init_params(jax.random.PRNGKey(0))
    return unstack_layers(params)


def _producer(plan: KernelPlan, dtype: str, width: int) -> BlockProducer:
    model = DenseModel(CONFIG, jnp.dtype(dtype), scan_layers=False, plan=plan)
    return BlockProducer(model, _params(dtype), capacity=48, width=width, steps_per_call=2)


def test_chunked_and_verify_bitwise_on_the_cpu_plan():
    producer = _producer(KernelPlan(row_invariant=True), "bfloat16", 4)
    C.check_chunked_matches_sequential(producer, PROMPT, [5, 11])
    C.check_verify_matches_decode(producer, PROMPT[:9], FEED)
    with pytest.raises(C.ConformanceError):
        C.check_chunked_matches_sequential(C.perturbed(producer, "chunk_logits_bit"), PROMPT,
                                           [5, 11])
    with pytest.raises(C.ConformanceError):
        C.check_verify_matches_decode(C.perturbed(producer, "verify_row_bit"), PROMPT[:9], FEED)


def test_widths_agree_on_the_gpu_plan_interpreted():
    """The Pallas grouped kernels (with every other GPU kernel, interpreted): a one-row
    decode program and a 16-row program give the same prefill, verify and decode rows."""
    plan = KernelPlan.interpreted()
    assert grouped.GROUPED_TILES.fits(D, F)  # so the Pallas form, not the fallback, runs
    decoder, prefiller = _producer(plan, "float32", 1), _producer(plan, "float32", 16)
    C.check_widths_agree(decoder, prefiller, PROMPT[:10], [4], FEED[:2])
    # Control: a verify row one bit off is seen (the same programs, so no new compile)
    with pytest.raises(C.ConformanceError):
        C.check_widths_agree(decoder, C.perturbed(prefiller, "verify_row_bit"), PROMPT[:10],
                             [4], FEED[:2])


def test_the_plan_declares_the_form():
    """The GPU's kernels (compiled or interpreted) take the Pallas form; every other plan,
    the TPU's included, the XLA loop."""
    assert grouped_impl(KernelPlan(row_invariant=True, pallas="compiled")) == "pallas"
    assert grouped_impl(KernelPlan.interpreted()) == "interpret"
    for plan in (XLA_PLAN, KernelPlan(row_invariant=True), KernelPlan(row_invariant=True,
                                                                       pallas="tpu")):
        assert grouped_impl(plan) == "xla"


def test_padding_rows_create_no_tiles(monkeypatch):
    """The experts a block of width 4 with 2 live rows hands the grouped products: its
    padding rows' are all ``-1``, so they take no tile (the used count is the live rows'),
    and the live rows' are real experts."""
    seen = []
    real = moe.expert_mlp

    def spy(rows, chosen, *args, **kwargs):
        jax.debug.callback(lambda e: seen.append(np.asarray(e)), chosen)
        return real(rows, chosen, *args, **kwargs)

    monkeypatch.setattr(moe, "expert_mlp", spy)
    model = DenseModel(CONFIG, jnp.float32, scan_layers=False,
                       plan=KernelPlan(row_invariant=True))
    params = _params("float32")
    cache = model.init_cache(16)
    tokens = jnp.asarray([7, 9, 11, 13], jnp.int32)
    jax.block_until_ready(model.block_forward(params, cache, tokens,
                                              jnp.arange(4, dtype=jnp.int32), jnp.int32(2),
                                              True))
    assert len(seen) == CONFIG.num_hidden_layers
    for chosen in seen:
        assert (chosen[2:] == -1).all() and ((chosen[:2] >= 0) & (chosen[:2] < E)).all()
        used = int(grouped.group(jnp.asarray(chosen), E, grouped.XLA_TILE_ROWS).used)
        assert used == int(grouped.group(jnp.asarray(chosen[:2]), E,
                                         grouped.XLA_TILE_ROWS).used)
        # control: padding rows with experts of their own would have taken more tiles
        spare = np.setdiff1d(np.arange(E), chosen[:2])[:2 * K].reshape(2, K)
        taking = jnp.asarray(np.concatenate([chosen[:2], spare]))
        assert int(grouped.group(taking, E, grouped.XLA_TILE_ROWS).used) > used
