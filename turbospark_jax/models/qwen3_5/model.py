"""The Qwen3.5 / Qwen3-Next family: ``qwen3_5_text`` and ``qwen3_next`` folders, and the text
decoder of ``qwen3_5`` folders, with the multi-token-prediction (MTP) head their checkpoints
carry: params, the model, and the family's declaration for loading. The config is
:mod:`~turbospark_jax.models.qwen3_5.config`.

A decoder mixes two kinds of layer (``layer_types``): *linear attention* (a gated DeltaNet: a
depthwise causal conv1d with SiLU over the q/k/v projections, then the delta rule on a float32
state ``S [Hv, dk, dv]`` per value head, decayed by ``exp(g)``, ``g = -exp(A_log) *
softplus(a + dt_bias)``, written with strength ``beta = sigmoid(b)`` from L2-normalised q and k,
read by q, then an RMSNorm gated by ``silu(z)``) and *gated full attention* (a q projection twice
as wide, each head split into query and gate; per-head q/k norms; RoPE on the first
``partial_rotary_factor`` of each head; the output times ``sigmoid(gate)``). Every layer ends in
a dense SwiGLU MLP; every RMSNorm but the gated one is zero-centred (scale ``1 + w``, in float32).
Qwen3-Next fuses the DeltaNet projections (``in_proj_qkvz`` / ``in_proj_ba``, grouped per key
head); Qwen3.5 keeps them apart. A layer may hold a mixture of experts instead of the dense MLP
(:mod:`~turbospark_jax.models.moe`).

Row by row: the recurrence walks the rows of a block one at a time, every row by the same loop
body (padding rows leave the state as it was), so decode, chunked prefill and verify are one
program and chunked == token by token holds bitwise. Where the walk runs is the model's kernel
plan (:attr:`Qwen35Model.plan`), which loading resolves from the backend
(:func:`~turbospark_jax.kernels.plan.kernel_plan`;
:func:`~turbospark_jax.kernels.plan.delta_rule_walk` reads it): on a GPU where the head sizes
suit it, one Pallas kernel per layer walks the live rows, the causal conv, the q/k norms and
the gates of each row included (:mod:`~turbospark_jax.kernels.delta_rule`; a loop of XLA
kernels there returns to the host on every pass, and the preamble is several small kernels
more); on a TPU where they suit it, a Pallas TPU kernel walks the live rows with the state held
in VMEM, after the preamble in XLA (:mod:`~turbospark_jax.kernels.tpu_delta_rule`); elsewhere,
and on a tensor-parallel mesh (:meth:`Qwen35Model.for_mesh`: a kernel is a single-device custom
call), a loop of XLA kernels walks all ``W`` rows, selecting the padding ones away. The walks
agree within float32 rounding; each is one program for every path, so the bitwise guarantees
hold within any of them. The plan also picks the grouped experts' form of a mixture-of-experts
layer (:func:`~turbospark_jax.kernels.plan.grouped_impl`).

The walk also writes a tape: each live row's conv and recurrent state (``retain_rows`` selects
from it, so ``rollback_retaining`` needs no replay) and each row's final hidden state (what the
MTP head reads). The recurrent tape is written in place and only for live rows, so a decode
step writes one state per layer; it holds ``max_width`` rows per linear layer, ``Hv * dk *
dv * 4`` bytes each.

Training and the parallel prefill (:meth:`Qwen35Model.train_forward`, wide headless passes) run
the chunked delta rule (:mod:`~turbospark_jax.models.qwen3_5.delta_rule`) instead: matrix
products over chunks of rows, within a tolerance of the walk.

Params (``D`` hidden, ``V`` vocab, ``F`` MLP width, ``H``/``KV``/``hd`` attention heads, ``C``
the conv channels ``2 * Hk * dk + Hv * dv``, ``K`` the conv width); matrices are ``[in, out]``
and ``layers`` is a list::

    embed_tokens [V, D]   norm [D]   lm_head [D, V] (untied only)
    layers[i]: input_layernorm, post_attention_layernorm [D]; gate_proj, up_proj [D, F];
               down_proj [F, D]; and, by kind,
      full:    q_proj [D, H*2*hd]  k_proj, v_proj [D, KV*hd]  o_proj [H*hd, D]  q_norm, k_norm [hd]
               q_bias [H*2*hd]  k_bias, v_bias [KV*hd]  o_bias [D]        (attention_bias only)
      linear:  in_proj_qkv [D, C]  in_proj_z [D, Hv*dv]  in_proj_b, in_proj_a [D, Hv]  (qwen3_5)
               in_proj_qkvz [D, Hk, 2*dk + 2*r*dv]  in_proj_ba [D, Hk, 2*r]  (qwen3_next, r=Hv/Hk)
               conv1d [K, C]  dt_bias, A_log [Hv]  gated_norm [dv]  out_proj [Hv*dv, D]

That is the layout of a folder (:func:`param_shapes`, what loading reads and saving writes).
The model runs a linear layer's input projections as one product: :func:`join_projections`
stores them side by side as ``in_proj [D, N]`` (the parts' columns in the order above,
flattened; ``N = C + Hv*dv + 2*Hv`` either way) when the params are initialised or loaded,
and :func:`split_projections` parts them again for saving and for a tensor-parallel mesh
(which splits each part on its own units). Quantized parts stay apart: the layer then runs
the parts' products and joins their outputs.
    mtp (mtp_num_hidden_layers > 0): pre_fc_norm_embedding, pre_fc_norm_hidden, norm [D];
               fc [2*D, D]; layers: full-attention layer dicts as above

A layer with experts (``E`` experts of width ``Fe``, a shared expert of width ``S``;
:mod:`~turbospark_jax.models.moe`) has, instead of ``gate_proj``, ``up_proj`` and
``down_proj``::

      router [E, D] (as the file keeps it)   expert_gate, expert_up [E, D, Fe]
      expert_down [E, Fe, D]   shared_gate, shared_up [D, S]   shared_down [S, D]
      shared_expert_gate [D, 1]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from turbospark_jax.core.state import append_only, scratch
from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.kernels import delta_rule as pallas_delta_rule
from turbospark_jax.kernels import plan as kernel_plans
from turbospark_jax.kernels import tpu_delta_rule
from turbospark_jax.kernels.layers import (
    apply_rope,
    attend,
    causal_attention,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    swiglu_mlp,
)
from turbospark_jax.kernels.plan import XLA_PLAN, KernelPlan, check_backend_plan
from turbospark_jax.models.base import BlockModel, check_tap_layers
from turbospark_jax.models.family import Family, HFTensor, Params
from turbospark_jax.models.moe import ExpertParallel, moe_block, moe_leaves
from turbospark_jax.models.qwen3_5.config import (
    ARCHITECTURES,
    FULL,
    LINEAR,
    MULTIMODAL,
    Qwen35Config,
)
from turbospark_jax.models.qwen3_5.delta_rule import delta_rule_chunked
from turbospark_jax.quant import kv as kv_quant
from turbospark_jax.quant.weights import as_array, is_quantized, take_rows, tied_logits

# -- params ----------------------------------------------------------------------------------


def _full_layer_shapes(c: Qwen35Config, sparse: bool) -> dict[str, tuple[int, ...]]:
    d, h, kv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    lp = {"input_layernorm": (d,), "post_attention_layernorm": (d,),
          "q_proj": (d, h * 2 * hd), "k_proj": (d, kv * hd), "v_proj": (d, kv * hd),
          "o_proj": (h * hd, d), "q_norm": (hd,), "k_norm": (hd,)}
    if sparse:
        e, fe, sh = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
        lp.update(router=(e, d), expert_gate=(e, d, fe), expert_up=(e, d, fe),
                  expert_down=(e, fe, d), shared_gate=(d, sh), shared_up=(d, sh),
                  shared_down=(sh, d), shared_expert_gate=(d, 1))
    else:
        lp.update(gate_proj=(d, c.intermediate_size), up_proj=(d, c.intermediate_size),
                  down_proj=(c.intermediate_size, d))
    if c.attention_bias:
        lp.update(q_bias=(h * 2 * hd,), k_bias=(kv * hd,), v_bias=(kv * hd,), o_bias=(d,))
    return lp


def param_shapes(config: Qwen35Config) -> Params:
    """The params tree with a shape tuple at every leaf, as a folder lays them out (module
    docstring); the model runs each linear layer's input projections joined
    (:func:`join_projections`)."""
    c = config
    d, nk, nv = c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv, r = c.linear_key_head_dim, c.linear_value_head_dim, nv // nk
    tree: Params = {"embed_tokens": (c.vocab_size, d), "norm": (d,)}
    if not c.tie_word_embeddings:
        tree["lm_head"] = (d, c.vocab_size)
    layers = []
    for kind, sparse in zip(c.layer_types, c.sparse_layers, strict=True):
        lp = _full_layer_shapes(c, sparse)
        if kind == LINEAR:
            for key in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
                        "q_bias", "k_bias", "v_bias", "o_bias"):
                lp.pop(key, None)
            if c.fused:
                lp.update(in_proj_qkvz=(d, nk, 2 * dk + 2 * r * dv), in_proj_ba=(d, nk, 2 * r))
            else:
                lp.update(in_proj_qkv=(d, c.conv_dim), in_proj_z=(d, nv * dv),
                          in_proj_b=(d, nv), in_proj_a=(d, nv))
            lp.update(conv1d=(c.linear_conv_kernel_dim, c.conv_dim), dt_bias=(nv,),
                      A_log=(nv,), gated_norm=(dv,), out_proj=(nv * dv, d))
        layers.append(lp)
    tree["layers"] = layers
    if c.mtp_num_hidden_layers:
        tree["mtp"] = {"pre_fc_norm_embedding": (d,), "pre_fc_norm_hidden": (d,),
                       "fc": (2 * d, d), "norm": (d,),
                       "layers": [_full_layer_shapes(c, c.moe)
                                  for _ in range(c.mtp_num_hidden_layers)]}
    return tree


# Our per-layer leaf -> its name under ``layers.{i}.`` in a Hugging Face folder.
_HF_LAYER_NAMES = {
    **{k: f"self_attn.{k}.weight" for k in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                            "k_norm")},
    **{f"{k}_bias": f"self_attn.{k}_proj.bias" for k in "qkvo"},
    **{k: f"mlp.{k}.weight" for k in ("gate_proj", "up_proj", "down_proj")},
    **{k: f"{k}.weight" for k in ("input_layernorm", "post_attention_layernorm")},
    **{k: f"linear_attn.{k}.weight" for k in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                              "in_proj_a", "in_proj_qkvz", "in_proj_ba",
                                              "out_proj", "conv1d")},
    "dt_bias": "linear_attn.dt_bias", "A_log": "linear_attn.A_log",
    "gated_norm": "linear_attn.norm.weight",
    "router": "mlp.gate.weight",
    **{f"shared_{k}": f"mlp.shared_expert.{k}_proj.weight" for k in ("gate", "up", "down")},
    "shared_expert_gate": "mlp.shared_expert_gate.weight",
    **{f"expert_{k}": f"mlp.experts.{{e}}.{k}_proj.weight" for k in ("gate", "up", "down")},
}


def hf_tensors(config: Qwen35Config) -> list[HFTensor]:
    """Every tensor a folder of ``config`` holds (MTP ones when ``mtp_num_hidden_layers``)."""
    c = config
    top = "model.language_model." if c.model_type in MULTIMODAL else "model."
    shapes = param_shapes(c)
    out: list[HFTensor] = []

    def add(name: str, key: tuple[str | int, ...], shape: tuple[int, ...]) -> None:
        if key[-1] in ("embed_tokens", "router") or len(shape) == 1:  # kept as stored
            out.append(HFTensor(name, key, shape))
        elif key[-1].startswith("expert_"):  # one nn.Linear [out, in] per expert
            out.extend(HFTensor(name.format(e=e), key, shape[:0:-1], transpose=True, stacked=e)
                       for e in range(shape[0]))
        elif key[-1] == "conv1d":  # nn.Conv1d keeps [C, 1, K]; ours is [K, C]
            out.append(HFTensor(name, key, (shape[1], 1, shape[0]), transpose=True))
        else:  # nn.Linear keeps [out, in]; ours is [in, ...out]
            out.append(HFTensor(name, key, (math.prod(shape[1:]), shape[0]), transpose=True))

    add(top + "embed_tokens.weight", ("embed_tokens",), shapes["embed_tokens"])
    add(top + "norm.weight", ("norm",), shapes["norm"])
    if "lm_head" in shapes:
        add("lm_head.weight", ("lm_head",), shapes["lm_head"])
    for i, lp in enumerate(shapes["layers"]):
        for key, shape in lp.items():
            add(f"{top}layers.{i}.{_HF_LAYER_NAMES[key]}", ("layers", i, key), shape)
    for key, shape in shapes.get("mtp", {}).items():
        if key != "layers":
            add(f"mtp.{key}.weight", ("mtp", key), shape)
    for j, lp in enumerate(shapes.get("mtp", {}).get("layers", [])):
        for key, shape in lp.items():
            add(f"mtp.layers.{j}.{_HF_LAYER_NAMES[key]}", ("mtp", "layers", j, key), shape)
    return out


_TOLERATED = re.compile(r"^model\.visual\.|rotary_emb\.inv_freq$")


def tolerated(name: str) -> bool:
    """Tensors a folder may carry that the text decoder ignores: the vision tower of a
    ``qwen3_5`` folder and recomputed rotary tables. (MTP tensors are always loaded when the
    config declares them, so they are not tolerated.)"""
    return bool(_TOLERATED.search(name))


def init_params(config: Qwen35Config, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random params like the reference's init: matrices ~ N(0, initializer_range), zero-centred
    norms 0, the gated norm and ``dt_bias`` 1, biases 0, ``A_log`` = log U(1, 16); the
    DeltaNet input projections joined (:func:`join_projections`)."""
    return join_projections(config, _init_params(config, key, jnp.dtype(dtype)))


