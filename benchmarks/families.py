"""Figures for the newer families on one device: Qwen3.5 (0.8B- and 4B-shaped) and Gemma 4
(E2B-shaped), random bf16 weights, batch 1, beside transformers measured in the same run.

    PYTHONPATH=. python -m benchmarks.families --out benchmarks/results/families
    PYTHONPATH=. python -m benchmarks.families --preset smoke --out /tmp/families   # CPU

Per shape, records (one JSON line each, also written to ``<out>/families.json``):

* ``decode``: greedy tokens/s after a context of 128 / 4k / 16k positions (32k for Gemma 4,
  whose sliding layers keep a ring), beside the roofline: the bytes a step must read (weights
  but the input embedding table; the KV rows attended; a recurrent layer's state read and
  written in float32) over the copy bandwidth measured in the same run;
* ``prefill``: exact (the block program, chunk by chunk) and parallel tokens/s;
* ``verify``: one verify of 2..8 rows against one decode step (inside a burst, and alone);
* ``hf_decode`` / ``hf_prefill``: transformers eager (a bare forward loop) and, on a GPU,
  static cache + ``torch.compile`` where the family supports it (an error is recorded, not
  raised, where it does not).

The shapes follow the published configurations' sizes as far as this runtime reads them;
the weights are random, so only speed is measured here (exactness is checked by
``benchmarks.qwen35_exactness`` and the tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.run import (
    Recorder,
    _block,
    _hf_compiled_decode,
    _hf_eager_loop,
    _meta,
    _timed,
    copy_bandwidth,
    decode_rate,
    prefill_rates,
)

LIN, FULL_Q = "linear_attention", "full_attention"
SLIDING, FULL_G = "sliding_attention", "full_attention"

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3.5-0.8b": dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584,
        num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=16, tie_word_embeddings=True,
        layer_types=[LIN, LIN, LIN, FULL_Q] * 6, mtp_num_hidden_layers=1),
    "qwen3.5-4b": dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=2560, intermediate_size=9216,
        num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, tie_word_embeddings=True,
        layer_types=[LIN, LIN, LIN, FULL_Q] * 8, mtp_num_hidden_layers=1),
    "gemma4-e2b": dict(
        model_type="gemma4_text", vocab_size=262144, hidden_size=1536, intermediate_size=6144,
        num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        global_head_dim=512, sliding_window=512, num_kv_shared_layers=20,
        use_double_wide_mlp=True, hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144, final_logit_softcapping=30.0,
        layer_types=[FULL_G if (i + 1) % 5 == 0 else SLIDING for i in range(35)]),
    "qwen3.5-tiny": dict(
        model_type="qwen3_5_text", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=[LIN, LIN, LIN, FULL_Q]),
    "gemma4-tiny": dict(
        model_type="gemma4_text", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        global_head_dim=32, sliding_window=8, num_kv_shared_layers=1,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
        layer_types=[SLIDING, FULL_G, SLIDING, FULL_G]),
}


@dataclasses.dataclass(frozen=True)
class Preset:
    shapes: tuple[str, ...]
    contexts: dict[str, tuple[int, ...]]  # by family
    new_tokens: int
    prefill_length: int
    width: int
    burst: int
    verify_rows: tuple[int, ...]


PRESETS = {
    "h200": Preset(("qwen3.5-0.8b", "qwen3.5-4b", "gemma4-e2b"),
                   {"qwen3_5_text": (128, 4096, 16384), "gemma4_text": (128, 4096, 32768)},
                   new_tokens=128, prefill_length=4096, width=16, burst=64,
                   verify_rows=(2, 4, 8)),
    "smoke": Preset(("qwen3.5-tiny", "gemma4-tiny"),
                    {"qwen3_5_text": (16,), "gemma4_text": (16,)},
                    new_tokens=4, prefill_length=24, width=4, burst=4, verify_rows=(2,)),
}


def build(name: str, capacity: int, width: int, burst: int,
          model_options: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """Our config, producer and params for a shape (random bf16 weights, listed layers);
    ``model_options`` sets fields of the built model (``keep_hidden_rows=True`` for a Gemma 4
    target its assistant drafts over)."""
    import jax
    import jax.numpy as jnp

    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.models.registry import family_of

    family = family_of(SHAPES[name]["model_type"])
    config = family.parse_config(SHAPES[name])
    model = dataclasses.replace(family.build(config, jnp.bfloat16, "list"),
                                **(model_options or {}))
    params = random_params(jax.eval_shape(model.init_params, jax.random.PRNGKey(0)))
    producer = BlockProducer(model, params, capacity=capacity, width=width,
                             steps_per_call=burst, donate=True)
    return config, producer, params


def random_params(shapes: Any) -> Any:
    """Random weights with the shapes and dtypes of ``shapes`` (normal, scale 0.02; integer
    leaves zero), drawn leaf by leaf: one small program per leaf shape. Compiling
    ``init_params`` whole for a 4B shape took XLA minutes on the H200 (its slow-compile alarm
    fired and the run ran out of time before the first figure)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(shapes)
    key = jax.random.PRNGKey(0)
    draw = _draw()
    out = [draw(jax.random.fold_in(key, i), tuple(s.shape), s.dtype)
           if jnp.issubdtype(s.dtype, jnp.floating) else jnp.zeros(s.shape, s.dtype)
           for i, s in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


@functools.cache
def _draw() -> Any:
    """The jitted draw of one leaf, one per process: a shape drawn before (by another model's
    params too) compiles nothing new."""
    import jax
    import jax.numpy as jnp

    def draw(k: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        return (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(dtype)

    return jax.jit(draw, static_argnums=(1, 2))


def step_bytes(config: Any, params: Any, context: int) -> int:
    """Bytes one decode step reads at ``context`` (see the module docstring)."""
    import jax

    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    embed = params.get("embed_tokens") if isinstance(params, dict) else None
    if embed is not None and not config.tie_word_embeddings:
        total -= embed.size * embed.dtype.itemsize
    per_layer = params.get("embed_tokens_per_layer") if isinstance(params, dict) else None
    if per_layer is not None:  # Gemma 4's per-layer inputs: a step gathers one row of it
        total -= (per_layer.shape[0] - 1) * per_layer.shape[1] * per_layer.dtype.itemsize
    if config.model_type.startswith("qwen3_5") or config.model_type == "qwen3_next":
        for kind in config.layer_types:
            if kind == FULL_Q:
                total += 2 * context * config.num_key_value_heads * config.head_dim * 2
            else:  # float32 recurrent state, read and written
                total += 2 * 4 * config.linear_num_value_heads * (
                    config.linear_key_head_dim * config.linear_value_head_dim)
    else:
        for i in range(config.num_hidden_layers):
            if config.owns_kv(i):
                head_dim, kv = config.dims(i)
                window = config.window(i)
                rows = context if window is None else min(context, window)
                total += 2 * rows * kv * head_dim * 2
    return int(total)


def verify_costs(producer: Any, vocab: int, rows: tuple[int, ...], context: int) -> dict:
    """Seconds of one verify of each row count, and of one single-step decode call."""
    from turbospark_jax.core.state import copy_state

    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(0, vocab, context)]
    _, base = producer.prefill_chunk(producer.init_state(), prompt, 0)
    out: dict[str, float] = {}
    for k in (1, *rows):
        feed = [int(t) for t in rng.integers(0, vocab, k)]
        best = float("inf")
        for _ in range(4):  # the first compiles
            state = copy_state(base)
            _block(state)
            if k == 1:
                dt, _ = _timed(lambda s=state, f=feed: producer.produce(s, f[0], context))
            else:
                dt, _ = _timed(lambda s=state, f=feed: producer.verify(s, f, context))
            best = min(best, dt)
        out["produce_s" if k == 1 else f"verify_{k}_s"] = best
    return out


def hf_model(name: str, device: str) -> Any:
    import torch
    import transformers

    d = dict(SHAPES[name])
    model_type = d.pop("model_type")
    d.pop("mtp_num_hidden_layers", None)
    if model_type == "qwen3_5_text":
        config, cls = transformers.Qwen3_5TextConfig(**d), transformers.Qwen3_5ForCausalLM
    else:
        config, cls = transformers.Gemma4TextConfig(**d), transformers.Gemma4ForCausalLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(torch.bfloat16)
    return model.eval()


def run_shape(name: str, preset: Preset, rec: Recorder, bandwidth: float, hf: bool) -> None:
    model_type = SHAPES[name]["model_type"]
    contexts = preset.contexts[model_type]
    capacity = max(max(contexts), preset.prefill_length) + preset.new_tokens + preset.width
    config, producer, params = build(name, capacity, preset.width, preset.burst)
    vocab = config.vocab_size
    for ctx in contexts:
        r = decode_rate(producer, ctx, preset.new_tokens, preset.burst,
                        chunk=min(2048, ctx), vocab=vocab)
        nbytes = step_bytes(config, params, ctx)
        rec.add(shape=name, workload="decode", context=ctx, impl="turbospark_jax", **r,
                step_bytes=nbytes, roofline_tokens_per_s=bandwidth / nbytes,
                fraction_of_roofline=r["tokens_per_s"] * nbytes / bandwidth)
    rec.add(shape=name, workload="prefill", length=preset.prefill_length, impl="turbospark_jax",
            **prefill_rates(producer, preset.prefill_length, min(2048, preset.prefill_length),
                            vocab))
    costs = verify_costs(producer, vocab, preset.verify_rows, contexts[0])
    step = 1.0 / decode_rate(producer, contexts[0], preset.new_tokens, preset.burst,
                             chunk=contexts[0], vocab=vocab)["tokens_per_s"]
    rec.add(shape=name, workload="verify", context=contexts[0], width=preset.width, **costs,
            decode_step_in_burst_s=step,
            **{f"verify_{k}_vs_step": costs[f"verify_{k}_s"] / step for k in preset.verify_rows},
            **{f"verify_{k}_vs_produce": costs[f"verify_{k}_s"] / costs["produce_s"]
               for k in preset.verify_rows})
    del producer, params
    if hf:
        run_hf(name, preset, rec, contexts, vocab)


def run_hf(name: str, preset: Preset, rec: Recorder, contexts: tuple[int, ...],
           vocab: int) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    try:
        model = hf_model(name, device)
    except Exception as exc:  # a shape transformers cannot build is a result, not a crash
        rec.add(shape=name, workload="hf_decode", error=f"{type(exc).__name__}: {exc}")
        return
    rng = np.random.default_rng(0)
    # Without flash-linear-attention (not in the image) transformers runs the gated delta rule
    # in its reference PyTorch form; contexts past 4k would take most of a device call.
    for ctx in [c for c in contexts if c <= 4096]:
        ids = torch.tensor(rng.integers(0, vocab, (1, ctx)), device=device)
        try:
            dt = _hf_eager_loop(model, ids, preset.new_tokens, sync)
            rec.add(shape=name, workload="hf_decode", context=ctx, impl="transformers-eager",
                    tokens_per_s=preset.new_tokens / dt)
        except Exception as exc:
            rec.add(shape=name, workload="hf_decode", context=ctx, impl="transformers-eager",
                    error=f"{type(exc).__name__}: {exc}")
    ids = torch.tensor(rng.integers(0, vocab, (1, preset.prefill_length)), device=device)
    with torch.inference_mode():
        model(ids)
        sync()
        t0 = time.perf_counter()
        model(ids)
        sync()
    rec.add(shape=name, workload="hf_prefill", length=preset.prefill_length,
            impl="transformers-eager-sdpa",
            tokens_per_s=preset.prefill_length / (time.perf_counter() - t0))
    if device == "cuda":
        shim = argparse.Namespace(name=name, vocab_size=vocab)
        settings = argparse.Namespace(contexts=(contexts[0],), new_tokens=preset.new_tokens)
        try:
            _hf_compiled_decode(model, shim, settings, rec, sync)
        except Exception as exc:
            rec.add(shape=name, workload="decode", context=contexts[0],
                    impl="transformers-static-compile", error=f"{type(exc).__name__}: {exc}")
        del model
        torch.cuda.empty_cache()


def report(path: Path) -> str:
    """Markdown tables of a ``families`` JSON file (what the README's family tables show)."""
    import json

    data = json.loads(path.read_text())
    recs = data["records"]
    lines = [f"Device {data['meta'].get('device')}, jax {data['meta'].get('jax')}, "
             f"{data['meta'].get('date')}. {data['meta'].get('note', '')}", ""]
    for shape in dict.fromkeys(r["shape"] for r in recs if "shape" in r):
        mine = [r for r in recs if r.get("shape") == shape and "error" not in r]
        lines += [f"### {shape}", "", "| workload | context / length | implementation | tokens/s "
                  "| roofline tokens/s | of roofline |", "|---|---|---|---|---|---|"]
        for r in mine:
            label = r.get("impl", "") + (f" ({r['variant']})" if r.get("variant") else "")
            if r["workload"] in ("decode", "hf_decode"):
                roof = r.get("roofline_tokens_per_s")
                lines.append(f"| decode | {r['context']} | {label} | {r['tokens_per_s']:.0f} | "
                             + (f"{roof:.0f} | {100 * r['fraction_of_roofline']:.0f}% |"
                                if roof else "| |"))
            elif r["workload"] == "prefill":
                for kind in ("exact", "parallel"):
                    if f"{kind}_tokens_per_s" in r:
                        lines.append(f"| {kind} prefill | {r['length']} | {label} | "
                                     f"{r[f'{kind}_tokens_per_s']:.0f} | | |")
            elif r["workload"] == "hf_prefill":
                lines.append(f"| prefill | {r['length']} | {label} | {r['tokens_per_s']:.0f} "
                             "| | |")
        for r in (r for r in mine if r["workload"] == "verify"):
            ks = sorted(int(k.split("_")[1]) for k in r if k.endswith("_vs_step"))
            lines.append("")
            lines.append(f"Verify at context {r['context']} ({r.get('variant', 'ours')}), "
                         "one call against one decode step inside a burst: " + ", ".join(
                             f"{k} rows {r[f'verify_{k}_vs_step']:.2f}x" for k in ks)
                         + "; against a one-step decode call: " + ", ".join(
                             f"{k} rows {r[f'verify_{k}_vs_produce']:.2f}x" for k in ks) + ".")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="h200")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of the preset's")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--report", action="store_true",
                    help="print the tables of <out>/families.json (or of --out itself when it "
                         "is a .json file) instead of measuring")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.out if args.out.suffix == ".json" else args.out / "families.json"))
        return 0
    preset = PRESETS[args.preset]
    shapes = preset.shapes if args.shapes is None else tuple(args.shapes.split(","))
    rec = Recorder(args.out, "families", _meta())
    # A 4 GiB copy: at 256 MiB the call's own launch cost halved the figure (1.6-2.2 TB/s
    # against 3.6-3.9 TB/s at 4 GiB on the same H200).
    bandwidth = copy_bandwidth(4 << 30 if args.preset == "h200" else 8 << 20)
    rec.add(workload="bandwidth", bytes_per_s=bandwidth)
    for name in shapes:
        run_shape(name, preset, rec, bandwidth, hf=not args.no_hf)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
