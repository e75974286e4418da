"""The Gemma 4 assistant (``gemma4_assistant``): its config, params and draft step as pure
functions over its target.

The assistant keeps no cache of its own: every one of its layers attends over the K/V its
target keeps (the last KV-owning layer of each kind, as the reference's shared KV states).
Each draft step reads the target's scaled embedding of the last token beside a hidden state
(the target's final-normed hidden state for the first step, then the assistant's own projected
one), projects them to its width, runs its decoder with the query at the position of that
token, and returns logits and the hidden state for the next step. All steps of a round sit at
the same position and see the same target rows, so a round is a ``lax.scan`` with no state.

What the query sees follows the reference, which hands the assistant the target's keys and
masks them bidirectionally: every target row before ``position`` in full layers, and the last
``sliding_window + 1`` of them (the assistant's own window) in sliding ones. With
``use_ordered_embeddings`` the vocabulary is narrowed through centroids: only the tokens of
the ``centroid_intermediate_top_k`` best centroids get logits, every other token the smallest
of those minus one.

Params (``D`` the assistant's hidden size, ``Db`` the target's, ``C`` centroids)::

    model: embed_tokens [V, D], norm [D], layers (as gemma4's, without K/V weights)
    pre_projection [2 Db, D]   post_projection [D, Db]   lm_head [D, V] (untied only)
    centroids [D, C]   token_ordering int32 [V]                    (ordered embeddings only)

The drafter that pairs it with its target is
:class:`~turbospark_jax.speculative.drafters.gemma4_assistant.Gemma4AssistantDrafter`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.kernels.layers import rms_norm
from turbospark_jax.models.family import HFTensor, Params
from turbospark_jax.models.gemma4 import model as gemma4
from turbospark_jax.models.gemma4.config import FULL, SLIDING, Gemma4Config


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    """``Gemma4AssistantConfig``: the assistant's text decoder (every layer reads shared
    K/V, no PLE) and the drafter's own fields, with the reference's names and defaults."""

    text: Gemma4Config
    backbone_hidden_size: int = 1536
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> AssistantConfig:
        """Parse a ``gemma4_assistant`` config.json.

        Raises:
          ModelLoadError: naming the key, for another model type, a malformed value, a text
            config the assistant cannot have (PLE, MoE, double-wide MLP, layers that keep
            their own K/V) or a vocabulary the centroids do not divide.
        """
        if not isinstance(d, Mapping) or d.get("model_type") != "gemma4_assistant":
            raise ModelLoadError("config.json key 'model_type' must be 'gemma4_assistant'")
        text = dict(d.get("text_config") or {})
        text["model_type"] = "gemma4_text"
        # The reference makes every layer read shared K/V when the text config leaves it 0.
        if not text.get("num_kv_shared_layers"):
            text["num_kv_shared_layers"] = text.get("num_hidden_layers", 30)
        text.setdefault("hidden_size_per_layer_input", 256)
        for key, allowed in (("hidden_size_per_layer_input", 0), ("use_double_wide_mlp", False),
                             ("enable_moe_block", False)):
            if text.get(key, allowed) != allowed:
                raise ModelLoadError(f"config.json key 'text_config.{key}' must be {allowed} for "
                                     f"an assistant, got {text[key]!r}")
        parsed = Gemma4Config.from_hf_dict(text)
        if not parsed.reads_target_kv:
            raise ModelLoadError("config.json key 'text_config.num_kv_shared_layers' must equal "
                                 "num_hidden_layers: every assistant layer reads the target's KV")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "text":
                continue
            value = d.get(f.name, f.default)
            if type(value) is not type(f.default):
                raise ModelLoadError(f"config.json key {f.name!r} must be "
                                     f"{type(f.default).__name__}, got {value!r}")
            values[f.name] = value
        config = cls(text=parsed, **values)
        if config.use_ordered_embeddings and (
            parsed.vocab_size % config.num_centroids
            or not 0 < config.centroid_intermediate_top_k <= config.num_centroids
        ):
            raise ModelLoadError("config.json keys 'num_centroids' / "
                                 "'centroid_intermediate_top_k' must divide the vocabulary into "
                                 "equal centroids and pick at most all of them")
        return config


def param_shapes(config: AssistantConfig) -> Params:
    """The params tree with a shape tuple at every leaf (layout in the module docstring)."""
    text = dataclasses.replace(config.text, tie_word_embeddings=True)  # no head in the decoder
    d, db, v = text.hidden_size, config.backbone_hidden_size, text.vocab_size
    tree: Params = {"model": gemma4.param_shapes(text), "pre_projection": (2 * db, d),
                    "post_projection": (d, db)}
    if not config.tie_word_embeddings:
        tree["lm_head"] = (d, v)
    if config.use_ordered_embeddings:
        tree.update(centroids=(d, config.num_centroids), token_ordering=(v,))
    return tree


def hf_tensors(config: AssistantConfig) -> list[HFTensor]:
    """Every tensor an assistant folder holds, and the leaf it fills (``token_ordering`` is an
    integer buffer: load it as int32)."""
    text = dataclasses.replace(config.text, tie_word_embeddings=True)
    out = [dataclasses.replace(t, key=("model", *t.key)) for t in gemma4.hf_tensors(text)]
    for key, shape in param_shapes(config).items():
        if key == "token_ordering":
            out.append(HFTensor("masked_embedding.token_ordering", (key,), shape))
        elif key != "model":
            name = "masked_embedding.centroids" if key == "centroids" else key
            out.append(HFTensor(f"{name}.weight", (key,), shape[::-1], transpose=True))
    return out


def init_params(config: AssistantConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random params (the decoder as :func:`gemma4.init_params`, the token order a random
    permutation)."""
    keys = jax.random.split(key, 5)
    text = dataclasses.replace(config.text, tie_word_embeddings=True)
    shapes = param_shapes(config)
    params: Params = {"model": gemma4.init_params(text, keys[0], dtype)}
    for k, name in zip(keys[1:], ("pre_projection", "post_projection", "lm_head", "centroids"),
                       strict=True):
        if name in shapes:
            w = jax.random.normal(k, shapes[name], jnp.float32) * text.initializer_range
            params[name] = w.astype(dtype)
    if config.use_ordered_embeddings:
        params["token_ordering"] = jax.random.permutation(keys[4], text.vocab_size).astype(
            jnp.int32)
    return params


