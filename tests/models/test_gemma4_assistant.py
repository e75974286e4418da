"""Parity of the Gemma 4 assistant drafter with transformers' ``Gemma4AssistantForCausalLM``
(CPU, float32, tiny random configs).

The reference side replays its candidate generator's first round: the target runs over a
12-token prompt (returning its hidden states and shared K/V), then the assistant drafts 4
tokens greedily from the target's next token and last hidden state. Ours feeds the prompt to a
target whose sliding ring (window 3, margin 8) has wrapped, takes the hidden state from
``Gemma4Model.block_hidden`` and drafts with :func:`draft_greedy`. Drafted logits agree within
``ATOL = 1e-4`` (measured ~1e-5 plain, ~2.5e-5 with centroids) and the tokens are equal; a nudged
weight is caught. Checked by hand: a sliding window of ``w`` or ``w + 2`` rows instead of
``w + 1`` moves the logits by more than 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.models.test_gemma4_parity import _BASE, CASES, VOCAB, convert, randomise  # noqa: E402
from turbospark_jax.errors import BadInputError, ModelLoadError  # noqa: E402
from turbospark_jax.models.gemma4 import assistant as A  # noqa: E402
from turbospark_jax.models.gemma4 import config as GC  # noqa: E402
from turbospark_jax.models.gemma4 import model as G  # noqa: E402
from turbospark_jax.speculative.drafters.gemma4_assistant import (  # noqa: E402
    Gemma4AssistantDrafter,
)

ATOL = 1e-4
PROMPT, STEPS = 12, 4
S, F = GC.SLIDING, GC.FULL
ASSISTANT_TEXT = dict(
    vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
    layer_types=[S, S, F], num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    global_head_dim=16, sliding_window=4, hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=0, initializer_range=0.1,
)
ASSISTANTS = {
    "tied": dict(use_ordered_embeddings=False),
    "centroids_untied": dict(use_ordered_embeddings=True, num_centroids=8,
                             centroid_intermediate_top_k=2, tie_word_embeddings=False),
}


def _assistant(name: str) -> tuple[Any, A.AssistantConfig, Any]:
    text = transformers.Gemma4TextConfig(**ASSISTANT_TEXT)
    hf_config = transformers.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=32,
                                                   **ASSISTANTS[name])
    torch.manual_seed(1)
    hf = transformers.Gemma4AssistantForCausalLM(hf_config).float().eval()
    hf.config._attn_implementation = hf.model.config._attn_implementation = "eager"
    randomise(hf, 4)
    if hf_config.use_ordered_embeddings:
        order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            hf.masked_embedding.token_ordering.copy_(order)
    config = A.AssistantConfig.from_hf_dict(hf_config.to_dict())
    state = hf.state_dict()
    shapes = A.param_shapes(config)
    params = jax.tree.map(lambda s: None, shapes, is_leaf=lambda x: isinstance(x, tuple))
    for t in A.hf_tensors(config):
        array = state[t.name].numpy()
        assert array.shape == t.hf_shape, (t.name, array.shape, t.hf_shape)
        node, leaf = params, shapes
        for k in t.key[:-1]:
            node, leaf = node[k], leaf[k]
        ours = t.to_ours(array, leaf[t.key[-1]])
        node[t.key[-1]] = jnp.asarray(ours.astype(np.int32) if ours.dtype == np.int64 else ours)
    assert set(state) - {t.name for t in A.hf_tensors(config)} <= {"lm_head.weight"}
    return hf, config, params


@pytest.fixture(scope="module")
def target() -> Any:
    text = transformers.Gemma4TextConfig(**{**_BASE, **CASES["ple_shared_wide_softcap"]})
    torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(text).float().eval()
    hf.config._attn_implementation = "eager"
    randomise(hf, 3)
    config = GC.Gemma4Config.from_hf_dict(text.to_dict())
    model = G.Gemma4Model(config, ring_margin=8)
    params = convert(config, hf.state_dict())
    prompt = np.random.default_rng(1).integers(0, VOCAB, PROMPT)
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(prompt[None]), output_hidden_states=True,
                 return_shared_kv_states=True)
    hidden = jax.jit(G.Gemma4Model.block_hidden, static_argnums=0)
    cache = model.init_cache(32)
    with jax.default_matmul_precision("highest"):
        for a, b in ((0, 8), (8, PROMPT)):  # blocks of at most ring_margin + 1 rows
            h, cache = hidden(model, params, cache, jnp.asarray(prompt[a:b], jnp.int32),
                              jnp.arange(a, b, dtype=jnp.int32), jnp.int32(b - a))
        first = jnp.argmax(model.forward(params, jnp.asarray(prompt[None], jnp.int32))[0, -1])
    assert model.reach(cache) > model.ring_slots  # the ring has wrapped
    return hf, out, model, params, cache, int(first), h[-1]


def _reference(hf_target: Any, out: Any, hf: Any) -> tuple[list[int], np.ndarray]:
    """transformers' candidate generator, first round."""
    hidden = out.hidden_states[-1][:, -1:]
    token = out.logits[:, -1:].argmax(-1)
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(STEPS):
            embeds = torch.cat([hf_target.get_input_embeddings()(token), hidden], dim=-1)
            o = hf(inputs_embeds=embeds, position_ids=torch.tensor([[PROMPT]]),
                   shared_kv_states=out.shared_kv_states, attention_mask=None)
            token, hidden = o.logits.argmax(-1), o.last_hidden_state
            tokens.append(int(token))
            logits.append(o.logits[0, 0].numpy())
    return tokens, np.stack(logits)


