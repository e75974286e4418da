"""The conformance suite on the dense family (random tiny configs, float32 and bfloat16), and
the parallel prefill's stated tolerance against the exact path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from turbospark_jax import CompletionRequest, run_raw_completion
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.kernels.plan import XLA_PLAN, KernelPlan
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, unstack_layers
from turbospark_jax.testing import conformance as C

VOCAB = 96


def _producer(model_type, dtype, listed=False, plan=XLA_PLAN, capacity=64, head_dim=12,
              hidden=48, tap_layers=(), **extra):
    cfg = DenseConfig(
        model_type=model_type, vocab_size=VOCAB, hidden_size=hidden, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        tie_word_embeddings=model_type == "qwen3", attention_bias=model_type == "qwen2", **extra,
    )
    model = DenseModel(cfg, dtype, scan_layers=not listed, plan=plan, tap_layers=tap_layers)
    params = model.init_params(jax.random.PRNGKey(1))
    if listed:  # the serving layout: one params dict and one KV buffer per layer
        params = unstack_layers(params)
        assert model.init_cache(8).per_layer
    return BlockProducer(model, params, capacity=capacity, width=4, steps_per_call=4,
                         donate=True)


PRODUCERS = {
    "qwen3_f32": _producer("qwen3", jnp.float32),
    "llama_bf16": _producer("llama", jnp.bfloat16),
    "qwen2_f32": _producer("qwen2", jnp.float32),
    # The serving layout.
    "llama_bf16_listed": _producer("llama", jnp.bfloat16, listed=True, capacity=80,
                                   head_dim=16, hidden=64),
    # Recording both layers' rows for a block drafter (the taps are append-only state, held
    # to the same bitwise checks as the KV rows), in the unrolled serving layout.
    "llama_bf16_listed_tapped": _producer("llama", jnp.bfloat16, listed=True, capacity=80,
                                          head_dim=16, hidden=64, tap_layers=(0, 1)),
    # The fused attention and RoPE-and-cache-write kernels (in the Pallas interpreter), over
    # two key tiles, with the q/k norm inside the RoPE kernel: the form a parallel prefill
    # pass runs on a GPU.
    "qwen3_f32_kernel": _producer("qwen3", jnp.float32, listed=True,
                                  plan=KernelPlan.interpreted(row_invariant=False),
                                  capacity=80, head_dim=16, hidden=64),
}
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=22)


@pytest.fixture(params=sorted(PRODUCERS))
def producer(request):
    return PRODUCERS[request.param]


@given(prompt=tokens, cuts=st.lists(st.integers(1, 21), max_size=4))
def test_chunked_equals_sequential(producer, prompt, cuts):
    C.check_chunked_matches_sequential(producer, prompt, cuts)


@given(prompt=tokens)
def test_prefill_advances_like_produce(producer, prompt):
    C.check_prefill_matches_produce(producer, prompt[:6])


@given(prefix=tokens, feed=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9))
def test_verify_rows_equal_decode(producer, prefix, feed):
    C.check_verify_matches_decode(producer, prefix, feed)


@given(first=tokens, keep=st.integers(0, 22), tail=st.lists(st.integers(0, VOCAB - 1),
                                                             min_size=1, max_size=5))
def test_reuse_equals_fresh(producer, first, keep, tail):
    C.check_reuse_matches_fresh(producer, first, [5, 6], [*first, 5, 6][:keep] + tail)


def test_rollback_restores(producer):
    C.check_rollback_restores(producer, [("chunk", [1, 2, 3, 4, 5])],
                              [("verify", [6, 7, 8]), ("produce", [9])], 4)


@pytest.mark.parametrize("control", sorted(C.CONTROLS))
def test_controls_are_caught(control):
    from tests.testing.test_conformance_toy import CHECKS

    p = PRODUCERS["llama_bf16"]
    CHECKS[control](p)
    with pytest.raises(C.ConformanceError):
        CHECKS[control](C.perturbed(p, control))


# Parallel prefill: a wider executable, so rounding differs. Stated tolerance: float32 logits
# within 1e-4 absolute of the exact path (measured ~1e-7 on CPU), bfloat16 within 0.1, and the
# greedy continuation identical on these seeds. Float32 means float32 products: a GPU's default
# rounds their inputs to TF32, a gap of its own (about 1e-3).
@pytest.mark.usefixtures("full_precision_products")
@pytest.mark.parametrize("name,tol", [("qwen3_f32", 1e-4), ("llama_bf16", 1e-1)])
def test_parallel_prefill_within_stated_tolerance(name, tol):
    p = PRODUCERS[name]
    prompt = list(np.random.RandomState(3).randint(0, VOCAB, 37))
    exact = run_raw_completion(p, CompletionRequest(prompt_ids=prompt, max_tokens=12,
                                                    record_logits=True))
    fast = run_raw_completion(p, CompletionRequest(prompt_ids=prompt, max_tokens=12,
                                                   record_logits=True, parallel_prefill=True,
                                                   prefill_chunk_size=16))
    assert np.abs(exact.logits[0] - fast.logits[0]).max() <= tol
    assert fast.token_ids == exact.token_ids
    assert fast.fed_ids == exact.fed_ids
