"""The dense model under a row-invariant kernel plan: block programs of different widths agree
bit for bit, row for row, on the CPU.

A producer of width 1 prefills token by token and decodes; producers of width 16 and 64 (other
programs) prefill in chunks and verify ``k + 1`` rows. Logits rows and every live state leaf
must be bitwise equal (:func:`~turbospark_jax.testing.conformance.check_widths_agree`). The
control runs the same check with XLA's own kernels, where it fails in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.plan import KernelPlan
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, unstack_layers
from turbospark_jax.testing import conformance as C
from turbospark_jax.testing.fixtures import backend_plan

VOCAB = 96
PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 77, 14, 30, 65, 8, 51, 23, 90, 1, 36, 70]
CUTS = [7, 9]
FEED = [12, 45, 3, 80]  # k + 1 rows of a verify, k = 3


def _model(model_type: str, dtype, kernels: str) -> DenseModel:
    cfg = DenseConfig(
        model_type=model_type, vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        tie_word_embeddings=model_type == "qwen3", attention_bias=model_type == "qwen2",
    )
    return DenseModel(cfg, dtype, plan=backend_plan(kernels == "rowinv"))


def _producers(model: DenseModel, widths: tuple[int, ...]) -> list[BlockProducer]:
    params = model.init_params(jax.random.PRNGKey(3))
    return [BlockProducer(model, params, capacity=64, width=w, steps_per_call=2)
            for w in widths]


@pytest.mark.parametrize("model_type, dtype, widths", [
    ("qwen3", jnp.float32, (16, 64)),  # q/k norm, tied head
    ("llama", jnp.bfloat16, (16,)),
])
def test_rowinv_widths_agree(model_type, dtype, widths):
    decoder, *prefillers = _producers(_model(model_type, dtype, "rowinv"), (1, *widths))
    for prefiller in prefillers:
        C.check_widths_agree(decoder, prefiller, PROMPT, CUTS, FEED)


def test_control_xla_kernels_differ_across_widths_in_float32():
    """The check can fail: with XLA's own kernels a width-1 program and a width-16 one round
    differently in float32 (XLA's one-row dot sums in another order). (In bfloat16 the rounding
    of the result can hide the difference on a model this small, so the control uses float32.)"""
    decoder, prefiller = _producers(_model("qwen3", jnp.float32, "xla"), (1, 16))
    with pytest.raises(C.ConformanceError):
        C.check_widths_agree(decoder, prefiller, PROMPT, CUTS, FEED)


def test_the_plan_is_checked():
    cfg = _model("llama", jnp.float32, "xla").config
    with pytest.raises(BadInputError, match="plan must be a KernelPlan"):
        DenseModel(cfg, plan="rowinv")
    with pytest.raises(BadInputError, match="pallas must be one of"):
        KernelPlan(row_invariant=True, pallas="triton")
    with pytest.raises(BadInputError, match="row_invariant must be True or False"):
        KernelPlan(row_invariant=1)
    assert DenseModel(cfg, plan=KernelPlan(row_invariant=True)).widths_agree
    assert not DenseModel(cfg).widths_agree  # XLA's kernels by default


# -- products handed on unfinished (DenseModel.defers_sums) -----------------------------------

def _prefill_bits(model: DenseModel, params, width: int = 1) -> tuple[np.ndarray, list]:
    producer = BlockProducer(model, params, capacity=64, width=width, prefill_width=16)
    logits, state = producer.prefill_chunk(producer.init_state(), PROMPT, 0)
    return (np.asarray(logits).view(np.uint32),
            [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(state.cache)])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_deferred_sums_give_the_bits_of_finished_products(dtype):
    """Listed (unrolled) layers hand each product on as partial sums that the next norm adds;
    stacked layers run as a scan finish every product first. Same arithmetic, same bits:
    logits and every cache leaf. And the deferring model's widths agree too."""
    model = _model("qwen3", dtype, "rowinv")
    stacked = model.init_params(jax.random.PRNGKey(3))
    listed = unstack_layers(stacked)
    assert model.defers_sums(listed["layers"]) and not model.defers_sums(stacked["layers"])
    logits, cache = _prefill_bits(model, stacked)
    logits_l, cache_l = _prefill_bits(model, listed)
    assert np.array_equal(logits, logits_l)
    assert all(np.array_equal(a, b) for a, b in zip(cache, cache_l, strict=True))
    decoder, prefiller = (BlockProducer(model, listed, capacity=64, width=w) for w in (1, 16))
    C.check_widths_agree(decoder, prefiller, PROMPT, CUTS, FEED)


def test_control_deferred_check_sees_one_changed_weight():
    model = _model("qwen3", jnp.float32, "rowinv")
    listed = unstack_layers(model.init_params(jax.random.PRNGKey(3)))
    logits, _ = _prefill_bits(model, listed)
    w = listed["layers"][1]["down_proj"]
    listed["layers"][1]["down_proj"] = w.at[0, 0].set(w[0, 0] * 1.5)
    assert not np.array_equal(logits, _prefill_bits(model, listed)[0])


