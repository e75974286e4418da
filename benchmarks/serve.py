"""Serving benchmark: aggregate tokens/s, time to first token and inter-token latency at several
concurrency levels, for our server and for transformers' continuous batching, in one run.

Ours: one live server on localhost (uvicorn in a thread) for every concurrency level, with as
many session slots as the largest level has streams (so the decode program is compiled once and
every stream is a row of it), prompts prefilled ``prefill_rows`` at a time in chunks of
``prefill_chunk`` tokens between decode steps; the clients stream greedy completions over HTTP
(httpx), so the figures include the HTTP and SSE work. Each level's prompts are its own, so no
level reuses another's prefix. Transformers:
``model.generate_batch`` (its continuous batching) over the same prompts with
``record_timestamps``, in process (no HTTP), its throughput measured from the first request's
creation to the last token (the call's own start-up and shut-down excluded, kept as
``call_s``). Both generate exactly the preset's ``new_tokens`` per request (no stop token).

    python -m benchmarks.serve --preset cpu      # the embedded model, float32 on the CPU
    python -m benchmarks.serve --preset h200     # a Llama-3.2-1B-shaped random model, bf16

Results go to ``--out`` (default ``benchmarks/results``) as ``serve_<preset>.json``, rewritten
after every measurement so a run cut short keeps what it measured, and a plot
``serve_<preset>.png``. ``--replicas N`` serves our side with N data-parallel replicas (one per
device, the slots split among them; ``serve_<preset>_rN.*``), after checking that sampled
requests served at once by the replicas get what one replica of the same slots gives alone.
``--budget-s`` (default 170) skips the levels not begun once it is spent (recorded as
skipped), so the h200 preset stays within four minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
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
    prefill_rows: int
    prefill_chunk: int


PRESETS = {
    "cpu": Preset("embedded", (1, 8, 32, 64), 32, 32, 128, 16, "float32", 8, 32),
    "h200": Preset("llama-3.2-1b", (1, 8, 32, 64), 128, 256, 512, 16, "bfloat16", 8, 128),
    "smoke": Preset("embedded", (1, 2), 8, 4, 32, 16, "float32", 2, 16),
    # The h200 preset's path (a random model without a tokenizer) in miniature, for the CPU.
    "tiny-random": Preset("tiny", (1, 2), 8, 4, 32, 4, "bfloat16", 2, 8),
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
        from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path, load_folder

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


class Report:
    """The run's records, written out whole after every one is added."""

    def __init__(self, path: Path, meta: dict[str, Any], deadline: float) -> None:
        self.path, self.meta, self.deadline = path, meta, deadline
        self.records: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        print(json.dumps(record), flush=True)
        self.path.write_text(json.dumps({"meta": self.meta, "records": self.records},
                                        indent=1) + "\n")

    def out_of_time(self, system: str, n: int) -> bool:
        """Whether the budget is spent (then the level is recorded as skipped)."""
        if time.perf_counter() < self.deadline:
            return False
        self.add({"system": system, "concurrency": n, "skipped": "out of the time budget"})
        return True


def _build_server(preset: Preset, model: Any, params: Any, tokenizer: Any, replicas: int,
                  slots: int) -> Any:
    """Our server with ``replicas`` replicas (one per device) of ``slots`` slots each."""
    from turbospark_jax.parallel.replicas import replicas_one_per_device
    from turbospark_jax.server.build import make_server

    producers = replicas_one_per_device(model, params, replicas, capacity=preset.context,
                                        width=preset.width, steps_per_call=8, donate=True)
    return make_server(producers, tokenizer, model_name="bench", slots=slots,
                       max_waiting=slots * replicas, prefill_chunk=preset.prefill_chunk,
                       prefill_rows=preset.prefill_rows)


