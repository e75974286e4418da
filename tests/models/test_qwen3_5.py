"""The Qwen3.5 / Qwen3-Next family: parity with transformers, the block program's bitwise
guarantees, and config parsing.

Parity (CPU, float32): a tiny random ``Qwen3_5ForCausalLM`` and a dense ``Qwen3NextForCausalLM``
(norm weights and biases randomised so they count) are converted through the family
declaration alone (``convert``: ``HFTensor.to_ours`` over ``FAMILY.hf_tensors``); ``forward``,
the block program's rows (``verify`` and ``prefill_chunk``) and the trunk's ``hidden`` tape
agree with the reference within ``ATOL = 1e-4`` (measured about 1e-5), and 10 greedy tokens equal
``generate(do_sample=False)``. A nudged weight shows the tolerance can fail.

Bitwise (on the same compiled programs, with hypothesis choosing the data): token by token ==
chunked, verify rows == decode, rollback, rollback_retaining from the tape, reuse == fresh;
each with a control that must fail. The ``qwen3_5_text`` case's model records tap rows (for a
block drafter), so each of those checks covers them as state too.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from turbospark_jax.core.kv_prefix import reusable_prefix
from turbospark_jax.core.state import live_equal
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.io.loading import load_folder
from turbospark_jax.io.saving import save_folder
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.testing import conformance as C

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB, SEQ, PROMPT, NEW_TOKENS = 64, 13, 9, 10
L, F = QC.LINEAR, QC.FULL
WIDTH, CAPACITY = 4, 48

_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=3,
    layer_types=[L, F, L], initializer_range=0.1,  # sharp logits: no near-ties in argmax
)


pytestmark = pytest.mark.usefixtures("full_precision_products")


CASES: dict[str, dict[str, Any]] = {
    "qwen3_5_text": dict(_BASE),
    # Fused projections, tied head, attention biases, half the head rotated, a 3-wide conv.
    "qwen3_next": dict(_BASE, tie_word_embeddings=True, attention_bias=True,
                       linear_conv_kernel_dim=3, rope_parameters={
                           "rope_type": "default", "rope_theta": 500.0,
                           "partial_rotary_factor": 0.5}),
}

#: The cases whose model records tap rows (a full and a DeltaNet layer): every bitwise check
#: below then covers the tap rows too (append-only state, compared up to the cursor).
TAPPED: dict[str, tuple[int, ...]] = {"qwen3_5_text": (1, 2)}


def hf_model(name: str) -> tuple[Any, QC.Qwen35Config]:
    if name == "qwen3_5_text":
        hf_config = transformers.Qwen3_5TextConfig(**CASES[name])
        hf = transformers.Qwen3_5ForCausalLM(hf_config)
    else:
        hf_config = transformers.Qwen3NextConfig(**CASES[name], num_experts=0)
        hf = transformers.Qwen3NextForCausalLM(hf_config)
    hf = hf.float().eval()
    hf.config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif n.endswith("bias") and "linear_attn" not in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return hf, Q.FAMILY.parse_config(hf_config.to_dict())


def state_dict(hf: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in hf.state_dict().items()}


def convert(config: QC.Qwen35Config, tensors: dict[str, np.ndarray]) -> Q.Params:
    """Hugging Face tensors by name as our params, through the family declaration alone, the
    DeltaNet projections then joined as loading joins them."""
    shapes = Q.param_shapes(config)
    params = jax.tree.map(lambda s: None, shapes, is_leaf=lambda x: isinstance(x, tuple))
    for t in Q.FAMILY.hf_tensors(config):
        assert tensors[t.name].shape == t.hf_shape, (t.name, tensors[t.name].shape)
        node, leaf = params, shapes
        for k in t.key[:-1]:
            node, leaf = node[k], leaf[k]
        node[t.key[-1]] = jnp.asarray(t.to_ours(tensors[t.name], leaf[t.key[-1]]))
    return Q.FAMILY.join_params(config, params)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> Any:
    torch.manual_seed(0)
    hf, config = hf_model(request.param)
    model = Q.FAMILY.build(config, jnp.float32, "list")
    if request.param in TAPPED:
        model = dataclasses.replace(model, tap_layers=TAPPED[request.param])
    params = convert(config, state_dict(hf))
    producer = BlockProducer(model, params, capacity=CAPACITY, width=WIDTH, steps_per_call=4)
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(2, SEQ))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(tokens), output_hidden_states=True)
    return request.param, hf, model, params, producer, tokens, out


_forward = jax.jit(Q.Qwen35Model.forward, static_argnums=0)


# -- parity with transformers ------------------------------------------------------------------


def test_config_and_tensor_names_match_transformers(case: Any) -> None:
    name, hf, model, *_ = case
    c = model.config
    assert (c.model_type, c.layer_types, c.fused) == (name, (L, F, L), name == "qwen3_next")
    if name == "qwen3_next":
        assert (c.rope_theta, c.rotary_dim, c.linear_conv_kernel_dim) == (500.0, 8, 3)
    ours = {t.name: t.hf_shape for t in Q.FAMILY.hf_tensors(model.config)}
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if model.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")  # saved folders leave the tied copy out
    assert ours == theirs


def test_forward_matches_transformers(case: Any) -> None:
    name, _, model, params, _, tokens, out = case
    got = np.asarray(_forward(model, params, jnp.asarray(tokens, jnp.int32)))
    err = float(np.abs(got - out.logits.numpy()).max())
    print(f"{name}: forward max abs diff {err:.2e}")
    assert err < ATOL


def test_forward_matches_transformers_past_one_chunk(case: Any) -> None:
    """80 rows: transformers' prefill runs its chunked delta rule over two 64-row chunks."""
    name, hf, model, params, *_ = case
    if name != "qwen3_5_text":
        pytest.skip("one case is enough for the length (each length is a compile)")
    tokens = np.random.default_rng(3).integers(0, VOCAB, size=(1, 80))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens)).logits.numpy()
    got = np.asarray(_forward(model, params, jnp.asarray(tokens, jnp.int32)))
    err = float(np.abs(got - ref).max())
    print(f"{name}: forward over 80 rows max abs diff {err:.2e}")
    assert err < ATOL


