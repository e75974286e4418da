"""Row-invariant kernels on a whole model: exactness across widths, speed, and each kernel's rate.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python -m benchmarks.rowinv_model --out /tmp/rowinv_model
    PYTHONPATH=. python -m benchmarks.rowinv_model --parts exact,speed --shapes qwen3-0.6b ...
    PYTHONPATH=. python -m benchmarks.rowinv_model --preset cpu --parts exact,speed --out /tmp/c
    PYTHONPATH=. python -m benchmarks.rowinv_model --preset smoke --out /tmp/x   # CPU, tiny
    PYTHONPATH=. python -m benchmarks.rowinv_model --preset cpu-widths --parts exact --out /tmp/w

Parts (``--parts``, in this order; each case on its own: an error is recorded and the run goes
on, the JSON is rewritten after every case, and cases past ``--budget-s`` are listed as
skipped):

* ``products``: each decode-size matrix product of a shape (the merged q/k/v, the output
  projection, the merged gate/up, the down projection, the output head) at 1 and 16 rows,
  ours (several matvec tilings) against XLA's dot, as GB/s of weight reads. Each is timed
  over enough distinct weight buffers to overflow the L2 cache, passed as separate
  arguments (a slice of one stacked buffer would be copied before a custom call reads it),
  by the wall clock and, on a GPU, from a trace (``kernel_us``, ``kernel_GBps``: the device's
  work alone, which is what a product costs inside a model's step; the wall clock at decode
  sizes is mostly the program's dispatch).
  Then the wide products (prefill rows) as TFLOP/s for a few matmul tilings. ``gate_up`` is
  the gated kernel the model runs (the SwiGLU gating in its epilogue), against XLA's plain
  product of both weights.
* ``exact``: random weights of a shape in bfloat16, ``kernels="rowinv"``: a prompt fed token
  by token at width 1, in wide blocks (``prefill_width``), and at a verify width: the last
  logits and every live cache row bitwise equal; then greedy decoding from each state, the
  emitted tokens and their logits equal; a verify of ``k + 1`` rows equal to decoding them one
  by one. The control: XLA's kernels at widths 1 and 16, expected to differ.
* ``speed``: decode tokens/s through ``producer.decode`` in fixed bursts and end to end
  through ``run_raw_completion`` (the issue's figure: its own burst sizing, the rate after
  the first token; each the best of three runs), greedy and sampled, at a short and a long
  context, with row-invariant kernels at width 1 and with XLA's kernels at width 16; exact
  prefill (``prefill_chunk``)
  and parallel prefill tokens/s; the weight roofline at the measured copy bandwidth.
  ``--modes`` and ``--workloads`` pick a subset (an XLA-flag variant measured beside the
  defaults, say); the JSON's meta records ``XLA_FLAGS``.
* ``attention``: the exact prefill's attention alone, one layer: a block of
  ``prefill_width`` rows at the end of each prefill length, over a cache that long, in the
  row-invariant form, for several :class:`~turbospark_jax.kernels.attention.AttentionTiles`
  (row tile, warps, stages), and a decode step's (one row over the speed part's cache) for
  several warps / stages: milliseconds a call (20 calls in one program's loop), TFLOP/s of
  the causal block, each kernel's own time from a trace on a GPU (``kernel_us``), and
  whether its bits equal the settings the kernels choose themselves' (they must: the
  settings are speed only). ``--attention-cases`` picks prefill, decode or both.
* ``profile``: one traced decode burst per kernel mode: kernels per token and the time each
  took (``benchmarks.profile_decode``), with each product's achieved GB/s, and where the
  device sat idle. Run it with ``TURBOSPARK_LOOP_GRAPHS=0``: on JAX 0.11.2 a trace of a
  burst in loop graphs records one step's kernels for the whole burst, which the part
  refuses (fewer product launches a token than layers); without the graphs the launch gaps
  are those of a run with none.
* ``prefill-profile`` (asked for by name, not in the default list): one traced exact prefill
  and one traced one-pass parallel prefill at each prefill length: the device's time in
  products, attention, norms, the RoPE-store and the rest, how much of the call's span the
  device was busy, the costliest kernels, and the products' TFLOP/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.rowinv import best_time
from benchmarks.run import SHAPES, Shape, copy_bandwidth, kv_bytes, weight_bytes

#: A shape no test uses: odd head counts, a width that is no power of two, an untied head.
ODD = Shape("odd-1.3b", "qwen3", 1536, 12, 12, 4, 128, 4608, 50257, False)
#: A shape a 2-core CPU decodes in seconds (the embedded draft model's order of size).
SMALL = Shape("small-60m", "qwen3", 512, 8, 8, 4, 64, 1536, 32000, True)
#: The odd shape's kind at a CPU's size: 6 query heads on 2 KV heads, an MLP width and a
#: vocabulary that no tile divides, an untied head.
ODD_SMALL = Shape("odd-small", "qwen3", 384, 3, 6, 2, 64, 1000, 5003, False)


def two_layers(shape: Shape) -> Shape:
    """``shape`` cut to two layers: every width of the real shape (hidden, heads, MLP,
    vocabulary) at a depth a CPU feeds a prompt through in minutes. Row invariance is a
    property of each layer's kernels at their widths, so two layers (one feeding the next)
    check what the whole depth would."""
    return dataclasses.replace(shape, name=f"{shape.name}-2l", num_hidden_layers=2)


#: The issue's shapes at their real widths, two layers deep (the ``cpu-widths`` preset).
TWO_LAYER = {s.name: s for s in (two_layers(SHAPES[n]) for n in
                                   ("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b"))}
ALL_SHAPES = {**SHAPES, ODD.name: ODD, SMALL.name: SMALL, ODD_SMALL.name: ODD_SMALL,
              **TWO_LAYER}


@dataclasses.dataclass(frozen=True)
class Preset:
    shapes: tuple[str, ...]
    exact_shapes: tuple[str, ...]
    contexts: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    new_tokens: int
    burst: int
    exact_prompt: int
    prefill_width: int
    verify_width: int
    copies_bytes: int


PRESETS = {
    "h200": Preset(shapes=("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b"),
                   exact_shapes=("llama-3.2-1b", "qwen3-0.6b", ODD.name),
                   contexts=(128, 4096), prefill_lengths=(2048, 8192), new_tokens=256,
                   burst=128, exact_prompt=600, prefill_width=2048, verify_width=5,
                   copies_bytes=256 << 20),
    "cpu": Preset(shapes=(SMALL.name,), exact_shapes=(SMALL.name, ODD_SMALL.name),
                  contexts=(128, 1024),
                  prefill_lengths=(512, 2048), new_tokens=64, burst=16, exact_prompt=300,
                  prefill_width=256, verify_width=5, copies_bytes=64 << 20),
    # The exact part at the 1B, 0.6B and 8B shapes' own widths on a CPU (float32, two layers).
    "cpu-widths": Preset(shapes=(SMALL.name,), exact_shapes=tuple(TWO_LAYER),
                         contexts=(128,), prefill_lengths=(512,), new_tokens=32, burst=16,
                         exact_prompt=300, prefill_width=256, verify_width=5,
                         copies_bytes=64 << 20),
    "smoke": Preset(shapes=("tiny",), exact_shapes=("tiny",), contexts=(24,),
                    prefill_lengths=(40,), new_tokens=8, burst=4, exact_prompt=37,
                    prefill_width=16, verify_width=3, copies_bytes=1 << 20),
}


class Run:
    """The results so far, written after every case; cases past the budget are skipped."""

    def __init__(self, out: Path, budget_s: float, meta: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "rowinv_model.json"
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.data: dict[str, Any] = {"meta": meta, "records": [], "errors": [], "skipped": []}
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def case(self, part: str, label: dict[str, Any], fn: Any) -> Any:
        if time.perf_counter() - self.start > self.budget_s:
            self.data["skipped"].append({"part": part, **label})
            self.write()
            return None
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # recorded; the run goes on
            self.data["errors"].append({"part": part, **label, "error": repr(e)[:600],
                                        "trace": traceback.format_exc()[-2500:]})
            print(f"{part} {label} ERROR {e!r}"[:400], flush=True)
            self.write()
            return None
        self.data["records"].append({"part": part, **label, **result,
                                     "case_s": round(time.perf_counter() - t0, 1)})
        self.write()
        print(f"{self.data['elapsed_s']:7.1f}s {part} {label} "
              f"{json.dumps(result, default=str)[:300]}", flush=True)
        return result


# -- products ---------------------------------------------------------------------------------

#: The products of :func:`products_of`, in its order.
PRODUCT_NAMES = ("qkv", "o", "gate_up", "down", "head")


def products_of(shape: Shape) -> list[tuple[str, int, tuple[int, ...], str]]:
    """``(name, K, (N, ...), layout)`` of one decode step's matrix products."""
    d, hd = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    f = shape.intermediate_size
    head = (shape.vocab_size,)
    specs = [(d, (q, kv, kv), "kn"), (q, (d,), "kn"), (d, (f, f), "kn"), (f, (d,), "kn"),
             (d, head, "nk" if shape.tie_word_embeddings else "kn")]
    return [(name, *spec) for name, spec in zip(PRODUCT_NAMES, specs, strict=True)]