@pytest.mark.parametrize("name", sorted(ASSISTANTS))
def test_drafts_match_transformers(target: Any, name: str) -> None:
    hf_target, out, model, params, cache, first, hidden = target
    hf, config, aparams = _assistant(name)
    want_tokens, want_logits = _reference(hf_target, out, hf)
    with jax.default_matmul_precision("highest"):
        tokens, logits = A.draft_greedy(config, aparams, model, params, cache, jnp.int32(first),
                                        hidden, jnp.int32(PROMPT), STEPS)
        nudged = dict(aparams, pre_projection=aparams["pre_projection"].at[0, 0].add(0.5))
        _, control = A.draft_greedy(config, nudged, model, params, cache, jnp.int32(first),
                                    hidden, jnp.int32(PROMPT), STEPS)
    err = float(np.abs(np.asarray(logits) - want_logits).max())
    print(f"assistant {name}: max abs logit diff {err:.2e}")
    assert err < ATOL
    assert [int(t) for t in tokens] == want_tokens
    assert float(np.abs(np.asarray(control) - want_logits).max()) > ATOL


def test_assistant_config_refusals(target: Any) -> None:
    base = {"model_type": "gemma4_assistant", "backbone_hidden_size": 32,
            "text_config": ASSISTANT_TEXT}
    assert A.AssistantConfig.from_hf_dict(base).text.reads_target_kv
    bad = {
        "hidden_size_per_layer_input": {"text_config": {**ASSISTANT_TEXT,
                                                        "hidden_size_per_layer_input": 8}},
        "num_kv_shared_layers": {"text_config": {**ASSISTANT_TEXT, "num_kv_shared_layers": 1}},
        "num_centroids": {"use_ordered_embeddings": True, "num_centroids": 7},
        "use_ordered_embeddings": {"use_ordered_embeddings": 1},
        "model_type": {"model_type": "gemma4_text"},
    }
    for key, change in bad.items():
        with pytest.raises(ModelLoadError, match=key):
            A.AssistantConfig.from_hf_dict({**base, **change})
    _, _, model, params, cache, first, hidden = target
    wrong = A.AssistantConfig.from_hf_dict(
        {**base, "text_config": {**ASSISTANT_TEXT, "head_dim": 16}})
    with pytest.raises(BadInputError, match="matching target cache"):
        A.draft_step(wrong, A.init_params(wrong, jax.random.PRNGKey(0)), model, params, cache,
                     jnp.int32(first), hidden, jnp.int32(PROMPT))