def test_block_program_matches_transformers(case: Any) -> None:
    """verify over the first two blocks (rows), prefill_chunk's last row, the hidden tape."""
    name, _, _, _, producer, tokens, out = case
    ref = out.logits.numpy()
    rows, state = producer.verify(producer.init_state(), list(tokens[0, : 2 * WIDTH]), 0)
    last, _ = producer.prefill_chunk(producer.init_state(), list(tokens[1]), 0)
    err = float(np.abs(np.asarray(rows) - ref[0, : 2 * WIDTH]).max())
    err_last = float(np.abs(np.asarray(last) - ref[1, -1]).max())
    hidden = out.hidden_states[-1].numpy()[0, WIDTH : 2 * WIDTH]  # after the final norm
    err_hidden = float(np.abs(np.asarray(state.cache.hidden[:WIDTH]) - hidden).max())
    print(f"{name}: verify {err:.2e}, prefill_chunk {err_last:.2e}, hidden {err_hidden:.2e}")
    assert max(err, err_last, err_hidden) < ATOL
    if name in TAPPED:  # tap layer 1's rows are the reference's hidden_states[2] (unnormed)
        assert TAPPED[name][0] == 1
        taps = np.asarray(state.cache.taps[: 2 * WIDTH, 0])
        assert float(np.abs(taps - out.hidden_states[2].numpy()[0, : 2 * WIDTH]).max()) < ATOL


def test_greedy_continuation_matches_generate(case: Any) -> None:
    _, hf, _, _, producer, tokens, _ = case
    prompt = [int(t) for t in tokens[0, :PROMPT]]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    logits, state = producer.prefill_chunk(producer.init_state(), prompt, 0)
    got = []
    for position in range(PROMPT, PROMPT + NEW_TOKENS):
        got.append(int(jnp.argmax(logits)))
        logits, state = producer.produce(state, got[-1], position)
    assert got == out[0, PROMPT:].tolist()


def test_parity_check_can_fail(case: Any) -> None:
    """Control: nudging one DeltaNet weight moves the logits past the tolerance."""
    _, _, model, params, _, tokens, out = case
    layers = [dict(lp) for lp in params["layers"]]
    layers[0]["A_log"] = layers[0]["A_log"].at[0].add(0.5)
    got = np.asarray(_forward(model, {**params, "layers": layers},
                              jnp.asarray(tokens, jnp.int32)))
    assert float(np.abs(got - out.logits.numpy()).max()) > ATOL