def _weights(k: int, ns: tuple[int, ...], layout: str, copies: int, seed: int) -> list[Any]:
    import jax
    import jax.numpy as jnp

    out = []
    for c in range(copies):
        key = jax.random.PRNGKey(seed * 1000 + c)
        parts = []
        for i, n in enumerate(ns):
            shape = (n, k) if layout == "nk" else (k, n)
            parts.append((jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
                          / np.sqrt(k)).astype(jnp.bfloat16))
        out.append(tuple(parts))
    return out


def _xla_product(x: Any, ws: tuple[Any, ...], layout: str = "kn") -> Any:
    import jax.numpy as jnp

    mats = [w.T for w in ws] if layout == "nk" else list(ws)
    w = mats[0] if len(mats) == 1 else jnp.concatenate(mats, axis=1)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _product_rate(product: Any, k: int, ns: tuple[int, ...], layout: str, rows: int,
                  copies_bytes: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    nbytes = k * sum(ns) * 2
    copies = int(max(2, min(32, -(-copies_bytes // nbytes))))
    ws = _weights(k, ns, layout, copies, seed=k + sum(ns))
    x = jax.random.normal(jax.random.PRNGKey(1), (rows, k), jnp.bfloat16)
    fn = jax.jit(lambda x, *ws: [product(x, w) for w in ws])
    dt = best_time(fn, x, *ws) / copies
    out = {"us": round(dt * 1e6, 2), "GBps": round(nbytes / dt / 1e9, 1), "copies": copies}
    traced = _device_seconds(fn, x, *ws)
    if traced is not None:  # the kernels alone: what a product costs inside a model's step
        out["kernel_us"] = round(traced / copies * 1e6, 2)
        out["kernel_GBps"] = round(nbytes * copies / traced / 1e9, 1)
    return out


def _device_seconds(fn: Any, *args: Any) -> float | None:
    """Seconds of device work (kernels and copies) in one traced call of ``fn``; None where
    the trace holds no device stream (a CPU). A product timed alone at decode sizes is
    mostly the program's dispatch: on the H100 the 1B shape's q/k/v matvec read 597 GB/s
    timed by the wall clock and 1,941 GB/s in the model's trace."""
    events = _device_events(fn, *args)
    return sum(d for _, _, d in events) * 1e-9 if events else None


def _device_events(fn: Any, *args: Any) -> list[tuple[str, int, int]]:
    """The device's ``(name, start_ns, duration_ns)`` events of one traced call of ``fn``,
    after one untraced call to compile it (none on a CPU)."""
    import jax

    from benchmarks.profile_decode import traced_events

    jax.block_until_ready(fn(*args))
    _, events = traced_events(lambda: jax.block_until_ready(fn(*args)))
    return events


#: The matvec kernel's column tiles (the first: its default). The narrow ones give a small
#: product more programs (the 0.6B shape's o and down products have 16 column tiles of 64
#: and four segments: 64 programs on 132 multiprocessors).
MATVEC_TILES = [dict(matvec_bn=64), dict(matvec_bn=128), dict(matvec_bn=128, matvec_warps=8),
                dict(matvec_bn=256, matvec_warps=8), dict(matvec_bn=32), dict(matvec_bn=16),
                dict(matvec_bn=32, matvec_warps=2)]
#: The gated kernel's column tiles (the first: its default for the shape).
GATED_TILES = [dict(), dict(gated_bn=16), dict(gated_bn=32), dict(gated_bn=64),
               dict(gated_bn=32, matvec_warps=2), dict(gated_bn=64, gated_stages=3)]
SEGMENTS = (2, 4, 8, 16)
MATMUL_TILES = [dict(bm=64, bn=128, warps=4, stages=3), dict(bm=128, bn=128, warps=8, stages=3),
                dict(bm=128, bn=256, warps=8, stages=3), dict(bm=128, bn=128, warps=4, stages=4),
                dict(bm=64, bn=256, warps=4, stages=4),
                dict(bm=128, bn=128, warps=8, stages=3, flat_loop=True),
                dict(bm=128, bn=256, warps=8, stages=3, flat_loop=True),
                dict(bm=128, bn=128, warps=4, stages=4, flat_loop=True)]


def _ours(prod: str, layout: str, tiles: Any, schedule: Any = None) -> Any:
    """Our kernel for one of :func:`products_of`'s products, ``(x, weights) -> rows``: the
    gated kernel for ``gate_up`` (it gates in its epilogue and has one segment over K, so
    ``schedule`` does not apply), :func:`rowinv_matmul` for the rest."""
    from turbospark_jax.kernels.rowinv import rowinv_matmul, rowinv_swiglu

    if prod == "gate_up":
        return lambda x, w: rowinv_swiglu(x, w[0], w[1], tiles=tiles)
    extra = {} if schedule is None else {"schedule": schedule}
    return lambda x, w: rowinv_matmul(x, w, w_layout=layout, tiles=tiles, **extra)


def part_products(preset: Preset, run: Run, shapes: list[str],
                  only: tuple[str, ...] | None = None) -> None:
    """``only``: the products to time (names of :func:`products_of`), or all of them."""
    import jax

    from turbospark_jax.kernels.rowinv import Schedule, Tiles

    on_gpu = jax.default_backend() == "gpu"
    for index, name in enumerate(shapes):
        shape = ALL_SHAPES[name]
        sweep = on_gpu and index == 0  # every matvec tiling on the first shape only
        for prod, k, ns, layout in products_of(shape):
            if only is not None and prod not in only:
                continue
            label = {"shape": name, "product": prod, "K": k, "N": list(ns), "layout": layout}
            for rows in (1, 16):
                run.case("products", {**label, "rows": rows, "impl": "xla"},
                         lambda k=k, ns=ns, layout=layout, rows=rows: _product_rate(
                             lambda x, w, layout=layout: _xla_product(x, w, layout),
                             k, ns, layout, rows, preset.copies_bytes))
                kinds = GATED_TILES if prod == "gate_up" else MATVEC_TILES
                for tiles in kinds if sweep and rows == 1 else kinds[:1]:
                    segments = SEGMENTS if sweep and rows == 1 and prod != "gate_up" else (4,)
                    for seg in segments:
                        t, s = Tiles(**tiles), Schedule(segment_tiles=seg)
                        case = {**label, "rows": rows, "impl": "ours", "tiles": tiles}
                        if prod != "gate_up":
                            case["segment_tiles"] = seg
                        run.case("products", case, functools.partial(
                            _product_rate, _ours(prod, layout, t, s), k, ns, layout, rows,
                            preset.copies_bytes))
        # wide products: TFLOP/s at prefill widths
        for prod, k, ns, layout in products_of(shape)[:4]:
            if only is not None and prod not in only:
                continue
            rows = max(preset.prefill_lengths[0], 16)
            label = {"shape": name, "product": prod, "K": k, "N": list(ns), "rows": rows}
            run.case("wide", {**label, "impl": "xla"}, functools.partial(
                _wide_rate, functools.partial(_xla_product, layout=layout), k, ns, layout, rows))
            for tiles in MATMUL_TILES if sweep else MATMUL_TILES[:1]:
                run.case("wide", {**label, "impl": "ours", "tiles": tiles}, functools.partial(
                    _wide_rate, _ours(prod, layout, Tiles(**tiles)), k, ns, layout, rows))


def _wide_rate(product: Any, k: int, ns: tuple[int, ...], layout: str, rows: int) -> dict:
    import jax
    import jax.numpy as jnp

    ws = _weights(k, ns, layout, 1, seed=3)[0]
    x = jax.random.normal(jax.random.PRNGKey(2), (rows, k), jnp.bfloat16)
    fn = jax.jit(lambda x, *w: product(x, w))
    return {"TFLOPs": round(2 * rows * k * sum(ns) / best_time(fn, x, *ws) / 1e12, 2)}


# -- the model ------------------------------------------------------------------------------

def _model(shape: Shape, kernels: str, seed: int = 0) -> tuple[Any, Any, Any]:
    import jax
    import jax.numpy as jnp

    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel, unstack_layers

    config = DenseConfig.from_hf_dict(shape.hf_dict())
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    model = DenseModel(config, dtype, scan_layers=False, kernels=kernels,
                       fuse_rope_store=FUSE_ROPE_STORE, fold_in_split=FOLD_IN_SPLIT)
    params = unstack_layers(jax.jit(model.init_params)(jax.random.PRNGKey(seed)))
    return config, model, params


#: ``--fuse-rope`` / ``--no-fuse-rope``: the models' ``fuse_rope_store``.
FUSE_ROPE_STORE = True
#: ``--fold-in-split``: the models' ``fold_in_split``.
FOLD_IN_SPLIT = True
#: ``--short-decode-keys``: the producers' ``short_decode_keys`` (None: the default).
SHORT_DECODE_KEYS: int | None = None


def _producer(model: Any, params: Any, capacity: int, width: int, burst: int,
              prefill_width: int | None = None, donate: bool = False) -> Any:
    """The exact part keeps states to feed them again (no donation); the speed part donates,
    as the CLI and the server do (a call that does not copies the KV cache first)."""
    from turbospark_jax.engine.producer import BlockProducer

    extra = {} if SHORT_DECODE_KEYS is None else {"short_decode_keys": SHORT_DECODE_KEYS}
    return BlockProducer(model, params, capacity=capacity, width=width, steps_per_call=burst,
                         prefill_width=prefill_width, donate=donate, **extra)


def _bits(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _live_cache(state: Any, rows: int) -> list[np.ndarray]:
    """Every layer's K and V rows ``0..rows-1``, as raw bits."""
    cache = state.cache
    ks = cache.k if isinstance(cache.k, tuple) else [cache.k[i] for i in range(cache.k.shape[0])]
    vs = cache.v if isinstance(cache.v, tuple) else [cache.v[i] for i in range(cache.v.shape[0])]
    return [_bits(b[:rows]) for b in (*ks, *vs)]


def _decode_logits(producer: Any, state: Any, first: int, start: int, steps: int) -> tuple:
    """Greedy decoding one ``produce`` at a time: the tokens and each step's logits bits."""
    tok, out, logits = first, [], []
    for i in range(steps):
        row, state = producer.produce(state, tok, start + i)
        logits.append(_bits(row))
        tok = int(np.argmax(np.asarray(row)))
        out.append(tok)
    return out, logits, state


def _burst_logits(producer: Any, state: Any, first: int, start: int, steps: int) -> list:
    """Greedy decoding of ``steps`` tokens (at most a burst) in one ``producer.decode``
    call: each step's logits bits (the state is not kept: the producer does not donate it)."""
    from turbospark_jax.core import sampling

    steps = min(steps, producer.steps_per_call)
    burst, _ = producer.decode(state, first, steps, params=sampling.SamplingParams.greedy(),
                               history=sampling.History.empty(producer.vocab_size),
                               key=sampling.request_key(0), gen_index=1)
    return [_bits(row) for row in np.asarray(burst.logits)]


#: The exact part's short prompt: its decode bursts run the short-context program.
SHORT_PROMPT = 64


def exact_case(shape: Shape, preset: Preset, kernels: str, widths: list[tuple[int, int | None]],
               ) -> dict[str, Any]:
    """Feed one prompt through producers of the given ``(width, prefill_width)``, decode 8
    tokens from each, and compare everything with the first, bitwise."""
    config, model, params = _model(shape, kernels)
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(0, config.vocab_size, preset.exact_prompt)]
    capacity = preset.exact_prompt + 64
    runs = []
    for width, prefill_width in widths:
        producer = _producer(model, params, capacity, width, preset.burst, prefill_width)
        last, state = producer.prefill_chunk(producer.init_state(), prompt, 0)
        cache = _live_cache(state, len(prompt))
        first = int(np.argmax(np.asarray(last)))
        # The device loop's decode program (its own draw plan, the head unbranched) from
        # the same state, before the one-by-one steps go on from it.
        burst = _burst_logits(producer, state, first, len(prompt), 8)
        tokens, logits, state = _decode_logits(producer, state, first, len(prompt), 8)
        runs.append({"last": _bits(last), "cache": cache, "tokens": tokens, "logits": logits,
                     "burst": burst, "producer": producer, "state": state})
    base = runs[0]
    result: dict[str, Any] = {"widths": widths, "prompt": len(prompt), "agree": []}
    for r in runs[1:]:
        same = lambda key, r=r: all(  # noqa: E731
            np.array_equal(a, b) for a, b in zip(base[key], r[key], strict=True))
        cache_same, logits_same = same("cache"), same("logits")
        last_same = np.array_equal(base["last"], r["last"])
        result["agree"].append({"prefill_logits": bool(last_same), "cache": bool(cache_same),
                                "tokens": r["tokens"] == base["tokens"],
                                "decode_logits": bool(logits_same),
                                "burst_logits": bool(same("burst"))})
    # the decode program's burst == the one-by-one steps it replaces
    result["burst_equals_steps"] = all(np.array_equal(a, b) for a, b in zip(
        base["burst"], base["logits"][: len(base["burst"])], strict=True))
    # a short context's burst (on a model that takes the bound, the decode program bounded
    # by short_decode_keys: its attention the folding kernel) == the unbounded program's
    # one-by-one steps
    narrow = base["producer"]
    short = prompt[:SHORT_PROMPT]
    last, short_state = narrow.prefill_chunk(narrow.init_state(), short, 0)
    first = int(np.argmax(np.asarray(last)))
    short_burst = _burst_logits(narrow, short_state, first, len(short), 8)
    _, short_steps, _ = _decode_logits(narrow, short_state, first, len(short), 8)
    result["short_decode_keys"] = narrow.short_decode_keys
    result["short_burst_equals_steps"] = all(np.array_equal(a, b) for a, b in zip(
        short_burst, short_steps[: len(short_burst)], strict=True))
    # verify of k + 1 rows at the widest producer == the narrowest producer's one-by-one steps
    wide = runs[-1]
    feed = [int(t) for t in rng.integers(0, config.vocab_size, preset.verify_width)]
    at = len(prompt) + 8
    v_logits, _ = wide["producer"].verify(wide["state"], feed, at)
    one_state, one = base["state"], []
    for i, t in enumerate(feed):
        row, one_state = base["producer"].produce(one_state, t, at + i)
        one.append(_bits(row))
    result["verify_equals_decode"] = all(
        np.array_equal(_bits(v_logits[i]), one[i]) for i in range(len(feed)))
    result["all_equal"] = bool(result["verify_equals_decode"] and result["burst_equals_steps"]
                               and result["short_burst_equals_steps"] and all(
        all(a.values()) for a in result["agree"]))
    return result


def _sampling(kind: str) -> Any:
    from turbospark_jax.core import sampling

    if kind == "greedy":
        return sampling.SamplingParams.greedy()
    return sampling.SamplingParams.make(temperature=0.8, top_p=0.95, top_k=50)


def decode_speed(producer: Any, context: int, new_tokens: int, burst: int, vocab: int,
                 kind: str) -> dict[str, Any]:
    """Fill ``context`` tokens (parallel path), then time ``new_tokens`` decode steps in device
    bursts of ``burst``."""
    import jax

    from turbospark_jax.core import sampling

    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, vocab, context)]
    params = _sampling(kind)

    def go(prompt_ids: list[int], tokens: int) -> float:
        state = producer.init_state()
        logits, state = producer.prefill_parallel(state, prompt_ids, 0)
        tok = int(np.argmax(np.asarray(logits)))
        jax.block_until_ready(state)  # the prefill's tail is not the decode's time
        history, key = sampling.History.empty(vocab), sampling.request_key(0)
        done = 0
        t0 = time.perf_counter()
        while done < tokens:
            steps = min(burst, tokens - done)
            # no logits back: a burst's [steps, V] float32 rows are 33 MB at the 1B shape
            b, state = producer.decode(state, tok, steps, params=params, history=history,
                                       key=key, gen_index=done + 1, record_logits=False)
            done += len(b.tokens)
            tok, history = b.tokens[-1], b.history
        return time.perf_counter() - t0

    go(prompt[:8], burst)  # compile
    dt = min(go(prompt, new_tokens) for _ in range(3))  # the best of three, as end to end
    return {"tokens_per_s": round(new_tokens / dt, 1)}


def completion_speed(producer: Any, context: int, new_tokens: int, vocab: int,
                     kind: str) -> dict[str, Any]:
    """Decode tokens/s end to end through ``run_raw_completion`` (the issue's figure): a
    ``context``-token prompt (exact prefill, not timed), then ``new_tokens`` tokens with
    the loop's own burst sizing, no stop id; the rate after the first token."""
    from turbospark_jax import CompletionRequest, run_raw_completion
    from turbospark_jax.core.sampling import SamplingConfig

    rng = np.random.default_rng(2)
    prompt = [int(t) for t in rng.integers(0, vocab, context)]
    settings = (SamplingConfig() if kind == "greedy"
                else SamplingConfig(temperature=0.8, top_p=0.95, top_k=50))

    def go(tokens: int) -> Any:
        request = CompletionRequest(prompt_ids=prompt, max_tokens=tokens, sampling=settings,
                                    seed=3)
        return run_raw_completion(producer, request)

    go(new_tokens)  # compile every program the loop takes
    # the best of three: one run's rate moved by several percent between calls on one machine
    runs = [go(new_tokens) for _ in range(3)]
    rates = [r.timings.decode_tokens_per_s(len(r.token_ids)) for r in runs]
    done = runs[int(np.argmax(rates))]
    generated = len(done.token_ids)
    return {"tokens_per_s": round(max(rates), 1), "runs_tokens_per_s": [round(r, 1) for r in rates],
            "generated": generated, "decode_s": round(done.timings.decode_s, 4)}


def prefill_speed(producer: Any, length: int, vocab: int, path: str) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, vocab, length)]
    # "parallel": passes of the default 2,048 rows (the first over its own rows, cuDNN's
    # attention on a GPU; the rest over the cache); "parallel-one-pass": the whole prompt
    # in one fresh pass.
    fn = {"exact": lambda s: producer.prefill_chunk(s, prompt, 0),
          "parallel": lambda s: producer.prefill_parallel(s, prompt, 0),
          "parallel-one-pass": lambda s: producer.prefill_parallel(s, prompt, 0,
                                                                   chunk=length)}[path]
    import jax

    jax.block_until_ready(fn(producer.init_state()))
    best = float("inf")
    for _ in range(2):
        state = producer.init_state()
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(state))
        best = min(best, time.perf_counter() - t0)
    return {"tokens_per_s": round(length / best, 1), "s": round(best, 4)}


