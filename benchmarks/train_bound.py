"""A measured ceiling on the recipe's training MFU: the step's matrix products, and nothing else.

The recipe's Qwen3.5 shapes are small (the embedded target: hidden 384, MLP 1024, vocabulary
8192), and products that thin may not reach the tensor cores' peak at all. This times, in one jitted
program on random bfloat16 inputs, every matrix product the training step must do:

* each weight that multiplies activations (read off the params tree, so the list follows the
  preset): the forward ``Y = X @ W`` and the backward ``dX = dY @ W^T`` and ``dW = X^T @ dY``,
  with ``M = batch * seq_len`` rows (the MTP head's layer and head see ``seq_len - 1`` rows a
  sequence; they are counted with ``seq_len``);
* the output head, once for the trunk and once for the MTP head, with float32 logits and a
  bfloat16 logits gradient into its backward products, as the step computes them
  (:func:`~turbospark_recipe.objectives.output_head`; ``head_grad_dtype="float32"`` times a
  float32 gradient);
* the full-attention layers' scores and weighted sums (the MTP layer's too): per sequence and
  head ``Q K^T`` and ``P V`` forward, ``dO V^T``, ``P^T dO``, ``dS K`` and ``dS^T Q`` backward,
  counted and timed as full ``T x T`` squares though causality makes half of them useful.

Each product accumulates in float32 and rounds its output to bfloat16, as the step does. Left
out: the gated delta rule's chunk products (float32, batched per 64-row chunk; their FLOPs are
reported from a trace of :func:`~turbospark_jax.models.qwen3_5.delta_rule.delta_rule_chunked`, not
timed), the flash-attention backward's recomputed scores, and all elementwise work, norms, the
optimizer and copies.

**The bound.** If the products alone take ``t`` seconds, no schedule of the step can beat
``model FLOPs per step / (peak * t)``: that is the MFU the recipe would reach if everything
else took no time at all (the model FLOPs are the recipe's own count,
:func:`~turbospark_recipe.flops.training_flops_per_token`, which leaves out the MTP head
and counts attention's causal half). A low ceiling says the shapes, not the rest of the step,
hold MFU down. Each distinct shape is also timed alone (``groups``), which shows the slow ones.
The train suite (:mod:`benchmarks.train`) records the bound beside each Qwen3.5 preset's step.

On a CPU the times are real but there is no peak: the fraction and the ceiling are ``None``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

#: Weights that read the same rows within a layer (one normed hidden state feeds them all), so
#: they share one input here as in the step. Any other weight reads its own rows.
SHARED_INPUT = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                     "in_proj_a", "in_proj_qkvz", "in_proj_ba"), "attn_in"),
    **dict.fromkeys(("gate_proj", "up_proj"), "mlp_in"),
}
#: 2-D leaves that multiply no activation: the depthwise conv's taps, and the embedding (a
#: gather on input; a tied head multiplies by it, which the head's products count).
NOT_MATMUL = ("conv1d", "embed_tokens")
#: The attention products per layer: (kind, lhs input, rhs input, dimension numbers), on
#: ``[B*H, T, hd]`` rows (q, k, v, do) and ``[B*H, T, T]`` squares (p, ds).
ATTENTION = (
    ("qk", "q", "k", (((2,), (2,)), ((0,), (0,)))),  # S = Q K^T
    ("pv", "p", "v", (((2,), (1,)), ((0,), (0,)))),  # O = P V
    ("dp", "do", "v", (((2,), (2,)), ((0,), (0,)))),  # dP = dO V^T
    ("dv", "p", "do", (((1,), (1,)), ((0,), (0,)))),  # dV = P^T dO
    ("dq", "ds", "k", (((2,), (1,)), ((0,), (0,)))),  # dQ = dS K
    ("dk", "ds", "q", (((1,), (1,)), ((0,), (0,)))),  # dK = dS^T Q
)
Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


@dataclasses.dataclass(frozen=True)
class Product:
    """One matrix product of the step: ``dot_general(inputs[lhs], inputs[rhs], dims)``."""

    name: str  # e.g. "layers[3].q_proj fwd"
    weight: str | None  # the params leaf (its keystr) for a weight's products; None for attention
    kind: str  # fwd / dx / dw for a weight; qk, pv, dp, dv, dq, dk for attention
    lhs: str
    rhs: str
    dims: Dims
    out_dtype: str


def _short(keystr: str) -> str:
    """``['mtp']['layers'][0]['q_proj']`` -> ``mtp.layers[0].q_proj``."""
    return re.sub(r"\['([^']*)'\]", r".\1", keystr).lstrip(".")


def enumerate_products(config: Any, params: Any, batch: int, seq_len: int,
                       head_grad_dtype: str = "bfloat16"
                       ) -> tuple[list[Product], dict[str, tuple[tuple[int, ...], str]]]:
    """The step's products and the inputs they read: ``(products, {input: (shape, dtype)})``.

    Every weight comes from ``params`` (arrays or shape structs): a leaf of two or more axes
    but the conv taps and the embedding, stored ``[in, ...out]``; of the MTP head's layers only
    the first, the one training runs. The head is the tied embedding ``[V, D]`` (or an untied
    ``lm_head [D, V]``), applied to the trunk's rows and the MTP head's.
    """
    from turbospark_jax.models.qwen3_5.config import FULL

    m = batch * seq_len
    products: list[Product] = []
    inputs: dict[str, tuple[tuple[int, ...], str]] = {}
    bf16 = "bfloat16"

    def weight_products(w: str, shape: tuple[int, ...], in_axis: int, x: str, tag: str,
                        head: bool = False) -> None:
        # A weight of more axes (Qwen3-Next's fused projections) multiplies as [in, out].
        k, n = shape[in_axis], math.prod(shape) // shape[in_axis]
        inputs.setdefault(w, ((shape[0], math.prod(shape[1:])), bf16))
        inputs.setdefault(x, ((m, k), bf16))
        dy = f"{tag}:dy"
        inputs[dy] = ((m, n), head_grad_dtype if head else bf16)
        out = 1 - in_axis
        name = _short(tag)
        # Y = X W (float32 logits for the head); dX = dY W^T; dW = X^T dY, in the weight's layout.
        products.append(Product(f"{name} fwd", w, "fwd", x, w, (((1,), (in_axis,)), ((), ())),
                                "float32" if head else bf16))
        products.append(Product(f"{name} dx", w, "dx", dy, w, (((1,), (out,)), ((), ())), bf16))
        lhs, rhs = (x, dy) if in_axis == 0 else (dy, x)
        products.append(Product(f"{name} dw", w, "dw", lhs, rhs, (((0,), (0,)), ((), ())),
                                bf16))

    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        keystr = jax.tree_util.keystr(path)
        leaf_name = str(path[-1].key)
        if len(leaf.shape) < 2 or leaf_name in NOT_MATMUL or leaf_name == "lm_head":
            continue
        if keystr.startswith("['mtp']['layers']") and path[2].idx != 0:
            continue  # the MTP head trains its first layer only (mtp_train_hidden)
        prefix = keystr[: -len(f"['{leaf_name}']")]
        x = f"{prefix}['{SHARED_INPUT.get(leaf_name, leaf_name)}']:x"
        weight_products(keystr, tuple(leaf.shape), 0, x, keystr)

    tied = "lm_head" not in params
    head_w = "['embed_tokens']" if tied else "['lm_head']"
    head_shape = tuple((params["embed_tokens"] if tied else params["lm_head"]).shape)
    users = ["head"] + (["mtp.head"] if config.mtp_num_hidden_layers else [])
    for user in users:
        weight_products(head_w, head_shape, 1 if tied else 0, f"{user}:x", user, head=True)

    # Attention: the trunk's full layers and the MTP head's (trained) layer, [B*H, T, *] rows.
    attending = [f"layers[{i}]" for i, t in enumerate(config.layer_types) if t == FULL]
    attending += ["mtp.layers[0]"] if config.mtp_num_hidden_layers else []
    bh, hd = batch * config.num_attention_heads, config.head_dim
    for layer in attending:
        for part in ("q", "k", "v", "do"):
            inputs[f"{layer}.attn:{part}"] = ((bh, seq_len, hd), bf16)
        for part in ("p", "ds"):
            inputs[f"{layer}.attn:{part}"] = ((bh, seq_len, seq_len), bf16)
        for kind, lhs, rhs, dims in ATTENTION:
            products.append(Product(f"{layer}.attn {kind}", None, kind, f"{layer}.attn:{lhs}",
                                    f"{layer}.attn:{rhs}", dims, bf16))
    return products, inputs


def shapes_of(product: Product, inputs: dict[str, tuple[tuple[int, ...], str]]
              ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(lhs shape, rhs shape, output shape)`` of a product."""
    lhs, rhs = inputs[product.lhs][0], inputs[product.rhs][0]
    (lc, rc), (lb, rb) = product.dims
    out = ([lhs[i] for i in lb] + [d for i, d in enumerate(lhs) if i not in (*lc, *lb)]
           + [d for i, d in enumerate(rhs) if i not in (*rc, *rb)])
    return lhs, rhs, tuple(out)


