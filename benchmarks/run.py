"""Decode and prefill throughput against transformers and the memory-bandwidth roofline.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python -m benchmarks.run --preset h200 --part ours --out benchmarks/results
    PYTHONPATH=. python -m benchmarks.run --preset h200 --part hf --out benchmarks/results
    PYTHONPATH=. python -m benchmarks.run --preset h200 --part exact --out benchmarks/results
    python -m benchmarks.run --report benchmarks/results     # merge into results.md + PNG

``--preset smoke`` runs a tiny configuration of every part on the CPU (the test suite does,
asserting only that well-formed results come out; no timing is ever asserted).

Parts write ``<out>/<part>.json`` as they go (a part cut short still leaves what it measured):
records of ``{part, shape, workload, ...figures}`` plus a ``meta`` block (date, versions,
device, measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model shape from the issue; every field is an HF config key."""

    name: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    def hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("name")
        d.update(rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=32768)
        return d


SHAPES = {
    "llama-3.2-1b": Shape("llama-3.2-1b", "llama", 2048, 16, 32, 8, 64, 8192, 128256, True),
    "qwen3-0.6b": Shape("qwen3-0.6b", "qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True),
    "llama-3.1-8b": Shape("llama-3.1-8b", "llama", 4096, 32, 32, 8, 128, 14336, 128256, False),
    "tiny": Shape("tiny", "qwen3", 64, 2, 4, 2, 16, 128, 256, True),
}


@dataclasses.dataclass(frozen=True)
class Preset:
    shapes: tuple[str, ...]
    contexts: tuple[int, ...]
    new_tokens: int
    prefill_lengths: tuple[int, ...]
    width: int
    sweep_shape: str
    sweep_widths: tuple[int, ...]
    sweep_contexts: tuple[int, ...]
    parallel_chunk: int
    burst: int
    hf_compile: bool
    #: drafters whose speculative output ``--part exact`` compares with plain decoding
    exact_drafters: tuple[str, ...] = ("same_model", "ngram", "oracle_0.7")
    #: draft lengths it compares at
    exact_blocks: tuple[int, ...] = (1, 4, 8)


PRESETS = {
    "h200": Preset(
        shapes=("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b"),
        contexts=(128, 1024, 4096, 16384),
        new_tokens=256,
        prefill_lengths=(2048, 8192),
        width=16,
        sweep_shape="llama-3.2-1b",
        sweep_widths=(1, 8, 16, 32, 64, 128, 256),
        sweep_contexts=(128, 16384),
        parallel_chunk=2048,
        burst=64,
        hf_compile=True,
    ),
    "smoke": Preset(
        shapes=("tiny",),
        contexts=(16,),
        new_tokens=8,
        prefill_lengths=(24,),
        width=4,
        sweep_shape="tiny",
        sweep_widths=(4,),
        sweep_contexts=(16,),
        parallel_chunk=16,
        burst=4,
        hf_compile=False,
        exact_drafters=("ngram",),  # the tests cover every drafter; this checks the harness
        exact_blocks=(4,),
    ),
}


class Recorder:
    """Appends records and rewrites ``<out>/<part>.json`` after each one."""

    def __init__(self, out: Path, part: str, meta: dict[str, Any]) -> None:
        self.path = out / f"{part}.json"
        self.part = part
        self.meta = meta
        self.records: list[dict[str, Any]] = []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, **record: Any) -> None:
        record = {"part": self.part, **record}
        self.records.append(record)
        print(json.dumps(record), flush=True)
        self.path.write_text(json.dumps({"meta": self.meta, "records": self.records}, indent=1))


def _meta() -> dict[str, Any]:
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "python": platform.python_version(),
    }


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    _block(out)
    return time.perf_counter() - t0, out