#: How the prefill profile sorts a trace's kernels: the first pattern in a kernel's name
#: names its group (ours by their names; cuBLAS / CUTLASS products and cuDNN attention by the
#: words their kernels carry).
PREFILL_GROUPS = (("products", ("rowinv_mat", "rowinv_mosaic", "rowinv_gate", "gemm", "cutlass",
                                 "xmma", "cublas", "nvjet")),
                  ("attention", ("cached_attention", "flash", "fmha", "cudnn", "attention")),
                  ("norms", ("row_rms_norm",)), ("rope_store", ("rope_store",)))


def _group(name: str) -> str:
    low = name.lower()
    for group, words in PREFILL_GROUPS:
        if any(w in low for w in words):
            return group
    return "other"


def prefill_profile(producer: Any, length: int, vocab: int, path: str,
                    shape: Shape) -> dict[str, Any]:
    """One prefill of ``length`` tokens, exact (``prefill_chunk``) or in one parallel pass
    (as :func:`prefill_speed` runs them), traced: the device's time by group
    (:data:`PREFILL_GROUPS`), how busy it was over the call's span and its widest idle gaps
    (with the kernels either side), the costliest kernels, and the products' FLOP rate
    (``2 x`` the layers' weights ``x`` the rows, plus the head on the last row)."""
    from benchmarks.profile_decode import idle_gaps

    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, vocab, length)]
    if path == "exact":
        call = lambda: producer.prefill_chunk(producer.init_state(), prompt, 0)  # noqa: E731
    else:
        call = lambda: producer.prefill_parallel(  # noqa: E731
            producer.init_state(), prompt, 0, chunk=length)
    events = _device_events(call)
    if not events:
        return {"events": 0}
    groups: dict[str, float] = {}
    kernels: dict[str, list[float]] = {}
    for name, _, dur in events:
        group = _group(name)
        groups[group] = groups.get(group, 0.0) + dur / 1e3
        row = kernels.setdefault(name[:80], [0, 0.0])
        row[0] += 1
        row[1] += dur / 1e3
    span_us = (max(s + d for _, s, d in events) - min(s for _, s, _ in events)) / 1e3
    idle = idle_gaps(sorted(events, key=lambda e: e[1]), top=8)
    layer_weights = sum(k * sum(ns) for name, k, ns, _ in products_of(shape) if name != "head")
    flop = 2 * layer_weights * shape.num_hidden_layers * length + 2 * shape.hidden_size * (
        shape.vocab_size)
    products_us = groups.get("products", 0.0)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:14]
    return {"span_ms": round(span_us / 1e3, 2),
            "busy_ms": round(sum(groups.values()) / 1e3, 2),
            "groups_ms": {g: round(us / 1e3, 2) for g, us in sorted(groups.items())},
            "products_TFLOPs": round(flop / (products_us * 1e-6) / 1e12, 1) if products_us
            else None,
            "idle_ms": round(idle["total_ns"] / 1e6, 2),
            "widest_gaps": [{"us": round(ns / 1e3, 1), "after": a[:48], "before": b[:48]}
                            for ns, a, b in idle["widest"]],
            "top_kernels": [{"kernel": n, "calls": c, "ms": round(us / 1e3, 3)}
                            for n, (c, us) in top]}