def test_projections_are_joined_and_part_again_for_a_folder(case: Any, tmp_path: Any) -> None:
    """The DeltaNet input projections run as one ``in_proj``; saving parts them again (the
    folder has transformers' tensors, bitwise) and loading joins them again; the same params
    with the parts apart (how a quantized or tensor-parallel model runs them) agree."""
    _, hf, model, params, producer, tokens, _ = case
    layer = params["layers"][0]
    parts = Q.projection_parts(model.config)
    assert "in_proj" in layer and not set(parts) & set(layer)
    assert layer["in_proj"].shape == (32, model.config.conv_dim + 4 * 8 + 2 * 4)
    save_folder(tmp_path, model.config, params)
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        theirs, names = state_dict(hf), set(f.keys())
        assert names == {t.name for t in Q.FAMILY.hf_tensors(model.config)}
        assert all(np.array_equal(f.get_tensor(k), theirs[k]) for k in names)
    loaded = load_folder(tmp_path, layer_layout="list")
    assert jax.tree.all(jax.tree.map(np.array_equal, loaded.params, params))
    apart = Q.split_projections(model.config, params)
    assert set(parts) <= set(apart["layers"][0]) and "in_proj" not in apart["layers"][0]
    assert jax.tree.all(jax.tree.map(np.array_equal, Q.join_projections(model.config, apart),
                                     params))
    split = BlockProducer(model, apart, capacity=CAPACITY, width=WIDTH, steps_per_call=4)
    prompt = [int(t) for t in tokens[0, :PROMPT]]
    want, _ = producer.prefill_chunk(producer.init_state(), prompt, 0)
    got, _ = split.prefill_chunk(split.init_state(), prompt, 0)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_multimodal_folder_loads_the_text_decoder() -> None:
    """A ``qwen3_5`` folder: the text decoder under model.language_model., the outer tie
    flag, the vision tower tolerated."""
    text = {k: v for k, v in CASES["qwen3_5_text"].items()}
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
    hf_config = transformers.Qwen3_5Config(text_config=text, vision_config=vision,
                                           tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(hf_config).float().eval()
    config = Q.FAMILY.parse_config(hf_config.to_dict())
    assert config.model_type == "qwen3_5" and config.tie_word_embeddings
    tensors = state_dict(hf)
    names = {t.name for t in Q.FAMILY.hf_tensors(config)}
    assert set(tensors) - names == {"lm_head.weight"} | {n for n in tensors if "visual" in n}
    assert all(Q.FAMILY.tolerated(n) for n in tensors if "visual" in n)
    params = convert(config, tensors)
    tokens = np.random.default_rng(2).integers(0, VOCAB, size=(1, 7))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens)).logits.numpy()
    got = np.asarray(_forward(Q.Qwen35Model(config), params, jnp.asarray(tokens, jnp.int32)))
    assert float(np.abs(got - ref).max()) < ATOL


# -- the block program's bitwise guarantees ----------------------------------------------------


@pytest.fixture(scope="module")
def producer(case: Any) -> BlockProducer:
    return case[4]


tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14)


@st.composite
def prompt_and_cuts(draw: Any) -> tuple[list[int], list[int]]:
    prompt = draw(tokens_st)
    return prompt, draw(st.lists(st.integers(1, max(1, len(prompt) - 1)), max_size=4))


@settings(max_examples=8)
@given(case=prompt_and_cuts())
def test_chunked_equals_token_by_token(producer: BlockProducer, case: Any) -> None:
    C.check_chunked_matches_sequential(producer, *case)


@settings(max_examples=6)
@given(prefix=tokens_st, feed=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
def test_verify_rows_equal_decode(producer: BlockProducer, prefix: list[int],
                                  feed: list[int]) -> None:
    C.check_verify_matches_decode(producer, prefix, feed)


ops = st.lists(st.one_of(
    st.tuples(st.just("produce"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=1)),
    st.tuples(st.just("chunk"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)),
    st.tuples(st.just("verify"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)),
), max_size=3)


@settings(max_examples=6)
@given(before=ops, after=ops, probe=st.integers(0, VOCAB - 1))
def test_rollback_restores(producer: BlockProducer, before: Any, after: Any, probe: int) -> None:
    C.check_rollback_restores(producer, before, after, probe)


@settings(max_examples=6)
@given(prefix=tokens_st, feed=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=WIDTH),
       keep=st.integers(0, WIDTH))