def _block(x: Any) -> None:
    import jax

    for leaf in jax.tree.leaves(x):
        if hasattr(leaf, "block_until_ready"):
            leaf.block_until_ready()


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device bandwidth in bytes/s (read + written): the better of a plain copy of
    the buffer and an elementwise pass over it (the roofline then uses the higher ceiling)."""
    import jax
    import jax.numpy as jnp

    n = nbytes // 2
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.bfloat16)
    passes = (jax.jit(lambda a: a + jnp.bfloat16(1)), lambda a: jnp.array(a, copy=True))
    best = float("inf")
    for f in passes:
        _block(f(x))
        for _ in range(5):
            dt, _ = _timed(lambda f=f: f(x))
            best = min(best, dt)
    return 2 * n * 2 / best


def _dense(shape: Shape, seed: int = 0) -> tuple[Any, Any, Any]:
    import jax
    import jax.numpy as jnp

    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel, unstack_layers

    config = DenseConfig.from_hf_dict(shape.hf_dict())
    model = DenseModel(config, jnp.bfloat16, scan_layers=False)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(seed))
    # One dict per layer: stacked weights get sliced (copied) inside the program's loop.
    return config, model, unstack_layers(params)


def weight_bytes(params: Any, config: Any) -> int:
    """Bytes a decode step reads from the weights (the embedding gather reads one row,
    except when tied, where the output head reads the whole table)."""
    import jax

    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if not config.tie_word_embeddings:
        emb = params["embed_tokens"]
        total -= emb.size * emb.dtype.itemsize
    return int(total)


def kv_bytes(config: Any, context: int) -> int:
    return 2 * config.num_hidden_layers * context * config.num_key_value_heads * (
        config.head_dim
    ) * 2


def _producer(model: Any, params: Any, capacity: int, width: int, steps: int) -> Any:
    from turbospark_jax.engine.producer import BlockProducer

    return BlockProducer(model, params, capacity=capacity, width=width, steps_per_call=steps,
                         donate=True)


def decode_rate(producer: Any, context: int, new_tokens: int, burst: int, chunk: int,
                vocab: int) -> dict[str, float]:
    """Fill ``context`` tokens (parallel path), then time ``new_tokens`` greedy decode steps."""
    from turbospark_jax.core import sampling

    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, vocab, context)]
    greedy = sampling.SamplingParams.greedy()
    key = sampling.request_key(0)

    def run(prompt_ids: list[int], tokens: int) -> tuple[float, float, list[int]]:
        state = producer.init_state()
        if producer.supports_parallel_prefill():
            fill = lambda: producer.prefill_parallel(  # noqa: E731
                state, prompt_ids, 0, chunk=min(chunk, context))
        else:  # a family without the parallel path fills through the block program
            fill = lambda: producer.prefill_chunk(state, prompt_ids, 0)  # noqa: E731
        t_fill, (logits, state) = _timed(fill)
        tok = int(np.argmax(np.asarray(logits)))
        history = sampling.History.empty(vocab)
        out: list[int] = []
        t0 = time.perf_counter()
        while len(out) < tokens:
            steps = min(burst, tokens - len(out))
            # no logits back: a burst's [steps, V] float32 rows are 33 MB at the 1B shape
            b, state = producer.decode(state, tok, steps, params=greedy, history=history,
                                       key=key, gen_index=len(out) + 1, record_logits=False)
            out += b.tokens
            tok, history = b.tokens[-1], b.history
        return t_fill, time.perf_counter() - t0, out

    run(prompt[: max(1, min(context, 8))], burst)  # compile every program used below
    _, dt, out = run(prompt, new_tokens)
    return {"decode_s": dt, "tokens_per_s": new_tokens / dt, "first_tokens": out[:4]}


def prefill_rates(producer: Any, length: int, chunk: int, vocab: int) -> dict[str, float]:
    """Exact (block program) and parallel prefill of ``length`` tokens, tokens/s."""
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, vocab, length)]
    res: dict[str, float] = {}
    paths = [("exact", lambda s: producer.prefill_chunk(s, prompt, 0))]
    if producer.supports_parallel_prefill():
        paths.append(("parallel", lambda s: producer.prefill_parallel(s, prompt, 0, chunk=chunk)))
    for name, fn in paths:
        fn(producer.init_state())  # compile
        dt, _ = _timed(lambda fn=fn: fn(producer.init_state()))
        res[f"{name}_s"] = dt
        res[f"{name}_tokens_per_s"] = length / dt
    return res


def _home_context(preset: Preset, length: int) -> int | None:
    fits = [c for c in preset.contexts if c + preset.new_tokens >= length]
    return min(fits) if fits else None


def part_ours(preset: Preset, rec: Recorder, bandwidth: float) -> None:
    for name in preset.shapes:
        shape = SHAPES[name]
        config, model, params = _dense(shape)
        wb = weight_bytes(params, config)
        for ctx in preset.contexts:
            cap = ctx + preset.new_tokens + preset.width + 1
            producer = _producer(model, params, cap, preset.width, preset.burst)
            r = decode_rate(producer, ctx, preset.new_tokens, preset.burst,
                            preset.parallel_chunk, config.vocab_size)
            roof = bandwidth / (wb + kv_bytes(config, ctx))
            rec.add(shape=name, workload="decode", context=ctx, width=preset.width,
                    roofline_tokens_per_s=roof, fraction_of_roofline=r["tokens_per_s"] / roof,
                    weight_bytes=wb, **r)
            for length in preset.prefill_lengths:
                # Each prompt length runs on the smallest decode program that holds it.
                if _home_context(preset, length) == ctx:
                    pr = prefill_rates(producer, length, preset.parallel_chunk,
                                       config.vocab_size)
                    rec.add(shape=name, workload="prefill", length=length, width=preset.width,
                            capacity=cap, **pr)
            del producer
        if name == preset.sweep_shape:
            for width in preset.sweep_widths:
                for ctx in preset.sweep_contexts:
                    cap = ctx + preset.new_tokens + width + 1
                    producer = _producer(model, params, cap, width, preset.burst)
                    r = decode_rate(producer, ctx, preset.new_tokens, preset.burst,
                                    preset.parallel_chunk, config.vocab_size)
                    rec.add(shape=name, workload="width_sweep_decode", context=ctx,
                            width=width, **r)
                    if ctx == preset.sweep_contexts[0]:
                        length = preset.prefill_lengths[0]
                        producer = _producer(model, params, length + width + 1, width,
                                             preset.burst)
                        pr = prefill_rates(producer, length, preset.parallel_chunk,
                                           config.vocab_size)
                        rec.add(shape=name, workload="width_sweep_prefill", length=length,
                                width=width, **pr)
                    del producer
        del params


def _hf_model(shape: Shape, device: str) -> Any:
    import torch
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}
    cfg = cfg_cls[shape.model_type](**shape.hf_dict(), attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def part_hf(preset: Preset, rec: Recorder) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for name in preset.shapes:
        shape = SHAPES[name]
        model = _hf_model(shape, device)
        rng = np.random.default_rng(0)
        for ctx in preset.contexts:
            ids = torch.tensor(rng.integers(0, shape.vocab_size, (1, ctx)), device=device)
            if ctx == preset.contexts[0]:
                # generate() as most users call it; slow here, so measured once per shape.
                dt = _hf_generate(model, ids, preset.new_tokens, sync)
                rec.add(shape=name, workload="decode", context=ctx,
                        impl="transformers-eager-sdpa", decode_s=dt,
                        tokens_per_s=preset.new_tokens / dt, via="generate")
            dt = _hf_eager_loop(model, ids, preset.new_tokens, sync)
            rec.add(shape=name, workload="decode", context=ctx, impl="transformers-eager-loop",
                    decode_s=dt, tokens_per_s=preset.new_tokens / dt,
                    via="a bare loop of forward calls with a DynamicCache and argmax")
        for length in preset.prefill_lengths:
            ids = torch.tensor(rng.integers(0, shape.vocab_size, (1, length)), device=device)
            best = float("inf")
            with torch.inference_mode():
                model(ids)  # warm up at this length
                for _ in range(3):
                    sync()
                    t0 = time.perf_counter()
                    model(ids)
                    sync()
                    best = min(best, time.perf_counter() - t0)
            rec.add(shape=name, workload="prefill", length=length,
                    impl="transformers-eager-sdpa", prefill_s=best, tokens_per_s=length / best)
        if preset.hf_compile and preset.contexts and device == "cuda":
            try:
                _hf_compiled_decode(model, shape, preset, rec, sync)
            except Exception as exc:  # a compile failure is a result to report, not a crash
                rec.add(shape=name, workload="decode", context=preset.contexts[0],
                        impl="transformers-static-compile", error=f"{type(exc).__name__}: {exc}")
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


def _hf_generate(model: Any, ids: Any, new_tokens: int, sync: Callable[[], None]) -> float:
    """Seconds for ``generate`` to add ``new_tokens`` greedy tokens, less one prompt pass."""
    import torch

    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        sync()
        t0 = time.perf_counter()
        model(ids)
        sync()
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        sync()
        total = time.perf_counter() - t0
    return max(total - t_prefill, 1e-9)


def _hf_eager_loop(model: Any, ids: Any, new_tokens: int, sync: Callable[[], None]) -> float:
    """Seconds for ``new_tokens`` greedy steps of a bare forward loop (no ``generate``
    bookkeeping): the least overhead eager transformers can have."""
    import torch

    with torch.inference_mode():
        out = model(ids, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        cache = out.past_key_values
        for _ in range(3):  # warm up the one-token path on a copy-free cache
            model(tok, past_key_values=cache, use_cache=True)
        out = model(ids, use_cache=True)
        tok, cache = out.logits[:, -1:].argmax(-1), out.past_key_values
        sync()
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok, cache = out.logits[:, -1:].argmax(-1), out.past_key_values
        sync()
        return time.perf_counter() - t0


def _hf_compiled_decode(model: Any, shape: Shape, preset: Preset, rec: Recorder,
                        sync: Callable[[], None]) -> None:
    """transformers' fast path: a static cache and the one-token forward compiled with
    ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), in a bare greedy loop. Only the
    decode steps are timed; the prompt goes through the eager model first."""
    import torch
    import transformers

    ctx, n = preset.contexts[0], preset.new_tokens
    device = next(model.parameters()).device
    ids = torch.randint(0, shape.vocab_size, (1, ctx), device=device)
    cache = transformers.StaticCache(config=model.config, max_cache_len=ctx + n + 8)
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def run() -> float:
        with torch.inference_mode():  # the cache's tensors are inference tensors: reset here
            cache.reset()
            out = model(ids, past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(ctx, device=device))
            tok = out.logits[:, -1:].argmax(-1)
            sync()
            t0 = time.perf_counter()
            for i in range(n):
                pos = torch.tensor([ctx + i], device=device)
                torch.compiler.cudagraph_mark_step_begin()
                logits = step(tok, past_key_values=cache, cache_position=pos,
                              position_ids=pos[None], use_cache=True).logits
                tok = logits[:, -1:].argmax(-1)
            sync()
            return time.perf_counter() - t0

    for _ in range(2):  # compile, record the graphs
        run()
    dt = run()
    rec.add(shape=shape.name, workload="decode", context=ctx,
            impl="transformers-static-compile", decode_s=dt, tokens_per_s=n / dt,
            via="StaticCache + torch.compile(reduce-overhead, fullgraph) in a bare loop")


def part_exact(preset: Preset, rec: Recorder) -> None:
    """Bitwise checks on this backend: chunked == token by token, speculative == plain."""
    from turbospark_jax import CompletionRequest, run_raw_completion
    from turbospark_jax.core.state import live_equal
    from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
    from turbospark_jax.speculative.drafters import DraftModelDrafter, NGramDrafter, OracleDrafter
    from turbospark_jax.speculative.pair import SpeculativePair
    from turbospark_jax.testing.conformance import chunked_prefill, sequential_prefill

    name = preset.sweep_shape
    config, model, params = _dense(SHAPES[name])
    rng = np.random.default_rng(2)
    for width in sorted({1, preset.width, max(preset.sweep_widths)}):
        producer = _producer(model, params, 160 + width, width, preset.burst)
        prompt = [int(t) for t in rng.integers(0, config.vocab_size, 61)]
        want, s_want = sequential_prefill(producer, producer.init_state(), prompt, 0)
        got, s_got = chunked_prefill(producer, producer.init_state(), prompt, [5, 22, 40])
        a, b = np.asarray(want), np.asarray(got)
        rec.add(shape=name, workload="chunked_vs_sequential", width=width, dtype="bfloat16",
                logits_equal=bool(np.array_equal(a, b)), state_equal=bool(live_equal(s_got,
                                                                                    s_want)),
                max_abs=float(np.abs(a - b).max()))
    producer = _producer(model, params, 400, preset.width, preset.burst)
    prompt = [int(t) for t in rng.integers(0, config.vocab_size, 48)]
    prompt = prompt + prompt[:24]  # something for the n-gram drafter to find
    req = CompletionRequest(prompt_ids=prompt, max_tokens=64, record_logits=True)
    plain = run_raw_completion(producer, req)
    draft = _producer(model, params, 400, preset.width, preset.burst)
    reference = prompt + plain.token_ids
    drafters = (("same_model", DraftModelDrafter(draft)),
                ("ngram", NGramDrafter(config.vocab_size)),
                ("oracle_0.7", OracleDrafter(config.vocab_size, reference, 0.7)))
    for dname, drafter in drafters:
        if dname not in preset.exact_drafters:
            continue
        for device in (True, False):
            for k in preset.exact_blocks:
                pair = SpeculativePair(producer, drafter, device_rounds=device)
                spec = run_raw_completion_speculative(pair, dataclasses.replace(req, draft_len=k))
                rec.add(shape=name, workload="speculative_vs_plain", drafter=dname, block=k,
                        on_device=spec.speculative.on_device,
                        tokens_equal=spec.token_ids == plain.token_ids,
                        logits_equal=bool(np.array_equal(spec.logits.view(np.uint32),
                                                         plain.logits.view(np.uint32))),
                        acceptance=spec.speculative.acceptance_rate,
                        mean_acceptance_length=spec.speculative.mean_acceptance_length)


def report(out: Path) -> None:
    """Merge ``<out>/*.json`` into ``results.md`` and ``decode_vs_context.png``."""
    records, metas = [], {}
    for path in sorted(out.glob("*.json")):
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and "meta" in data
                and all("part" in r for r in data.get("records", [None]))):
            continue  # another harness's file (speculative, profiles, vision, rowinv, ...)
        metas[path.stem] = data["meta"]
        records += data["records"]
    lines = ["# Benchmark results", ""]
    for part, meta in metas.items():
        lines.append(f"- `{part}`: " + ", ".join(f"{k} {v}" for k, v in meta.items()))
    lines += ["", "## Decode (batch 1, greedy, tokens/s)", "",
              "| shape | context | ours | roofline | ours / roofline | transformers eager "
              "| ours / eager | transformers generate() | transformers compiled "
              "| ours / compiled |", "|---|---|---|---|---|---|---|---|---|---|"]
    hf = {(r["shape"], r["context"], r.get("impl")): r for r in records
          if r["part"] == "hf" and r["workload"] == "decode"}
    ours: dict[tuple[str, int], dict[str, Any]] = {}
    for r in records:  # one row per shape and context: the first file (sorted) that has it
        if r["part"] == "ours" and r["workload"] == "decode":
            ours.setdefault((r["shape"], r["context"]), r)
    for r in ours.values():
        eager = hf.get((r["shape"], r["context"], "transformers-eager-loop"), {})
        gen = hf.get((r["shape"], r["context"], "transformers-eager-sdpa"), {})
        comp = hf.get((r["shape"], r["context"], "transformers-static-compile"), {})
        e, c = eager.get("tokens_per_s"), comp.get("tokens_per_s")
        lines.append(
            f"| {r['shape']} | {r['context']} | {r['tokens_per_s']:.0f} | "
            f"{r['roofline_tokens_per_s']:.0f} | {r['fraction_of_roofline']:.0%} | "
            f"{_fmt(e)} | {_fmt(r['tokens_per_s'] / e if e else None, 'x')} | "
            f"{_fmt(gen.get('tokens_per_s'))} | {_fmt(c)} | "
            f"{_fmt(r['tokens_per_s'] / c if c else None, 'x')} |")
    lines += ["", "## Prefill (tokens/s)", "",
              "| shape | length | exact (block program) | parallel | transformers sdpa |",
              "|---|---|---|---|---|"]
    hfp = {(r["shape"], r["length"]): r for r in records
           if r["part"] == "hf" and r["workload"] == "prefill"}
    for r in records:
        if r["part"] == "ours" and r["workload"] == "prefill":
            h = hfp.get((r["shape"], r["length"]), {})
            lines.append(f"| {r['shape']} | {r['length']} | {r['exact_tokens_per_s']:.0f} | "
                         f"{r['parallel_tokens_per_s']:.0f} | {_fmt(h.get('tokens_per_s'))} |")
    lines += ["", "## Block width W (exact program)", "",
              "| W | decode @ context | tokens/s | exact prefill tokens/s |", "|---|---|---|---|"]
    sweep_p = {r["width"]: r for r in records if r["workload"] == "width_sweep_prefill"}
    for r in records:
        if r["workload"] == "width_sweep_decode":
            p = sweep_p.get(r["width"], {})
            lines.append(f"| {r['width']} | {r['context']} | {r['tokens_per_s']:.0f} | "
                         f"{_fmt(p.get('exact_tokens_per_s'))} |")
    lines += ["", "## Exactness on this backend", "",
              "| check | detail | bitwise equal |", "|---|---|---|"]
    for r in records:
        if r["workload"] == "chunked_vs_sequential":
            lines.append(f"| chunked prefill vs token by token | W={r['width']}, "
                         f"{r['dtype']} | logits {r['logits_equal']}, state "
                         f"{r['state_equal']} |")
        if r["workload"] == "speculative_vs_plain":
            where = "device" if r.get("on_device") else "host"
            lines.append(f"| speculative greedy vs plain greedy ({where} rounds) | {r['drafter']}, "
                         f"draft length "
                         f"{r['block']}, acceptance {r['acceptance']:.2f} | tokens "
                         f"{r['tokens_equal']}, logits {r['logits_equal']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plot(records, out / "decode_vs_context.png")


def _fmt(x: float | None, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.1f}{suffix}" if x < 100 else f"{x:.0f}{suffix}"


def _plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in records if r["workload"] == "decode"})
    fig, axes = plt.subplots(1, max(1, len(shapes)), figsize=(5 * max(1, len(shapes)), 4),
                             squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=False):
        ours = sorted((r["context"], r["tokens_per_s"], r["roofline_tokens_per_s"])
                      for r in records if r["shape"] == shape and r["part"] == "ours"
                      and r["workload"] == "decode")
        if ours:
            ax.plot([o[0] for o in ours], [o[1] for o in ours], "o-", label="turbospark_jax")
            ax.plot([o[0] for o in ours], [o[2] for o in ours], "k--", label="roofline")
        for impl, style in (("transformers-eager-loop", "s-"),
                            ("transformers-static-compile", "^")):
            pts = sorted((r["context"], r["tokens_per_s"]) for r in records
                         if r["shape"] == shape and r.get("impl") == impl
                         and r["workload"] == "decode" and "tokens_per_s" in r)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(shape)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s (batch 1)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--part", choices=["ours", "hf", "exact", "all"], default="all")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--report", type=Path, help="only merge the JSON files in this folder")
    parser.add_argument("--shapes", help="comma-separated subset of the preset's shapes")
    parser.add_argument("--contexts",
                        help="comma-separated decode contexts (override; empty: no decode)")
    parser.add_argument("--widths", help="comma-separated W sweep (override; empty: none)")
    parser.add_argument("--sweep-contexts", help="comma-separated W-sweep contexts (override)")
    parser.add_argument("--no-hf-compile", action="store_true",
                        help="skip transformers' static cache + torch.compile run")
    args = parser.parse_args(argv)
    if args.report:
        report(args.report)
        return 0
    preset = PRESETS[args.preset]
    if args.shapes:
        preset = dataclasses.replace(preset, shapes=tuple(args.shapes.split(",")))
    if args.contexts is not None:  # "" measures no decode: prefill alone
        preset = dataclasses.replace(
            preset, contexts=tuple(int(c) for c in args.contexts.split(",") if c))
    if args.sweep_contexts:
        preset = dataclasses.replace(
            preset, sweep_contexts=tuple(map(int, args.sweep_contexts.split(","))))
    if args.no_hf_compile:
        preset = dataclasses.replace(preset, hf_compile=False)
    if args.widths is not None:
        widths = tuple(int(w) for w in args.widths.split(",") if w)
        preset = dataclasses.replace(preset, sweep_widths=widths)
    meta = _meta()
    parts = ["ours", "hf", "exact"] if args.part == "all" else [args.part]
    if "ours" in parts:
        bw = copy_bandwidth(4 << 30 if meta["backend"] == "gpu" else 64 << 20)
        meta_ours = {**meta, "copy_bandwidth_bytes_per_s": bw}
        part_ours(preset, Recorder(args.out, "ours", meta_ours), bw)
    if "hf" in parts:
        import torch

        part_hf(preset, Recorder(args.out, "hf", {**meta, "torch": torch.__version__}))
    if "exact" in parts:
        part_exact(preset, Recorder(args.out, "exact", meta))
    report(args.out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