def part_prefill_profile(preset: Preset, run: Run, shapes: list[str]) -> None:
    """The exact prefill (blocks of ``prefill_width`` rows) and the one-pass parallel
    prefill at each prefill length, one traced call each (:func:`prefill_profile`)."""
    for name in shapes:
        shape = ALL_SHAPES[name]
        config, model, params = _model(shape, "rowinv")
        producer = _producer(model, params, max(preset.prefill_lengths) + 64, 1, preset.burst,
                             preset.prefill_width, donate=True)
        for length in preset.prefill_lengths:
            for path in ("exact", "parallel-one-pass"):
                run.case("prefill-profile", {"shape": name, "kernels": "rowinv", "path": path,
                                             "length": length,
                                             "prefill_width": preset.prefill_width},
                         functools.partial(prefill_profile, producer, length,
                                           config.vocab_size, path, shape))
        del producer, params, model


#: The attention part's prefill settings. The first, ``{}``, is what the kernels choose
#: themselves (``tiles_for``); the bits of every other setting are checked against its.
ATTENTION_TILES = [dict(), dict(max_row_tile=64, warps=4, stages=2),
                   dict(max_row_tile=128, warps=8, stages=3), dict(max_row_tile=128, warps=8),
                   dict(max_row_tile=128, warps=4, stages=3), dict(max_row_tile=64, stages=3),
                   dict(max_row_tile=128, warps=8, stages=4), dict(max_row_tile=32, warps=4)]