# -- paired with its target in the speculative loops ------------------------------------------


@pytest.fixture(scope="module")
def paired(target: Any) -> Any:
    from turbospark_jax.engine.producer import BlockProducer

    _, _, model, params, _, _, _ = target
    keeping = G.Gemma4Model(model.config, model.dtype, ring_margin=8, keep_hidden_rows=True)
    producer = BlockProducer(keeping, params, capacity=64, width=6, steps_per_call=8)
    _, config, aparams = _assistant("centroids_untied")
    return producer, config, aparams


@pytest.mark.parametrize("device", [True, False], ids=["device", "host"])
def test_paired_assistant_is_lossless_greedy_bit_for_bit(paired: Any, device: bool) -> None:
    from turbospark_jax import CompletionRequest, run_raw_completion
    from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
    from turbospark_jax.speculative.pair import SpeculativePair

    producer, config, aparams = paired
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, VOCAB, PROMPT)]
    request = CompletionRequest(prompt_ids=prompt, max_tokens=24, record_logits=True)
    plain = run_raw_completion(producer, request)
    pair = SpeculativePair(producer, Gemma4AssistantDrafter(producer, config, aparams),
                           device_rounds=device)
    got = run_raw_completion_speculative(pair, dataclasses.replace(request, draft_len=4))
    assert got.speculative.on_device == device
    assert got.token_ids == plain.token_ids
    assert np.array_equal(got.logits.view(np.uint32), plain.logits.view(np.uint32))
    assert got.fed_ids == plain.fed_ids


def test_paired_proposals_are_the_assistants_own(paired: Any) -> None:
    """The drafter proposes what draft_greedy (checked against transformers above) drafts
    from the target's last row."""
    producer, config, aparams = paired
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, PROMPT)]
    state = producer.prefill_chunk(producer.init_state(), prompt, 0)[1]
    pending = 5
    want, _ = A.draft_greedy(config, aparams, producer.model, producer.params, state.cache,
                             jnp.int32(pending), state.cache.hidden_rows[PROMPT - 1],
                             jnp.int32(PROMPT), 3)
    drafter = Gemma4AssistantDrafter(producer, config, aparams)
    got, _ = drafter.block((), [*prompt, pending], 3, target=state)
    assert got == [int(t) for t in want]


def test_pairing_refusals(target: Any, paired: Any) -> None:
    from turbospark_jax.engine.producer import BlockProducer

    _, _, model, params, _, _, _ = target
    producer, config, aparams = paired
    plain = BlockProducer(model, params, capacity=64, width=6)  # keeps no hidden rows
    with pytest.raises(BadInputError, match="keep_hidden_rows"):
        Gemma4AssistantDrafter(plain, config, aparams)
    with pytest.raises(BadInputError, match="target="):
        Gemma4AssistantDrafter(producer, config, aparams).block((), [1, 2], 2)


# -- under the costed oracle (benchmarks/assistant_oracle.py) ---------------------------------


