"""Parity of the Gemma 4 family with Hugging Face ``transformers`` (CPU, float32).

Each case builds a tiny random ``Gemma4ForCausalLM`` (or the text decoder of a
``Gemma4ForConditionalGeneration``), randomises its norm weights, biases and layer scalars so
they are exercised, and converts its state dict with our family declaration
(``FAMILY.hf_tensors`` and ``HFTensor.to_ours``, independent of the loader). Checks per case:

* full-sequence logits of :meth:`Gemma4Model.forward` within ``ATOL = 1e-4`` (measured ~5e-6);
* the block program's logits (``BlockProducer.verify`` over the whole sequence from an empty
  state, and ``prefill_chunk``'s last row) within the same ``ATOL``;
* 10 greedy tokens after a 12-token prompt (longer than every window) equal
  ``generate(do_sample=False)`` (text-only cases);
* a control: one weight nudged moves the logits past ``ATOL``.

The cases switch each feature on and off: PLE, KV sharing (with the double-wide MLP), k_eq_v
with its own full-layer KV head count, attention biases, final softcapping, untied head,
non-default RoPE settings, sliding windows of 3-5 positions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from turbospark_jax.engine.producer import BlockProducer  # noqa: E402
from turbospark_jax.models.gemma4 import config as GC  # noqa: E402
from turbospark_jax.models.gemma4 import model as G  # noqa: E402

ATOL = 1e-4
VOCAB = 96
SEQ = 14
PROMPT = 12
NEW_TOKENS = 10
S, F = GC.SLIDING, GC.FULL

_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, global_head_dim=16, vocab_size_per_layer_input=VOCAB,
    initializer_range=0.1,  # sharp logits, so greedy argmaxes are not near-ties
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)

CASES: dict[str, dict[str, Any]] = {
    "plain_untied": dict(
        num_hidden_layers=3, layer_types=[S, S, F], sliding_window=4,
        hidden_size_per_layer_input=0, tie_word_embeddings=False,
    ),
    "ple_shared_wide_softcap": dict(
        num_hidden_layers=5, layer_types=[S, F, S, S, F], sliding_window=3,
        hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
    ),
    "k_eq_v_bias_rope": dict(
        num_hidden_layers=4, layer_types=[S, F, S, F], sliding_window=5,
        hidden_size_per_layer_input=4, attention_k_eq_v=True, num_global_key_value_heads=1,
        attention_bias=True, num_kv_shared_layers=1,
        rope_parameters={S: {"rope_type": "default", "rope_theta": 100.0},
                         F: {"rope_type": "proportional", "rope_theta": 5000.0,
                             "partial_rotary_factor": 0.5, "factor": 2.0}},
    ),
}


def randomise(model: Any, seed: int) -> None:
    """Norm weights 1 + noise, biases noise, layer scalars in [0.5, 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))


def convert(config: GC.Gemma4Config, state_dict: dict[str, Any]) -> G.Params:
    """A transformers state dict as our params, through the family declaration alone."""
    shapes = G.param_shapes(config)
    params = jax.tree.map(lambda s: None, shapes, is_leaf=lambda x: isinstance(x, tuple))
    for t in G.FAMILY.hf_tensors(config):
        array = state_dict[t.name].detach().numpy()
        assert array.shape == t.hf_shape, (t.name, array.shape, t.hf_shape)
        node, leaf = params, shapes
        for k in t.key[:-1]:
            node, leaf = node[k], leaf[k]
        node[t.key[-1]] = jnp.asarray(t.to_ours(array, leaf[t.key[-1]]))
    return params


def build(name: str, wrapped: bool = False) -> tuple[Any, G.Gemma4Model, G.Params]:
    # The wrapper masks multimodal placeholders with the pad id, so it needs one.
    text = transformers.Gemma4TextConfig(**{**_BASE, **CASES[name],
                                            **({"pad_token_id": 0} if wrapped else {})})
    torch.manual_seed(0)
    if wrapped:
        hf_config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=None,
                                              audio_config=None)
        hf = transformers.Gemma4ForConditionalGeneration(hf_config)
    else:
        hf_config = text
        hf = transformers.Gemma4ForCausalLM(text)
    hf = hf.float().eval()
    hf.config._attn_implementation = "eager"
    randomise(hf, seed=len(name))
    config = G.FAMILY.parse_config(hf_config.to_dict())
    assert config.model_type == ("gemma4" if wrapped else "gemma4_text")
    state = hf.state_dict()
    extra = set(state) - {t.name for t in G.FAMILY.hf_tensors(config)}
    assert all(G.FAMILY.tolerated(n) or n == "lm_head.weight" for n in extra), extra
    model = G.FAMILY.build(config, jnp.float32, "list")
    return hf, model, convert(config, state)


_forward = jax.jit(G.Gemma4Model.forward, static_argnums=0)


@pytest.fixture(scope="module", params=[*CASES, "wrapped"])
def case(request: pytest.FixtureRequest) -> Any:
    wrapped = request.param == "wrapped"
    hf, model, params = build("ple_shared_wide_softcap" if wrapped else request.param, wrapped)
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(2, SEQ))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens)).logits.numpy()
    producer = BlockProducer(model, params, capacity=32, width=4, steps_per_call=4)
    return request.param, hf, model, params, producer, tokens, ref


def test_forward_matches_transformers(case: Any) -> None:
    name, _, model, params, _, tokens, ref = case
    with jax.default_matmul_precision("highest"):
        got = np.asarray(_forward(model, params, jnp.asarray(tokens, jnp.int32)))
    err = float(np.abs(got - ref).max())
    print(f"{name}: forward max abs diff {err:.2e}")
    assert err < ATOL


def test_block_program_matches_transformers(case: Any) -> None:
    name, _, _, _, producer, tokens, ref = case
    with jax.default_matmul_precision("highest"):
        rows, _ = producer.verify(producer.init_state(), list(tokens[0]), 0)
        last, _ = producer.prefill_chunk(producer.init_state(), list(tokens[1]), 0)
    err = float(np.abs(np.asarray(rows) - ref[0]).max())
    err_last = float(np.abs(np.asarray(last) - ref[1, -1]).max())
    print(f"{name}: block program max abs diff {err:.2e} (prefill_chunk {err_last:.2e})")
    assert max(err, err_last) < ATOL


def test_greedy_continuation_matches_generate(case: Any) -> None:
    name, hf, _, _, producer, tokens, _ = case
    if name == "wrapped":
        pytest.skip("the multimodal wrapper's generate is not what this family serves")
    prompt = [int(t) for t in tokens[0, :PROMPT]]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    expected = out[0, PROMPT:].tolist()
    with jax.default_matmul_precision("highest"):
        logits, state = producer.prefill_chunk(producer.init_state(), prompt, 0)
        got = []
        for position in range(PROMPT, PROMPT + NEW_TOKENS):
            got.append(int(jnp.argmax(logits)))
            logits, state = producer.produce(state, got[-1], position)
    assert got == expected


def test_parity_check_can_fail(case: Any) -> None:
    """Control: nudging one MLP weight moves the logits past the tolerance."""
    _, _, model, params, _, tokens, ref = case
    layers = [dict(lp) for lp in params["layers"]]
    layers[0]["down_proj"] = layers[0]["down_proj"].at[0, 0].add(0.05)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(_forward(model, {**params, "layers": layers},
                                  jnp.asarray(tokens, jnp.int32)))
    assert float(np.abs(got - ref).max()) > ATOL