#: Kernel calls a timed attention program runs (see :func:`attention_case`).
ATTENTION_CALLS = 20
#: The decode step's settings tried (one query row; the split and fold kernels).
DECODE_ATTENTION_TILES = [dict(), dict(warps=1), dict(warps=2), dict(warps=8),
                          dict(stages=1), dict(stages=3), dict(warps=2, stages=3)]


def attention_case(shape: Shape, rows: int, length: int, tiles: dict[str, int],
                   base: dict[str, np.ndarray], capacity: int | None = None) -> dict[str, Any]:
    """One layer's row-invariant attention: ``rows`` rows ending at position ``length - 1``
    over a cache of ``capacity`` (default ``length + 64``) positions; ``base`` keeps the
    chosen settings' bits."""
    import jax
    import jax.numpy as jnp

    from turbospark_jax.kernels.attention import AttentionTiles, cached_attention

    interpret = jax.default_backend() != "gpu"
    dtype = jnp.float32 if interpret else jnp.bfloat16
    heads, kv, hd = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    capacity = capacity or length + 64
    keys = jax.random.split(jax.random.PRNGKey(length), 3)
    q = jax.random.normal(keys[0], (rows, heads, hd), dtype)
    k = jax.random.normal(keys[1], (capacity, kv, hd), dtype)
    v = jax.random.normal(keys[2], (capacity, kv, hd), dtype)
    pos = jnp.arange(length - rows, length, dtype=jnp.int32)
    settings = AttentionTiles(**tiles) if tiles else None
    attend = functools.partial(cached_attention, interpret=interpret, row_invariant=True,
                               tiles=settings)
    fn = jax.jit(attend)
    # Timed as one program that runs the kernel ATTENTION_CALLS times in a loop (each call's
    # queries feeding on the last output, so none is hoisted), the best of three: a call
    # timed from the host alone carries its dispatch (about as long as a decode step's
    # kernel) and, first in a group, the clocks' ramp (an earlier sweep read 1.28 ms for a
    # setting that runs in 0.7).
    calls = ATTENTION_CALLS if not interpret else 1

    @jax.jit
    def looped(q, k, v, pos):
        def body(_, q):
            return q + attend(q, k, v, pos).astype(q.dtype).reshape(q.shape) * 0.0
        return jax.lax.fori_loop(0, calls, body, q)

    seconds = best_time(looped, q, k, v, pos, repeats=3) / calls
    bits = _bits(fn(q, k, v, pos))
    key = f"{shape.name}/{rows}/{length}/{capacity}"
    base.setdefault(key, bits)
    # causal work: each row sees (its position + 1) keys, 4 * head_dim flops a key a head
    seen = float(np.sum(np.arange(length - rows, length) + 1))
    out = {"ms": round(seconds * 1e3, 3),
           "TFLOPs": round(4 * hd * heads * seen / seconds / 1e12, 1),
           "same_bits_as_default": bool(np.array_equal(bits, base[key]))}
    kernels = _device_kernels(fn, q, k, v, pos)
    if kernels is not None:  # one traced call: each kernel's own time (what a step pays)
        out["kernel_us"] = kernels
    return out


