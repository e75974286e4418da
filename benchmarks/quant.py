"""Quantized weights against the model's own dtype: decode tokens/s at batch 1, the bytes a
step reads as stored and the share of that roofline reached, and prefill tokens/s.

Each shape runs in every format of the preset in the same process, the unquantized model
(:data:`BASELINE`: weights in the preset's dtype, bfloat16 on a GPU) among them: a format's
decode speed-up and its prefill ratio are over that baseline's in the same run. The bar for
prefill is a ratio of at least :data:`PREFILL_BAR`: a quantized product may spend on
dequantizing what it saves in reads, but a prompt should not pay much for it.

Weights are random: the figures need the stored bytes and shapes, not meaningful values.
:func:`random_quantized_params` draws the stored form directly on the device (values, scales,
zero points in the layouts of :class:`~turbospark_jax.quant.weights.QuantizedWeight`), since
quantizing a large model's weights through the host takes minutes. Which matrices are
quantized follows the loader's rule (``quantize_params`` in :mod:`turbospark_jax.io.loading`):
the family's linear tensors the scheme fits, the output head left in the model's dtype.

A preset with ``fast_decode`` also decodes each quantized format on the plan ``exact=False``
loads (records with ``"exact": false``; on a GPU its few-row products of quantized weights run
on the CUDA cores, :mod:`turbospark_jax.kernels.quant_matvec`), against the same baseline.

A format whose weights and cache would not fit the device's memory is skipped with the bytes
it needs (a 70B shape in bfloat16 on one 80 GB card); a shape measured without its baseline
reports decode figures only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from benchmarks import common
from benchmarks.decode import completion_rate

#: The unquantized model's name in a preset's formats (its records name the dtype).
BASELINE = "unquantized"
#: A quantized format's prefill tokens/s over the baseline's must reach this.
PREFILL_BAR = 0.8
#: Share of the device's memory a format's weights and cache may take before it is skipped.
MEMORY_SHARE = 0.92


@dataclasses.dataclass(frozen=True)
class Preset:
    shapes: tuple[str, ...]
    formats: tuple[str, ...]
    contexts: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    new_tokens: int
    repeats: int
    dtype: str
    copy_bytes: int
    #: ``(shape, formats)`` pairs: shapes measured in these formats only (one too large for
    #: the baseline on one device)
    only: tuple[tuple[str, tuple[str, ...]], ...] = ()
    exact: bool = True
    #: quantized formats' decode is also measured on the plan ``exact=False`` loads (on a GPU
    #: their products run on the CUDA cores there)
    fast_decode: bool = False
    budget_s: float | None = None
    #: shapes whose decode is also measured with a quantized KV cache, at :attr:`kv_context`
    kv_shapes: tuple[str, ...] = ()
    kv_context: int = 0

    def formats_of(self, shape: str) -> tuple[str, ...]:
        return dict(self.only).get(shape, self.formats)


#: int4 before int8 and fp8: a run its time budget cuts short loses the least telling cases
_FORMATS = (BASELINE, "int4", "int8", "fp8")
_GPU = Preset(shapes=("llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b"), formats=_FORMATS,
              contexts=(128, 4096), prefill_lengths=(2048, 8192), new_tokens=128, repeats=2,
              dtype="bfloat16", copy_bytes=4 << 30, only=(("llama-3.1-70b", ("int4",)),),
              budget_s=300.0, kv_shapes=("llama-3.2-1b",), kv_context=32768, fast_decode=True)
PRESETS = {
    "smoke": Preset(("tiny-llama",), _FORMATS, (16,), (32,), 8, 1, "float32", 1 << 20,
                    kv_shapes=("tiny-llama",), kv_context=24, fast_decode=True),
    "cpu": Preset(("small-60m",), _FORMATS, (128, 1024), (256, 1024), 32, 2, "float32",
                  64 << 20),
    "h100": _GPU,
    "h200": _GPU,
}


# -- the stored layout, without quantizing anything ----------------------------------------


def stored_layout(leaf: Any, k: int, spec: Any, dtype: Any) -> Any:
    """The :class:`~turbospark_jax.quant.weights.QuantizedWeight` that quantizing the
    matrix leaf ``leaf`` (its shape alone is read; ``k`` inputs) by ``spec`` stores, with
    ``jax.ShapeDtypeStruct`` leaves: the shapes and dtypes of
    :func:`~turbospark_jax.quant.weights.quantize`'s output, to draw or to count."""
    import jax
    import jax.numpy as jnp

    from turbospark_jax.quant.weights import (
        FP8_BLOCK,
        QuantizedWeight,
        split_inputs,
        stored_dtype,
    )

    in_shape, out_shape = split_inputs(leaf.shape, k)
    n = math.prod(out_shape)
    scheme = "fp8" if spec.scheme == "fp8-block" else spec.scheme
    group = {"int4": spec.group, "fp8-block": FP8_BLOCK}.get(spec.scheme, k)
    columns = FP8_BLOCK if spec.scheme == "fp8-block" else 1
    q = (k, n // 2) if scheme == "int4" else (k, n)
    scales = jax.ShapeDtypeStruct((k // group, n), jnp.float32)
    zero = jax.ShapeDtypeStruct((k // group, n), jnp.uint8) if scheme == "int4" else None
    return QuantizedWeight(jax.ShapeDtypeStruct(q, stored_dtype(scheme)), scales, zero, scheme,
                           group, in_shape, out_shape, jnp.dtype(dtype), columns)


def quantized_shapes(family: Any, config: Any, model: Any, fmt: str) -> Any:
    """The list-layout params of ``model`` as ``jax.ShapeDtypeStruct`` leaves, with each
    matrix the loader would quantize in ``fmt`` as its :func:`stored_layout` (``fmt`` the
    baseline: none)."""
    import jax

    from turbospark_jax.quant.weights import Quantization

    shapes = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    if family.to_layer_layout is not None:
        shapes = jax.eval_shape(lambda p: family.to_layer_layout(p, "list"), shapes)
    if fmt == BASELINE:
        return shapes
    spec = Quantization.parse(fmt)
    for t in family.hf_tensors(config):
        if not t.linear or (t.key[-1] == "lm_head" and not spec.head):
            continue
        k, n = t.hf_shape[1], t.hf_shape[0]
        if not spec.fits(k, n):
            continue
        # the list layout puts a stacked tensor's layer after the stack's own key
        path = t.key if t.stacked is None else (t.key[0], t.stacked, *t.key[1:])
        parent = functools.reduce(lambda node, key: node[key], path[:-1], shapes)
        if not hasattr(parent[path[-1]], "q"):
            parent[path[-1]] = stored_layout(parent[path[-1]], k, spec, model.dtype)
    return shapes


#: Scales that give each scheme's dequantized values a spread near the random model's 0.02.
_SCALE = {"int8": 0.02 / 73.0, "int4": 0.02 / 4.6, "fp8": 0.02}


@functools.cache
def _draw_stored() -> Any:
    import jax
    import jax.numpy as jnp

    def draw(key: Any, shape: tuple[int, ...], dtype: str, kind: str) -> Any:
        if kind in _SCALE:  # a scheme's scales
            return jax.random.uniform(key, shape, jnp.float32, 0.5, 1.5) * _SCALE[kind]
        if kind == "values:int8":
            return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)
        if kind == "values:int4":  # two nibbles a byte
            return jax.random.bits(key, shape, jnp.uint8)
        if kind == "zero":
            return jax.random.randint(key, shape, 0, 16, jnp.int32).astype(jnp.uint8)
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)  # fp8 values

    return jax.jit(draw, static_argnums=(1, 2, 3))


def random_quantized_params(shapes: Any, seed: int = 0) -> Any:
    """Random weights for :func:`quantized_shapes`'s tree: each stored matrix drawn on the
    device in its stored form (values over the format's range, positive scales, zero points
    in ``[0, 15]``), every other leaf as :func:`~benchmarks.common.random_params` draws it."""
    import jax

    from turbospark_jax.quant.weights import is_quantized

    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_quantized)
    plain = iter(common.random_params([x for x in leaves if not is_quantized(x)]))
    draw = _draw_stored()
    key = jax.random.PRNGKey(seed)
    out = []
    for i, leaf in enumerate(leaves):
        if not is_quantized(leaf):
            out.append(next(plain))
            continue
        keys = jax.random.split(jax.random.fold_in(key, i), 3)
        q = draw(keys[0], leaf.q.shape, leaf.q.dtype.name, f"values:{leaf.scheme}")
        scale = draw(keys[1], leaf.scale.shape, "float32", leaf.scheme)
        zero = None if leaf.zero is None else draw(keys[2], leaf.zero.shape, "uint8", "zero")
        out.append(dataclasses.replace(leaf, q=q, scale=scale, zero=zero))
    return jax.tree.unflatten(treedef, out)


def nbytes(tree: Any) -> int:
    """Bytes of a tree's leaves (arrays or ``jax.ShapeDtypeStruct``), quantized ones as
    stored."""
    import jax

    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def device_memory() -> int | None:
    """Bytes the device may hold (``None`` where the backend does not say: a CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


# -- the suite -------------------------------------------------------------------------------


def prefill_rate(producer: Any, length: int, vocab: int, repeats: int) -> dict[str, Any]:
    """Tokens/s of the parallel prefill of a ``length``-token prompt into an empty state
    (the path a prompt takes), best of ``repeats`` after one that compiles."""
    prompt = common.prompt_ids(length, vocab, seed=1)
    best, _ = common.best_seconds(
        lambda: producer.prefill_parallel(producer.init_state(), prompt, 0), repeats)
    return {"s": round(best, 5), "tokens_per_s": round(length / best, 1)}


def run(preset: Preset, results: common.Results) -> None:
    import jax

    bandwidth = common.copy_bandwidth(preset.copy_bytes)
    results.data["meta"]["copy_bandwidth_bytes_per_s"] = bandwidth
    limit = device_memory()
    results.data["meta"]["device_memory_bytes"] = limit
    for shape in preset.shapes:
        formats = preset.formats_of(shape)
        lengths = preset.prefill_lengths if BASELINE in formats else ()
        capacity = max([max(preset.contexts) + preset.new_tokens, *lengths]) + 64
        base: dict[tuple[str, int], float] = {}
        for fmt in formats:
            shape_case(shape, fmt, preset, results, bandwidth, limit, capacity, lengths, base)
            jax.clear_caches()
        if shape in preset.kv_shapes:
            kv_cases(shape, preset, results)


#: The KV cache's stored forms the KV cases compare (``None``: the model's dtype).
KV_DTYPES = (None, "int8", "fp8")


def kv_cases(shape: str, preset: Preset, results: common.Results) -> None:
    """Decode at :attr:`Preset.kv_context` with the weights in the preset's dtype and the KV
    cache in each of :data:`KV_DTYPES`; each case's ratio is over the unquantized cache's."""
    import dataclasses as dc

    import jax

    family, config, model = common.model_of(shape, preset.dtype, preset.exact)
    params = random_quantized_params(quantized_shapes(family, config, model, BASELINE))
    capacity = preset.kv_context + preset.new_tokens + 64
    limit = device_memory()
    base: dict[tuple[str, int], float] = {}
    for kv in KV_DTYPES:
        kv_model = dc.replace(model, kv_dtype=kv)
        cache = nbytes(jax.eval_shape(lambda m=kv_model: m.init_cache(capacity)))
        label = {"shape": shape, "format": preset.dtype, "quantized": False, "kind": "kv_decode",
                 "kv_dtype": kv or preset.dtype, "context": preset.kv_context,
                 "cache_bytes": cache}
        if not _fits(results, nbytes(params) + cache, limit, label):
            continue
        try:
            built = common.built_from(shape, config, kv_model, params, capacity=capacity,
                                      exact=preset.exact, burst=min(64, preset.new_tokens))
        except Exception as exc:  # out of memory, say: recorded, next form
            results.data["errors"].append({**label, "error": f"{type(exc).__name__}: {exc}"[:600]})
            continue
        case = results.case(label, lambda b=built: completion_rate(
            b.producer, preset.kv_context, preset.new_tokens, "greedy", preset.repeats,
            config.vocab_size))
        if case is not None:
            case["speedup_over_baseline"] = _over(base, ("kv", preset.kv_context),
                                                  BASELINE if kv is None else kv,
                                                  case["tokens_per_s"])
            results.write()
        del built
        jax.clear_caches()


def shape_case(shape: str, fmt: str, preset: Preset, results: common.Results,
               bandwidth: float, limit: int | None, capacity: int,
               lengths: tuple[int, ...], base: dict[tuple[str, int], float]) -> None:
    """Every case of ``shape`` in ``fmt``: decode at each context, prefill at each length;
    ``base`` holds the baseline's figures (filled when ``fmt`` is the baseline)."""
    import jax

    family, config, model = common.model_of(shape, preset.dtype, preset.exact)
    shapes = quantized_shapes(family, config, model, fmt)
    cache = nbytes(jax.eval_shape(lambda: model.init_cache(capacity)))
    need = nbytes(shapes) + cache
    label = {"shape": shape, "format": preset.dtype if fmt == BASELINE else fmt,
             "quantized": fmt != BASELINE}
    if not _fits(results, need, limit, label):
        return
    try:
        params = random_quantized_params(shapes)
        built = common.built_from(shape, config, model, params, capacity=capacity,
                                  exact=preset.exact, burst=min(64, preset.new_tokens))
    except Exception as exc:  # out of memory, say: recorded, next format
        results.data["errors"].append({**label, "error": f"{type(exc).__name__}: {exc}"[:600]})
        results.write()
        return
    decode_cases(built, preset.exact, label, fmt, preset, results, bandwidth, shapes, base)
    if preset.fast_decode and preset.exact and fmt != BASELINE:
        fast = common.with_exactness(model, False)
        if fast.plan != model.plan:
            fast_built = common.built_from(shape, config, fast, params, capacity=capacity,
                                           exact=False, burst=min(64, preset.new_tokens))
            decode_cases(fast_built, False, label, fmt, preset, results, bandwidth, shapes,
                         base)
    vocab = config.vocab_size
    for length in lengths:
        case = results.case({**label, "kind": "prefill", "length": length},
                            lambda n=length: prefill_rate(built.producer, n, vocab,
                                                          preset.repeats))
        if case is not None:
            ratio = _over(base, ("prefill", length), fmt, case["tokens_per_s"])
            case["ratio_to_baseline"] = ratio
            case["meets_bar"] = None if ratio is None else ratio >= PREFILL_BAR
            results.write()


def decode_cases(built: Any, exact: bool, label: dict[str, Any], fmt: str, preset: Preset,
                 results: common.Results, bandwidth: float, shapes: Any,
                 base: dict[tuple[str, int], float]) -> None:
    """Decode at each of the preset's contexts on ``built``; the speed-up is over the
    baseline's exact decode."""
    weights = common.step_bytes(built.config, shapes, 0)
    for context in preset.contexts:
        need = common.step_bytes(built.config, shapes, context)
        roof = bandwidth / need
        case = results.case(
            {**label, "kind": "decode", "exact": exact, "width": built.producer.width,
             "context": context, "weight_bytes": weights, "step_bytes": need,
             "roofline_tokens_per_s": round(roof, 2)},
            lambda c=context: completion_rate(built.producer, c, preset.new_tokens, "greedy",
                                              preset.repeats, built.config.vocab_size))
        if case is not None:
            case["fraction_of_roofline"] = round(case["tokens_per_s"] / roof, 4)
            case["speedup_over_baseline"] = _over(base, ("decode", context), fmt,
                                                  case["tokens_per_s"])
            results.write()


def _fits(results: common.Results, need: int, limit: int | None,
          label: dict[str, Any]) -> bool:
    """Whether ``need`` bytes fit the device's share (:data:`MEMORY_SHARE`); a case that does
    not is recorded as skipped, with both sizes."""
    if limit is None or need <= MEMORY_SHARE * limit:
        return True
    results.skip(f"its weights and cache take {need / 2**30:.1f} GiB; the device holds "
                 f"{limit / 2**30:.1f} GiB", **label)
    return False


def _over(base: dict[tuple[str, int], float], key: tuple[str, int], fmt: str,
          rate: float) -> float | None:
    """``rate`` over the baseline's at ``key`` (which the baseline's own case sets)."""
    if fmt == BASELINE:
        base[key] = rate
    return round(rate / base[key], 3) if base.get(key) else None