def _logits(config: AssistantConfig, params: Params, h: jax.Array) -> jax.Array:
    """h [D] (final-normed) -> float32 logits [V], narrowed through the centroids if asked."""
    head = params["model"]["embed_tokens"] if config.tie_word_embeddings else params["lm_head"].T
    if not config.use_ordered_embeddings:
        return jnp.einsum("d,vd->v", h, head, preferred_element_type=jnp.float32)
    per_centroid = config.text.vocab_size // config.num_centroids
    _, best = jax.lax.top_k(h @ params["centroids"], config.centroid_intermediate_top_k)
    ids = params["token_ordering"].reshape(config.num_centroids, per_centroid)[best].reshape(-1)
    chosen = jnp.einsum("d,kd->k", h, head[ids], preferred_element_type=jnp.float32)
    return jnp.full((config.text.vocab_size,), chosen.min() - 1.0).at[ids].set(chosen)


def draft_step(
    config: AssistantConfig, params: Params, target: gemma4.Gemma4Model, target_params: Params,
    target_cache: gemma4.Gemma4Cache, token: jax.Array, hidden: jax.Array, position: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One draft: the token at ``position`` -> logits for ``position + 1``.

    Args:
      config, params: the assistant.
      target, target_params, target_cache: the target model, whose cache holds the rows at
        positions ``< position`` (its ring must still hold the last ``sliding_window + 1``).
      token: int32 ``[]``, the last token (not yet fed to the target).
      hidden: ``[Db]``, the target's final-normed hidden state of the row before it
        (:meth:`Gemma4Model.block_hidden`) on the first step, then the previous step's.
      position: int32 ``[]``, the position of ``token``.

    Returns:
      float32 logits ``[V]`` and the hidden state ``[Db]`` the next step takes.

    Raises:
      BadInputError: the assistant was not made for this target (its width or head dims).
    """
    text, tc = config.text, target.config
    if config.backbone_hidden_size != tc.hidden_size:
        raise BadInputError(f"the assistant's backbone_hidden_size ({config.backbone_hidden_size}"
                            f") is not the target's hidden_size ({tc.hidden_size})")
    for i in range(text.num_hidden_layers):
        kind = text.layer_types[i]
        if kind not in tc.layer_types or text.dims(i) != tc.dims(tc.owners(kind)[-1]):
            raise BadInputError(f"assistant layer {i} ({kind}, head dim and KV heads "
                                f"{text.dims(i)}) has no matching target cache")
    # The reference's bidirectional mask over the handed-in keys, written as causal attention:
    # keys shifted one position up (so the query at `position` sees rows < position) and a
    # window one wider (the last sliding_window + 1 rows).
    layers = gemma4.Gemma4Model(
        dataclasses.replace(text, sliding_window=text.sliding_window + 1), target.dtype)
    keys = {}
    if tc.owners(FULL):  # the target's rows in its dtype (dequantized from a quantized cache)
        capacity = target_cache.k_full[-1].shape[0]
        keys[FULL] = (*target.last_owner_kv(target_cache, FULL),
                      jnp.arange(capacity, dtype=jnp.int32) + 1)
    if tc.owners(SLIDING):
        keys[SLIDING] = (*target.last_owner_kv(target_cache, SLIDING),
                         target_cache.ring_positions + 1)
    x = jnp.concatenate([target.embed_tokens(target_params, token[None]), hidden[None]], -1)
    x = x.astype(target.dtype) @ params["pre_projection"]
    x = layers.decoder(params["model"], x, None, position[None].astype(jnp.int32), None, keys)
    h = rms_norm(x, params["model"]["norm"], text.rms_norm_eps, weight_in_float32=True)[0]
    return _logits(config, params, h), h @ params["post_projection"]


@functools.partial(jax.jit, static_argnums=(0, 2, 8))
def draft_greedy(
    config: AssistantConfig, params: Params, target: gemma4.Gemma4Model, target_params: Params,
    target_cache: gemma4.Gemma4Cache, token: jax.Array, hidden: jax.Array, position: jax.Array,
    steps: int,
) -> tuple[jax.Array, jax.Array]:
    """``steps`` greedy drafts after ``token`` (each fed back), as the reference's candidate
    generator makes them: int32 tokens ``[steps]`` and float32 logits ``[steps, V]``."""

    def step(carry: tuple[jax.Array, jax.Array], _: None) -> Any:
        tok, h = carry
        logits, h = draft_step(config, params, target, target_params, target_cache, tok, h,
                               position)
        tok = jnp.argmax(logits).astype(jnp.int32)
        return (tok, h), (tok, logits)

    _, (tokens, logits) = jax.lax.scan(
        step, (jnp.asarray(token, jnp.int32), hidden), None, length=steps)
    return tokens, logits