def _slots(preset: Preset, replicas: int) -> int:
    """Slots per replica: over all of them, as many as the largest level has streams."""
    return -(-max(preset.concurrency) // replicas)


def _sampled_answers(url: str, prompts: list[list[int]], seeds: list[int], tokens: int
                     ) -> list[Any]:
    """Sampled completions with log-probabilities, all requests in flight at once."""
    import httpx

    async def all_at_once() -> list[Any]:
        async with httpx.AsyncClient(timeout=600) as http:
            replies = await asyncio.gather(*[http.post(url + "/v1/completions", json={
                "model": "bench", "prompt": p, "max_tokens": tokens, "temperature": 0.8,
                "seed": seed, "logprobs": 5}) for p, seed in zip(prompts, seeds, strict=True)])
        return [r.json()["choices"][0] for r in replies]

    return [(c["token_ids"], c["logprobs"]) for c in asyncio.run(all_at_once())]


def replicas_exact(preset: Preset, model: Any, params: Any, tokenizer: Any, replicas: int,
                   report: Report) -> None:
    """Whether ``2 * replicas`` sampled requests served at once by the replicas get the same
    tokens and log-probabilities as served one at a time by one replica alone (of the same
    slots: the batch size is part of the compiled programs)."""
    from turbospark_jax.testing.live_server import running

    answers: list[Any] = []
    for count in (replicas, 1):
        server = _build_server(preset, model, params, tokenizer, count, _slots(preset, replicas))
        prompts = _prompts(2 * replicas, preset.prompt_tokens, server.engine.producer.vocab_size,
                           seed=20_000)
        with running(server) as url:
            if count == 1:
                answers.append([_sampled_answers(url, [p], [i], 16)[0]
                                for i, p in enumerate(prompts)])
            else:
                answers.append(_sampled_answers(url, prompts, list(range(len(prompts))), 16))
    report.add({"system": "turbospark_jax", "replicas": replicas, "check": "replicas_exact",
                "requests": len(prompts), "equal": answers[0] == answers[1]})


@contextlib.contextmanager
def our_server(preset: Preset, model: Any, params: Any, tokenizer: Any, report: Report,
               replicas: int = 1) -> Iterator[Callable[[int], None]]:
    """Start and warm our server; yields ``measure(n)``, which times ``n`` streams."""
    from turbospark_jax.testing.live_server import running

    server = _build_server(preset, model, params, tokenizer, replicas, _slots(preset, replicas))
    producer = server.engine.producer
    slots = server.engine.load()["slots"]
    with running(server) as url:
        # Compile the prefill, the batched step and the reuse path's small programs with
        # prompts no timed level shares (no prefix of theirs is cached).
        started = time.perf_counter()
        warm = _prompts(2, preset.prompt_tokens, producer.vocab_size, seed=10_000)
        for prompts in ([warm[0]], [warm[0][:-1] + warm[1][-1:], warm[1]]):
            asyncio.run(_drive(url, prompts, 2))
        report.meta["ours_warmup_s"] = time.perf_counter() - started

        def measure(n: int) -> None:
            if report.out_of_time("turbospark_jax", n):
                return
            prompts = _prompts(n, preset.prompt_tokens, producer.vocab_size, seed=n)
            figures = asyncio.run(_drive(url, prompts, preset.new_tokens))
            report.add({"system": "turbospark_jax", "concurrency": n, "slots": slots,
                        "replicas": replicas, **figures})

        yield measure


# -- transformers -------------------------------------------------------------------------------


def _hf_model(preset: Preset, device: str) -> Any:
    import torch
    import transformers

    if preset.model == "embedded":
        from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path

        model = transformers.AutoModelForCausalLM.from_pretrained(
            embedded_model_path(DEFAULT_TARGET), dtype=getattr(torch, preset.dtype),
            attn_implementation="sdpa")
        return model.to(device).eval()
    from benchmarks.run import SHAPES
    from benchmarks.run import _hf_model as shaped

    return shaped(SHAPES[preset.model], device)


def hf_runner(preset: Preset, device: str, report: Report) -> Callable[[int], None]:
    """transformers' model for the preset; returns ``measure(n)``, which times ``n`` requests."""
    import transformers

    model = _hf_model(preset, device)
    vocab = model.config.vocab_size
    warmed: list[int] = []

    def measure(n: int) -> None:
        if report.out_of_time("transformers_generate_batch", n):
            return
        prompts = _prompts(n, preset.prompt_tokens, vocab, seed=n)
        config = transformers.GenerationConfig(
            max_new_tokens=preset.new_tokens, do_sample=False, eos_token_id=-1,
            pad_token_id=0)
        try:
            if not warmed:  # once: each call starts and stops its manager (slow on a CPU)
                model.generate_batch(prompts[:1], generation_config=config, max_new_tokens=2)
                warmed.append(n)
            start = time.perf_counter()
            outs = model.generate_batch(prompts, generation_config=config,
                                        record_timestamps=True)
            wall = time.perf_counter() - start
        except Exception as exc:  # record why, and keep the run's other figures
            report.add({"system": "transformers_generate_batch", "concurrency": n,
                        "error": f"{type(exc).__name__}: {exc}"})
            return
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
        report.add({"system": "transformers_generate_batch", "concurrency": n,
                    **_latency_summary(ttft or [float("nan")], gaps, tokens, window),
                    "call_s": wall})

    return measure


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
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="seconds after which the levels left are skipped")
    parser.add_argument("--replicas", type=int, default=1,
                        help="data-parallel replicas of our server, one per device (the slots "
                             "are split among them); more than 1 also checks their outputs "
                             "against one replica and writes serve_<preset>_r<N>.*")
    args = parser.parse_args(argv)
    deadline = time.perf_counter() + args.budget_s
    # JAX would take most of the GPU's memory up front; transformers runs in the same process.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    preset = PRESETS[args.preset]
    backend = jax.default_backend()
    device = "cuda" if backend == "gpu" else "cpu"
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "backend": backend, "device": str(jax.devices()[0]), "jax": jax.__version__,
            "python": sys.version.split()[0], "machine": platform.machine(),
            "preset": dataclasses.asdict(preset)}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"serve_{args.preset}" + (f"_r{args.replicas}" if args.replicas > 1 else "")
    report = Report(args.out / f"{name}.json", meta, deadline)
    model, params, tokenizer = _our_model(preset)
    if args.replicas > 1:
        replicas_exact(preset, model, params, tokenizer, args.replicas, report)
    # Level by level, ours then transformers': a budget that runs out cuts both alike.
    with our_server(preset, model, params, tokenizer, report, args.replicas) as ours:
        theirs = None if args.skip_hf else hf_runner(preset, device, report)
        for n in preset.concurrency:
            ours(n)
            if theirs is not None:
                theirs(n)
    records = report.records
    plot(records, args.out / f"{name}.png",
         f"{preset.model} on {backend}: {preset.prompt_tokens}-token prompts, "
         f"{preset.new_tokens} new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
