"""The Pallas kernels' per-call times beside the XLA forms they replace.

* ``matvec``: each matrix product of a decode step of a shape (merged q/k/v, output projection,
  merged gate/up, down projection, output head) at one row, the row-invariant kernel against
  XLA's dot: microseconds a product and GB/s of weight reads, timed over enough distinct
  weight buffers in one program to overflow the L2 cache. With a preset's ``formats``, the
  products with ``[K, N]`` weights also run with the weights quantized (``format``: int8,
  int4, fp8), read at their stored width and dequantized in the kernel; GB/s then counts the
  stored bytes (docs/decisions/0020-quantized-products.md). The same quantized products run
  once more marked ``exact: false``: the CUDA-core kernel of the non-exact plan
  (:mod:`~turbospark_jax.kernels.quant_matvec`), whose row is compared bitwise with itself in
  a block of its most rows only (its wide blocks run the row-invariant kernels).
* ``norm``: the row-invariant RMSNorm at one row and at a prefill block of rows.

The products and the norm also record whether a row alone gets the bits it gets inside a
block of ``block_rows`` (``row_alone_equals_row_in_block``): the row-invariant kernels must,
XLA's forms (the control) need not.
* ``attention``: the fused attention kernel in its row-invariant form, one decode row over a
  cache of each preset context.
* ``delta_rule``: the DeltaNet row kernel (Qwen3.5's recurrent layers: the conv, norms and
  gates of each row and the gated delta rule) over a block of rows, against XLA's row-by-row
  scan of the rule alone.

Calls other than the products are timed as one program that runs the kernel ``calls`` times
in a loop, each call's input fed by the last output (a call timed alone from the host carries
its dispatch). Off a GPU the kernels run in the Pallas interpreter: the figures then time the
interpreter and only say that every case runs (``meta.interpreted``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import common


@dataclasses.dataclass(frozen=True)
class Preset:
    shapes: tuple[str, ...]
    contexts: tuple[int, ...]
    block_rows: int
    delta_rule: tuple[tuple[int, int, int], ...]  # (value heads, key dim, value dim)
    delta_rows: int
    calls: int
    repeats: int
    copies_bytes: int
    #: the products of :func:`products_of` to time (None: every one)
    products: tuple[str, ...] | None = None
    #: quantized formats the ``[K, N]`` products also run in
    formats: tuple[str, ...] = ()


_GPU = Preset(("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b"), (128, 4096, 16384), 2048,
              ((16, 128, 128), (32, 128, 128)), 16, 20, 5, 256 << 20,
              formats=("int8", "int4", "fp8"))
PRESETS = {
    "smoke": Preset(("tiny",), (32,), 8, ((2, 16, 16),), 4, 1, 1, 1 << 16,
                    products=("o", "gate_up"), formats=("int4-g32",)),
    "cpu": Preset(("tiny",), (64,), 16, ((2, 16, 16),), 4, 1, 2, 1 << 18),
    "h100": _GPU,
    "h200": _GPU,
}


def _interpret() -> bool:
    import jax

    return jax.default_backend() != "gpu"


def looped_seconds(fn: Callable[..., Any], first: Any, rest: tuple[Any, ...], calls: int,
                   repeats: int) -> float:
    """Seconds a call of ``fn(first, *rest)`` inside one program of ``calls`` calls, each one's
    ``first`` fed by the last output's first leaf (scaled by zero: the values stay, the
    dependence keeps the calls apart)."""
    import jax

    @jax.jit
    def looped(first: Any, *rest: Any) -> Any:
        def body(_: Any, x: Any) -> Any:
            out = jax.tree.leaves(fn(x, *rest))[0]
            return x + (out.reshape(-1)[: x.size].reshape(x.shape) * 0).astype(x.dtype)

        return jax.lax.fori_loop(0, calls, body, first)

    best, _ = common.best_seconds(lambda: looped(first, *rest), repeats)
    return best / calls


def products_of(shape: str) -> list[tuple[str, int, tuple[int, ...], str]]:
    """``(name, K, (N, ...), layout)`` of a decode step's matrix products."""
    s = common.SHAPES[shape]
    d, hd = s["hidden_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    f = s["intermediate_size"]
    head = "nk" if s["tie_word_embeddings"] else "kn"
    return [("qkv", d, (q, kv, kv), "kn"), ("o", q, (d,), "kn"), ("gate_up", d, (f, f), "kn"),
            ("down", f, (d,), "kn"), ("head", d, (s["vocab_size"],), head)]


def matvec_case(k: int, ns: tuple[int, ...], layout: str, impl: str, dtype: Any,
                copies_bytes: int, repeats: int, block_rows: int,
                fmt: str | None = None, exact: bool = True) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from turbospark_jax.kernels import quant_matvec
    from turbospark_jax.kernels.rowinv import rowinv_matmul, rowinv_swiglu

    if fmt is None:
        nbytes = k * sum(ns) * jnp.dtype(dtype).itemsize
    else:
        nbytes = sum(_stored(k, n, fmt, dtype).stored_bytes for n in ns)
    copies = int(max(2, min(32, -(-copies_bytes // nbytes))))
    keys = jax.random.split(jax.random.PRNGKey(k + sum(ns)), copies * len(ns))
    if fmt is None:
        ws = [tuple((jax.random.normal(keys[c * len(ns) + i],
                                       (n, k) if layout == "nk" else (k, n),
                                       jnp.float32) / np.sqrt(k)).astype(dtype)
                    for i, n in enumerate(ns)) for c in range(copies)]
    else:
        from benchmarks.quant import random_quantized_params

        ws = [tuple(random_quantized_params([_stored(k, n, fmt, dtype)], seed=c * len(ns) + i)[0]
                    for i, n in enumerate(ns)) for c in range(copies)]
    x = jax.random.normal(jax.random.PRNGKey(1), (1, k), jnp.float32).astype(dtype)
    if impl == "xla":
        def product(x: Any, w: tuple[Any, ...]) -> Any:
            mats = [m.T for m in w] if layout == "nk" else list(w)
            return jnp.dot(x, jnp.concatenate(mats, axis=1) if len(mats) > 1 else mats[0],
                           preferred_element_type=jnp.float32).astype(x.dtype)
    elif not exact:  # the non-exact plan's CUDA-core kernel (quantized weights only)
        block_rows = min(block_rows, quant_matvec.MAX_ROWS)
        gated = len(ns) == 2 and ns[0] == ns[1]

        def product(x: Any, w: tuple[Any, ...]) -> Any:
            if gated:
                return quant_matvec.quant_swiglu(x, w[0], w[1], impl=impl)
            return quant_matvec.quant_matmul(x, w, impl=impl)
    elif len(ns) == 2 and ns[0] == ns[1] and layout == "kn":  # gate/up: the gated kernel
        def product(x: Any, w: tuple[Any, ...]) -> Any:
            return rowinv_swiglu(x, w[0], w[1], impl=impl)
    else:
        def product(x: Any, w: tuple[Any, ...]) -> Any:
            return rowinv_matmul(x, w if len(w) > 1 else w[0], w_layout=layout, impl=impl)
    fn = jax.jit(lambda x, *ws: [product(x, w) for w in ws])
    best, _ = common.best_seconds(lambda: fn(x, *ws), repeats)
    per = best / copies
    return {"us": round(per * 1e6, 2), "GBps": round(nbytes / per / 1e9, 2), "copies": copies,
            "row_alone_equals_row_in_block": same_row_bits(
                jax.jit(lambda x: product(x, ws[0])), x, block_rows)}


def _stored(k: int, n: int, fmt: str, dtype: Any) -> Any:
    """The stored layout of a ``[k, n]`` matrix in ``fmt``, with shape-only leaves."""
    import jax

    from benchmarks.quant import stored_layout
    from turbospark_jax.quant.weights import Quantization

    return stored_layout(jax.ShapeDtypeStruct((k, n), dtype), k, Quantization.parse(fmt), dtype)


def same_row_bits(fn: Callable[[Any], Any], row: Any, rows: int) -> bool:
    """Whether ``fn`` gives ``row`` alone the bits it gives it as the first of ``rows`` rows
    (the row-invariant kernels must; XLA's forms need not)."""
    import jax
    import jax.numpy as jnp

    others = jax.random.normal(jax.random.PRNGKey(7), (rows - 1, *row.shape[1:]), jnp.float32)
    block = jnp.concatenate([row, others.astype(row.dtype)])
    alone, within = np.asarray(fn(row)[:1]), np.asarray(fn(block)[:1])
    return bool(np.array_equal(alone.view(np.uint8), within.view(np.uint8)))


def run(preset: Preset, results: common.Results) -> None:
    import jax.numpy as jnp

    interpret = _interpret()
    results.data["meta"]["interpreted"] = interpret
    dtype = jnp.float32 if interpret else jnp.bfloat16
    impl = "interpret" if interpret else "pallas"
    for shape in preset.shapes:
        for name, k, ns, layout in products_of(shape):
            if preset.products is not None and name not in preset.products:
                continue
            for kind in (impl, "xla"):
                results.case({"kernel": "matvec", "shape": shape, "product": name, "K": k,
                              "N": list(ns), "impl": kind},
                             lambda k=k, ns=ns, layout=layout, kind=kind: matvec_case(
                                 k, ns, layout, kind, dtype, preset.copies_bytes,
                                 preset.repeats, preset.block_rows))
            for fmt in preset.formats if layout == "kn" else ():
                for exact in (True, False):  # the exact plan's kernels, then the CUDA cores'
                    label = {} if exact else {"exact": False}
                    results.case({"kernel": "matvec", "shape": shape, "product": name,
                                  "K": k, "N": list(ns), "impl": impl, "format": fmt, **label},
                                 lambda k=k, ns=ns, fmt=fmt, exact=exact: matvec_case(
                                     k, ns, "kn", impl, dtype, preset.copies_bytes,
                                     preset.repeats, preset.block_rows, fmt, exact))
        s = common.SHAPES[shape]
        for rows in (1, preset.block_rows):
            results.case({"kernel": "norm", "shape": shape, "rows": rows, "impl": impl},
                         lambda rows=rows, s=s: norm_case(rows, s["hidden_size"], impl, dtype,
                                                          preset))
        for context in preset.contexts:
            results.case({"kernel": "attention", "shape": shape, "rows": 1,
                          "context": context, "impl": impl},
                         lambda c=context, s=s: attention_case(s, c, interpret, dtype, preset))
    for heads, dk, dv in preset.delta_rule:
        for kind in ("kernel", "xla_scan"):
            results.case({"kernel": "delta_rule", "value_heads": heads, "key_dim": dk,
                          "value_dim": dv, "rows": preset.delta_rows, "impl": kind},
                         lambda h=heads, dk=dk, dv=dv, kind=kind: delta_rule_case(
                             h, dk, dv, kind, interpret, preset))


def norm_case(rows: int, hidden: int, impl: str, dtype: Any, preset: Preset) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from turbospark_jax.kernels.row_norm import row_rms_norm

    x = jax.random.normal(jax.random.PRNGKey(0), (rows, hidden), jnp.float32).astype(dtype)
    weight = jnp.ones((hidden,), dtype)
    per = looped_seconds(lambda x, w: row_rms_norm(x, w, 1e-6, impl=impl), x, (weight,),
                         preset.calls, preset.repeats)
    return {"us": round(per * 1e6, 2), "row_alone_equals_row_in_block": same_row_bits(
        jax.jit(lambda x: row_rms_norm(x, weight, 1e-6, impl=impl)), x[:1], preset.block_rows)}


def attention_case(shape: dict[str, Any], context: int, interpret: bool, dtype: Any,
                   preset: Preset) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from turbospark_jax.kernels.attention import cached_attention

    heads, kv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    keys = jax.random.split(jax.random.PRNGKey(context), 3)
    q = jax.random.normal(keys[0], (1, heads, hd), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (context + 64, kv, hd), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (context + 64, kv, hd), jnp.float32).astype(dtype)
    pos = jnp.asarray([context - 1], jnp.int32)
    per = looped_seconds(lambda q, k, v, pos: cached_attention(
        q, k, v, pos, interpret=interpret, row_invariant=True), q, (k, v, pos), preset.calls,
        preset.repeats)
    cache_bytes = 2 * context * kv * hd * jnp.dtype(dtype).itemsize
    return {"us": round(per * 1e6, 2), "cache_GBps": round(cache_bytes / per / 1e9, 2)}


def delta_rule_case(heads: int, dk: int, dv: int, kind: str, interpret: bool,
                    preset: Preset) -> dict[str, Any]:
    """The DeltaNet row kernel (a key head per value head, a 4-wide conv: the conv, norms,
    gates and rule of each row) or XLA's row-by-row scan of the rule alone."""
    import jax
    import jax.numpy as jnp

    from turbospark_jax.kernels.delta_rule import GateColumns, delta_net_rows
    from turbospark_jax.models.qwen3_5.delta_rule import delta_rule_scan

    w = preset.delta_rows
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    normal = lambda i, shape: jax.random.normal(keys[i], shape, jnp.float32)  # noqa: E731
    state = normal(5, (heads, dk, dv)) * 0.1
    if kind == "kernel":
        taps, channels = 4, 2 * heads * dk + heads * dv
        gates = GateColumns(channels + heads * dv, channels + heads * dv + heads, 1)

        def fn(a_log: Any, buf: Any, proj: Any, weight: Any, state: Any) -> Any:
            return delta_net_rows(buf, proj, weight, a_log, jnp.ones_like(a_log), state,
                                  jnp.int32(w), key_heads=heads, gates=gates,
                                  interpret=interpret)

        first = jnp.zeros((heads,), jnp.float32)
        rest = (normal(0, (taps - 1 + w, channels)),
                normal(1, (w, channels + heads * dv + 2 * heads)),
                normal(2, (taps, channels)) * 0.5, state)
    else:
        def unit(key: Any, shape: tuple[int, ...]) -> Any:
            x = jax.random.normal(key, shape, jnp.float32)
            return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

        fn = delta_rule_scan
        first = unit(keys[0], (w, heads, dk))
        rest = (unit(keys[1], (w, heads, dk)), normal(2, (w, heads, dv)),
                -jax.nn.softplus(normal(3, (w, heads))), jax.nn.sigmoid(normal(4, (w, heads))),
                state)
    per = looped_seconds(fn, first, rest, preset.calls, preset.repeats)
    return {"us": round(per * 1e6, 2), "state_MiB": round(heads * dk * dv * 4 / 2**20, 3)}