def projection_parts(config: Qwen35Config) -> tuple[str, ...]:
    """A linear layer's input projections as a folder keeps them, in the order their columns
    are joined into ``in_proj``."""
    if config.fused:
        return ("in_proj_qkvz", "in_proj_ba")
    return ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def join_projections(config: Qwen35Config, params: Params) -> Params:
    """``params`` (numpy or jax leaves) with each linear layer's input projections joined into
    one ``in_proj [D, N]``, so the layer runs one product where it ran several on the same
    rows (a product's columns do not mix, so each part's outputs are what its own product
    gives, up to how the compiler blocks the wider product). A layer whose parts are
    quantized, or joined already, is left as it is. The other leaves are shared, not
    copied."""
    names = projection_parts(config)

    def join(lp: Params) -> Params:
        parts = [lp.get(n) for n in names]
        if any(p is None or is_quantized(p) for p in parts):
            return lp
        lib = np if all(isinstance(p, np.ndarray) for p in parts) else jnp
        joined = lib.concatenate([p.reshape(p.shape[0], -1) for p in parts], axis=1)
        return {**{k: v for k, v in lp.items() if k not in names}, "in_proj": joined}

    return {**params, "layers": [join(lp) if kind == LINEAR else lp for kind, lp in
                                 zip(config.layer_types, params["layers"], strict=True)]}


