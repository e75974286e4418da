"""The Qwen3.5 family's mixture-of-experts forms: ``qwen3_5_moe_text`` (every layer and the MTP
layer with experts) and ``qwen3_next`` with experts (here mixed with dense layers through
``mlp_only_layers``, and without renormalisation), from tiny random ``transformers`` folders.

* logits within the family's ``ATOL`` of ``transformers`` (float32), with a control;
* greedy text equal to ``transformers``' through ``tsj.generate`` and the CLI;
* chunked == token by token, verify == decode, rollback retaining == decode, reuse == fresh,
  bitwise, with the conformance suite's controls;
* the MTP head with experts against a reference built from ``transformers``' own
  ``Qwen3_5MoeDecoderLayer`` (transformers drops ``mtp.*`` weights, so the head is ours), and
  as a drafter through the API: speculative greedy text equals plain greedy text;
* a multimodal ``qwen3_5_moe`` config reads its ``text_config`` and names its tensors under
  ``model.language_model.``.
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
from turbospark_jax.io.loading import load_folder
from turbospark_jax.io.saving import save_folder
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.testing import conformance as C

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("full_precision_products")

ATOL = 1e-4  # the family's parity tolerance (tests/models/test_qwen3_5.py)
NEW_TOKENS = 8
COMMON: dict[str, Any] = dict(
    hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_experts=8, num_experts_per_tok=2, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, initializer_range=0.1,
    layer_types=[QC.LINEAR, QC.FULL, QC.LINEAR], bos_token_id=0, eos_token_id=1,
    pad_token_id=2, max_position_embeddings=512)


def _hf(kind: str, vocab: int) -> Any:
    if kind == "qwen3_5_moe_text":
        model = transformers.Qwen3_5MoeForCausalLM(
            transformers.Qwen3_5MoeTextConfig(**COMMON, vocab_size=vocab))
    else:
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **COMMON, vocab_size=vocab, intermediate_size=40, mlp_only_layers=[1],
            norm_topk_prob=False))
    model.config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norms away from their init, so they count
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.float().eval()


@pytest.fixture(scope="module", params=["qwen3_5_moe_text", "qwen3_next"])
def folder(request, tmp_path_factory) -> tuple[str, Path, Any, Any]:
    fast = fixture_tokenizer()
    torch.manual_seed(0)
    hf = _hf(request.param, len(fast))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    fast.save_pretrained(path)
    return request.param, path, hf, fast


_forward = jax.jit(Q.Qwen35Model.forward, static_argnums=0)


def test_logits_match_transformers(folder) -> None:
    kind, path, hf, _ = folder
    ours = load_folder(path, dtype="float32", layer_layout="list")
    want_sparse = (True,) * 3 if kind == "qwen3_5_moe_text" else (True, False, True)
    assert ours.config.sparse_layers == want_sparse
    tokens = np.random.default_rng(1).integers(3, hf.config.vocab_size, size=(2, 12))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(_forward(ours.model, ours.params, jnp.asarray(tokens, jnp.int32)))
    assert float(np.abs(got - ref).max()) < ATOL
    # Control: the shared expert's gate nudged moves the logits past the tolerance.
    layers = list(ours.params["layers"])
    layers[0] = {**layers[0], "shared_expert_gate": layers[0]["shared_expert_gate"] + 1.0}
    nudged = np.asarray(_forward(ours.model, {**ours.params, "layers": layers},
                                 jnp.asarray(tokens, jnp.int32)))
    assert float(np.abs(nudged - ref).max()) > ATOL


def test_greedy_text_equals_transformers(folder) -> None:
    _, path, hf, fast = folder
    prompt = "def add(a, b):\n    return"
    want = hf_greedy_text(hf, fast, prompt, NEW_TOKENS)
    assert want
    model = tsj.load(path, dtype="float32", context=128)
    assert tsj.generate(model, prompt, max_tokens=NEW_TOKENS).text == want
    assert cli_text(path, prompt, NEW_TOKENS) == want + "\n"


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]


def test_conformance(folder) -> None:
    ours = load_folder(folder[1], dtype="float32", layer_layout="list")
    producer = BlockProducer(ours.model, ours.params, capacity=48, width=4, steps_per_call=2)
    check_conformance_with_controls(producer, PROMPT)
    C.check_rollback_retaining_matches_decode(producer, PROMPT[:6], PROMPT[6:10], 2, 5)


# -- the MTP head with experts ------------------------------------------------------------------


MTP_TINY: dict[str, Any] = dict(
    model_type="qwen3_5_moe_text", vocab_size=64, hidden_size=32, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=2,
    layer_types=(QC.LINEAR, QC.FULL), initializer_range=0.1, mtp_num_hidden_layers=1,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=24)


class ReferenceMTP(torch.nn.Module):
    """The published head over transformers' own MoE decoder layer."""

    def __init__(self, text: Any) -> None:
        super().__init__()
        d, eps = text.hidden_size, text.rms_norm_eps
        self.pre_fc_norm_embedding = hf_moe.Qwen3_5MoeRMSNorm(d, eps)
        self.pre_fc_norm_hidden = hf_moe.Qwen3_5MoeRMSNorm(d, eps)
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.layers = torch.nn.ModuleList([hf_moe.Qwen3_5MoeDecoderLayer(text, 0)])
        self.norm = hf_moe.Qwen3_5MoeRMSNorm(d, eps)
        self.rotary = hf_moe.Qwen3_5MoeTextRotaryEmbedding(text)

    def forward(self, embeds: Any, hidden: Any) -> Any:
        t = hidden.shape[1]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds),
                               self.pre_fc_norm_hidden(hidden)], -1))
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        rope = self.rotary(x, positions[None].expand(3, -1, -1))
        x = self.layers[0](x, position_embeddings=rope, attention_mask=mask,
                           position_ids=positions)
        return self.norm(x)


