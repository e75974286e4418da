"""The Qwen3.5 MTP head against a reference written here in torch (transformers drops the
``mtp.*`` weights, so it has none): the published structure, with the decoder layer taken from
transformers' ``Qwen3_5DecoderLayer`` and our random weights loaded into it under the
checkpoint's tensor names (through ``FAMILY.hf_tensors``, so the names are checked too).

* a sequence fed through ``mtp_block_forward`` in blocks (the last one partly padding) gives the
  reference's logits and hidden states within ``ATOL = 1e-4``;
* a chained draft step (the previous step's ``new_hidden`` and a drafted token, one position
  on) gives what the reference gives for the sequence extended by that row;
* a control: a nudged ``fc`` weight moves the logits past ``ATOL``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_q35  # noqa: E402

ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("full_precision_products")
VOCAB, SEQ, WIDTH = 64, 10, 4
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=2,
    layer_types=(QC.LINEAR, QC.FULL), initializer_range=0.1, mtp_num_hidden_layers=1,
)


class ReferenceMTP(torch.nn.Module):
    """The published head: attribute names are the ``mtp.*`` tensor names."""

    def __init__(self, text: Any) -> None:
        super().__init__()
        d, eps = text.hidden_size, text.rms_norm_eps
        self.pre_fc_norm_embedding = hf_q35.Qwen3_5RMSNorm(d, eps)
        self.pre_fc_norm_hidden = hf_q35.Qwen3_5RMSNorm(d, eps)
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.layers = torch.nn.ModuleList([hf_q35.Qwen3_5DecoderLayer(text, 0)])
        self.norm = hf_q35.Qwen3_5RMSNorm(d, eps)
        self.rotary = hf_q35.Qwen3_5TextRotaryEmbedding(text)

    def forward(self, embeds: Any, hidden: Any) -> tuple[Any, Any]:
        """embeds, hidden [1, T, D] (row t: the token after position t, the hidden state at
        t) -> the normed output [1, T, D]; causal attention over the rows, positions 0..T-1."""
        t = hidden.shape[1]
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.fc(x)
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        # Rotary ids as [3, 1, T] (one row per multimodal RoPE section): the shape every
        # transformers version's text rotary takes (5.17 rejects a plain [1, T]).
        rope = self.rotary(x, positions[None].expand(3, -1, -1))
        x = self.layers[0](x, position_embeddings=rope,
                           attention_mask=mask, position_ids=positions)
        return self.norm(x)


@functools.cache
def setup() -> tuple[Q.Qwen35Model, Q.Params, ReferenceMTP, Any]:
    config = QC.Qwen35Config(**TINY)
    model = Q.Qwen35Model(config)
    params = model.init_params(jax.random.PRNGKey(0))
    # Norms are zero at init; give them (and everything else of the head) some spread.
    leaves, treedef = jax.tree.flatten(params["mtp"])
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    params["mtp"] = jax.tree.unflatten(treedef, [
        a + 0.2 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys, strict=True)])
    text = transformers.Qwen3_5TextConfig(**{**TINY, "layer_types": [QC.FULL],
                                              "num_hidden_layers": 1})
    text._attn_implementation = "eager"
    ref = ReferenceMTP(text).float().eval()
    state = {}
    for t in Q.FAMILY.hf_tensors(config):
        if t.name.startswith("mtp."):
            node = params
            for k in t.key:
                node = node[k]
            state[t.name[len("mtp."):]] = torch.tensor(t.to_hf(np.asarray(node)))
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all(m.startswith("rotary") for m in missing), (missing, unexpected)
    head = torch.tensor(np.asarray(params["lm_head"]).T)
    embed = torch.tensor(np.asarray(params["embed_tokens"]))
    return model, params, ref, (embed, head)


_step = jax.jit(Q.Qwen35Model.mtp_block_forward, static_argnums=0, static_argnames="step")


def reference(ref: ReferenceMTP, tables: Any, hidden: np.ndarray,
              tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    embed, head = tables
    with torch.no_grad():
        out = ref(embed[torch.tensor(tokens)][None], torch.tensor(hidden)[None])[0]
        return (out @ head.T).numpy(), out.numpy()


def run_blocks(model: Q.Qwen35Model, params: Q.Params, hidden: np.ndarray,
               tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, Q.MTPCache]:
    cache = model.mtp_init_cache(16)
    logits, outs = [], []
    for a in range(0, len(tokens), WIDTH):
        live = min(WIDTH, len(tokens) - a)
        h = np.zeros((WIDTH, hidden.shape[1]), np.float32)
        t = np.zeros((WIDTH,), np.int32)
        h[:live], t[:live] = hidden[a : a + live], tokens[a : a + live]
        lg, nh, cache = _step(model, params, cache, jnp.asarray(h), jnp.asarray(t),
                              jnp.arange(a, a + WIDTH, dtype=jnp.int32), jnp.int32(live))
        logits.append(np.asarray(lg)[:live])
        outs.append(np.asarray(nh)[:live])
    return np.concatenate(logits), np.concatenate(outs), cache


def inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(SEQ, 32)).astype(np.float32), rng.integers(0, VOCAB, SEQ)


def test_mtp_blocks_match_the_reference() -> None:
    model, params, ref, tables = setup()
    hidden, tokens = inputs(0)
    want_logits, want_hidden = reference(ref, tables, hidden, tokens)
    logits, new_hidden, _ = run_blocks(model, params, hidden, tokens)
    err = float(np.abs(logits - want_logits).max())
    err_h = float(np.abs(new_hidden - want_hidden).max())
    print(f"mtp: logits max abs diff {err:.2e}, hidden {err_h:.2e}")
    assert max(err, err_h) < ATOL


def test_chained_step_matches_the_reference_on_the_extended_sequence() -> None:
    """Step 1 of a draft chain at the last position reads step 0's new_hidden and the token
    step 0 drafted, one position on, over the KV rows the blocks wrote."""
    model, params, ref, tables = setup()
    hidden, tokens = inputs(1)
    logits, new_hidden, cache = run_blocks(model, params, hidden, tokens)
    drafted = int(np.argmax(logits[-1]))
    got, _, cache = _step(model, params, cache, jnp.asarray(new_hidden[-1:]),
                          jnp.asarray([drafted], jnp.int32), jnp.asarray([SEQ], jnp.int32),
                          jnp.int32(1))
    want, _ = reference(ref, tables, np.concatenate([hidden, new_hidden[-1:]]),
                        np.append(tokens, drafted))
    assert float(np.abs(np.asarray(got)[0] - want[-1]).max()) < ATOL


def test_mtp_check_can_fail() -> None:
    model, params, ref, tables = setup()
    hidden, tokens = inputs(0)
    want, _ = reference(ref, tables, hidden, tokens)
    nudged = {**params, "mtp": {**params["mtp"], "fc": params["mtp"]["fc"].at[0, 0].add(0.3)}}
    got, _, _ = run_blocks(model, nudged, hidden, tokens)
    assert float(np.abs(got - want).max()) > ATOL


def test_each_chain_step_uses_its_own_layer_and_rows() -> None:
    config = QC.Qwen35Config(**{**TINY, "mtp_num_hidden_layers": 2})
    model = Q.Qwen35Model(config)
    _, params, _, _ = setup()
    mtp = params["mtp"]
    params = {**params, "mtp": {**mtp, "layers": [mtp["layers"][0]] * 2}}
    assert [t.name for t in Q.FAMILY.hf_tensors(config) if t.name.startswith("mtp.layers.1.")]
    cache = model.mtp_init_cache(8)
    _, _, after = _step(model, params, cache, jnp.ones((2, 32)), jnp.asarray([1, 2], jnp.int32),
                        jnp.asarray([3, 4], jnp.int32), jnp.int32(1), step=1)
    assert not np.any(np.asarray(after.k[0]))
    written = np.flatnonzero(np.abs(np.asarray(after.k[1])).sum(axis=(1, 2)))
    assert written.tolist() == [3]  # row 1 was padding
    with pytest.raises(BadInputError, match="mtp"):
        Q.Qwen35Model(QC.Qwen35Config(**{**TINY, "mtp_num_hidden_layers": 0})).mtp_init_cache(8)