def test_costed_oracle_overrules_the_assistant(paired: Any) -> None:
    """Alpha 1 proposes the reference; alpha 0 never does, proposing the assistant's own token
    where it differs from the reference and reference + 1 where it does not. The host form and
    the device form propose the same."""
    from turbospark_jax.speculative.drafters import CostedOracleDrafter

    producer, config, aparams = paired
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(0, VOCAB, PROMPT)]
    state = producer.prefill_chunk(producer.init_state(), prompt, 0)[1]
    pending, m = 5, 4
    inner = Gemma4AssistantDrafter(producer, config, aparams)
    drafted, _ = inner.block((), [*prompt, pending], m, target=state)
    ahead = [int(t) for t in rng.integers(0, VOCAB, m + 2)]
    ahead[1] = drafted[1]  # the assistant is right here: its token cannot be the wrong one
    reference = [*prompt, pending, *ahead]
    right = reference[PROMPT + 1 : PROMPT + 1 + m]
    for alpha, want in ((1.0, right),
                        (0.0, [d if d != r else (r + 1) % VOCAB
                               for d, r in zip(drafted, right, strict=True)])):
        drafter = CostedOracleDrafter(inner, reference, alpha, seed=7)
        got, _ = drafter.block((), [*prompt, pending], m, target=state)
        assert got == want
        device, params = drafter.on_device()
        proposals, q, count, after = jax.jit(device.propose)(
            params, (), state, jnp.int32(pending), jnp.int32(m), None)
        assert q is None and after == () and int(count) == m
        assert [int(t) for t in proposals[:m]] == want
    assert all(w != r for w, r in zip(want, right, strict=True))


def test_costed_oracle_assistant_is_lossless_on_the_device_loop(paired: Any) -> None:
    """Through the device rounds (greedy, no rows recorded: a loop of known trip count, the
    assistant's and the wrapper's loops bounded), every alpha reproduces plain greedy
    decoding; alpha 1 keeps every proposal and alpha 0 none."""
    from turbospark_jax import CompletionRequest, run_raw_completion
    from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
    from turbospark_jax.speculative.drafters import CostedOracleDrafter
    from turbospark_jax.speculative.pair import SpeculativePair
    from turbospark_jax.speculative.rounds import runs_fixed_rounds

    producer, config, aparams = paired
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, VOCAB, PROMPT)]
    request = CompletionRequest(prompt_ids=prompt, max_tokens=20)
    plain = run_raw_completion(producer, request)
    request = dataclasses.replace(request, draft_len=4)
    inner = Gemma4AssistantDrafter(producer, config, aparams)
    for alpha in (0.0, 0.6, 1.0):
        drafter = CostedOracleDrafter(inner, prompt + plain.token_ids, alpha)
        assert runs_fixed_rounds(drafter.on_device()[0], True, False)
        pair = SpeculativePair(producer, drafter)
        got = run_raw_completion_speculative(pair, request)
        s = got.speculative
        assert s.on_device and got.token_ids == plain.token_ids, alpha
        assert s.accepted == {0.0: 0, 1.0: s.drafted}.get(alpha, s.accepted)
        assert alpha in (0.0, 1.0) or 0 < s.accepted < s.drafted


def test_costed_oracle_refuses_a_drafter_with_state(paired: Any) -> None:
    from turbospark_jax.speculative.drafters import CostedOracleDrafter, DraftModelDrafter

    producer, _, _ = paired
    for inner in (DraftModelDrafter(producer), object()):
        with pytest.raises(BadInputError, match="keeps no state"):
            CostedOracleDrafter(inner, [1, 2], 0.5)  # type: ignore[arg-type]


def test_greedy_fixed_assistant_bursts_hold_no_loop_that_stops_on_data(paired: Any) -> None:
    """As ``tests/speculative/test_rounds_fixed_form.py`` holds for the other drafters: the
    assistant's greedy burst is in the fixed form and every loop in it has a constant trip
    count (it is compiled with its while loops recorded on a GPU)."""
    from tests.kernels.test_gpu_lowering import _constant_trip_loops
    from tests.speculative.test_rounds_fixed_form import lowered_rounds
    from turbospark_jax.speculative.pair import SpeculativePair

    producer, config, aparams = paired
    pair = SpeculativePair(producer, Gemma4AssistantDrafter(producer, config, aparams))
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, PROMPT)]
    text, fixed = lowered_rounds(pair, prompt, draft_len=3)
    loops, constant = _constant_trip_loops(text)
    assert fixed and loops >= 2 and constant == loops, (loops, constant)
