"""``qwen3_moe`` in the dense family: a tiny random ``transformers.Qwen3MoeForCausalLM``
folder (weights, tokenizer) loads and matches ``transformers``, and the exactness guarantees
hold on it bit for bit.

* full-sequence and cached-decode logits within the dense family's ``ATOL`` of
  ``transformers`` (float32), with a control (one expert weight nudged moves them past it);
* greedy text through ``tsj.load``/``tsj.generate`` and through the CLI equals
  ``transformers``' ``generate``;
* chunked prefill == token by token, verify == decode, reuse == fresh, bitwise, under XLA's
  kernels and the row-invariant plan, with the conformance suite's controls;
* under the row-invariant plan, programs of widths 1 and 16 agree row for row;
* quantize-on-load quantizes the expert stacks (one matrix per layer and expert);
* the config's expert keys are read as transformers reads them, and mixed dense/sparse
  layers are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import turbospark_jax as tsj
from tests.models.test_moe import cli_text, fixture_tokenizer, hf_greedy_text
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import ModelLoadError
from turbospark_jax.io.loading import load_folder
from turbospark_jax.io.saving import save_folder
from turbospark_jax.kernels.plan import XLA_PLAN, KernelPlan
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, unstack_layers
from turbospark_jax.quant.weights import is_quantized
from turbospark_jax.testing import conformance as C
from turbospark_jax.testing.fixtures import jitted_block

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # the dense family's parity tolerance (tests/models/test_dense_parity.py)
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, Any, Any]:
    fast = fixture_tokenizer()
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, initializer_range=0.1,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, max_position_embeddings=512)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config)
    hf.config._attn_implementation = "eager"
    hf = hf.float().eval()
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(path)
    fast.save_pretrained(path)
    return path, hf, fast


_forward = jax.jit(DenseModel.forward, static_argnums=0)


def test_logits_match_transformers(folder) -> None:
    path, hf, _ = folder
    ours = load_folder(path, dtype="float32")
    assert ours.config.moe and ours.params["layers"]["expert_gate"].shape == (2, 8, 32, 16)
    tokens = np.random.default_rng(1).integers(3, hf.config.vocab_size, size=(2, 16))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(_forward(ours.model, ours.params, jnp.asarray(tokens, jnp.int32)))
        cache = ours.model.init_cache(32)
        rows = []
        for i, t in enumerate(tokens[0]):
            logits, cache = jitted_block(ours.model, ours.params, cache,
                                         jnp.asarray([t], jnp.int32), jnp.asarray([i], jnp.int32),
                                         jnp.int32(1), jnp.bool_(True))
            rows.append(np.asarray(logits[0]))
    assert float(np.abs(got - ref).max()) < ATOL
    assert float(np.abs(np.stack(rows) - ref[0]).max()) < ATOL
    # Control: one expert's weight nudged moves the logits past the tolerance.
    layers = dict(ours.params["layers"])
    layers["expert_down"] = layers["expert_down"].at[:, :, 0, :].add(0.3)
    nudged = np.asarray(_forward(ours.model, {**ours.params, "layers": layers},
                                 jnp.asarray(tokens, jnp.int32)))
    assert float(np.abs(nudged - ref).max()) > ATOL


def test_greedy_text_equals_transformers_through_the_api_and_the_cli(folder) -> None:
    path, hf, fast = folder
    prompt = "def add(a, b):\n    return"
    want = hf_greedy_text(hf, fast, prompt, NEW_TOKENS)
    assert want
    model = tsj.load(path, dtype="float32", context=128)
    assert tsj.generate(model, prompt, max_tokens=NEW_TOKENS).text == want
    assert cli_text(path, prompt, NEW_TOKENS) == want + "\n"


def _producer(folder, plan: KernelPlan, dtype: Any, width: int = 4,
              listed: bool = False) -> BlockProducer:
    ours = load_folder(folder[0], dtype=dtype)
    model = DenseModel(ours.config, dtype, scan_layers=not listed, plan=plan)
    params = unstack_layers(ours.params) if listed else ours.params
    return BlockProducer(model, params, capacity=48, width=width, steps_per_call=2)


PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 77, 14, 30, 65, 8, 51, 23]
FEED = [12, 45, 3, 80]


@pytest.mark.parametrize("plan, dtype, listed", [
    (XLA_PLAN, "float32", False),
    (KernelPlan(row_invariant=True), "bfloat16", True),
])
def test_conformance(folder, plan, dtype, listed) -> None:
    producer = _producer(folder, plan, dtype, listed=listed)
    C.check_chunked_matches_sequential(producer, PROMPT, [5, 11])
    C.check_verify_matches_decode(producer, PROMPT[:9], FEED)
    C.check_reuse_matches_fresh(producer, PROMPT[:10], [7, 9], PROMPT[:8] + FEED)
    # Controls: a flipped logit bit, a flipped verify row and a wrong reuse are seen.
    with pytest.raises(C.ConformanceError):
        C.check_chunked_matches_sequential(C.perturbed(producer, "chunk_logits_bit"), PROMPT,
                                           [5, 11])
    with pytest.raises(C.ConformanceError):
        C.check_verify_matches_decode(C.perturbed(producer, "verify_row_bit"), PROMPT[:9], FEED)
    with pytest.raises(C.ConformanceError):
        C.check_reuse_matches_fresh(C.perturbed(producer, "reuse_claims_one_more"),
                                    PROMPT[:10], [7, 9], PROMPT[:8] + FEED)


def test_rowinv_widths_agree(folder) -> None:
    plan = KernelPlan(row_invariant=True)
    decoder = _producer(folder, plan, "float32", width=1)
    prefiller = _producer(folder, plan, "float32", width=16)
    C.check_widths_agree(decoder, prefiller, PROMPT, [7, 9], FEED)
    # Control: with XLA's own kernels the two programs round differently in float32.
    with pytest.raises(C.ConformanceError):
        C.check_widths_agree(_producer(folder, XLA_PLAN, "float32", width=1),
                             _producer(folder, XLA_PLAN, "float32", width=16), PROMPT, [7, 9],
                             FEED)


def test_quantize_on_load_quantizes_the_expert_stacks(folder) -> None:
    path, hf, _ = folder
    ours = load_folder(path, dtype="float32", quantize="int8")
    layers = ours.params["layers"]
    for name in ("expert_gate", "expert_up", "expert_down"):
        assert is_quantized(layers[name]) and layers[name].lead == (2, 8), name
    assert not is_quantized(layers["router"])  # the router stays as the file has it
    tokens = np.arange(3, 15)[None]
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(_forward(ours.model, ours.params, jnp.asarray(tokens, jnp.int32)))
    assert float(np.abs(got - ref).max()) < 0.1  # int8 rounding, not a wrong layout


def test_quantized_expert_stacks_round_trip_through_a_folder(folder, tmp_path) -> None:
    """Saved, each expert's matrix is a quantized tensor of its own; read back, the stacks
    are the same bits, on the same (layer, expert) axes."""
    ours = load_folder(folder[0], dtype="float32", quantize="int8")
    save_folder(tmp_path, ours.config, ours.params)
    again = load_folder(tmp_path, dtype="float32")
    for name in ("expert_gate", "expert_up", "expert_down"):
        a, b = ours.params["layers"][name], again.params["layers"][name]
        assert is_quantized(b) and b.shape == a.shape
        assert np.array_equal(np.asarray(a.q), np.asarray(b.q))
        assert np.array_equal(np.asarray(a.scale), np.asarray(b.scale))
        # Control: experts differ, so a stack read back in another order would show.
        assert not np.array_equal(np.asarray(b.q)[0, 0], np.asarray(b.q)[0, 1])


def test_save_folder_round_trips(folder, tmp_path) -> None:
    ours = load_folder(folder[0], dtype="float32")
    save_folder(tmp_path, ours.config, ours.params)
    again = load_folder(tmp_path, dtype="float32")
    assert again.config == ours.config
    for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(again.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_config_keys(folder) -> None:
    raw = json.loads((folder[0] / "config.json").read_text())
    config = DenseConfig.from_hf_dict(raw)
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (8, 2, True)
    assert DenseConfig.from_hf_dict(config.to_hf_dict()) == config
    # The name published checkpoints use, and transformers' defaults for keys left out.
    published = {k: v for k, v in raw.items() if k != "num_local_experts"}
    assert DenseConfig.from_hf_dict({**published, "num_experts": 8}).num_experts == 8
    sparse = {k: raw[k] for k in ("model_type", "vocab_size", "hidden_size",
                                  "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads")}
    default = DenseConfig.from_hf_dict(sparse)
    assert (default.num_experts, default.num_experts_per_tok, default.moe_intermediate_size,
            default.norm_topk_prob) == (128, 8, 768, False)
    # Every layer dense is a model without experts.
    assert not DenseConfig.from_hf_dict({**raw, "mlp_only_layers": [0, 1]}).moe
    with pytest.raises(ModelLoadError, match="must all be sparse or all dense"):
        DenseConfig.from_hf_dict({**raw, "mlp_only_layers": [0]})
    with pytest.raises(ModelLoadError, match="must all be sparse or all dense"):
        DenseConfig.from_hf_dict({**raw, "decoder_sparse_step": 2})
    with pytest.raises(ModelLoadError, match="disagree"):
        DenseConfig.from_hf_dict({**raw, "num_experts": 4})
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        DenseConfig.from_hf_dict({**raw, "num_experts_per_tok": 9})
    with pytest.raises(ModelLoadError, match="mlp_only_layers"):
        DenseConfig.from_hf_dict({**raw, "mlp_only_layers": "0"})