def split_projections(config: Qwen35Config, params: Params) -> Params:
    """:func:`join_projections` undone: each joined ``in_proj`` parted into the projections a
    folder keeps (shapes as :func:`param_shapes`); params without one are returned as they
    are."""
    names = projection_parts(config)
    shapes = param_shapes(config)["layers"]

    def split(lp: Params, shape: Params) -> Params:
        if "in_proj" not in lp:
            return lp
        joined, start, parts = lp["in_proj"], 0, {}
        for name in names:
            width = math.prod(shape[name][1:])
            parts[name] = joined[:, start : start + width].reshape(shape[name])
            start += width
        return {**{k: v for k, v in lp.items() if k != "in_proj"}, **parts}

    return {**params, "layers": [split(lp, sh) for lp, sh in
                                 zip(params["layers"], shapes, strict=True)]}


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params(config: Qwen35Config, key: jax.Array, dtype: jnp.dtype) -> Params:
    paths, treedef = jax.tree.flatten_with_path(
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    sizes = [math.prod(shape) for _, shape in paths]
    # One draw for every leaf, sliced: a threefry per leaf makes a program slow to compile.
    k_normal, k_uniform = jax.random.split(key)
    normal = jax.random.normal(k_normal, (sum(sizes),)) * config.initializer_range
    uniform = jax.random.uniform(k_uniform, (sum(sizes),), minval=1.0, maxval=16.0)
    leaves, start = [], 0
    for (path, shape), size in zip(paths, sizes, strict=True):
        name, part = path[-1].key, slice(start, start + size)
        start += size
        if name in ("gated_norm", "dt_bias"):
            leaf = jnp.ones(shape)
        elif name == "A_log":
            leaf = jnp.log(uniform[part]).reshape(shape)
        elif "norm" in name or name.endswith("bias"):
            leaf = jnp.zeros(shape)
        else:
            leaf = normal[part].reshape(shape)
        leaves.append(leaf.astype(dtype))
    return jax.tree.unflatten(treedef, leaves)


# -- the model -------------------------------------------------------------------------------


@struct.dataclass(kw_only=True)
class Qwen35Cache:
    """Cache of the trunk (``C`` positions, ``Wm`` = ``max_width`` tape rows).

    Fields:
      k, v: per full-attention layer ``[C, KV, hd]`` (keys normed and rotated); one
        ``[0, C, KV, hd]`` array when the model has no full layer.
      conv: per linear layer ``[K - 1, conv_dim]``, the last ``K - 1`` conv inputs (model dtype).
      recurrent: per linear layer float32 ``[Hv, dk, dv]``, the delta-rule state.
      conv_tape, recurrent_tape: scratch, per linear layer ``[Wm, K - 1, conv_dim]`` and
        ``[Wm, Hv, dk, dv]``: the state after each row of the last block. Only the rows below
        its live count mean anything (past it the conv tape repeats the last live row's state
        and the recurrent tape keeps whatever an earlier block left).
      hidden: scratch ``[Wm, D]``, each row's final hidden state after the final norm (what the
        output head and the MTP head read), for the last block.
      hidden_rows: ``[C, D]`` (``[0, D]`` without an MTP head), the same for every fed
        position: what the MTP drafter primes its own rows from.
      k_scale, v_scale: for a quantized cache (:attr:`Qwen35Model.kv_dtype`), per full
        layer each stored row's float32 scale ``[C, KV]`` (:mod:`~turbospark_jax.quant.kv`);
        ``()`` otherwise. The linear layers' states are not a KV cache and stay as they are.
    """

    k: tuple[jax.Array, ...] | jax.Array = append_only(axis=1)
    v: tuple[jax.Array, ...] | jax.Array = append_only(axis=1)
    k_scale: tuple[jax.Array, ...] = kv_quant.scale_field(append_only(axis=1))
    v_scale: tuple[jax.Array, ...] = kv_quant.scale_field(append_only(axis=1))
    conv: tuple[jax.Array, ...]
    recurrent: tuple[jax.Array, ...]
    conv_tape: tuple[jax.Array, ...] = scratch()
    recurrent_tape: tuple[jax.Array, ...] = scratch()
    hidden: jax.Array = scratch()
    hidden_rows: jax.Array = append_only(axis=0)


@struct.dataclass(kw_only=True)
class TappedQwen35Cache(Qwen35Cache):
    """A :class:`Qwen35Cache` that also records the output rows of the model's tap layers
    (:attr:`Qwen35Model.tap_layers`) for every fed position, for a block drafter to read.

    Fields (besides the trunk's):
      taps: ``[C, K, D]``: row ``p`` holds the output of each of the ``K`` tap layers (in
        ``tap_layers`` order, after the layer's MLP) at position ``p``, in the model dtype.
        Append-only like the KV rows and written by every pass that feeds rows (decode,
        chunked prefill, verify, parallel prefill), so a rollback by value keeps the live
        rows and the cursor hides the rest; the exact program writes bitwise the same rows
        whether a position was fed alone or in a block.
    """

    taps: jax.Array = append_only(axis=0)


@struct.dataclass(kw_only=True)
class MTPCache:
    """KV rows of the MTP head's layers: ``k``, ``v`` per layer ``[C, KV, hd]``; row ``p``
    holds what the head computed from the trunk's hidden state at position ``p``."""

    k: tuple[jax.Array, ...] = append_only(axis=1)
    v: tuple[jax.Array, ...] = append_only(axis=1)


def _norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm: scale ``1 + weight`` applied in float32, rounded once (unlike
    :func:`~turbospark_jax.kernels.layers.rms_norm`, which rounds before its scale)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _delta_row(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
               live: jax.Array, r: jax.Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
    """Row ``r`` of the XLA walk (``carry``: state, outputs, tape or None); a padding row
    changes nothing, its values selected away."""
    s, outs, states = carry
    decayed = s * jnp.exp(g[r])[:, None, None]  # [Hv, dk, dv]
    delta = (v[r] - jnp.einsum("hkv,hk->hv", decayed, k[r])) * beta[r][:, None]
    new = decayed + k[r][:, :, None] * delta[:, None, :]
    on = r < live
    outs = outs.at[r].set(jnp.where(on, jnp.einsum("hkv,hk->hv", new, q[r]), outs[r]))
    if states is not None:
        states = states.at[r].set(jnp.where(on, new, states[r]))
    return jnp.where(on, new, s), outs, states


KVFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]
State = tuple[jax.Array, jax.Array]  # (conv [K-1, C], recurrent float32 [Hv, dk, dv])


@dataclasses.dataclass(frozen=True)
class Qwen35Model(BlockModel):
    """The Qwen3.5 / Qwen3-Next decoder (and its MTP head) as pure functions.

    Attributes:
      config: the hyperparameters.
      dtype: activation / KV / conv-state dtype; params should match. The recurrent state is
        always float32.
      max_width: the widest block ``block_forward`` accepts: the tapes keep this many rows.
      tap_layers: layers whose output rows the cache records for every fed position
        (:class:`TappedQwen35Cache`), for a block drafter; empty: none.
      kv_dtype: the stored form of the full-attention layers' K/V rows: ``None`` (the model
        dtype), ``"int8"`` or ``"fp8"`` (:mod:`~turbospark_jax.quant.kv`; set by
        :func:`~turbospark_jax.io.loading.load_folder`'s ``kv_dtype``). The MTP head's own
        rows stay in the model dtype.
      expert_parallel: the expert stacks split over a mesh axis
        (:class:`~turbospark_jax.models.moe.ExpertParallel`; set by
        :class:`~turbospark_jax.parallel.sharding.ShardedProducer` on a mesh with an expert
        axis), or None.
      plan: the backend's kernels (:class:`~turbospark_jax.kernels.plan.KernelPlan`, never
        row-invariant here): how the exact path walks the delta rule's rows
        (:attr:`row_walk`) and the grouped experts' form. XLA's by default; loading resolves
        the backend's (:func:`~turbospark_jax.io.loading.serving_plan`), and
        :meth:`for_mesh` and :meth:`interpreted` set others.
    """

    can_tap = True
    rewindable = False  # the recurrent leaves summarise every fed token: no cursor rewinds them
    parallel_prefill = True  # wide headless passes with the chunked delta rule
    records_tape = True
    backend_kernels = True

    config: Qwen35Config
    dtype: Any = jnp.float32
    max_width: int = 16
    tap_layers: tuple[int, ...] = ()
    kv_dtype: str | None = None
    expert_parallel: ExpertParallel | None = None
    plan: KernelPlan = XLA_PLAN

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        kv_quant.check_kv_dtype(self.kv_dtype)
        check_tap_layers(self.tap_layers, self.config.num_hidden_layers)
        if self.max_width < 1:
            raise BadInputError(f"max_width must be >= 1, got {self.max_width}")
        check_backend_plan(self.plan, "Qwen3.5")

    def for_mesh(self) -> Qwen35Model:
        """This model with its plan's Pallas kernels off: the exact path's rows on the XLA
        loop, which a tensor-parallel mesh splits over the value heads, and the grouped
        experts on XLA's loop (a kernel is a single-device custom call the compiler cannot
        split)."""
        return dataclasses.replace(self, plan=dataclasses.replace(self.plan, pallas="off"))

    def interpreted(self, target: str = "gpu") -> Qwen35Model:
        """This model on the GPU's (or with ``target="tpu"`` the TPU's) kernels in the Pallas
        interpreter: a test fixture that runs that backend's walk on a CPU (slow: tiny models
        only), never a serving choice."""
        plan = KernelPlan.interpreted(row_invariant=False, target=target)
        return dataclasses.replace(self, plan=plan)

    @property
    def row_walk(self) -> str:
        """How the exact path walks the delta rule's rows
        (:func:`~turbospark_jax.kernels.plan.delta_rule_walk` of the plan and head sizes)."""
        c = self.config
        return kernel_plans.delta_rule_walk(self.plan, c.linear_key_head_dim,
                                            c.linear_value_head_dim)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def init_params(self, key: jax.Array) -> Params:
        return init_params(self.config, key, self.dtype)

    def _kv(self, capacity: int, layers: int,
            kv_dtype: str | None = None) -> tuple[jax.Array, ...] | jax.Array:
        c = self.config
        shape = (capacity, c.num_key_value_heads, c.head_dim)
        dtype = kv_quant.stored_dtype(kv_dtype, self.dtype)
        if not layers:  # an empty tuple has no position axis for the cache machinery to see
            return jnp.zeros((0, *shape), dtype)
        return tuple(jnp.zeros(shape, dtype) for _ in range(layers))

    def _zero_states(self) -> list[State]:
        c = self.config
        conv = (c.linear_conv_kernel_dim - 1, c.conv_dim)
        rec = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        return [(jnp.zeros(conv, self.dtype), jnp.zeros(rec, jnp.float32))
                for _ in range(c.count(LINEAR))]

    def init_cache(self, capacity: int) -> Qwen35Cache:
        """An empty cache holding ``capacity`` positions of KV rows (and of tap rows when the
        model has tap layers: a :class:`TappedQwen35Cache`)."""
        c, wm = self.config, self.max_width
        states = self._zero_states()
        taps = {}
        if self.tap_layers:
            taps["taps"] = jnp.zeros((capacity, len(self.tap_layers), c.hidden_size), self.dtype)
        n_full = c.count(FULL)
        scales = {}
        if self.kv_dtype is not None and n_full:
            shape = (capacity, c.num_key_value_heads)
            scales = {name: tuple(jnp.zeros(shape, kv_quant.SCALE_DTYPE) for _ in range(n_full))
                      for name in ("k_scale", "v_scale")}
        return (TappedQwen35Cache if taps else Qwen35Cache)(
            **taps, **scales,
            k=self._kv(capacity, n_full, self.kv_dtype), v=self._kv(capacity, n_full,
                                                                    self.kv_dtype),
            conv=tuple(s[0] for s in states), recurrent=tuple(s[1] for s in states),
            conv_tape=tuple(jnp.zeros((wm, *s[0].shape), self.dtype) for s in states),
            recurrent_tape=tuple(jnp.zeros((wm, *s[1].shape), jnp.float32)
                                 for s in states),
            hidden=jnp.zeros((wm, c.hidden_size), self.dtype),
            hidden_rows=jnp.zeros((capacity if c.mtp_num_hidden_layers else 0, c.hidden_size),
                                  self.dtype),
        )

    def retain_rows(self, restored: Qwen35Cache, current: Qwen35Cache,
                    keep_rows: int) -> Qwen35Cache:
        """``restored`` advanced over the first ``keep_rows`` rows of the last block: their
        states are read off the tape ``current`` holds (the KV rows are already written).
        ``hidden`` stays the last block's, so row ``keep_rows - 1`` is the kept one's.
        ``keep_rows`` may be traced (the device speculative loop), so the pick is a select."""
        keep = jnp.asarray(keep_rows)
        row = jnp.maximum(keep - 1, 0)

        def pick(tape: jax.Array, old: jax.Array) -> jax.Array:
            return jnp.where(keep > 0, tape[row], old)

        return restored.replace(
            conv=tuple(pick(t, o) for t, o in zip(current.conv_tape, restored.conv, strict=True)),
            recurrent=tuple(pick(t, o) for t, o in zip(current.recurrent_tape, restored.recurrent,
                                                       strict=True)),
            conv_tape=current.conv_tape, recurrent_tape=current.recurrent_tape,
            hidden=current.hidden,
        )

    # -- layers -------------------------------------------------------------------------------

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos/sin ``[W, rotary_dim]`` for the rotated part of each head."""
        c = self.config
        inv_freq, _ = rope_inv_freq(c.rotary_dim, c.rope_theta, None, c.max_position_embeddings)
        return rope_cos_sin(positions, inv_freq, 1.0, self.dtype)

    def _attention(self, lp: Params, h: jax.Array, positions: jax.Array,
                   rope: tuple[jax.Array, jax.Array], kv: KVFn) -> jax.Array:
        """Gated full attention: h [W, D] -> [W, D]. ``kv(k, v)`` stores this block's keys and
        values and returns what the rows attend over, ``(keys, values, key_positions)``."""
        q, k, v, gate = self._attention_inputs(lp, h, rope)
        keys, values, key_positions = kv(k, v)
        return self._attention_output(lp, attend(q, keys, values, positions, key_positions),
                                      gate)

    def _attention_inputs(self, lp: Params, h: jax.Array, rope: tuple[jax.Array, jax.Array]
                          ) -> tuple[jax.Array, ...]:
        """h [W, D] -> rotated queries [W, H, hd], rotated keys and values [W, KV, hd], and
        the output gate [W, H, hd]."""
        c, w = self.config, h.shape[0]
        bias = c.attention_bias
        hd, rd = c.head_dim, c.rotary_dim
        qg = h @ lp["q_proj"] + (lp["q_bias"] if bias else 0)
        qg = qg.reshape(w, c.num_attention_heads, 2, hd)
        q, gate = qg[:, :, 0], qg[:, :, 1]  # [W, H, hd] each
        k = (h @ lp["k_proj"] + (lp["k_bias"] if bias else 0)).reshape(w, -1, hd)
        v = (h @ lp["v_proj"] + (lp["v_bias"] if bias else 0)).reshape(w, -1, hd)
        q, k = _norm(q, lp["q_norm"], c.rms_norm_eps), _norm(k, lp["k_norm"], c.rms_norm_eps)
        # RoPE turns the first rotary_dim features of each head; the rest pass through.
        q = jnp.concatenate([apply_rope(q[..., :rd], *rope), q[..., rd:]], axis=-1)
        k = jnp.concatenate([apply_rope(k[..., :rd], *rope), k[..., rd:]], axis=-1)
        return q, k, v, gate

    def _attention_output(self, lp: Params, attn: jax.Array, gate: jax.Array) -> jax.Array:
        """Attention rows [..., H, hd] gated by ``sigmoid(gate)`` -> [..., D]."""
        gated = (attn * jax.nn.sigmoid(gate)).reshape(*attn.shape[:-2], -1)
        return gated @ lp["o_proj"] + (lp["o_bias"] if self.config.attention_bias else 0)

    def _projected(self, lp: Params, h: jax.Array) -> jax.Array:
        """h [W, D] -> the linear layer's input projections [W, N], columns as ``in_proj``'s:
        one product where they are joined, else each part's (quantized parts) side by
        side."""
        if "in_proj" in lp:
            return h @ lp["in_proj"]
        return jnp.concatenate([h @ lp[name].reshape(h.shape[-1], -1)
                                for name in projection_parts(self.config)], axis=-1)

    def _delta_inputs(self, proj: jax.Array) -> tuple[jax.Array, ...]:
        """The projections [W, N] -> conv input [W, C] (q, k, v channels), z [W, Hv, dv], b,
        a [W, Hv]."""
        c, w = self.config, proj.shape[0]
        nk, nv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads,
                          c.linear_key_head_dim, c.linear_value_head_dim)
        if not c.fused:
            mixed, z, b, a = jnp.split(proj, [c.conv_dim, c.conv_dim + nv * dv,
                                              c.conv_dim + nv * dv + nv], axis=-1)
            return mixed, z.reshape(w, nv, dv), b, a
        # Qwen3-Next groups the outputs per key head: [q, k, v of its r value heads, z of them],
        # then [b, a of them].
        r = nv // nk
        qkvz = proj[:, : nk * (2 * dk + 2 * r * dv)].reshape(w, nk, -1)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
        ba = proj[:, nk * (2 * dk + 2 * r * dv) :].reshape(w, nk, 2 * r)
        mixed = jnp.concatenate([q.reshape(w, -1), k.reshape(w, -1), v.reshape(w, -1)], axis=-1)
        return mixed, z.reshape(w, nv, dv), ba[..., :r].reshape(w, nv), ba[..., r:].reshape(w, nv)

    def _gate_columns(self) -> pallas_delta_rule.GateColumns:
        """Where each value head's ``b`` and ``a`` sit among the projected columns
        (:meth:`_projected`)."""
        c = self.config
        nk, nv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads,
                          c.linear_key_head_dim, c.linear_value_head_dim)
        r = nv // nk
        if not c.fused:  # [qkv | z | b | a], b and a per value head
            return pallas_delta_rule.GateColumns(c.conv_dim + nv * dv,
                                                 c.conv_dim + nv * dv + nv, r)
        ba = nk * (2 * dk + 2 * r * dv)  # then [b, a] of each key head's r value heads
        return pallas_delta_rule.GateColumns(ba, ba + r, 2 * r)

    def _delta_preamble(self, lp: Params, buf: jax.Array, b: jax.Array, a: jax.Array,
                        repeat: bool = True) -> tuple[jax.Array, ...]:
        """The delta rule's inputs for the walks after an XLA preamble: the conv window
        ``buf [K-1+W, C]`` convolved and SiLU'd, q and k L2-normalised (q scaled) and
        repeated over their value heads ``[W, Hv, dk]`` (``repeat``; else per key head, ``[W,
        Hk, dk]``), v ``[W, Hv, dv]``, and ``g``, ``beta [W, Hv]``, all float32."""
        c, f32 = self.config, jnp.float32
        nk, nv, dk = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim
        w = buf.shape[0] - c.linear_conv_kernel_dim + 1
        weight = lp["conv1d"].astype(f32)  # [K, C]
        acc = sum(buf[t : t + w].astype(f32) * weight[t]
                  for t in range(c.linear_conv_kernel_dim))
        conv_out = jax.nn.silu(acc).astype(self.dtype)  # [W, C]
        key_dim = nk * dk
        q = conv_out[:, :key_dim].reshape(w, nk, dk).astype(f32)
        k = conv_out[:, key_dim : 2 * key_dim].reshape(w, nk, dk).astype(f32)
        v = conv_out[:, 2 * key_dim :].reshape(w, nv, -1).astype(f32)
        q, k = _l2norm(q) * dk**-0.5, _l2norm(k)
        if repeat:  # each key head serves nv / nk consecutive value heads
            q, k = (jnp.repeat(t, nv // nk, axis=1) for t in (q, k))  # [W, Hv, dk]
        beta = jax.nn.sigmoid(b).astype(f32)  # [W, Hv]
        g = -jnp.exp(lp["A_log"].astype(f32)) * jax.nn.softplus(a.astype(f32) + lp["dt_bias"])
        return q, k, v, g, beta

    def _delta_net(self, lp: Params, h: jax.Array, state: State, live: jax.Array,
                   tape: jax.Array | None, chunked: bool = False,
                   ) -> tuple[jax.Array, State, Any]:
        """The gated DeltaNet over W rows from ``state``; rows ``>= live`` leave it unchanged.
        Returns ``(out [W, D], new state, tape)``. Given the layer's recurrent tape ``[Wm, Hv,
        dk, dv]``, the returned tape is the conv state after each row ``[W, K-1, C]`` and that
        recurrent tape with rows ``< live`` set to the state after each row (``None`` without
        a tape). ``chunked`` runs the recurrence in its chunked form
        (:mod:`~turbospark_jax.models.qwen3_5.delta_rule`; the parallel prefill's and
        training's, within a tolerance of the row-by-row walk; no tape)."""
        c, w = self.config, h.shape[0]
        taps, f32 = c.linear_conv_kernel_dim, jnp.float32
        proj = self._projected(lp, h)
        mixed, z, b, a = self._delta_inputs(proj)
        conv_state, rec = state
        buf = jnp.concatenate([conv_state, mixed.astype(self.dtype)], axis=0)  # [K-1+W, C]
        rows = jnp.arange(w, dtype=jnp.int32)
        # Every row runs the same loop body whatever the block's width or live count, so
        # chunked == token by token holds bitwise on any walk. Padding rows' outputs stay
        # zero and their tape rows as they were.
        walk = "chunked" if chunked else self.row_walk
        if walk in ("pallas", "interpret"):
            # One launch: the conv, the norms, the gates and the walk over the live rows.
            core, rec, tape = pallas_delta_rule.delta_net_rows(
                buf, proj, lp["conv1d"], lp["A_log"], lp["dt_bias"], rec, live, tape,
                key_heads=c.linear_num_key_heads, gates=self._gate_columns(),
                interpret=walk == "interpret")
            core = core.reshape(w, c.linear_num_value_heads, -1)  # [W, Hv, dv]
        elif walk in ("tpu", "tpu_interpret"):
            q, k, v, g, beta = self._delta_preamble(lp, buf, b, a, repeat=False)
            core, rec, tape = tpu_delta_rule.tpu_delta_rule(q, k, v, g, beta, rec, live, tape,
                                                            impl=walk)
            core = core.astype(self.dtype)  # [W, Hv, dv]
        else:
            q, k, v, g, beta = self._delta_preamble(lp, buf, b, a)
            if chunked:
                # Padding rows write nothing (beta 0) and decay nothing (g 0).
                real = (rows < live)[:, None]
                core, rec = delta_rule_chunked(q, k, v, jnp.where(real, g, 0.0),
                                               jnp.where(real, beta, 0.0), rec)
                tape = None
            else:
                # All W rows, padding ones selected away, so the trip count is a constant: a
                # loop that stops on data would read back to the host every pass on a GPU,
                # and must not sit inside the speculative rounds' recorded loops.
                rec, core, tape = jax.lax.fori_loop(
                    0, w, functools.partial(_delta_row, q, k, v, g, beta, live),
                    (rec, jnp.zeros(v.shape, f32), tape))
            core = core.astype(self.dtype)  # [W, Hv, dv]
        gated = rms_norm(core, lp["gated_norm"], c.rms_norm_eps).astype(f32)
        gated = (gated * jax.nn.silu(z.astype(f32))).astype(self.dtype)
        out = gated.reshape(w, -1) @ lp["out_proj"]
        # The conv state after row r is the K-1 inputs ending there (after the last live row
        # for padding rows).
        kept = jnp.minimum(rows + 1, live)
        new_conv = jax.lax.dynamic_slice_in_dim(buf, live, taps - 1, axis=0)
        tapes = None
        if tape is not None:
            tapes = (buf[kept[:, None] + jnp.arange(taps - 1)[None, :]], tape)
        return out, (new_conv, rec), tapes

    def _mlp(self, lp: Params, x: jax.Array, live: jax.Array | None = None) -> jax.Array:
        """The layer's MLP with its residual, rows x [W, D]; ``live``: bool [W], the rows
        that are not padding (a padding row's experts take no tile)."""
        with jax.named_scope("mlp"):
            h = _norm(x, lp["post_attention_layernorm"], self.config.rms_norm_eps)
            if "router" in lp:  # at one program width, like the rest of the model
                return x + moe_block(h, moe_leaves(lp), self.config.routing, row_invariant=False,
                                     placement=self.expert_parallel,
                                     impl=kernel_plans.grouped_impl(self.plan), live=live)
            return x + swiglu_mlp(h, lp["gate_proj"], lp["up_proj"], lp["down_proj"])

    def _full_layer(self, lp: Params, x: jax.Array, positions: jax.Array,
                    rope: tuple[jax.Array, jax.Array], kv: KVFn,
                    live: jax.Array | None = None) -> jax.Array:
        with jax.named_scope("attention"):
            h = _norm(x, lp["input_layernorm"], self.config.rms_norm_eps)
            x = x + self._attention(lp, h, positions, rope, kv)
        return self._mlp(lp, x, live)

    def _decoder(self, layers: list[Params], x: jax.Array, positions: jax.Array,
                 live: jax.Array, states: list[State], kv: Callable[[int], KVFn],
                 tapes_in: Sequence[jax.Array] | None, chunked: bool = False,
                 ) -> tuple[jax.Array, list[State], list[Any], jax.Array | None]:
        """Every layer over rows x [W, D]; ``kv(j)`` is full layer ``j``'s store-and-read;
        ``tapes_in`` the linear layers' recurrent tapes to write (``None``: no tape).
        Returns ``(x, states, tapes, taps)``: ``taps`` ``[W, K, D]`` are the outputs of the
        :attr:`tap_layers` (``None`` without any)."""
        c = self.config
        rope = self._rope(positions)
        real = jnp.arange(x.shape[0], dtype=jnp.int32) < live  # [W]
        states, tapes, taps = list(states), [], []
        for i, lp in enumerate(layers):
            j = c.kind_index(i)
            with jax.named_scope(f"layer_{i}"):
                if c.layer_types[i] == FULL:
                    x = self._full_layer(lp, x, positions, rope, kv(j), real)
                else:
                    with jax.named_scope("delta_rule"):
                        h = _norm(x, lp["input_layernorm"], c.rms_norm_eps)
                        o, states[j], layer_tape = self._delta_net(
                            lp, h, states[j], live, None if tapes_in is None else tapes_in[j],
                            chunked)
                    tapes.append(layer_tape)
                    x = self._mlp(lp, x + o, real)
            # Every layer's output rows are materialised as they are, tapped or not: on a GPU
            # the tap's extra reader can change how XLA fuses them into the next layer, and a
            # tapped target would then decode apart from an untapped one.
            x = jax.lax.optimization_barrier(x)
            if i in self.tap_layers:
                taps.append(x)
        return x, states, tapes, jnp.stack(taps, axis=1) if taps else None

    def _logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        """Normed hidden [W, D] -> float32 logits [W, V]."""
        if self.config.tie_word_embeddings:
            return tied_logits(hidden, params["embed_tokens"])
        return jnp.einsum("wd,dv->wv", hidden, as_array(params["lm_head"], hidden.dtype),
                          preferred_element_type=jnp.float32)

    def _embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        return take_rows(params["embed_tokens"], tokens, self.dtype)

    def _kv_store(self, buffers: list[jax.Array], write_at: jax.Array,
                  key_positions: jax.Array, scales: list[jax.Array] | None = None,
                  ) -> Callable[[int], KVFn]:
        """A ``kv`` for :meth:`_decoder` writing into per-layer ``buffers`` (k, v interleaved)
        in place; padding rows go to distinct out-of-range rows, which ``drop`` discards.
        With ``scales`` (the buffers' row scales, interleaved alike) the rows are written
        quantized by :attr:`kv_dtype` and read back dequantized."""
        scatter = {"mode": "drop", "unique_indices": True}
        kv_dtype = self.kv_dtype if scales else None

        def for_layer(j: int) -> KVFn:
            def store(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
                read = []
                for n, rows in ((2 * j, k), (2 * j + 1, v)):
                    buffers[n], scale = kv_quant.write(
                        buffers[n], scales[n] if kv_dtype else (), write_at, rows, kv_dtype,
                        **scatter)
                    if kv_dtype is not None:
                        scales[n] = scale
                    read.append(kv_quant.read(buffers[n], scale, self.dtype))
                return read[0], read[1], key_positions
            return store

        return for_layer

    # -- entry points -------------------------------------------------------------------------

    def block_forward(
        self,
        params: Params,
        cache: Qwen35Cache,
        tokens: jax.Array,
        positions: jax.Array,
        live: jax.Array,
        need_head: jax.Array,
        *,
        key_limit: int | None = None,
        fresh: bool = False,
    ) -> tuple[jax.Array, Qwen35Cache]:
        """Run ``W`` rows against the cache (see :meth:`BlockModel.block_forward`). Also writes
        the tape and ``hidden`` for the block.

        A parallel-prefill pass (either hint given) may be wider than ``max_width``: its
        DeltaNet layers run the chunked recurrence, and it writes no tape and leaves
        ``hidden`` as it was (a verify rewrites both before anything reads them); the trunk
        rows the MTP head reads (``hidden_rows``) are written as always.

        Raises:
          BadInputError: ``W > max_width`` outside a parallel pass (the tape could not hold
            every row).
        """
        parallel = fresh or key_limit is not None
        width = tokens.shape[0]
        if width > self.max_width and not parallel:
            raise BadInputError(f"a block of {width} rows exceeds the tape of max_width="
                                f"{self.max_width} rows")
        n_full = self.config.count(FULL)
        capacity = cache.k[0].shape[0] if n_full else cache.k.shape[1]
        rows = jnp.arange(width, dtype=jnp.int32)
        write_at = jnp.where(rows < live, positions, capacity + rows)  # [W]
        buffers = [b for pair in zip(cache.k, cache.v, strict=True) for b in pair]
        scales = [s for pair in zip(cache.k_scale, cache.v_scale, strict=True) for s in pair]
        kv = self._kv_store(buffers, write_at, jnp.arange(capacity, dtype=jnp.int32), scales)
        x = self._embed(params, tokens)
        states = list(zip(cache.conv, cache.recurrent, strict=True))
        x, states, tapes, taps = self._decoder(params["layers"], x, positions, live, states,
                                               kv, None if parallel else cache.recurrent_tape,
                                               chunked=parallel)
        hidden = _norm(x, params["norm"], self.config.rms_norm_eps)
        scaled = {"k_scale": tuple(scales[0::2]), "v_scale": tuple(scales[1::2])} if scales else {}
        if taps is not None:  # rows [W, K, D] at each live row's position
            cache = cache.replace(taps=cache.taps.at[write_at].set(
                taps, mode="drop", unique_indices=True))
        if parallel:
            return jnp.zeros((width, self.vocab_size), jnp.float32), cache.replace(
                k=tuple(buffers[0::2]) if n_full else cache.k,
                v=tuple(buffers[1::2]) if n_full else cache.v, **scaled,
                conv=tuple(s[0] for s in states), recurrent=tuple(s[1] for s in states),
                hidden_rows=cache.hidden_rows.at[write_at].set(
                    hidden, mode="drop", unique_indices=True),
            )
        with jax.named_scope("head"):
            logits = jax.lax.cond(need_head, lambda h: self._logits(params, h),
                                  lambda h: jnp.zeros((width, self.vocab_size), jnp.float32),
                                  hidden)
        return logits, cache.replace(
            k=tuple(buffers[0::2]) if n_full else cache.k,
            v=tuple(buffers[1::2]) if n_full else cache.v, **scaled,
            conv=tuple(s[0] for s in states), recurrent=tuple(s[1] for s in states),
            conv_tape=tuple(t.at[:width].set(n[0])
                            for t, n in zip(cache.conv_tape, tapes, strict=True)),
            recurrent_tape=tuple(n[1] for n in tapes),
            hidden=cache.hidden.at[:width].set(hidden),
            hidden_rows=cache.hidden_rows.at[write_at].set(
                hidden, mode="drop", unique_indices=True),
        )

    def forward(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Plain causal pass over whole sequences from an empty state: int32 ``[B, T]`` ->
        float32 logits ``[B, T, V]`` (row ``t`` at position ``t``). The recurrence is the same
        row-by-row scan as the block program's, over all ``T`` rows."""

        def one(seq: jax.Array) -> jax.Array:
            positions = jnp.arange(seq.shape[0], dtype=jnp.int32)
            x, _, _, _ = self._decoder(params["layers"], self._embed(params, seq), positions,
                                       jnp.int32(seq.shape[0]), self._zero_states(),
                                       lambda j: lambda k, v: (k, v, positions), None)
            return self._logits(params, _norm(x, params["norm"], self.config.rms_norm_eps))

        return jax.vmap(one)(tokens)

    def train_forward(self, params: Params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Whole sequences from an empty state, for training: int32 ``[B, T]`` -> float32
        logits ``[B, T, V]`` and the normed hidden states ``[B, T, D]`` (what the MTP head
        reads). The DeltaNet layers run the chunked recurrence
        (:mod:`~turbospark_jax.models.qwen3_5.delta_rule`) and the full-attention layers one
        causal attention over the batch (cuDNN's fused kernel on a GPU in bfloat16 or float16,
        XLA's otherwise): within a tolerance of :meth:`forward`, never bitwise."""
        x, _ = self._train_pass(params, tokens, with_taps=False)
        hidden = _norm(x, params["norm"], self.config.rms_norm_eps)
        return self.head_logits(params, hidden), hidden

    def forward_taps(self, params: Params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """:meth:`train_forward` that returns the tap layers' output rows instead of the
        hidden states (training a block drafter against this model): int32 ``[B, T]`` ->
        float32 logits ``[B, T, V]`` and the tap rows ``[B, T, K, D]`` (model dtype), within
        the chunked recurrence's tolerance of what the cache records.

        Raises:
          BadInputError: the model has no tap layers.
        """
        if not self.tap_layers:
            raise BadInputError("forward_taps needs a model built with tap_layers=(...)")
        x, taps = self._train_pass(params, tokens, with_taps=True)
        hidden = _norm(x, params["norm"], self.config.rms_norm_eps)
        return self.head_logits(params, hidden), taps

    def _train_attention(self) -> str:
        """The training pass's attention: cuDNN's fused kernel on a GPU in bfloat16 or float16
        (its scores never written out, forward or backward), XLA's products otherwise (cuDNN
        takes no other dtype)."""
        fused = jax.default_backend() == "gpu" and self.dtype in (jnp.bfloat16, jnp.float16)
        return "cudnn" if fused else "xla"

    def _train_full_layer(self, lp: Params, x: jax.Array,
                          rope: tuple[jax.Array, jax.Array]) -> jax.Array:
        """A full-attention layer over whole sequences x [B, T, D] (row t at position t)."""
        h = _norm(x, lp["input_layernorm"], self.config.rms_norm_eps)
        q, k, v, gate = jax.vmap(lambda rows: self._attention_inputs(lp, rows, rope))(h)
        attn = causal_attention(q, k, v, implementation=self._train_attention())
        x = x + self._attention_output(lp, attn, gate)
        return self._mlp(lp, x.reshape(-1, x.shape[-1])).reshape(x.shape)

    def _train_pass(self, params: Params, tokens: jax.Array, *, with_taps: bool
                    ) -> tuple[jax.Array, jax.Array | None]:
        """Every layer over whole sequences (int32 ``[B, T]``) from an empty state, batch
        first: the layer's output rows ``[B, T, D]`` and, ``with_taps``, the tap rows
        ``[B, T, K, D]``."""
        c = self.config
        t = tokens.shape[1]
        rope = self._rope(jnp.arange(t, dtype=jnp.int32))
        zero = self._zero_states()[0] if c.count(LINEAR) else None
        x = self._embed(params, tokens)  # [B, T, D]
        taps = []
        for i, lp in enumerate(params["layers"]):
            with jax.named_scope(f"layer_{i}"):
                if c.layer_types[i] == FULL:
                    x = self._train_full_layer(lp, x, rope)
                else:
                    def linear(rows: jax.Array, lp: Params = lp) -> jax.Array:
                        h = _norm(rows, lp["input_layernorm"], c.rms_norm_eps)
                        o, _, _ = self._delta_net(lp, h, zero, jnp.int32(t), None,
                                                  chunked=True)
                        return self._mlp(lp, rows + o)

                    x = jax.vmap(linear)(x)
            if with_taps and i in self.tap_layers:
                taps.append(x)
        return x, jnp.stack(taps, axis=2) if taps else None

    def head_logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        """The output head alone: normed hidden ``[..., D]`` -> float32 logits ``[..., V]``
        (a training loss applies it a slice of rows at a time)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        return self._logits(params, flat).reshape(*hidden.shape[:-1], -1)

    def mtp_train_hidden(self, params: Params, hidden: jax.Array,
                         tokens: jax.Array) -> jax.Array:
        """The MTP head over whole sequences, for training, before the output head: row ``t``
        reads ``hidden[t]`` and ``tokens[t + 1]``; its normed output rows ``[B, T - 1, D]``
        (through :meth:`head_logits`) predict ``tokens[t + 2]``, as a drafter's first proposal
        does. Its attention is the training pass's (:meth:`train_forward`)."""
        c = self.config
        x = self._mtp_input(params, hidden[:, :-1], tokens[:, 1:])
        rope = self._rope(jnp.arange(x.shape[1], dtype=jnp.int32))
        x = self._train_full_layer(params["mtp"]["layers"][0], x, rope)
        return _norm(x, params["mtp"]["norm"], c.rms_norm_eps)

    def _mtp_input(self, params: Params, hidden: jax.Array, next_tokens: jax.Array
                   ) -> jax.Array:
        """The MTP layer's input rows: ``fc([norm(embed(next)), norm(hidden)])``, any leading
        axes."""
        c, mp = self.config, params["mtp"]
        e = _norm(self._embed(params, next_tokens), mp["pre_fc_norm_embedding"], c.rms_norm_eps)
        h = _norm(hidden.astype(self.dtype), mp["pre_fc_norm_hidden"], c.rms_norm_eps)
        return jnp.concatenate([e, h], axis=-1) @ mp["fc"]

    # -- the MTP head ---------------------------------------------------------------------------

    def mtp_init_cache(self, capacity: int) -> MTPCache:
        """Empty KV rows for each MTP layer, ``capacity`` positions."""
        layers = self.config.mtp_num_hidden_layers
        if not layers:
            raise BadInputError("this config has no MTP head (mtp_num_hidden_layers is 0)")
        return MTPCache(k=self._kv(capacity, layers), v=self._kv(capacity, layers))

    def mtp_block_forward(
        self, params: Params, mtp_cache: MTPCache, hidden: jax.Array, next_tokens: jax.Array,
        positions: jax.Array, live: jax.Array, *, step: int = 0,
    ) -> tuple[jax.Array, jax.Array, MTPCache]:
        """One MTP step over ``W`` rows: row ``i`` predicts the token after ``next_tokens[i]``
        from it and the hidden state of the position before it.

        The head is the published one (the names of the ``mtp.*`` tensors):
        ``fc([pre_fc_norm_embedding(embed(next)), pre_fc_norm_hidden(hidden)])``, one
        full-attention decoder layer with its own KV rows, ``norm``, the trunk's output head.
        ``hidden`` is the normed kind (``Qwen35Cache.hidden`` for the trunk's rows, or this
        function's ``new_hidden`` when chaining), as vLLM and SGLang feed these heads.

        Args:
          params: the model's params (with ``mtp``; the embedding and head are shared).
          mtp_cache: from :meth:`mtp_init_cache`.
          hidden: ``[W, D]``, the hidden state at each row's position.
          next_tokens: int32 ``[W]``, the token that followed it (sampled or drafted).
          positions: int32 ``[W]``, the position of each row's ``hidden`` (the MTP KV row it
            writes); a chain's step ``j`` uses ``position + j``.
          live: int32 ``[]``; rows ``>= live`` write nothing.
          step: static; a chain's step index, choosing layer ``step % mtp_num_hidden_layers``.

        Returns:
          ``(logits, new_hidden, mtp_cache)``: float32 ``[W, V]``, ``[W, D]`` (what the next
          chained step reads), and the cache with the live rows written.
        """
        c, mp = self.config, params["mtp"]
        layer = step % c.mtp_num_hidden_layers
        capacity, width = mtp_cache.k[0].shape[0], hidden.shape[0]
        rows = jnp.arange(width, dtype=jnp.int32)
        write_at = jnp.where(rows < live, positions, capacity + rows)
        buffers = [mtp_cache.k[layer], mtp_cache.v[layer]]
        kv = self._kv_store(buffers, write_at, jnp.arange(capacity, dtype=jnp.int32))(0)
        x = self._mtp_input(params, hidden, next_tokens)
        x = self._full_layer(mp["layers"][layer], x, positions, self._rope(positions), kv,
                             rows < live)
        new_hidden = _norm(x, mp["norm"], c.rms_norm_eps)
        k, v = list(mtp_cache.k), list(mtp_cache.v)
        k[layer], v[layer] = buffers
        return self._logits(params, new_hidden), new_hidden, MTPCache(k=tuple(k), v=tuple(v))


def _build(config: Qwen35Config, dtype: Any, layer_layout: str) -> Qwen35Model:
    if layer_layout != "list":
        raise ModelLoadError(f"Qwen3.5 layers are of mixed kinds, so its params are a list of "
                             f"per-layer dicts; layer_layout must be 'list', got {layer_layout!r}")
    return Qwen35Model(config, dtype)


FAMILY = Family(
    name="qwen3_5",
    architectures=ARCHITECTURES,
    parse_config=Qwen35Config.from_hf_dict,
    config_type=Qwen35Config,
    param_shapes=param_shapes,
    hf_tensors=hf_tensors,
    build=_build,
    tolerated=tolerated,
    list_layout_only=True,
    join_params=join_projections,
    split_params=split_projections,
)