def flops_of(product: Product, inputs: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """Two FLOPs per multiply-add: ``2 * output size * contracted size``."""
    lhs, _, out = shapes_of(product, inputs)
    return 2 * math.prod(out) * math.prod(lhs[i] for i in product.dims[0][0])


def dot_flops(jaxpr: Any) -> int:
    """FLOPs of every ``dot_general`` in a jaxpr and the jaxprs nested in it (a scan's body
    times its length; a loop's body or a conditional's branches once each)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lc)
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr or a Jaxpr
                if hasattr(inner, "eqns"):
                    total += times * dot_flops(inner)
    return total


def delta_rule_flops(config: Any, batch: int, seq_len: int) -> int:
    """The chunked delta rule's products, forward and backward, over every linear layer of a
    step: traced from :func:`~turbospark_jax.models.qwen3_5.delta_rule.delta_rule_chunked` (64-row
    chunks) at one sequence's shapes, times the batch."""
    from turbospark_jax.models.qwen3_5.config import LINEAR
    from turbospark_jax.models.qwen3_5.delta_rule import delta_rule_chunked

    hv, dk, dv = (config.linear_num_value_heads, config.linear_key_head_dim,
                  config.linear_value_head_dim)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
             state: jax.Array) -> jax.Array:
        o, _ = delta_rule_chunked(q, k, v, g, beta, state)
        return jnp.sum(o)

    f32 = jnp.float32
    args = [jax.ShapeDtypeStruct(s, f32) for s in ((seq_len, hv, dk), (seq_len, hv, dk),
                                                   (seq_len, hv, dv), (seq_len, hv),
                                                   (seq_len, hv), (hv, dk, dv))]
    traced = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    return dot_flops(traced.jaxpr) * batch * config.count(LINEAR)


