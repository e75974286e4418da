"""The row-invariant model's GPU form, run whole in the Pallas interpreter on the CPU.

On a GPU the row-invariant plan runs a different graph from the CPU's: the Triton kernels of
``rowinv`` (merged products from one launch, the tied head read as ``[N, K]``, products handed
on as partial sums), the one-program-a-row norm that adds them to the residual, the
RoPE-and-cache-write work inside the attention kernel in its row-invariant form (the folding
kernel for a short context, the split kernel whose last program folds for a long one), the
two launched apart for wide blocks, and the last-row head of a wide prefill. Here the model
runs :meth:`KernelPlan.interpreted`, every kernel in the interpreter, so the wiring of that
graph is checked before any GPU runs it: the logits match the same model on XLA's kernels to
float32 rounding, and producers of widths 1, 1 with 256-row prefill blocks (the folding
attention kernel) and 4 with 16-row blocks give bitwise the same prefill and decode logits;
the device loop's decode program (draw plans, chunks of steps, one-row kernels) gives the
logits of one-by-one steps, and sampled, the tokens and state of the branching program.
(The interpreter's tile products are XLA dots, so the bitwise part speaks for the schedule,
not for the GPU's own arithmetic: ``tests/models/test_dense_widths_agree.py`` run with
``JAX_PLATFORMS=cuda`` checks that on the hardware.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.kernels import rope_store as pallas_rope_store
from turbospark_jax.kernels.plan import KernelPlan
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, unstack_layers

BF16 = jnp.bfloat16
CONFIG = DenseConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, tie_word_embeddings=True)
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 256, 300)]
CAPACITY = 640  # two key splits


@pytest.fixture(scope="module", autouse=True)
def full_float32_products():
    """Float32 products at full precision: on a GPU, XLA's reference would otherwise take
    TF32 products (about 1e-4 off), which the CPU never does; the comparison is against
    float32 rounding on both."""
    with jax.default_matmul_precision("highest"):
        yield


def _logits(model: DenseModel, params, width: int, prefill_width: int | None,
            **producer_fields) -> tuple:
    producer = BlockProducer(model, params, capacity=CAPACITY, width=width,
                             prefill_width=prefill_width, steps_per_call=2, **producer_fields)
    last, state = producer.prefill_chunk(producer.init_state(), PROMPT, 0)
    step, _ = producer.produce(state, 7, len(PROMPT))
    return np.asarray(last), np.asarray(step)


def _model(plan: KernelPlan) -> tuple[DenseModel, object]:
    model = DenseModel(CONFIG, jnp.float32, scan_layers=False, plan=plan)
    return model, unstack_layers(model.init_params(jax.random.PRNGKey(0)))


GPU_FORM = KernelPlan.interpreted()


@pytest.fixture(scope="module")
def reference():
    """The same model on XLA's kernels, on the CPU as it is."""
    return _logits(*_model(KernelPlan()), 1, None)


def test_gpu_form_matches_xla_and_its_widths_agree(reference):
    model, params = _model(GPU_FORM)
    assert model.bounds_keys and model.widths_agree
    runs = {w: _logits(model, params, *w) for w in ((1, None), (1, 256), (4, 16))}
    for got in runs.values():
        for g, want in zip(got, reference, strict=True):
            np.testing.assert_allclose(g, want, rtol=0, atol=1e-5)
        for g, b in zip(got, runs[(1, None)], strict=True):
            assert np.array_equal(g.view(np.uint32), b.view(np.uint32))


def test_gpu_form_folds_in_the_last_split_program_and_keeps_every_bit(monkeypatch):
    """A decode step over the cache's two key splits (no short-context program:
    ``short_decode_keys=0``) runs the RoPE-store inside the split kernel, whose last program
    folds each tile's partials; the prefill, in 16-row blocks, runs the split form too. Its
    logits are bitwise those of the default producer (the short-context folding kernel for
    the decode step), at both widths."""
    from turbospark_jax.engine import program as block_program

    def forget_programs():  # the patched kernel is called only when a program is traced
        for program in (block_program.compiled_program, block_program.compiled_parallel):
            program.cache_clear()
        jax.clear_caches()

    original, folds = pallas_rope_store.fold_in_last_split, []
    model, params = _model(GPU_FORM)
    forget_programs()
    try:
        monkeypatch.setattr(pallas_rope_store, "fold_in_last_split",
                            lambda *a, **k: folds.append(1) or original(*a, **k))
        for w in ((1, None), (4, 16)):
            got = _logits(model, params, *w, short_decode_keys=0)
            want = _logits(model, params, *w)
            for g, b in zip(got, want, strict=True):
                assert np.array_equal(g.view(np.uint32), b.view(np.uint32))
    finally:  # no later test may meet a program traced with the patched kernel
        forget_programs()
    assert folds  # the last split programs folded


def test_control_one_changed_weight_is_past_the_tolerance(reference):
    model, params = _model(GPU_FORM)
    w = params["layers"][0]["down_proj"]
    params["layers"][0]["down_proj"] = w.at[3].set(w[3] * 1.1)  # 1% was 9.99e-6 on jax 0.12
    got = _logits(model, params, 1, None)
    assert np.abs(got[0] - reference[0]).max() > 1e-5


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.9, "top_k": 20, "top_p": 0.9}],
                         ids=["greedy", "top_k"])
def test_gpu_form_decode_program_equals_its_steps(monkeypatch, settings):
    """The device loop's decode program in its GPU form (the draw plan's branch-free draw,
    the head unbranched, steps in chunks with idle ones after the count, the matvec kernel on
    the call's one row, the gated gate/up kernel): greedy, its logits are bitwise those of
    one-by-one steps; sampled, its tokens, logits and state those of the branching one-step
    program."""
    from turbospark_jax.core import sampling

    model, params = _model(GPU_FORM)
    producer = BlockProducer(model, params, capacity=CAPACITY, width=1, steps_per_call=16,
                             donate=False)
    _, state = producer.prefill_chunk(producer.init_state(), PROMPT[:40], 0)
    params_ = sampling.SamplingParams.make(**settings)

    def burst():
        return producer.decode(state, PROMPT[40], 11, params=params_,
                               history=sampling.History.empty(CONFIG.vocab_size),
                               key=sampling.request_key(2), gen_index=1)

    planned, planned_state = burst()
    assert len(planned.tokens) == 11
    if not settings:
        tok, st = PROMPT[40], state
        for i, row in enumerate(np.asarray(planned.logits)):
            step, st = producer.produce(st, tok, 40 + i)
            assert np.array_equal(np.asarray(step).view(np.uint32), row.view(np.uint32)), i
            tok = planned.tokens[i]
            assert tok == int(np.argmax(np.asarray(step)))
        return
    monkeypatch.setattr(sampling, "draw_plan", lambda *_: "any")
    branching, branching_state = burst()
    assert planned.tokens == branching.tokens
    assert np.array_equal(planned.logits.view(np.uint32), branching.logits.view(np.uint32))
    for a, b in zip(jax.tree.leaves(planned_state.cache), jax.tree.leaves(branching_state.cache),
                    strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
