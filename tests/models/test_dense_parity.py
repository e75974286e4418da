"""Parity of the dense family with Hugging Face ``transformers`` (CPU, float32).

Each case builds a tiny random model with a transformers config class, randomises every
weight (norm scales and biases included, so they are exercised), saves it with
``save_pretrained`` and loads the folder with our loader. Three checks per case:

* full-sequence logits from :meth:`DenseModel.forward` agree with transformers within
  ``ATOL = 1e-4`` absolute;
* step-by-step decoding through :meth:`DenseModel.block_forward` (one live row per call,
  a KV cache) agrees with transformers' full-sequence logits within the same ``ATOL``;
* 32 greedy tokens decoded through ``block_forward`` equal ``generate(do_sample=False)``.

The cases cover every ``model_type``, GQA and MQA, tied and untied embeddings, attention and
MLP biases, Qwen3's q/k norm, head dims that are not ``hidden / heads`` (24 and 40), llama3,
yarn and linear RoPE scaling, Mistral's sliding window and Qwen2's per-layer sliding window,
each shorter than the sequences run.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from turbospark_jax.io.loading import LoadedModel, load_folder  # noqa: E402
from turbospark_jax.models.dense.model import DenseModel  # noqa: E402
from turbospark_jax.testing.fixtures import jitted_block, randomise_hf_norms_and_biases  # noqa: E402

ATOL = 1e-4
VOCAB = 160
SEQ = 24
PROMPT = 8
NEW_TOKENS = 32
CAPACITY = PROMPT + NEW_TOKENS

_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # sharper logits than 0.02, so greedy argmaxes are not near-ties
    bos_token_id=None,
    eos_token_id=None,  # generate must not stop early
    pad_token_id=None,
)

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_gqa": ("LlamaConfig", {}),
    "llama_mqa_tied_llama3_bias": (
        "LlamaConfig",
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama_head_dim_24": ("LlamaConfig", dict(head_dim=24)),
    "mistral_window_linear_rope": (
        "MistralConfig",
        dict(sliding_window=6, rope_scaling=dict(rope_type="linear", factor=2.0)),
    ),
    "qwen2_bias_mixed_window": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "qwen2_tied_mha": ("Qwen2Config", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3_qk_norm_head_dim_40_yarn": (
        "Qwen3Config",
        dict(
            head_dim=40,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
            max_position_embeddings=64,  # = factor * original, as transformers expects
        ),
    ),
    "qwen3_mqa_tied": ("Qwen3Config", dict(head_dim=16, num_key_value_heads=1,
                                           tie_word_embeddings=True)),
}


_forward = jax.jit(DenseModel.forward, static_argnums=0)




@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    class_name, overrides = CASES[request.param]
    config = getattr(transformers, class_name)(**{**_BASE, **overrides})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf = hf.float().eval()
    randomise_hf_norms_and_biases(hf, seed=len(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    ours = load_folder(folder, dtype="float32")
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(2, SEQ))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    return request.param, hf, ours, tokens, ref


def _decode(ours: LoadedModel, tokens: np.ndarray, capacity: int) -> np.ndarray:
    cache = ours.model.init_cache(capacity)
    rows = []
    for i, t in enumerate(tokens):
        logits, cache = jitted_block(
            ours.model, ours.params, cache, jnp.asarray([t], jnp.int32),
            jnp.asarray([i], jnp.int32), jnp.int32(1), jnp.bool_(True),
        )
        rows.append(np.asarray(logits[0]))
    return np.stack(rows)


def test_forward_matches_transformers(case: Any) -> None:
    name, _, ours, tokens, ref = case
    with jax.default_matmul_precision("highest"):
        got = np.asarray(_forward(ours.model, ours.params, jnp.asarray(tokens, jnp.int32)))
    err = float(np.abs(got - ref).max())
    print(f"{name}: forward max abs diff {err:.2e}")
    assert err < ATOL


def test_cached_decode_matches_transformers(case: Any) -> None:
    name, _, ours, tokens, ref = case
    with jax.default_matmul_precision("highest"):
        got = _decode(ours, tokens[0], capacity=CAPACITY)  # the greedy test's program
    err = float(np.abs(got - ref[0]).max())
    print(f"{name}: decode max abs diff {err:.2e}")
    assert err < ATOL


def test_greedy_continuation_matches_generate(case: Any) -> None:
    _, hf, ours, tokens, _ = case
    prompt = tokens[0, :PROMPT]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(prompt[None]), max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    expected = out[0, PROMPT:].tolist()
    assert len(expected) == NEW_TOKENS

    model, params = ours.model, ours.params
    cache = model.init_cache(CAPACITY)
    with jax.default_matmul_precision("highest"):
        fed = list(prompt)
        generated: list[int] = []
        for position in range(CAPACITY - 1):
            logits, cache = jitted_block(
                model, params, cache, jnp.asarray([fed[position]], jnp.int32),
                jnp.asarray([position], jnp.int32), jnp.int32(1), jnp.bool_(True),
            )
            if position >= PROMPT - 1:
                token = int(jnp.argmax(logits[0]))
                generated.append(token)
                fed.append(token)
            if len(generated) == NEW_TOKENS:
                break
    assert generated == expected


def test_parity_check_can_fail(case: Any) -> None:
    """Control: a small change to one weight moves the logits past the tolerance."""
    _, _, ours, tokens, ref = case
    params = jax.tree.map(lambda a: a, ours.params)
    params["layers"] = dict(params["layers"])
    params["layers"]["down_proj"] = params["layers"]["down_proj"].at[0, 0, 0].add(0.05)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(_forward(ours.model, params, jnp.asarray(tokens, jnp.int32)))
    assert float(np.abs(got - ref).max()) > ATOL