def _mtp_state(config: QC.Qwen35Config, params: Any) -> dict[str, Any]:
    """Our ``mtp.*`` leaves under the names transformers' modules hold: the per-expert
    tensors the checkpoint names (through ``FAMILY.hf_tensors``) merged into its fused
    ``gate_up_proj [E, 2F, D]`` and ``down_proj [E, D, F]``."""
    state, experts = {}, {}
    for t in Q.FAMILY.hf_tensors(config):
        if not t.name.startswith("mtp."):
            continue
        node = params
        for k in t.key:
            node = node[k]
        if t.stacked is not None:
            node = node[t.stacked]
        array = torch.tensor(t.to_hf(np.asarray(node)))
        if ".experts." in t.name:
            experts.setdefault(t.name.split(".")[-2], []).append(array)
        else:
            state[t.name[len("mtp."):]] = array
    state["layers.0.mlp.experts.gate_up_proj"] = torch.cat(
        [torch.stack(experts["gate_proj"]), torch.stack(experts["up_proj"])], dim=1)
    state["layers.0.mlp.experts.down_proj"] = torch.stack(experts["down_proj"])
    return state


def test_mtp_head_with_experts_matches_the_reference() -> None:
    config = QC.Qwen35Config(**MTP_TINY)
    model = Q.Qwen35Model(config)
    params = model.init_params(jax.random.PRNGKey(0))
    leaves, treedef = jax.tree.flatten(params["mtp"])
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    params["mtp"] = jax.tree.unflatten(treedef, [
        a + 0.2 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys, strict=True)])
    assert "router" in params["mtp"]["layers"][0]
    text = transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in MTP_TINY.items() if k != "model_type"} | {
            "layer_types": [QC.FULL], "num_hidden_layers": 1})
    text._attn_implementation = "eager"
    ref = ReferenceMTP(text).float().eval()
    missing, unexpected = ref.load_state_dict(_mtp_state(config, params), strict=False)
    assert not unexpected and all(m.startswith("rotary") for m in missing), (missing, unexpected)

    rng = np.random.default_rng(0)
    seq, width = 8, 4
    hidden = rng.normal(size=(seq, 32)).astype(np.float32)
    tokens = rng.integers(0, 64, seq)
    with torch.no_grad():
        out = ref(torch.tensor(np.asarray(params["embed_tokens"]))[torch.tensor(tokens)][None],
                  torch.tensor(hidden)[None])[0]
        want = (out @ torch.tensor(np.asarray(params["lm_head"]))).numpy()
    step = jax.jit(Q.Qwen35Model.mtp_block_forward, static_argnums=0, static_argnames="step")
    cache, got = model.mtp_init_cache(16), []
    for a in range(0, seq, width):
        logits, _, cache = step(model, params, cache, jnp.asarray(hidden[a:a + width]),
                                jnp.asarray(tokens[a:a + width], jnp.int32),
                                jnp.arange(a, a + width, dtype=jnp.int32), jnp.int32(width))
        got.append(np.asarray(logits))
    assert float(np.abs(np.concatenate(got) - want).max()) < ATOL


def test_mtp_drafting_on_a_moe_target_equals_plain_decoding(tmp_path) -> None:
    config = QC.Qwen35Config(**{**MTP_TINY, "vocab_size": 96})
    params = Q.init_params(config, jax.random.PRNGKey(2))
    save_folder(tmp_path, config, params)
    prompt = [5, 17, 3, 88, 41, 41, 9, 60, 2]
    drafted = tsj.load(tmp_path, dtype="float32", context=64, drafter="mtp", draft_len=2)
    assert drafted.drafter is not None
    plain = tsj.generate(drafted, prompt, max_tokens=10, stop_token_ids=(), draft_len=0)
    got = tsj.generate(drafted, prompt, max_tokens=10, stop_token_ids=())
    assert got.token_ids == plain.token_ids and got.speculative is not None
    assert plain.speculative is None  # the reference really decoded plainly


def test_multimodal_moe_config_and_names() -> None:
    raw = transformers.Qwen3_5MoeConfig(text_config=dict(
        **{k: v for k, v in MTP_TINY.items() if k not in ("model_type", "layer_types")},
        layer_types=[QC.LINEAR, QC.FULL])).to_dict()
    config = Q.FAMILY.parse_config(raw)
    assert (config.model_type, config.text_model_type, config.moe) == (
        "qwen3_5_moe", "qwen3_5_moe_text", True)
    names = [t.name for t in Q.FAMILY.hf_tensors(config)]
    assert "model.language_model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.language_model.layers.0.mlp.shared_expert_gate.weight" in names
    assert Q.FAMILY.parse_config(config.to_hf_dict()) == config