def traced_step_flops(config: Any, params: Any, batch: int, seq_len: int) -> int:
    """Every product of the recipe's own loss and gradient, traced (not run) with XLA's
    attention so that its products show: a cross-check of the enumeration, which should
    account for all of it but the delta rule's and the MTP head's one row a sequence fewer."""
    from jax._src.interpreters import partial_eval as pe

    from turbospark_recipe import train as rt

    tc = rt.TrainConfig(batch_size=batch, seq_len=seq_len)
    # float32 takes XLA's attention on every backend (cuDNN's fused kernel, which hides its
    # products, runs only in bfloat16 or float16); the products' shapes are the same.
    model = rt.build_model(config, "float32")
    rows = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)

    def loss(p: Any, r: jax.Array) -> jax.Array:
        return rt.training_loss(model, tc.mtp_weight, p, r, tc.head_rows)[0]

    traced = jax.make_jaxpr(jax.grad(loss))(params, rows)
    # XLA drops what the gradient does not use (the trunk's unused logits); so does this.
    live, _ = pe.dce_jaxpr(traced.jaxpr, [True] * len(traced.jaxpr.outvars))
    return dot_flops(live)


def _program(products: Sequence[Product]) -> Callable[[dict[str, jax.Array]], list[jax.Array]]:
    def run(arrays: dict[str, jax.Array]) -> list[jax.Array]:
        # Every output is returned, so none can be dropped or narrowed to a slice.
        return [jax.lax.dot_general(arrays[p.lhs], arrays[p.rhs], p.dims,
                                    preferred_element_type=jnp.float32).astype(p.out_dtype)
                for p in products]

    return jax.jit(run)


