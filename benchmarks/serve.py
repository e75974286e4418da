"""Serving benchmark: aggregate tokens/s, time to first token and inter-token latency at several
concurrency levels, for our server and for transformers' continuous batching, in one run.

Ours: a live server on localhost (uvicorn in a thread) with as many session slots as streams,
so every stream is a row of the batched decode program; the clients stream greedy completions
over HTTP (httpx), so the figures include the HTTP and SSE work. Transformers:
``model.generate_batch`` (its continuous batching) over the same prompts with
``record_timestamps``, in process (no HTTP), its throughput measured from the first request's
creation to the last token (the call's own start-up and shut-down excluded, kept as
``call_s``). Both generate exactly the preset's ``new_tokens`` per request (no stop token).

    python -m benchmarks.serve --preset cpu      # the embedded model, float32 on the CPU
    python -m benchmarks.serve --preset h200     # a Llama-3.2-1B-shaped random model, bf16

Results go to ``benchmarks/results/serve_<preset>.json`` and a plot ``serve_<preset>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Preset:
    """One benchmark configuration."""

    model: str  # "embedded" or a shape name from benchmarks.run.SHAPES
    concurrency: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int
    context: int
    width: int
    dtype: str


PRESETS = {
    "cpu": Preset("embedded", (1, 8, 32, 64), 32, 32, 128, 16, "float32"),
    "h200": Preset("llama-3.2-1b", (1, 8, 32, 64), 128, 256, 512, 16, "bfloat16"),
    "smoke": Preset("embedded", (1, 2), 8, 4, 32, 16, "float32"),
    # The h200 preset's path (a random model without a tokenizer) in miniature, for the CPU.
    "tiny-random": Preset("tiny", (1, 2), 8, 4, 32, 4, "bfloat16"),
}


class IdTokenizer:
    """Text for a random model: each id is written ``<id>`` (its vocabulary has no tokenizer)."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return "".join(f"<{int(i)}>" for i in ids)

    def id_to_token(self, token_id: int) -> str:
        return f"<{int(token_id)}>"

    def token_to_id(self, text: str) -> None:
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(part) for part in text.strip("<>").split("><") if part]


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, length)] for _ in range(n)]


def _latency_summary(ttft: list[float], gaps: list[float], tokens: int, wall: float
                     ) -> dict[str, float]:
    return {
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "itl_p50_s": float(np.percentile(gaps, 50)) if gaps else 0.0,
        "itl_p99_s": float(np.percentile(gaps, 99)) if gaps else 0.0,
        "wall_s": wall,
        "tokens": tokens,
    }


# -- ours -----------------------------------------------------------------------------------


def _our_model(preset: Preset) -> tuple[Any, Any, Any]:
    """(model, params, tokenizer) for the preset."""
    if preset.model == "embedded":
        from turbospark_jax.loading import DEFAULT_TARGET, embedded_model_path, load_folder

        loaded = load_folder(embedded_model_path(DEFAULT_TARGET), dtype=preset.dtype,
                             layer_layout="list")
        return loaded.model, loaded.params, loaded.tokenizer
    from benchmarks.run import SHAPES, _dense

    _, model, params = _dense(SHAPES[preset.model])
    return model, params, IdTokenizer()


async def _stream_one(http: Any, url: str, prompt: list[int], tokens: int
                      ) -> tuple[float, list[float], int]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                    stamps.append(time.perf_counter())
    return stamps[0] - start, list(np.diff(stamps)), len(stamps)