def test_rollback_retaining_equals_decoding_the_kept_rows(
    producer: BlockProducer, prefix: list[int], feed: list[int], keep: int
) -> None:
    """Keeping ``keep`` rows of a verify (states read off the tape) leaves what decoding those
    rows from the checkpoint leaves, bitwise; the hidden tape's kept row is decode's."""
    keep = min(keep, len(feed))
    retained = C.check_rollback_retaining_matches_decode(producer, prefix, feed, keep, 5)
    if keep:
        _, state = producer.prefill_chunk(producer.init_state(), prefix, 0)
        for i, tok in enumerate(feed[:keep - 1]):
            _, state = producer.produce(state, tok, len(prefix) + i)
        _, last = producer.produce(state, feed[keep - 1], len(prefix) + keep - 1)
        assert np.array_equal(retained.cache.hidden[keep - 1], last.cache.hidden[0])


@settings(max_examples=6)
@given(first=tokens_st, generated=st.lists(st.integers(0, VOCAB - 1), max_size=3),
       tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), extend=st.booleans())
def test_reuse_equals_fresh(producer: BlockProducer, first: list[int], generated: list[int],
                            tail: list[int], extend: bool) -> None:
    second = (first + generated if extend else first[:1]) + tail
    n = C.check_reuse_matches_fresh(producer, first, generated, second)
    # Recurrent leaves: the whole record when the prompt extends it, else nothing.
    assert n == reusable_prefix(first + generated, None, second, rewindable=False)


PROMPT_IDS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
CONTROL_CHECKS = {
    "chunk_logits_bit": lambda p: C.check_chunked_matches_sequential(p, PROMPT_IDS, [2, 7]),
    "chunk_skips_position": lambda p: C.check_chunked_matches_sequential(p, PROMPT_IDS, [2, 7]),
    "prefill_corrupts_state": lambda p: C.check_prefill_matches_produce(p, PROMPT_IDS[:4]),
    "verify_row_bit": lambda p: C.check_verify_matches_decode(p, PROMPT_IDS[:4],
                                                              PROMPT_IDS[4:8]),
    "rollback_off_by_one": lambda p: C.check_rollback_restores(
        p, [("chunk", PROMPT_IDS[:5])], [("verify", PROMPT_IDS[5:8])], 3),
    "reuse_claims_one_more": lambda p: C.check_reuse_matches_fresh(
        p, PROMPT_IDS, [7], [*PROMPT_IDS, 7, 8]),
}


@pytest.mark.parametrize("control", sorted(C.CONTROLS))
def test_every_check_catches_its_control(producer: BlockProducer, control: str) -> None:
    CONTROL_CHECKS[control](producer)  # the honest producer passes
    with pytest.raises(C.ConformanceError):
        CONTROL_CHECKS[control](C.perturbed(producer, control))


def test_state_comparison_sees_one_bit_of_recurrent_state(producer: BlockProducer) -> None:
    """Control for the state half of the bitwise checks: the recurrent and conv leaves are
    compared (only the tapes are scratch), so one flipped bit in either is a difference."""
    _, state = producer.prefill_chunk(producer.init_state(), PROMPT_IDS, 0)
    cache = state.cache
    for field in ("recurrent", "conv"):
        leaves = list(getattr(cache, field))
        flat = np.array(leaves[-1]).reshape(-1)
        flat[:1] = (flat[:1].view(np.uint32) ^ np.uint32(1)).view(np.float32)
        leaves[-1] = jnp.asarray(flat.reshape(leaves[-1].shape))
        bad = state.replace(cache=cache.replace(**{field: tuple(leaves)}))
        assert live_equal(state, state) and not live_equal(bad, state)
    tape = cache.replace(recurrent_tape=tuple(t + 1 for t in cache.recurrent_tape))
    assert live_equal(state.replace(cache=tape), state)


# -- tap rows (what a block drafter reads) -------------------------------------------------------


def _tapped(case: Any) -> tuple[Q.Qwen35Model, Q.Params, BlockProducer]:
    name, _, model, params, producer, *_ = case
    if name not in TAPPED:
        pytest.skip("the tapped case covers the tap rows")
    return model, params, producer


def test_state_comparison_sees_one_bit_of_a_live_tap_row(case: Any) -> None:
    """Control for the tap half of the bitwise checks above: one flipped bit in a live tap row
    is a difference; a row past the cursor is dead, so changing it is not."""
    _, _, producer = _tapped(case)
    _, state = producer.prefill_chunk(producer.init_state(), PROMPT_IDS, 0)
    taps = np.array(state.cache.taps)
    flipped = taps.copy()
    flipped[len(PROMPT_IDS) - 1, -1, :1] = (
        flipped[len(PROMPT_IDS) - 1, -1, :1].view(np.uint32) ^ np.uint32(1)).view(np.float32)
    dead = taps.copy()
    dead[len(PROMPT_IDS)] += 1.0

    def with_taps(t: np.ndarray) -> Any:
        return state.replace(cache=state.cache.replace(taps=jnp.asarray(t)))

    assert not live_equal(with_taps(flipped), state)
    assert live_equal(with_taps(dead), state)