@pytest.mark.parametrize("layout", ["stacked", "listed"])
def test_last_row_head_is_that_row_of_the_whole_head(layout):
    """``block_forward(last_row_head=True)`` (what a wide exact prefill runs) gives row
    ``live - 1`` of the head over every row, bitwise; XLA's kernels refuse it."""
    model = _model("qwen3", jnp.float32, "rowinv")
    params = model.init_params(jax.random.PRNGKey(3))
    if layout == "listed":
        params = unstack_layers(params)
    cache = model.init_cache(64)
    tokens = jnp.asarray(PROMPT[:16], jnp.int32)
    positions = jnp.arange(16, dtype=jnp.int32)
    run = jax.jit(lambda live, last: model.block_forward(
        params, cache, tokens, positions, live, jnp.bool_(True), last_row_head=last)[0],
        static_argnums=1)
    for live in (16, 9):
        whole, one = run(jnp.int32(live), False), run(jnp.int32(live), True)
        assert one.shape == (1, VOCAB)
        assert np.array_equal(np.asarray(one[0]).view(np.uint32),
                              np.asarray(whole[live - 1]).view(np.uint32))
        assert not np.array_equal(np.asarray(one[0]), np.asarray(whole[live - 2]))  # control
    xla = _model("qwen3", jnp.float32, "xla")
    with pytest.raises(BadInputError, match="last_row_head"):
        xla.block_forward(xla.init_params(jax.random.PRNGKey(3)), xla.init_cache(64), tokens,
                          positions, jnp.int32(16), jnp.bool_(True), last_row_head=True)