def _device_kernels(fn: Any, *args: Any) -> dict[str, float] | None:
    """Microseconds of each device kernel (by name, summed) in one traced call of ``fn``;
    None where the trace holds no device stream (a CPU)."""
    events = _device_events(fn, *args)
    if not events:
        return None
    totals: dict[str, float] = {}
    for name, _, duration in events:
        totals[name] = round(totals.get(name, 0.0) + duration * 1e-3, 2)
    return totals


def part_attention(preset: Preset, run: Run, shapes: list[str],
                   cases: tuple[str, ...] = ("prefill", "decode")) -> None:
    base: dict[str, np.ndarray] = {}
    for name in shapes:
        shape = ALL_SHAPES[name]
        for length in preset.prefill_lengths if "prefill" in cases else ():
            rows = min(preset.prefill_width, length)
            for tiles in ATTENTION_TILES:
                run.case("attention", {"shape": name, "rows": rows, "length": length,
                                       "tiles": tiles},
                         functools.partial(attention_case, shape, rows, length, tiles, base))
        # a decode step over the speed part's cache (its capacity: the longest prompt + 64)
        capacity = max(preset.prefill_lengths) + 64
        for length in preset.contexts if "decode" in cases else ():
            for tiles in DECODE_ATTENTION_TILES:
                run.case("attention", {"shape": name, "rows": 1, "length": length,
                                       "capacity": capacity, "tiles": tiles},
                         functools.partial(attention_case, shape, 1, length, tiles, base,
                                           capacity))