async def _drive(url: str, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        runs = await asyncio.gather(*[_stream_one(http, url, p, tokens) for p in prompts])
        wall = time.perf_counter() - start
    ttft = [r[0] for r in runs]
    gaps = [g for r in runs for g in r[1]]
    return _latency_summary(ttft, gaps, sum(r[2] for r in runs), wall)


def run_ours(preset: Preset, model: Any, params: Any, tokenizer: Any) -> list[dict[str, Any]]:
    from turbospark_jax.block_producer import BlockProducer
    from turbospark_jax.server.build import make_server
    from turbospark_jax.testing.live_server import running

    records = []
    for n in preset.concurrency:
        producer = BlockProducer(model, params, capacity=preset.context, width=preset.width,
                                 steps_per_call=8, donate=True)
        server = make_server(producer, tokenizer, model_name="bench", slots=n,
                             max_waiting=n, prefill_chunk=64)
        prompts = _prompts(n, preset.prompt_tokens, producer.vocab_size)
        with running(server) as url:
            # Compile the prefill, the batched step and the reuse path's small programs with
            # prompts the timed run does not share (no prefix of it is cached).
            warm = _prompts(2, preset.prompt_tokens, producer.vocab_size, seed=1)
            for prompt in (warm[0], warm[0][:-1] + warm[1][-1:], warm[1]):
                asyncio.run(_drive(url, [prompt], 2))
            figures = asyncio.run(_drive(url, prompts, preset.new_tokens))
        records.append({"system": "turbospark_jax", "concurrency": n, **figures})
        print(json.dumps(records[-1]), flush=True)
    return records


# -- transformers -------------------------------------------------------------------------------


def _hf_model(preset: Preset, device: str) -> Any:
    import torch
    import transformers

    if preset.model == "embedded":
        from turbospark_jax.loading import DEFAULT_TARGET, embedded_model_path

        model = transformers.AutoModelForCausalLM.from_pretrained(
            embedded_model_path(DEFAULT_TARGET), dtype=getattr(torch, preset.dtype),
            attn_implementation="sdpa")
        return model.to(device).eval()
    from benchmarks.run import SHAPES
    from benchmarks.run import _hf_model as shaped

    return shaped(SHAPES[preset.model], device)


def run_hf(preset: Preset, device: str) -> list[dict[str, Any]]:
    import transformers

    model = _hf_model(preset, device)
    vocab = model.config.vocab_size
    records = []
    for n in preset.concurrency:
        prompts = _prompts(n, preset.prompt_tokens, vocab)
        config = transformers.GenerationConfig(
            max_new_tokens=preset.new_tokens, do_sample=False, eos_token_id=-1,
            pad_token_id=0)
        try:
            model.generate_batch(prompts[:1], generation_config=config, max_new_tokens=2)
            start = time.perf_counter()
            outs = model.generate_batch(prompts, generation_config=config,
                                        record_timestamps=True)
            wall = time.perf_counter() - start
        except Exception as exc:  # record why, and keep the run's other figures
            records.append({"system": "transformers_generate_batch", "concurrency": n,
                            "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps(records[-1]), flush=True)
            continue
        ttft, gaps, tokens, first, last = [], [], 0, [], []
        for out in outs.values():
            stamps = out.timestamps or []
            tokens += len(out.generated_tokens)
            if stamps:
                ttft.append(stamps[0] - out.created_time)
                gaps += list(np.diff(stamps))
                first.append(out.created_time)
                last.append(stamps[-1])
        # generate_batch starts and stops a manager thread around the requests (seconds on a
        # CPU); the throughput window runs from the first request's creation to the last
        # token, and the whole call's time is kept as call_s.
        window = max(last) - min(first) if last else wall
        records.append({"system": "transformers_generate_batch", "concurrency": n,
                        **_latency_summary(ttft or [float("nan")], gaps, tokens, window),
                        "call_s": wall})
        print(json.dumps(records[-1]), flush=True)
    return records


# -- report ---------------------------------------------------------------------------------


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Aggregate tokens/s against concurrent streams, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for system in sorted({r["system"] for r in records}):
        rows = [r for r in records if r["system"] == system and "tokens_per_s" in r]
        ax.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], "o-",
                label=system)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--skip-hf", action="store_true", help="only our server")
    args = parser.parse_args(argv)
    import jax

    preset = PRESETS[args.preset]
    backend = jax.default_backend()
    device = "cuda" if backend == "gpu" else "cpu"
    model, params, tokenizer = _our_model(preset)
    records = run_ours(preset, model, params, tokenizer)
    if not args.skip_hf:
        records += run_hf(preset, device)
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "backend": backend, "device": str(jax.devices()[0]), "jax": jax.__version__,
            "python": sys.version.split()[0], "machine": platform.machine(),
            "preset": dataclasses.asdict(preset)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"serve_{args.preset}.json").write_text(
        json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    plot(records, args.out / f"serve_{args.preset}.png",
         f"{preset.model} on {backend}: {preset.prompt_tokens}-token prompts, "
         f"{preset.new_tokens} new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