@pytest.mark.parametrize("chunk", [64, 8])  # one fresh pass; passes over a key limit
def test_parallel_prefill_runs_on_xla_kernels(chunk):
    """The parallel prefill stands outside the bitwise guarantees, so a row-invariant model
    runs its passes on XLA's (faster) kernels, the last token in the last pass with the head
    on its row alone (``parallel_head``): its state and logits are bitwise the XLA-kernel
    model's after the same passes, and within float32 rounding of the exact prefill's."""
    prompt = PROMPT * 2
    rowinv_model, xla_model = (_model("qwen3", jnp.float32, k) for k in ("rowinv", "xla"))
    assert rowinv_model.parallel_head and xla_model.parallel_head
    params = rowinv_model.init_params(jax.random.PRNGKey(3))

    producers = {m: BlockProducer(m, params, capacity=64, width=1, steps_per_call=2)
                 for m in (rowinv_model, xla_model)}

    def prefill(model, parallel):
        p = producers[model]
        if parallel:
            return p.prefill_parallel(p.init_state(), prompt, 0, chunk=chunk)
        return p.prefill_chunk(p.init_state(), prompt, 0)

    logits, state = prefill(rowinv_model, True)
    xla_logits, xla_state = prefill(xla_model, True)
    assert int(state.fed.count) == len(prompt) == int(xla_state.fed.count)
    rows = len(prompt)  # every row from the passes
    for a, b in zip((state.cache.k, state.cache.v), (xla_state.cache.k, xla_state.cache.v),
                    strict=True):
        for layer, xla_layer in zip(a, b, strict=True):
            assert np.array_equal(np.asarray(layer[:rows]), np.asarray(xla_layer[:rows]))
    assert np.array_equal(np.asarray(logits), np.asarray(xla_logits))
    exact, exact_state = prefill(rowinv_model, False)
    assert logits.shape == exact.shape
    np.testing.assert_allclose(np.asarray(logits), np.asarray(exact), rtol=1e-4, atol=1e-4)
    # the next decode step from either state agrees within the same rounding
    p = producers[rowinv_model]
    nxt = [np.asarray(p.produce(s, 5, len(prompt))[0]) for s in (state, exact_state)]
    np.testing.assert_allclose(nxt[0], nxt[1], rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("full_precision_products")  # TF32 on a GPU misses the bars
def test_a_parallel_pass_takes_a_last_row_head_on_xla_kernels():
    """``parallel_head``: a parallel pass (``fresh`` or ``key_limit``) gives the last live
    row's logits under XLA's kernels too (no bitwise claim there), the row a full head gives
    within rounding; outside such a pass the XLA-kernel model still refuses."""
    xla = _model("qwen3", jnp.float32, "xla")
    params = xla.init_params(jax.random.PRNGKey(3))
    tokens = jnp.asarray(PROMPT * 2 + [0] * (64 - 2 * len(PROMPT)), jnp.int32)
    positions = jnp.arange(64, dtype=jnp.int32)
    live = jnp.int32(2 * len(PROMPT))
    one, _ = xla.block_forward(params, xla.init_cache(64), tokens, positions, live, True,
                               fresh=True, last_row_head=True)
    whole, _ = xla.block_forward(params, xla.init_cache(64), tokens, positions, live, True,
                                 fresh=True)
    assert one.shape == (1, VOCAB)
    np.testing.assert_allclose(np.asarray(one[0]), np.asarray(whole[int(live) - 1]),
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(one[0]), np.asarray(whole[int(live) - 2]))  # control


def _attention_operands(rows: int, length: int = 600, seed: int = 2):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((rows, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((length, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((length, 2, 16)), jnp.float32)
    return q, k, v, jnp.arange(length, dtype=jnp.int32)


@pytest.mark.usefixtures("full_precision_products")  # TF32 on a GPU misses the bars
@pytest.mark.parametrize("window", [None, 100])
def test_blocked_attention_is_attention_and_its_rows_ignore_the_tiles_bound(window):
    """The XLA form's attention walks the keys in 256-key blocks up to the last one its tile
    sees: within rounding of the whole softmax, and a row's bits do not depend on how far
    the other rows of its tile make it walk (blocks a row sees nothing of add exact zeros),
    the last block overlapping the one before (600 keys)."""
    from turbospark_jax.kernels import layers
    from turbospark_jax.kernels.plan import _attend_blocks

    q, k, v, kp = _attention_operands(4)
    blocked = jax.jit(_attend_blocks, static_argnums=5)
    near = jnp.asarray([5, 6, 7, 8], jnp.int32)
    far = jnp.asarray([5, 580, 300, 599], jnp.int32)
    got_near, got_far = blocked(q, k, v, near, kp, window), blocked(q, k, v, far, kp, window)
    assert np.array_equal(np.asarray(got_near[0]), np.asarray(got_far[0]))
    np.testing.assert_allclose(np.asarray(got_far), np.asarray(
        layers.attend(q, k, v, far, kp, window)), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("full_precision_products")  # TF32 on a GPU misses the bars
def test_control_a_row_follows_its_blocks_boundaries(monkeypatch):
    """The bitwise comparison above can fail: where the online softmax folds (the block
    boundaries, fixed offsets of the cache) does change a row's last bits, here a row at
    position 580 walked in 128-key blocks instead of 256."""
    from turbospark_jax.kernels import plan as row_kernels

    q, k, v, kp = _attention_operands(4)
    pos = jnp.asarray([580, 581, 582, 583], jnp.int32)
    wide = np.asarray(row_kernels._attend_blocks(q, k, v, pos, kp, None))
    monkeypatch.setattr(row_kernels, "KEY_BLOCK", 128)
    narrow = np.asarray(row_kernels._attend_blocks(q, k, v, pos, kp, None))
    np.testing.assert_allclose(wide, narrow, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(wide[0], narrow[0])


# -- short-context decode programs (BlockModel.bounds_keys) ----------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_short_context_bursts_run_the_bounded_program_with_the_same_bits(key_bounds_seen,
                                                                          temperature):
    """Decode bursts whose rows all sit below ``short_decode_keys`` run the program bounded by
    it (``max_keys`` reaches the model's attention), later bursts the unbounded one; tokens and
    logits equal those of a producer that never bounds, bit for bit. (On the CPU the dense
    model's attention is XLA's and ignores the bound, so this checks the plumbing and that a
    second program changes nothing; the GPU's folding kernel is checked against the split
    kernel in ``tests/kernels/test_attention.py`` and lowered in
    ``tests/kernels/test_gpu_lowering.py``.)"""
    from turbospark_jax.core import sampling
    from turbospark_jax.generation.completion import CompletionRequest
    from turbospark_jax.generation.driver import run_raw_completion

    model = _model("qwen3", jnp.float32, "rowinv")
    params = model.init_params(jax.random.PRNGKey(3))
    bounded, plain = (BlockProducer(model, params, capacity=96, width=1, steps_per_call=8,
                                    short_decode_keys=keys) for keys in (40, None))
    assert bounded.short_decode_keys == 40 and plain.short_decode_keys is None
    request = CompletionRequest(prompt_ids=PROMPT, max_tokens=40, record_logits=True, burst=8,
                                sampling=sampling.SamplingConfig(temperature=temperature),
                                seed=7)
    got, want = (run_raw_completion(p, request) for p in (bounded, plain))
    assert got.token_ids == want.token_ids and len(got.token_ids) == 40
    assert np.array_equal(got.logits.view(np.uint32), want.logits.view(np.uint32))
    assert 40 in key_bounds_seen and None in key_bounds_seen  # bounded bursts, then not
    # a model that does not declare the capability is never handed the hint
    assert BlockProducer(_model("llama", jnp.float32, "xla"), params, capacity=96,
                         width=1).short_decode_keys is None
    for bad in (-1, True, "512"):
        with pytest.raises(BadInputError, match="short_decode_keys"):
            BlockProducer(model, params, capacity=96, width=1, short_decode_keys=bad)