def test_forward_taps_are_the_recorded_rows(case: Any) -> None:
    """The training pass (chunked delta rule) gives the tap rows the block program records,
    within the parallel tolerance, and the logits of ``train_forward``."""
    model, params, producer = _tapped(case)
    _, state = producer.prefill_chunk(producer.init_state(), PROMPT_IDS, 0)
    logits, taps = jax.jit(model.forward_taps)(params, jnp.asarray([PROMPT_IDS], jnp.int32))
    assert taps.shape == (1, len(PROMPT_IDS), len(model.tap_layers), model.config.hidden_size)
    assert np.allclose(taps[0], state.cache.taps[: len(PROMPT_IDS)], atol=PARALLEL_ATOL)
    want, _ = jax.jit(model.train_forward)(params, jnp.asarray([PROMPT_IDS], jnp.int32))
    assert np.array_equal(np.asarray(logits), np.asarray(want))


def test_tap_settings_are_checked(case: Any) -> None:
    model, params, _ = _tapped(case)
    untapped = dataclasses.replace(model, tap_layers=())
    assert not hasattr(untapped.init_cache(4), "taps")
    with pytest.raises(BadInputError, match="tap_layers"):
        untapped.forward_taps(params, jnp.zeros((1, 2), jnp.int32))
    for bad in ((0, 3), (2, 1), [0], (True,)):
        with pytest.raises(BadInputError, match="tap_layers"):
            dataclasses.replace(model, tap_layers=bad)


# -- config.json ---------------------------------------------------------------------------------


def test_config_round_trips_through_transformers() -> None:
    classes = {"qwen3_5_text": transformers.Qwen3_5TextConfig,
               "qwen3_next": transformers.Qwen3NextConfig, "qwen3_5": transformers.Qwen3_5Config}
    for model_type, cls in classes.items():
        ours = QC.Qwen35Config(model_type=model_type, num_hidden_layers=6,
                               layer_types=(L, L, F, L, F, L), mtp_num_hidden_layers=1,
                               eos_token_id=(1, 2), tie_word_embeddings=True, rope_theta=1e6)
        theirs = cls(**ours.to_hf_dict()).to_dict()
        assert Q.FAMILY.parse_config(theirs) == ours
        assert Q.FAMILY.parse_config(ours.to_hf_dict()) == ours


def test_defaults_and_legacy_keys_mirror_transformers() -> None:
    sparse = {"model_type": "qwen3_next", "num_experts": 0, "num_hidden_layers": 8,
              "full_attention_interval": 2, "rope_theta": 1e7, "partial_rotary_factor": 0.5}
    ours = Q.FAMILY.parse_config(sparse)
    theirs = transformers.Qwen3NextConfig(**sparse)
    assert ours.layer_types == tuple(theirs.layer_types)
    assert (ours.rope_theta, ours.partial_rotary_factor) == (1e7, 0.5)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_key_value_heads",
                "head_dim", "linear_num_value_heads", "linear_conv_kernel_dim", "rms_norm_eps"):
        assert getattr(ours, key) == getattr(theirs, key), key
    text = Q.FAMILY.parse_config({"model_type": "qwen3_5_text"})
    ref = transformers.Qwen3_5TextConfig()
    assert text.layer_types == tuple(ref.layer_types) and text.vocab_size == ref.vocab_size
    assert text.partial_rotary_factor == ref.rope_parameters["partial_rotary_factor"]


@pytest.mark.parametrize("config, sparse", [
    ({"model_type": "qwen3_next", "num_hidden_layers": 4}, (True,) * 4),  # 512 experts
    ({"model_type": "qwen3_next", "num_experts": 4, "num_experts_per_tok": 2,
      "mlp_only_layers": [0, 2],
      "num_hidden_layers": 4}, (False, True, False, True)),
    ({"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": 4}}, (True,) * 4),
    ({"model_type": "qwen3_5_moe_text", "num_hidden_layers": 4}, (True,) * 4),
])
def test_moe_configs_load(config: dict[str, Any], sparse: tuple[bool, ...]) -> None:
    """The mixture-of-experts forms parse (tests/models/test_moe_qwen3_5.py runs them)."""
    assert Q.FAMILY.parse_config(config).sparse_layers == sparse


