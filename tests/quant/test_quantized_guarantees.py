"""Every bitwise guarantee holds within a quantized model, in every scheme and family.

A quantized model is its own model: its products multiply by the dequantized weights, an
elementwise function of the stored bits, through the same kernels as any other weight. So
chunked prefill equals token by token, verify equals decode, reuse equals fresh, and (for the
dense family's row-invariant plan) programs of different widths agree, bitwise, exactly as for
the unquantized model; the controls show each check can fail. The quantized model is not its
parent: its logits differ, within the loose distance a stated scheme allows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.quant.tiny import QWEN35
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.models.dense import model as D
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.gemma4 import config as GC
from turbospark_jax.models.gemma4 import model as G
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.quant.weights import QuantizedWeight
from turbospark_jax.testing import conformance as C
from turbospark_jax.testing.fixtures import backend_plan, quantized

pytestmark = pytest.mark.usefixtures("full_precision_products")

VOCAB = 64
SCHEMES = ("int8", "int4-g32", "fp8")
PROMPT = [5, 17, 3, 60, 41, 41, 9, 60, 2, 33, 14, 30, 63, 8, 51, 23, 1, 36]


def _dense(scheme, width=4, plan=None, dtype=jnp.bfloat16):
    cfg = DenseConfig(model_type="llama", vocab_size=VOCAB, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    model = D.DenseModel(cfg, dtype, scan_layers=False, plan=plan or backend_plan(True))
    params = model.init_params(jax.random.PRNGKey(2))
    if scheme is not None:
        params = quantized(D.FAMILY, cfg, params, scheme, dtype)
    return model, D.unstack_layers(params)


def _producers(scheme, widths, dtype=jnp.bfloat16):
    model, params = _dense(scheme, dtype=dtype)
    return [BlockProducer(model, params, capacity=64, width=w, steps_per_call=2)
            for w in widths]


def _qwen35(scheme):
    config = QWEN35
    model = Q.FAMILY.build(config, jnp.float32, "list")
    params = model.init_params(jax.random.PRNGKey(4))
    return model, quantized(Q.FAMILY, config, params, scheme, jnp.float32)


def _gemma4(scheme):
    config = GC.Gemma4Config.from_hf_dict(dict(
        model_type="gemma4_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
        num_hidden_layers=3, layer_types=[GC.SLIDING, GC.FULL, GC.SLIDING],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        sliding_window=3, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
        initializer_range=0.1))
    model = G.Gemma4Model(config, jnp.float32, ring_margin=8)
    params = model.init_params(jax.random.PRNGKey(3))
    return model, quantized(G.FAMILY, config, params, scheme, jnp.float32)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dense_widths_agree_quantized(scheme):
    decoder, prefiller = _producers(scheme, (1, 16))
    assert isinstance(decoder.params["layers"][0]["q_proj"], QuantizedWeight)
    C.check_widths_agree(decoder, prefiller, PROMPT, [7, 9], [12, 45, 3, 60])


def test_control_widths_check_fails_for_another_quantization():
    """The check can fail: the decoder of an int8 model against the prefiller of an fp8 one."""
    (decoder,) = _producers("int8", (1,))
    (prefiller,) = _producers("fp8", (16,))
    with pytest.raises(C.ConformanceError):
        C.check_widths_agree(decoder, prefiller, PROMPT, [7, 9], [12, 45, 3, 60])


FAMILIES = {"dense": lambda s: _dense(s), "qwen3_5": _qwen35, "gemma4": _gemma4}
#: Every scheme on the dense family; one each on the others (the schemes share every line of
#: code past the dequantization, which the dense cases and the unit tests cover).
CASES = [("dense", "int8"), ("dense", "int4-g32"), ("dense", "fp8"), ("qwen3_5", "int4-g32"),
         ("gemma4", "int8")]
PRODUCERS = {
    (family, scheme): BlockProducer(*FAMILIES[family](scheme), capacity=48, width=4,
                                    steps_per_call=4, donate=True)
    for family, scheme in CASES
}
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)


@pytest.fixture(params=sorted(PRODUCERS), ids=lambda k: f"{k[0]}-{k[1]}")
def producer(request):
    return PRODUCERS[request.param]


@settings(max_examples=4)
@given(prompt=tokens, cuts=st.lists(st.integers(1, 19), max_size=3))
def test_chunked_equals_sequential(producer, prompt, cuts):
    C.check_chunked_matches_sequential(producer, prompt, cuts)


@settings(max_examples=4)
@given(prefix=tokens, feed=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5))
def test_verify_rows_equal_decode(producer, prefix, feed):
    C.check_verify_matches_decode(producer, prefix, feed)


def test_reuse_equals_fresh(producer):
    C.check_reuse_matches_fresh(producer, PROMPT[:10], [5, 6], [*PROMPT[:7], 9, 2])


@pytest.mark.parametrize("control", ["chunk_logits_bit", "verify_row_bit"])
def test_controls_are_caught(control):
    from tests.testing.test_conformance_toy import CHECKS

    p = PRODUCERS[("qwen3_5", "int4-g32")]
    CHECKS[control](p)
    with pytest.raises(C.ConformanceError):
        CHECKS[control](C.perturbed(p, control))


#: How far a quantized tiny model's logits may stray from its float32 parent's (the largest
#: difference over the prompt, relative to the parent's largest logit): int8 rounds each
#: weight to 1/254 of its column's range, fp8 to 3 mantissa bits, int4 to 1/15 of a group's.
DRIFT = {"int8": 0.05, "fp8": 0.15, "int4-g32": 0.5}


@pytest.mark.parametrize("scheme", sorted(DRIFT))
def test_quantized_logits_near_parent_not_equal(scheme):
    (parent,) = _producers(None, (4,), jnp.float32)
    (child,) = _producers(scheme, (4,), jnp.float32)
    a, b = _logits(parent), _logits(child)
    gap = np.abs(a - b).max() / np.abs(a).max()
    assert 0 < gap <= DRIFT[scheme], gap


def _logits(producer):
    """The logits of every position of ``PROMPT``, fed token by token."""
    state, rows = producer.init_state(), []
    for position, token in enumerate(PROMPT):
        logits, state = producer.produce(state, token, position)
        rows.append(np.asarray(logits))
    return np.stack(rows)
