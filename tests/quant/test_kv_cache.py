"""The quantized KV cache (``kv_dtype="int8" | "fp8"``) in every family.

Each new cache row is quantized from its own values alone, so the model with a quantized
cache is a model of its own whose every bitwise guarantee holds: chunked prefill equals token
by token, verify equals decode, reuse equals fresh, a rollback restores, and the dense
family's row-invariant programs of different widths agree. Its logits stay near those of the
same weights with an unquantized cache (a stated, loose distance), and a token takes about
half the cache bytes of a 16-bit one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import turbospark_jax as tsj
from tests.quant.test_quantized_guarantees import PROMPT, _logits  # token-by-token logits
from tests.quant.tiny import QWEN35
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.io.loading import load_folder
from turbospark_jax.io.saving import save_folder
from turbospark_jax.models.dense import model as D
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.gemma4 import config as GC
from turbospark_jax.models.gemma4 import model as G
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.quant import kv as kv_quant
from turbospark_jax.testing import conformance as C
from turbospark_jax.testing.fixtures import backend_plan

pytestmark = pytest.mark.usefixtures("full_precision_products")

VOCAB = 64
KV_DTYPES = ("int8", "fp8")
DENSE = DenseConfig(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16)


# -- rows -------------------------------------------------------------------------------------


def _rows(seed=0, shape=(6, 3, 16)):
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    x[2, 1] = 0.0  # a zero row
    x[4, 0] *= 1e3  # a row far larger than the rest
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_row_is_quantized_from_its_own_values(kv_dtype):
    """A block quantized at once stores bitwise what each row quantized alone stores; the
    control, one scale for the whole block (a scheme that mixes rows), does not."""
    x = _rows()
    values, scale = kv_quant.quantize(x, kv_dtype)
    assert values.dtype == kv_quant.stored_dtype(kv_dtype, jnp.bfloat16)
    assert scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    alone = [kv_quant.quantize(x[i : i + 1], kv_dtype) for i in range(x.shape[0])]
    assert np.array_equal(np.asarray(values.astype(jnp.float32)),
                          np.concatenate([np.asarray(v.astype(jnp.float32)) for v, _ in alone]))
    assert np.array_equal(np.asarray(scale), np.concatenate([np.asarray(s) for _, s in alone]))
    assert float(scale[2, 1]) == 1.0  # a zero row gets scale 1 and stores zeros
    assert not np.asarray(values[2, 1].astype(jnp.float32)).any()
    shared = jnp.max(jnp.abs(x.astype(jnp.float32))) / {"int8": 127.0, "fp8": 448.0}[kv_dtype]
    mixed = kv_quant.quantize_with(x, shared, kv_dtype)
    assert not np.array_equal(np.asarray(mixed.astype(jnp.float32)),
                              np.asarray(values.astype(jnp.float32)))


@pytest.mark.parametrize(("kv_dtype", "bound"), [("int8", 0.5 / 127), ("fp8", 1 / 16)])
def test_dequantized_rows_are_within_the_stored_rounding(kv_dtype, bound):
    x = _rows(1).astype(jnp.float32)
    back = kv_quant.dequantize(*kv_quant.quantize(x, kv_dtype), jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    err = np.asarray(jnp.abs(back - x) / jnp.where(amax > 0, amax, 1))
    assert 0 < err.max() <= bound * 1.001, err.max()


def test_unknown_kv_dtype_is_refused_naming_the_choices(tmp_path):
    for bad in ("int4", "bfloat16", 8, True):
        with pytest.raises(BadInputError, match="'int8', 'fp8'"):
            kv_quant.check_kv_dtype(bad)
    with pytest.raises(BadInputError, match="kv_dtype"):
        D.DenseModel(DENSE, kv_dtype="e5m2")
    # before the folder is even looked at: this one does not exist
    with pytest.raises(BadInputError, match="kv_dtype"):
        load_folder(tmp_path / "absent", kv_dtype="int4")
    with pytest.raises(BadInputError, match="kv_dtype"):
        tsj.load(tmp_path / "absent", kv_dtype="int4")


@pytest.mark.parametrize("family", ["dense", "qwen3_5"])
def test_load_folder_sets_the_kv_dtype(tmp_path, family):
    model, params = FAMILIES[family](None)
    if family == "dense":
        params = D.stack_layers(params)
    save_folder(tmp_path, model.config, params)
    loaded = load_folder(tmp_path, layer_layout="list", kv_dtype="fp8")
    assert loaded.model.kv_dtype == "fp8"
    assert load_folder(tmp_path, layer_layout="list").model.kv_dtype is None
    producer = BlockProducer(loaded.model, loaded.params, capacity=16, width=4)
    logits, _ = producer.prefill_chunk(producer.init_state(), PROMPT[:5], 0)
    assert np.isfinite(np.asarray(logits)).all()


def test_bytes_per_token_halve():
    """A 16-bit cache row of ``hd`` values takes ``2 hd`` bytes, a quantized one ``hd + 4``
    (its float32 scale): for a 128-wide head, 0.52 of the bytes, so 1.94x the tokens."""
    config = dataclasses.replace(DENSE, head_dim=128)
    model = D.DenseModel(config, jnp.bfloat16, scan_layers=False)
    rows = config.num_hidden_layers * config.num_key_value_heads * 2  # k and v
    assert kv_quant.cache_bytes_per_token(model) == rows * 128 * 2
    for kv_dtype in KV_DTYPES:
        quantized = kv_quant.cache_bytes_per_token(model, kv_dtype)
        assert quantized == rows * (128 + 4)
        assert quantized == kv_quant.cache_bytes_per_token(
            dataclasses.replace(model, kv_dtype=kv_dtype))
        assert quantized / kv_quant.cache_bytes_per_token(model) < 0.52
    # Every family: the position-indexed buffers shrink likewise (Gemma 4's rings are of
    # fixed size and do not count).
    for model, _ in (_qwen35(None), _gemma4(None)):
        model = dataclasses.replace(model, dtype=jnp.bfloat16)
        base = kv_quant.cache_bytes_per_token(model)
        assert base > 0 and kv_quant.cache_bytes_per_token(model, "int8") < 0.7 * base


# -- the models -------------------------------------------------------------------------------


def _dense(kv_dtype, dtype=jnp.bfloat16, plan=None):
    model = D.DenseModel(DENSE, dtype, scan_layers=False, plan=plan or backend_plan(True),
                         kv_dtype=kv_dtype)
    params = D.DenseModel(DENSE, dtype).init_params(jax.random.PRNGKey(2))
    return model, D.unstack_layers(params)


def _qwen35(kv_dtype):
    config = QWEN35
    model = dataclasses.replace(Q.FAMILY.build(config, jnp.float32, "list"), kv_dtype=kv_dtype)
    return model, model.init_params(jax.random.PRNGKey(4))


def _gemma4(kv_dtype):
    config = GC.Gemma4Config.from_hf_dict(dict(
        model_type="gemma4_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
        num_hidden_layers=3, layer_types=[GC.SLIDING, GC.FULL, GC.SLIDING],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        sliding_window=3, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
        initializer_range=0.1))
    model = G.Gemma4Model(config, jnp.float32, ring_margin=8, kv_dtype=kv_dtype)
    return model, model.init_params(jax.random.PRNGKey(3))


FAMILIES = {"dense": _dense, "qwen3_5": _qwen35, "gemma4": _gemma4}
PRODUCERS = {
    (family, kv_dtype): BlockProducer(*FAMILIES[family](kv_dtype), capacity=48, width=4,
                                      steps_per_call=4, donate=True)
    for family in FAMILIES for kv_dtype in KV_DTYPES
}
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)


@pytest.fixture(params=sorted(PRODUCERS), ids=lambda k: f"{k[0]}-{k[1]}")
def producer(request):
    return PRODUCERS[request.param]


def test_the_cache_is_stored_quantized(producer):
    state = producer.prefill_chunk(producer.init_state(), PROMPT[:5], 0)[1]
    stored = kv_quant.stored_dtype(producer.model.kv_dtype, producer.model.dtype)
    leaves = jax.tree_util.tree_leaves_with_path(state.cache)
    kv = [leaf for path, leaf in leaves if leaf.ndim >= 3 and leaf.dtype == stored]
    scales = [leaf for path, leaf in leaves if "scale" in jax.tree_util.keystr(path)]
    assert kv and len(scales) == len(kv)
    assert all(s.dtype == jnp.float32 and s.shape == k.shape[:-1]
               for s, k in zip(scales, kv, strict=True))


@settings(max_examples=3, deadline=None)
@given(prompt=tokens, cuts=st.lists(st.integers(1, 19), max_size=3))
def test_chunked_equals_sequential(producer, prompt, cuts):
    C.check_chunked_matches_sequential(producer, prompt, cuts)


@settings(max_examples=3, deadline=None)
@given(prefix=tokens, feed=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4))
def test_verify_rows_equal_decode(producer, prefix, feed):
    C.check_verify_matches_decode(producer, prefix, feed)


def test_reuse_equals_fresh_and_rollback_restores(producer):
    C.check_reuse_matches_fresh(producer, PROMPT[:10], [5, 6], [*PROMPT[:7], 9, 2])
    C.check_rollback_restores(producer, [("chunk", PROMPT[:5])], [("verify", PROMPT[5:8])], 3)


@pytest.mark.parametrize("control", ["chunk_logits_bit", "verify_row_bit", "rollback_off_by_one"])
def test_controls_are_caught(control):
    from tests.testing.test_conformance_toy import CHECKS

    p = PRODUCERS[("dense", "int8")]
    CHECKS[control](p)
    with pytest.raises(C.ConformanceError):
        CHECKS[control](C.perturbed(p, control))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_dense_widths_agree(kv_dtype):
    model, params = _dense(kv_dtype)
    decoder, prefiller = (BlockProducer(model, params, capacity=64, width=w, steps_per_call=2)
                          for w in (1, 16))
    C.check_widths_agree(decoder, prefiller, PROMPT, [7, 9], [12, 45, 3, 60])


def test_control_widths_check_fails_across_kv_dtypes():
    """The width check can fail: an int8-cache decoder against an fp8-cache prefiller."""
    decoder = BlockProducer(*_dense("int8"), capacity=64, width=1, steps_per_call=2)
    prefiller = BlockProducer(*_dense("fp8"), capacity=64, width=16, steps_per_call=2)
    with pytest.raises(C.ConformanceError):
        C.check_widths_agree(decoder, prefiller, PROMPT, [7, 9], [12, 45, 3, 60])


#: How far a tiny model's logits with a quantized cache may stray from the same weights'
#: with a float32 cache (the largest difference over the prompt, relative to the largest
#: logit): int8 rounds each cached value to 1/254 of its row's range, fp8 keeps 3 mantissa
#: bits.
DRIFT = {"int8": 0.05, "fp8": 0.15}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_near_the_unquantized_cache_not_equal(family, kv_dtype):
    def build(kv):
        made = FAMILIES[family](kv)
        if family == "dense":
            made = _dense(kv, dtype=jnp.float32)
        return BlockProducer(*made, capacity=48, width=4, steps_per_call=4)

    a, b = _logits(build(None)), _logits(build(kv_dtype))
    gap = np.abs(a - b).max() / np.abs(a).max()
    assert 0 < gap <= DRIFT[kv_dtype], gap
