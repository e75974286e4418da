"""Gemma 4 with its MoE block (``enable_moe_block``): a tiny random
``transformers.Gemma4ForCausalLM`` folder (sliding and full layers, PLE on, norms and router
scales randomised so they count) loads and matches ``transformers``.

* logits within the family's ``ATOL`` of ``transformers`` (float32), with a control;
* greedy text through ``tsj.generate`` and the CLI equals ``transformers``' ``generate``;
* chunked == token by token, verify == decode, reuse == fresh, bitwise, with controls;
* the router alone matches ``transformers``' ``Gemma4TextRouter`` (weights and experts);
* the config's expert keys are checked, and the assistant drafter's config refuses them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import turbospark_jax as tsj
from tests.models.test_moe import (
    check_conformance_with_controls,
    cli_text,
    fixture_tokenizer,
    hf_greedy_text,
)
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import ModelLoadError
from turbospark_jax.io.loading import load_folder
from turbospark_jax.models import moe
from turbospark_jax.models.gemma4 import config as GC
from turbospark_jax.models.gemma4.assistant import AssistantConfig
from turbospark_jax.models.gemma4.model import Gemma4Model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.gemma4 import modeling_gemma4 as hf_g4  # noqa: E402

pytestmark = pytest.mark.usefixtures("full_precision_products")

ATOL = 1e-4  # the family's parity tolerance (tests/models/test_gemma4_parity.py)
NEW_TOKENS = 8
S, F = GC.SLIDING, GC.FULL
TINY: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, global_head_dim=16, layer_types=[S, S, F],
    sliding_window=4, hidden_size_per_layer_input=4, enable_moe_block=True, num_experts=6,
    top_k_experts=2, moe_intermediate_size=16, initializer_range=0.1, bos_token_id=0,
    eos_token_id=1, pad_token_id=2, max_position_embeddings=512)


def _randomise(module: Any, seed: int) -> None:
    """Norm weights, router scales and per-expert scales away from one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or "scale" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, Any, Any]:
    fast = fixture_tokenizer()
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(**TINY, vocab_size=len(fast),
                                           vocab_size_per_layer_input=len(fast))
    hf = transformers.Gemma4ForCausalLM(config)
    hf.config._attn_implementation = "eager"
    hf = hf.float().eval()
    _randomise(hf, 1)
    path = tmp_path_factory.mktemp("gemma4_moe")
    hf.save_pretrained(path)
    fast.save_pretrained(path)
    return path, hf, fast


_forward = jax.jit(Gemma4Model.forward, static_argnums=0)


def test_logits_match_transformers(folder) -> None:
    path, hf, _ = folder
    ours = load_folder(path, dtype="float32", layer_layout="list")
    assert ours.config.enable_moe_block
    assert ours.params["layers"][0]["experts_gate_up"].shape == (6, 32, 32)
    tokens = np.random.default_rng(1).integers(3, hf.config.vocab_size, size=(2, 12))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(_forward(ours.model, ours.params, jnp.asarray(tokens, jnp.int32)))
    assert float(np.abs(got - ref).max()) < ATOL
    # Control: one expert's scale nudged moves the logits past the tolerance.
    layers = list(ours.params["layers"])
    layers[1] = {**layers[1], "per_expert_scale": layers[1]["per_expert_scale"] * 1.5}
    nudged = np.asarray(_forward(ours.model, {**ours.params, "layers": layers},
                                 jnp.asarray(tokens, jnp.int32)))
    assert float(np.abs(nudged - ref).max()) > ATOL


def test_greedy_text_equals_transformers(folder) -> None:
    path, hf, fast = folder
    prompt = "def add(a, b):\n    return"
    want = hf_greedy_text(hf, fast, prompt, NEW_TOKENS)
    assert want
    model = tsj.load(path, dtype="float32", context=128)
    assert tsj.generate(model, prompt, max_tokens=NEW_TOKENS).text == want
    assert cli_text(path, prompt, NEW_TOKENS) == want + "\n"


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]


def test_conformance(folder) -> None:
    ours = load_folder(folder[0], dtype="float32", layer_layout="list")
    producer = BlockProducer(ours.model, ours.params, capacity=48, width=4, steps_per_call=2)
    check_conformance_with_controls(producer, PROMPT)


def test_router_matches_transformers() -> None:
    config = transformers.Gemma4TextConfig(**TINY, vocab_size=64)
    router = hf_g4.Gemma4TextRouter(config).float().eval()
    torch.manual_seed(2)
    torch.nn.init.normal_(router.proj.weight, std=0.3)
    _randomise(router, 2)
    x = np.random.default_rng(0).normal(size=(9, 32)).astype(np.float32)
    with torch.no_grad():
        _, want_w, want_e = router(torch.tensor(x))
    t = {k: jnp.asarray(v.detach().numpy()) for k, v in router.state_dict().items()}
    got_w, got_e = moe.scaled_router(jnp.asarray(x), t["scale"], t["proj.weight"],
                                     t["per_expert_scale"], moe.Routing(6, 2, True), 1e-6)
    assert np.array_equal(np.asarray(got_e), want_e.numpy())
    np.testing.assert_allclose(np.asarray(got_w), want_w.numpy(), rtol=1e-5, atol=1e-6)


def test_expert_keys_are_checked() -> None:
    base = {**TINY, "model_type": "gemma4_text", "vocab_size": 64}
    config = GC.Gemma4Config.from_hf_dict(base)
    assert GC.Gemma4Config.from_hf_dict(config.to_hf_dict()) == config
    for key, value in (("num_experts", None), ("top_k_experts", 9), ("moe_intermediate_size", 0),
                       ("enable_moe_block", "yes")):
        with pytest.raises(ModelLoadError, match=key):
            GC.Gemma4Config.from_hf_dict({**base, key: value})
    with pytest.raises(ModelLoadError, match="enable_moe_block"):
        AssistantConfig.from_hf_dict({"model_type": "gemma4_assistant", "text_config": {
            **{k: v for k, v in base.items() if k != "model_type"},
            "hidden_size_per_layer_input": 0}})