@pytest.mark.parametrize("config, key", [
    ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_moe_text"}},
     "model_type"),
    ({"model_type": "qwen3_5_text", "num_experts": 8}, "num_experts"),
])
def test_experts_outside_the_moe_types_are_refused(config: dict[str, Any], key: str) -> None:
    with pytest.raises(ModelLoadError, match=key):
        Q.FAMILY.parse_config(config)


def test_dense_qwen3_next_with_every_layer_listed_as_mlp_only_is_accepted() -> None:
    config = Q.FAMILY.parse_config({"model_type": "qwen3_next", "num_experts": 4,
                                    "num_hidden_layers": 2, "mlp_only_layers": [0, 1]})
    assert config.layer_types == (L, L)


@pytest.mark.parametrize("key, value", [
    ("hidden_size", "32"), ("hidden_size", 0), ("num_hidden_layers", True),
    ("rms_norm_eps", "tiny"), ("tie_word_embeddings", 1), ("layer_types", [L, F]),
    ("layer_types", ["linear_attention", "sliding_attention", F, F]), ("layer_types", "all"),
    ("full_attention_interval", 0), ("hidden_act", "gelu"), ("num_key_value_heads", 3),
    ("linear_num_key_heads", 3), ("partial_rotary_factor", 0.1), ("partial_rotary_factor", "1"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0}), ("rope_parameters", [1]),
    ("rope_scaling", {"type": "linear", "factor": 2.0}), ("mtp_num_hidden_layers", -1),
    ("mtp_use_dedicated_embeddings", True), ("attn_output_gate", False),
    ("eos_token_id", "2"), ("text_config", "x"), ("linear_conv_kernel_dim", 0),
])
def test_malformed_values_name_their_key(key: str, value: Any) -> None:
    config = {"model_type": "qwen3_5" if key == "text_config" else "qwen3_5_text",
              "num_hidden_layers": 4, key: value}
    with pytest.raises(ModelLoadError, match=re.escape(key)):
        Q.FAMILY.parse_config(config)


def test_wrong_model_type_and_layout_are_refused() -> None:
    with pytest.raises(ModelLoadError, match="llama"):
        Q.FAMILY.parse_config({"model_type": "llama"})
    with pytest.raises(ModelLoadError, match="layer_layout"):
        Q.FAMILY.build(QC.Qwen35Config(num_hidden_layers=4), jnp.float32, "stacked")


# -- parallel prefill (the chunked delta rule) ---------------------------------------------------

#: The parallel prefill's last-row logits against the exact path's (float32; measured ~1e-6).
PARALLEL_ATOL = 1e-4


@pytest.mark.parametrize("start", [0, 5])
def test_parallel_prefill_is_close_and_continues_alike(case: Any, start: int) -> None:
    """Fresh (one pass over the prompt) and continued (passes of ``chunk`` rows after a prefix)
    parallel prefills agree with the exact path within the tolerance, leave states within it,
    and greedy decoding after them picks the same tokens."""
    _, _, model, _, producer, tokens, _ = case
    prompt = [int(t) for t in tokens[0]]
    exact_logits, exact = producer.prefill_chunk(producer.init_state(), prompt, 0)
    state = producer.init_state()
    if start:
        _, state = producer.prefill_chunk(state, prompt[:start], 0)
    logits, fast = producer.prefill_parallel(state, prompt[start:], start, chunk=4)
    assert float(np.abs(np.asarray(logits) - np.asarray(exact_logits)).max()) < PARALLEL_ATOL
    for a, b in zip(exact.cache.recurrent, fast.cache.recurrent, strict=True):
        assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) < PARALLEL_ATOL
    assert np.array_equal(np.asarray(exact.fed.ids), np.asarray(fast.fed.ids))
    if model.config.mtp_num_hidden_layers:
        assert np.allclose(exact.cache.hidden_rows, fast.cache.hidden_rows, atol=PARALLEL_ATOL)
    if model.tap_layers:  # the parallel passes record every row's taps too
        assert np.allclose(exact.cache.taps[: len(prompt)], fast.cache.taps[: len(prompt)],
                           atol=PARALLEL_ATOL)
    tok_a, tok_b = int(np.argmax(exact_logits)), int(np.argmax(logits))
    assert tok_a == tok_b
    for position in range(len(prompt), len(prompt) + 4):
        la, exact = producer.produce(exact, tok_a, position)
        lb, fast = producer.produce(fast, tok_b, position)
        tok_a, tok_b = int(np.argmax(la)), int(np.argmax(lb))
        assert tok_a == tok_b
