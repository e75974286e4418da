"""Which ``PartitionSpec`` every params and cache leaf of each model family gets on the
tensor-parallel mesh axis :data:`TP`.

A family's layout names, for each leaf, the axis that is split and the count of whole units
(heads, MLP columns, vocabulary rows, conv channels) along it; an axis is split only where
the mesh size divides that count, so a device always holds whole units, and otherwise stays
whole on every device. Each family also names the counts that *must* divide (the query heads
and the MLP width: splitting neither would leave nothing worth the name tensor parallel), and
:func:`check_divisible` refuses a mesh that cuts them.

Mixture-of-experts stacks split on each expert's width, like an MLP: every device holds a
slice of every expert, so a token's experts are on every device and no token moves. On a
mesh with an :data:`EP` axis they split on their expert axis over it instead (expert
parallelism: whole experts a device, :class:`~turbospark_jax.models.moe.ExpertParallel`),
and stay whole along :data:`TP`.

The layers whose reduction axis is the split one (``o_proj``, ``down_proj``, an expert's
down projection, a DeltaNet's ``out_proj``, Gemma 4's ``per_layer_projection``) are
row-parallel: each device adds its own part of every sum and an all-reduce adds the parts
(one all-reduce of ``[W, D]`` a layer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from turbospark_jax.errors import BadInputError
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.gemma4.config import Gemma4Config
from turbospark_jax.models.qwen3_5.config import FULL, Qwen35Config

#: The mesh axis tensor parallelism splits over.
TP = "tp"
#: The mesh axis expert parallelism splits the expert stacks over (a mesh without it splits
#: each expert's width over :data:`TP`).
EP = "ep"

#: The expert stacks' leaf names (the Qwen forms', then Gemma 4's fused ones); each has its
#: expert axis third from the end.
EXPERT_STACKS = ("expert_gate", "expert_up", "expert_down", "experts_gate_up", "experts_down")

Params = dict[str, Any]
#: One leaf's split: per dimension (counted from the last), ``None`` or the number of whole
#: units along it, split over :data:`TP` where the mesh size divides the count.
Axes = tuple[int | None, ...]


def resolve(axes: Axes, ndim: int, tp: int) -> PartitionSpec:
    """``axes`` as a spec of ``ndim`` dimensions: leading ones (a stacked layer axis) whole,
    a unit count split where ``tp`` divides it."""
    split = tuple(TP if n is not None and n % tp == 0 else None for n in axes)
    return PartitionSpec(*((None,) * (ndim - len(axes)) + split))


def refuse_indivisible(counts: dict[str, int], tp: int) -> None:
    """Raise if ``tp`` does not divide every one of ``counts``.

    Raises:
      BadInputError: naming each count it does not divide and the mesh sizes that would.
    """
    bad = {name: n for name, n in counts.items() if n % tp}
    if bad:
        fits = [d for d in range(1, tp + 1) if all(n % d == 0 for n in counts.values())]
        raise BadInputError(
            f"cannot split this model over {tp} devices: "
            + ", ".join(f"{name}={n}" for name, n in bad.items())
            + f" is not a multiple of {tp}. Use a mesh of {' or '.join(map(str, fits))} devices"
        )


# -- the dense family ----------------------------------------------------------------------


def _expert_layer(fe: int) -> dict[str, Axes]:
    """Expert stacks (:mod:`~turbospark_jax.models.moe`) split like an MLP, on each expert's
    width: ``[.., E, D, Fe]`` column-parallel, ``[.., E, Fe, D]`` row-parallel (every
    device holds a slice of every expert, so a token's experts are on every device and no
    token moves); the router whole."""
    return {"expert_gate": (None, fe), "expert_up": (None, fe), "expert_down": (fe, None)}


def _dense_layer(c: DenseConfig) -> dict[str, Axes]:
    h, kv, f = c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    return {
        "q_proj": (None, h, None), "k_proj": (None, kv, None), "v_proj": (None, kv, None),
        "q_bias": (h, None), "k_bias": (kv, None), "v_bias": (kv, None),
        "o_proj": (h, None, None),  # [H, hd, D]
        "gate_proj": (None, f), "up_proj": (None, f), "gate_bias": (f,), "up_bias": (f,),
        "down_proj": (f, None),  # [F, D]
        **_expert_layer(c.moe_intermediate_size),
    }


def _dense_params(c: DenseConfig, key: tuple[Any, ...]) -> Axes:
    if key[-1] == "embed_tokens":
        return (c.vocab_size, None)
    if key[-1] == "lm_head":
        return (None, c.vocab_size)
    return _dense_layer(c).get(key[-1], ())


def _dense_check(c: DenseConfig) -> dict[str, int]:
    mlp = ({"moe_intermediate_size": c.moe_intermediate_size} if c.moe
           else {"intermediate_size": c.intermediate_size})
    return {"num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, **mlp}


def _dense_cache(c: DenseConfig, name: str) -> Axes:
    # k, v: [L, C, KV, hd] stacked or [C, KV, hd] per layer; the tap rows whole.
    return (c.num_key_value_heads, None) if name in ("k", "v") else ()


# -- Qwen3.5 / Qwen3-Next --------------------------------------------------------------------


def _qwen_layer(c: Qwen35Config) -> dict[str, Axes]:
    h, kv, f = c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    sh = c.shared_expert_intermediate_size
    return {
        # gated full attention; the matrices are flat: [D, H*2*hd], [D, KV*hd], [H*hd, D]
        "q_proj": (None, h), "q_bias": (h,), "k_proj": (None, kv), "v_proj": (None, kv),
        "k_bias": (kv,), "v_bias": (kv,), "o_proj": (h, None),
        "gate_proj": (None, f), "up_proj": (None, f), "down_proj": (f, None),
        # the DeltaNet: conv channels [q | k | v] in contiguous ranges (the depthwise conv is
        # local); z, b, a and the recurrence on their value heads. The mesh gets the input
        # projections apart (a joined in_proj mixes their units, so it is parted first).
        "in_proj_qkv": (None, c.conv_dim), "conv1d": (None, c.conv_dim),
        "in_proj_z": (None, hv), "in_proj_b": (None, hv), "in_proj_a": (None, hv),
        "dt_bias": (hv,), "A_log": (hv,), "out_proj": (hv, None),
        # Qwen3-Next's fused projections, grouped per key head: [D, Hk, ...]
        "in_proj_qkvz": (None, hk, None), "in_proj_ba": (None, hk, None),
        # experts, and the shared expert like an MLP (its sigmoid gate [D, 1] whole)
        **_expert_layer(c.moe_intermediate_size),
        "shared_gate": (None, sh), "shared_up": (None, sh), "shared_down": (sh, None),
    }


def _qwen_params(c: Qwen35Config, key: tuple[Any, ...]) -> Axes:
    if key == ("embed_tokens",):
        return (c.vocab_size, None)
    if key == ("lm_head",):
        return (None, c.vocab_size)
    if key[0] == "layers" or key[:2] == ("mtp", "layers"):
        return _qwen_layer(c).get(key[-1], ())
    return ()  # the final norm; the MTP head's norms and fc


def _qwen_check(c: Qwen35Config) -> dict[str, int]:
    counts = {"intermediate_size": c.intermediate_size} if not all(c.sparse_layers) else {}
    if c.moe:
        counts.update(moe_intermediate_size=c.moe_intermediate_size,
                      shared_expert_intermediate_size=c.shared_expert_intermediate_size)
    if FULL in c.layer_types or c.mtp_num_hidden_layers:
        counts = {"num_attention_heads": c.num_attention_heads, **counts}
    return counts


def _qwen_cache(c: Qwen35Config, name: str) -> Axes:
    hv = c.linear_num_value_heads
    return {
        "k": (c.num_key_value_heads, None), "v": (c.num_key_value_heads, None),  # [C, KV, hd]
        "conv": (c.conv_dim,), "conv_tape": (c.conv_dim,),  # [.., K-1, C]
        "recurrent": (hv, None, None), "recurrent_tape": (hv, None, None),  # [.., Hv, dk, dv]
    }.get(name, ())  # hidden, hidden_rows: whole


# -- Gemma 4 ---------------------------------------------------------------------------------


def _gemma_params(c: Gemma4Config, key: tuple[Any, ...]) -> Axes:
    h, p = c.num_attention_heads, c.hidden_size_per_layer_input
    top = {"embed_tokens": (c.vocab_size, None), "lm_head": (None, c.vocab_size),
           "embed_tokens_per_layer": (c.vocab_size_per_layer_input, None)}
    if key[0] != "layers":
        return top.get(key[0], ())  # norms and the per-layer model projection: whole
    i, name = key[1], key[2]
    kv, f = c.dims(i)[1], c.mlp_width(i)
    return {
        "q_proj": (None, h, None), "q_bias": (h, None), "k_proj": (None, kv, None),
        "v_proj": (None, kv, None), "k_bias": (kv, None), "v_bias": (kv, None),
        "o_proj": (h, None, None),  # [H, hd, D]
        "gate_proj": (None, f), "up_proj": (None, f), "down_proj": (f, None),
        "per_layer_input_gate": (None, p),
        "per_layer_projection": (p, None),  # [P, D]
        # The MoE block's fused stacks ([E, 2F, D]: the gate's rows, then the up
        # projection's) stay whole: a split of the 2F rows would part each gate row from
        # its up row.
    }.get(name, ())


def _gemma_check(c: Gemma4Config) -> dict[str, int]:
    widths = sorted({c.mlp_width(i) for i in range(c.num_hidden_layers)})
    return {"num_attention_heads": c.num_attention_heads,
            **{("intermediate_size" if w == c.intermediate_size else "double-wide MLP width"): w
               for w in widths}}


def _gemma_cache(c: Gemma4Config, name: str) -> Axes:
    # k_full / v_full [C, KVg, ghd] and k_ring / v_ring [R, KV, hd] on their KV heads (a
    # single KV head, as small Gemma 4s have, stays whole); slot positions and hidden rows whole.
    kv = {"k_full": c.full_kv_heads, "v_full": c.full_kv_heads,
          "k_ring": c.num_key_value_heads, "v_ring": c.num_key_value_heads}.get(name)
    return () if kv is None else (kv, None)


# -- by family ---------------------------------------------------------------------------------

#: config type -> (required counts, params axes, cache axes).
_FAMILIES: dict[type, tuple[Callable[..., dict[str, int]], Callable[..., Axes],
                            Callable[..., Axes]]] = {
    DenseConfig: (_dense_check, _dense_params, _dense_cache),
    Qwen35Config: (_qwen_check, _qwen_params, _qwen_cache),
    Gemma4Config: (_gemma_check, _gemma_params, _gemma_cache),
}


def _family(config: Any) -> tuple[Callable[..., Any], ...]:
    layout = _FAMILIES.get(type(config))
    if layout is None:
        raise BadInputError(
            f"no tensor-parallel layout for a {type(config).__name__}; the families with one "
            f"are {', '.join(t.__name__ for t in _FAMILIES)}"
        )
    return layout


def check_divisible(config: Any, tp: int, ep: int = 1) -> None:
    """Refuse a split that would cut a query head or an MLP column group across devices
    (other counts, KV heads say, stay whole where ``tp`` does not divide them; the dense
    family also requires its KV heads to divide), and, with ``ep > 1`` devices on an
    :data:`EP` axis, a model without experts or with an expert count ``ep`` does not divide
    (the experts' width then need not divide ``tp``: they stay whole along it).

    Raises:
      BadInputError: naming each count that ``tp`` or ``ep`` does not divide and the sizes
        that would; or the config is of a family without a layout.
    """
    counts = _family(config)[0](config)
    if ep > 1:
        experts = num_experts(config)
        if not experts:
            raise BadInputError(
                f"the mesh has an expert axis {EP!r} of {ep} devices but this "
                f"{type(config).__name__} has no experts; use a mesh without it (tp_mesh "
                f"with ep=1)")
        if experts % ep:
            fits = [d for d in range(1, experts + 1) if experts % d == 0]
            raise BadInputError(
                f"cannot split {experts} experts over the {ep} devices of mesh axis {EP!r}: "
                f"num_experts={experts} is not a multiple of {ep}. Use an expert axis of "
                f"{' or '.join(map(str, fits))} devices")
        counts.pop("moe_intermediate_size", None)
    refuse_indivisible(counts, tp)


def num_experts(config: Any) -> int:
    """The routed experts in each MoE layer of ``config``; 0 for a model without them."""
    if isinstance(config, Gemma4Config):
        return (config.num_experts or 0) if config.enable_moe_block else 0
    return config.num_experts if config.moe else 0


def _key(path: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(p.key if hasattr(p, "key") else p.idx for p in path)


def param_specs(config: Any, params: Params, tp: int, ep: int = 1) -> Params:
    """A ``PartitionSpec`` for every leaf of ``params`` (arrays or shape structs; the dense
    family's stacked or list layout alike). With ``ep > 1`` the expert stacks split on their
    expert axis over :data:`EP` and are whole along :data:`TP`.

    Raises:
      BadInputError: a family without a layout.
    """
    axes = _family(config)[1]
    dense = isinstance(config, DenseConfig)

    def spec(path: Any, leaf: Any) -> PartitionSpec:
        key = _key(path)
        if dense and key[0] == "layers" and isinstance(key[1], int):
            key = (key[0], key[2])  # the dense list layout: layers/<i>/<name>
        if ep > 1 and key[-1] in EXPERT_STACKS:
            return PartitionSpec(*(None,) * (len(leaf.shape) - 3), EP, None, None)
        return resolve(axes(config, key), len(leaf.shape), tp)

    return jax.tree_util.tree_map_with_path(spec, params)


def cache_specs(config: Any, cache: Any, tp: int) -> Any:
    """A ``PartitionSpec`` for every leaf of a cache (or its shape structs): a field's
    leaves (one per layer, or stacked) all take that field's split.

    Raises:
      BadInputError: a family without a layout.
    """
    axes = _family(config)[2]

    def spec(path: Any, leaf: Any) -> PartitionSpec:
        name = path[0].name  # the cache dataclass's field
        return resolve(axes(config, name), len(leaf.shape), tp)

    return jax.tree_util.tree_map_with_path(spec, cache)