def part_exact(preset: Preset, run: Run, shapes: list[str]) -> None:
    p = preset
    for name in shapes:
        shape = ALL_SHAPES[name]
        widths = [(1, None), (1, p.prefill_width), (p.verify_width, p.prefill_width // 4)]
        run.case("exact", {"shape": name, "kernels": "rowinv"},
                 lambda shape=shape, widths=widths: exact_case(shape, p, "rowinv", widths))
    name = shapes[0]
    run.case("exact", {"shape": name, "kernels": "xla", "control": True},
             lambda: exact_case(ALL_SHAPES[name], p, "xla", [(1, None), (16, None)]))


def _modes(modes: tuple[str, ...]) -> list[tuple[str, int]]:
    """``(kernels, width)`` of each kernel mode in ``modes`` as the speed and profile parts
    run it: the row-invariant kernels at width 1, XLA's at the width its exactness needs (16
    on a GPU, 1 elsewhere)."""
    import jax

    xla_width = 16 if jax.default_backend() == "gpu" else 1
    return [(k, w) for k, w in (("rowinv", 1), ("xla", xla_width)) if k in modes]


def part_speed(preset: Preset, run: Run, shapes: list[str], bandwidth: float,
               modes: tuple[str, ...] = ("rowinv", "xla"),
               workloads: tuple[str, ...] = ("decode", "completion", "prefill")) -> None:
    p = preset
    for name in shapes:
        shape = ALL_SHAPES[name]
        for kernels, width in _modes(modes):
            try:
                config, model, params = _model(shape, kernels)
            except Exception as e:  # e.g. out of memory: recorded, next shape
                run.data["errors"].append({"part": "speed", "shape": name, "error": repr(e)})
                continue
            wb = weight_bytes(params, config)
            top = max(p.contexts) + p.new_tokens + 64
            prefill_width = p.prefill_width if kernels == "rowinv" else None
            producer = _producer(model, params, max(top, max(p.prefill_lengths) + 64), width,
                                 p.burst, prefill_width, donate=True)
            for ctx in p.contexts:
                roof = bandwidth / (wb + kv_bytes(config, ctx))
                for kind in ("greedy", "sampled"):
                    if "decode" in workloads:
                        run.case("speed", {"shape": name, "kernels": kernels, "width": width,
                                           "workload": "decode", "context": ctx,
                                           "sampling": kind,
                                           "roofline_tokens_per_s": round(roof, 1)},
                                 functools.partial(decode_speed, producer, ctx, p.new_tokens,
                                                   p.burst, config.vocab_size, kind))
                    if "completion" not in workloads:
                        continue
                    run.case("speed", {"shape": name, "kernels": kernels, "width": width,
                                       "workload": "completion", "context": ctx,
                                       "sampling": kind,
                                       "roofline_tokens_per_s": round(roof, 1)},
                             functools.partial(completion_speed, producer, ctx, p.new_tokens,
                                               config.vocab_size, kind))
            for length in p.prefill_lengths if "prefill" in workloads else ():
                paths = ("exact", "parallel") + (("parallel-one-pass",) if length > 2048
                                                 else ())
                for path in paths:
                    run.case("speed", {"shape": name, "kernels": kernels, "width": width,
                                       "prefill_width": prefill_width, "workload": "prefill",
                                       "path": path, "length": length},
                             functools.partial(prefill_speed, producer, length,
                                               config.vocab_size, path))
            del producer, params, model


def kernel_rates(shape: Shape, kernels: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Each traced kernel's time per token and, for the labelled matrix products, the rate at
    which it read its weights (GB/s): ``kernels`` maps a kernel name to
    ``[calls per token, microseconds per token]`` (``profile_decode.profile_burst``)."""
    weights = {name: k * sum(ns) * 2 for name, k, ns, _ in products_of(shape)}
    out = []
    for name, (calls, us) in kernels.items():
        row: dict[str, Any] = {"kernel": name[:80], "calls_per_token": calls,
                               "us_per_token": round(us, 2)}
        for product, nbytes in weights.items():
            if name.startswith(("rowinv_matvec_", "rowinv_matmul_")) and name.endswith(
                    "_" + product):
                row["weight_GBps"] = round(nbytes * calls / (us * 1e-6) / 1e9, 1)
        out.append(row)
    return out


def part_profile(preset: Preset, run: Run, shapes: list[str], bandwidth: float,
                 modes: tuple[str, ...] = ("rowinv", "xla"), capacity: int = 512,
                 contexts: tuple[int, ...] = (128,)) -> None:
    """A traced decode burst after each of ``contexts`` prompt tokens; the cache holds
    ``capacity`` positions, or the longest context and the burst where that is more."""
    from benchmarks.profile_decode import profile_burst

    capacity = max(capacity, max(contexts) + preset.burst + 64)
    for name in shapes:
        shape = ALL_SHAPES[name]
        for kernels, width in _modes(modes):
            config, model, params = _model(shape, kernels)
            producer = _producer(model, params, capacity, width, preset.burst, donate=True)

            def traced(producer=producer, vocab=config.vocab_size, shape=shape,
                       kind="greedy", context=128) -> dict:
                result = profile_burst(producer, context, preset.burst, vocab, _sampling(kind))
                if "all_kernels" in result:
                    from benchmarks.decode_bound import check_whole_steps

                    check_whole_steps({"shape": shape.name, "context": context, **result},
                                      shape.num_hidden_layers)
                    result["kernel_rates"] = kernel_rates(shape, result["all_kernels"])
                return result

            for context in contexts:
                for kind in ("greedy", "sampled") if kernels == "rowinv" else ("greedy",):
                    run.case("profile", {"shape": name, "kernels": kernels, "width": width,
                                         "context": context, "capacity": capacity,
                                         "sampling": kind},
                             functools.partial(traced, kind=kind, context=context))
            del producer, params, model


def main(argv: list[str] | None = None) -> int:
    import jax

    from turbospark_jax.core import sampling
    from turbospark_jax.kernels import attention as pallas_attention
    from turbospark_jax.kernels import pdl as pallas_pdl
    from turbospark_jax.kernels import rowinv

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    ap.add_argument("--parts", default="products,exact,speed,profile")
    ap.add_argument("--shapes", help="comma-separated shapes (default: the preset's)")
    ap.add_argument("--exact-shapes", help="comma-separated shapes for the exact part")
    ap.add_argument("--budget-s", type=float, default=520.0)
    ap.add_argument("--profile-capacity", type=int, default=512,
                    help="the profile part's cache capacity (the speed part's is its longest "
                         "prefill plus 64)")
    ap.add_argument("--profile-contexts", default="128",
                    help="the profile part's prompt lengths before its traced burst "
                         "(comma-separated; the capacity grows to hold the longest)")
    ap.add_argument("--products", dest="only_products",
                    help="the products part's products (comma-separated: qkv, o, gate_up, "
                         "down, head; default: all)")
    ap.add_argument("--modes", default="rowinv,xla",
                    help="the speed and profile parts' kernel modes (comma-separated: "
                         "rowinv, xla)")
    ap.add_argument("--workloads", default="decode,completion,prefill",
                    help="the speed part's workloads (comma-separated)")
    ap.add_argument("--attention-cases", default="prefill,decode",
                    help="the attention part's cases (comma-separated: prefill, decode)")
    ap.add_argument("--prefill-width", type=int,
                    help="the exact prefill's block rows instead of the preset's (a speed "
                         "setting: every width gives the same bits; 8192 runs an 8k prompt's "
                         "products on 8,192 rows at once)")
    ap.add_argument("--key-tile", type=int,
                    help="the attention kernels' key tile instead of pallas_attention.KEY_TILE "
                         "(an experiment: it fixes the order of a row's softmax additions on "
                         "every path at once, so widths still agree; run the exact part under "
                         "it too)")
    ap.add_argument("--keys-per-split", type=int,
                    help="the attention's keys per split instead of "
                         "pallas_attention.KEYS_PER_SPLIT (an experiment like --key-tile: the "
                         "splits' boundaries fix the order the partials fold in on every path "
                         "at once; a multiple of the key tile)")
    ap.add_argument("--short-decode-keys", type=int,
                    help="the producers' short_decode_keys (0: one decode program for every "
                         "context; default: BlockProducer's)")
    ap.add_argument("--fuse-rope", action=argparse.BooleanOptionalAction, default=None,
                    help="run the RoPE-store inside the attention kernel where that folds "
                         "on chip (DenseModel.fuse_rope_store, on by default; the same bits); "
                         "--no-fuse-rope launches the two kernels")
    ap.add_argument("--fold-in-split", action=argparse.BooleanOptionalAction, default=True,
                    help="with the fused RoPE-store, fold a long context's key splits in "
                         "each query tile's last split program (DenseModel.fold_in_split, "
                         "the default; the same bits); --no-fold-in-split runs the fold "
                         "kernel")
    ap.add_argument("--fold-loads", type=int,
                    help="splits' partials the fold loads at once instead of "
                         "pallas_attention.FOLD_LOADS (speed only: the folds stay one after "
                         "another in split order; a power of two from 1 to 16)")
    ap.add_argument("--gated-programs", type=int,
                    help="programs the gated matvec kernel's column tile aims at instead of "
                         "rowinv.GATED_PROGRAMS (speed only; 192 was the default until "
                         "session 45)")
    ap.add_argument("--top-block", type=int,
                    help="ids a block of the sampled draw's candidate search holds instead of "
                         "sampling.TOP_BLOCK (speed only: the search's values and ids are "
                         "lax.top_k's for any block; a power of two from 128 to 16,384)")
    ap.add_argument("--pdl", choices=pallas_pdl.MODES, default=pallas_pdl.MODE,
                    help="programmatic dependent launch inside the decode kernels "
                         "(kernels/pdl.py; the same bits): 'trigger' lets the next "
                         "kernel be scheduled early and waits before the rows")
    args = ap.parse_args(argv)
    pallas_pdl.MODE = args.pdl
    global FOLD_IN_SPLIT
    FOLD_IN_SPLIT = args.fold_in_split
    global FUSE_ROPE_STORE
    if args.fuse_rope is not None:
        FUSE_ROPE_STORE = args.fuse_rope
    args.fuse_rope = FUSE_ROPE_STORE
    global SHORT_DECODE_KEYS
    SHORT_DECODE_KEYS = args.short_decode_keys
    if args.key_tile is not None:
        if args.key_tile < 16 or args.key_tile & (args.key_tile - 1):
            ap.error(f"--key-tile must be a power of two >= 16, got {args.key_tile}")
        pallas_attention.KEY_TILE = args.key_tile  # read when a kernel is traced
    if args.gated_programs is not None:
        if args.gated_programs < 1:
            ap.error(f"--gated-programs must be positive, got {args.gated_programs}")
        rowinv.GATED_PROGRAMS = args.gated_programs  # read when a kernel is planned
    if args.fold_loads is not None:
        if not 1 <= args.fold_loads <= 16 or args.fold_loads & (args.fold_loads - 1):
            ap.error(f"--fold-loads must be a power of two from 1 to 16, got {args.fold_loads}")
        pallas_attention.FOLD_LOADS = args.fold_loads  # read when a kernel is traced
    if args.top_block is not None:
        if not 128 <= args.top_block <= 16384 or args.top_block & (args.top_block - 1):
            ap.error(f"--top-block must be a power of two from 128 to 16384, "
                     f"got {args.top_block}")
        sampling.TOP_BLOCK = args.top_block  # read when a draw is traced
    if args.keys_per_split is not None:
        tile = pallas_attention.KEY_TILE
        if args.keys_per_split < tile or args.keys_per_split % tile:
            ap.error(f"--keys-per-split must be a positive multiple of the key tile ({tile}), "
                     f"got {args.keys_per_split}")
        pallas_attention.KEYS_PER_SPLIT = args.keys_per_split  # read when a call is planned
    preset = PRESETS[args.preset]
    if args.prefill_width is not None:
        width = args.prefill_width
        if width < 16 or width & (width - 1):
            ap.error(f"--prefill-width must be a power of two >= 16, got {width}")
        preset = dataclasses.replace(preset, prefill_width=width)
    shapes = args.shapes.split(",") if args.shapes else list(preset.shapes)
    exact_shapes = (args.exact_shapes.split(",") if args.exact_shapes
                    else list(preset.exact_shapes))
    for s in shapes + exact_shapes:
        if s not in ALL_SHAPES:
            ap.error(f"unknown shape {s!r}; known: {', '.join(ALL_SHAPES)}")
    if args.only_products is not None:
        unknown = set(args.only_products.split(",")) - set(PRODUCT_NAMES)
        if unknown:
            ap.error(f"unknown products {sorted(unknown)}; known: {', '.join(PRODUCT_NAMES)}")
    parts = args.parts.split(",")
    meta = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
            "python": platform.python_version(), "preset": args.preset,
            "prefill_width": preset.prefill_width, "key_tile": args.key_tile,
            "keys_per_split": args.keys_per_split, "fold_loads": args.fold_loads,
            "gated_programs": args.gated_programs, "top_block": args.top_block,
            "short_decode_keys": args.short_decode_keys, "fuse_rope": args.fuse_rope,
            "fold_in_split": args.fold_in_split, "pdl": args.pdl}
    bandwidth = copy_bandwidth(4 << 30 if jax.default_backend() == "gpu" else 64 << 20)
    meta["copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
    run = Run(args.out, args.budget_s, meta)
    for part in parts:
        if part == "products":
            part_products(preset, run, shapes, None if args.only_products is None
                          else tuple(args.only_products.split(",")))
        elif part == "exact":
            part_exact(preset, run, exact_shapes)
        elif part == "speed":
            part_speed(preset, run, shapes, bandwidth, tuple(args.modes.split(",")),
                       tuple(args.workloads.split(",")))
        elif part == "attention":
            part_attention(preset, run, shapes, tuple(args.attention_cases.split(",")))
        elif part == "profile":
            part_profile(preset, run, shapes, bandwidth, tuple(args.modes.split(",")),
                         args.profile_capacity,
                         tuple(int(c) for c in args.profile_contexts.split(",")))
        elif part == "prefill-profile":
            part_prefill_profile(preset, run, shapes)
        else:
            ap.error(f"unknown part {part!r}")
    run.write()
    print(json.dumps({k: run.data[k] for k in ("errors", "skipped")}, default=str)[:3000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