def time_products(products: Sequence[Product], arrays: dict[str, jax.Array], iters: int,
                  repeats: int) -> dict[str, Any]:
    """Seconds per call of one program running ``products``: the median over ``repeats`` of
    ``iters`` back-to-back calls (after a compile and two warm calls)."""
    used = {p.lhs for p in products} | {p.rhs for p in products}
    args = {name: arrays[name] for name in used}
    fn = _program(products)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(args))
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        jax.block_until_ready(fn(args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
        del out
    return {"time_s": statistics.median(times), "times_s": times, "compile_s": compile_s}


def _signature(p: Product, inputs: dict[str, tuple[tuple[int, ...], str]]) -> tuple[Any, ...]:
    lhs, rhs = inputs[p.lhs], inputs[p.rhs]
    return (p.kind, lhs, rhs, p.dims, p.out_dtype)


def _dtype_tag(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "f32"}.get(dtype, dtype)


def matmul_bound(preset: str, batch: int, seq_len: int, iters: int, repeats: int,
                 head_grad_dtype: str = "bfloat16", seed: int = 0) -> dict[str, Any]:
    """The bound's record for a Qwen3.5 recipe preset at ``batch`` x ``seq_len`` tokens a step
    (module docstring): every product listed with its FLOPs, the groups of one shape timed
    alone, all of them timed in one program, and the MFU ceiling that time allows."""
    from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path
    from turbospark_jax.io.tokenizer import Tokenizer
    from turbospark_jax.models.qwen3_5.config import Qwen35Config
    from turbospark_recipe import train as rt
    from turbospark_recipe.flops import peak_flops, training_flops_per_token

    tokenizer = Tokenizer.from_folder(embedded_model_path(DEFAULT_TARGET))
    config = rt.model_config(preset, tokenizer)
    if not isinstance(config, Qwen35Config):
        raise ValueError(f"preset {preset!r} is not a Qwen3.5 model; this bound is for those")
    params = jax.eval_shape(
        lambda: rt.build_model(config, "float32").init_params(jax.random.PRNGKey(0)))
    products, inputs = enumerate_products(config, params, batch, seq_len, head_grad_dtype)
    delta = delta_rule_flops(config, batch, seq_len)
    traced = traced_step_flops(config, params, batch, seq_len)

    # Fresh random inputs, one array per input (none shared by chance, so XLA merges nothing
    # the step would not).
    key = jax.random.PRNGKey(seed)
    arrays = {name: jax.random.normal(jax.random.fold_in(key, i), shape, dtype)
              for i, (name, (shape, dtype)) in enumerate(sorted(inputs.items()))}
    jax.block_until_ready(arrays)

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", "?")
    peak = peak_flops(kind)
    flops = {p.name: flops_of(p, inputs) for p in products}
    total = sum(flops.values())
    attention = sum(flops[p.name] for p in products if p.weight is None)

    groups: dict[tuple[Any, ...], list[Product]] = {}
    for p in products:
        groups.setdefault(_signature(p, inputs), []).append(p)
    group_records = []
    for members in groups.values():
        p = members[0]
        lhs, rhs, out = shapes_of(p, inputs)
        weights = sorted({_short(m.weight).rsplit(".", 1)[-1] for m in members if m.weight})
        weights = ["head" if w in ("embed_tokens", "lm_head") else w for w in weights]
        g_flops = sum(flops[m.name] for m in members)
        timing = time_products(members, arrays, iters, repeats)
        group_records.append({
            "kind": p.kind, "lhs": list(lhs), "rhs": list(rhs), "out": list(out),
            "dtypes": f"{_dtype_tag(inputs[p.lhs][1])} x {_dtype_tag(inputs[p.rhs][1])} -> "
                      f"{_dtype_tag(p.out_dtype)}",
            "weights": weights or ["attention"], "count": len(members), "flops": g_flops,
            **timing, "tflops": g_flops / timing["time_s"] / 1e12,
            "fraction_of_peak": None if peak is None else g_flops / timing["time_s"] / peak,
        })

    whole = time_products(products, arrays, iters, repeats)
    t = whole["time_s"]
    per_token = training_flops_per_token(config, params, seq_len)
    model_flops = per_token * batch * seq_len
    # The MTP head sees seq_len - 1 rows a sequence: its products at the step's true size.
    exact = sum(f if not name.startswith("mtp.") else
                f // seq_len * (seq_len - 1) if "attn" not in name else
                f // seq_len**2 * (seq_len - 1) ** 2 for name, f in flops.items())
    return {
        "preset": preset, "batch": batch, "seq_len": seq_len, "rows": batch * seq_len,
        "iters": iters, "repeats": repeats, "head_grad_dtype": head_grad_dtype,
        "backend": jax.default_backend(), "device_kind": kind, "peak_flops": peak,
        "products": [{"name": p.name, "weight": p.weight, "kind": p.kind,
                      **dict(zip(("lhs", "rhs", "out"),
                                 (list(s) for s in shapes_of(p, inputs)), strict=True)),
                      "dtypes": [inputs[p.lhs][1], inputs[p.rhs][1], p.out_dtype],
                      "flops": flops[p.name]} for p in products],
        "matmul_flops": total,
        "attention_flops": attention,
        "attention_causal_useful_flops": attention // 2,
        "delta_rule_chunk_flops": delta,
        "traced_step_dot_flops": traced,
        # What the trace holds beyond the listed products and the delta rule's: 0 if the list
        # is complete.
        "unaccounted_flops": traced - exact - delta,
        "input_bytes": sum(a.nbytes for a in arrays.values()),
        "groups": group_records,
        "compile_s": whole["compile_s"], "time_s": t, "times_s": whole["times_s"],
        "groups_time_s": sum(g["time_s"] for g in group_records),
        "tflops": total / t / 1e12,
        "fraction_of_peak": None if peak is None else total / t / peak,
        "model_flops_per_token": per_token, "model_flops_per_step": model_flops,
        "mfu_ceiling": None if peak is None else model_flops / (peak * t),
    }
