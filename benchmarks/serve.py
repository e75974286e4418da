"""The server's aggregate tokens/s, time to first token and inter-token latency at a few
concurrency levels, beside transformers' continuous batching in the same run.

Ours: one live server on localhost (uvicorn in a thread) for every level, with as many session
slots as the largest level has streams (the decode program compiles once and every stream is a
row of it); the clients stream greedy completions over HTTP, so the figures include the HTTP
and SSE work. Each level's prompts are its own (no level reuses another's prefix).
transformers: ``model.generate_batch`` over the same prompts with ``record_timestamps``, in
process, its throughput from the first request's creation to the last token (the call's own
start-up and shut-down kept apart as ``call_s``). Every request generates exactly
``new_tokens`` (no stop token).

One stream against the plain loop: the same server streams one request at a time (its decode
step runs only as many rows as its bucket needs, not every slot's), beside
:func:`~turbospark_jax.generation.driver.run_raw_completion` on the server's own producer, each
the median of a few runs of the same prompt; the figure is the stream's tokens/s after its first
token (``stream_tokens_per_s``) and their ratio (bar 0.95), in the results file's
``one_stream_vs_plain`` entry.

A shared system prompt: a server of its own, with one slot a request, takes ``requests``
streams at once, each a long system prompt (the same for all) and a short user turn of its own,
twice: once with the engine's sharing of prefixes across slots turned off, once with it on (each
run with a system prompt of its own, so neither finds the other's in a slot). The figures are
the prompt tokens prefilled (the prompt tokens less the ``cached_tokens`` each response
reports), the tokens/s and the time to first token of each run, and their ratios, in the results
file's ``shared_prefix`` entry. All streams arrive together: the first prefill call's requests
find nothing to share and prefill the system prompt themselves; the rest copy it from them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import common


@dataclasses.dataclass(frozen=True)
class SharedPrompt:
    """The shared-system-prompt case: ``requests`` streams of ``system_tokens`` shared tokens
    and ``turn_tokens`` of their own, each generating ``new_tokens``."""

    system_tokens: int
    requests: int
    turn_tokens: int
    new_tokens: int


@dataclasses.dataclass(frozen=True)
class Preset:
    #: "embedded" (the default model folder) or a shape of :data:`common.SHAPES`
    model: str
    concurrency: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int
    context: int
    width: int
    dtype: str
    prefill_rows: int
    prefill_chunk: int
    hf: bool
    budget_s: float | None = None
    shared: SharedPrompt | None = None


_GPU = Preset("llama-3.2-1b", (1, 8, 32, 64), 128, 256, 512, 16, "bfloat16", 8, 128, hf=True,
              budget_s=420.0, shared=SharedPrompt(2048, 64, 32, 64))
PRESETS = {
    "smoke": Preset("tiny", (1, 2), 8, 4, 32, 4, "float32", 2, 8, hf=False,
                    shared=SharedPrompt(24, 4, 4, 4)),
    # A dense shape: transformers' continuous batching refuses the embedded model's
    # linear-attention layers.
    "cpu": Preset("small-60m", (1, 4, 16), 32, 32, 128, 16, "float32", 8, 32, hf=True,
                  budget_s=120.0, shared=SharedPrompt(256, 16, 16, 16)),
    "h100": _GPU,
    "h200": _GPU,
}


class IdTokenizer:
    """Text for a random model without a tokenizer: each id is written ``<id>``."""

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


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    return [common.prompt_ids(length, vocab, seed=seed * 1000 + i) for i in range(n)]


#: The one stream's tokens/s after its first token over the plain loop's: at least this.
ONE_STREAM_BAR = 0.95
#: Runs of each side of the one-stream comparison (the median is kept).
ONE_STREAM_RUNS = 3


def latency_summary(ttft: list[float], gaps: list[float], tokens: int, wall: float
                    ) -> dict[str, float]:
    """``stream_tokens_per_s``: tokens after a stream's first one per second of the gaps
    between them (one stream: its decode rate)."""
    return {"tokens_per_s": tokens / wall,
            "stream_tokens_per_s": len(gaps) / sum(gaps) if gaps else 0.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "itl_p50_s": float(np.percentile(gaps, 50)) if gaps else 0.0,
            "itl_p99_s": float(np.percentile(gaps, 99)) if gaps else 0.0,
            "wall_s": wall, "tokens": tokens}


# -- ours -----------------------------------------------------------------------------------


def our_server(preset: Preset) -> Any:
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.server.build import make_server

    if preset.model == "embedded":
        from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path, load_folder

        loaded = load_folder(embedded_model_path(DEFAULT_TARGET), dtype=preset.dtype,
                             layer_layout="list")
        model, params, tokenizer = loaded.model, loaded.params, loaded.tokenizer
    else:
        _, model, params = common.random_model(preset.model, preset.dtype)
        tokenizer = IdTokenizer()
    producer = BlockProducer(model, params, capacity=preset.context, width=preset.width,
                             steps_per_call=8, donate=True)
    slots = max(preset.concurrency)
    return make_server(producer, tokenizer, model_name="bench", slots=slots, max_waiting=slots,
                       prefill_chunk=preset.prefill_chunk, prefill_rows=preset.prefill_rows)


async def _stream_one(http: Any, url: str, prompt: list[int], tokens: int,
                      extra: dict[str, Any] | None = None,
                      usages: list[dict[str, Any]] | None = None
                      ) -> tuple[float, list[float], int]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, **(extra or {})}
    if usages is not None:
        body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                    stamps.append(time.perf_counter())
                if usages is not None and chunk.get("usage"):
                    usages.append(chunk["usage"])
    return stamps[0] - start, list(np.diff(stamps)), len(stamps)


def drive(url: str, prompts: list[list[int]], tokens: int,
          extras: list[dict[str, Any] | None] | None = None,
          usages: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """Every prompt streamed at once (prompt ``i`` with the request fields ``extras[i]``); the
    level's figures. ``usages``: each response's usage is appended to it."""
    import httpx

    async def all_at_once() -> tuple[list[Any], float]:
        limits = httpx.Limits(max_connections=len(prompts) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            start = time.perf_counter()
            runs = await asyncio.gather(*[
                _stream_one(http, url, p, tokens, (extras or [None] * len(prompts))[i],
                            usages)
                for i, p in enumerate(prompts)])
            return runs, time.perf_counter() - start

    runs, wall = asyncio.run(all_at_once())
    return latency_summary([r[0] for r in runs], [g for r in runs for g in r[1]],
                           sum(r[2] for r in runs), wall)


def one_stream_vs_plain(url: str, producer: Any, preset: Preset, vocab: int
                        ) -> dict[str, Any]:
    """One greedy stream through the server against the plain loop on ``producer`` (the
    server's own, called while the server is idle), the same prompt for both."""
    from turbospark_jax.generation.completion import CompletionRequest
    from turbospark_jax.generation.driver import run_raw_completion

    prompt = prompts_for(1, preset.prompt_tokens, vocab, seed=20_000)[0]
    drive(url, [prompt], 2)  # the same prefix for every run: a warm slot, as the plain loop's
    served = [drive(url, [prompt], preset.new_tokens)["stream_tokens_per_s"]
              for _ in range(ONE_STREAM_RUNS)]
    run_raw_completion(producer, CompletionRequest(prompt_ids=prompt, max_tokens=2))
    plain = []
    for _ in range(ONE_STREAM_RUNS):
        done = run_raw_completion(producer, CompletionRequest(prompt_ids=prompt,
                                                              max_tokens=preset.new_tokens))
        plain.append(done.timings.decode_tokens_per_s(done.usage.generated_tokens))
    ours, theirs = float(np.median(served)), float(np.median(plain))
    return {"stream_tokens_per_s": ours, "plain_tokens_per_s": theirs, "ratio": ours / theirs,
            "bar": ONE_STREAM_BAR, "passes": ours / theirs >= ONE_STREAM_BAR,
            "runs": {"server": served, "plain": plain}}


def one_stream(results: common.Results, url: str, server: Any, preset: Preset) -> None:
    """:func:`one_stream_vs_plain` into the results file's ``one_stream_vs_plain`` entry (kept
    apart from the concurrency levels' cases, which the report tabulates); a failure is an
    error like a case's."""
    engine = server.engine
    label = {"slots": len(engine.slots), "buckets": list(engine.decoder.buckets)}
    try:
        figures = one_stream_vs_plain(url, engine.producer, preset, engine.producer.vocab_size)
    except Exception as exc:  # a failure is a result; the levels still run
        results.data["errors"].append({"case": "one_stream_vs_plain",
                                       "error": f"{type(exc).__name__}: {exc}"[:600]})
    else:
        results.data["one_stream_vs_plain"] = {**label, **figures}
        print(json.dumps({"one_stream_vs_plain": results.data["one_stream_vs_plain"]}),
              flush=True)
    results.write()


def shared_prompt_run(url: str, engine: Any, case: SharedPrompt, vocab: int, seed: int,
                      *, shares: bool) -> dict[str, Any]:
    """One run of the shared-system-prompt case, with the engine's sharing across slots on or
    off; its figures and the prompt tokens prefilled."""
    system = common.prompt_ids(case.system_tokens, vocab, seed=seed)
    prompts = [system + turn for turn in prompts_for(case.requests, case.turn_tokens, vocab,
                                                     seed=seed + 1)]
    usages: list[dict[str, Any]] = []
    engine._shares_prefixes = shares  # the benchmark's switch; not a serving option
    try:
        figures = drive(url, prompts, case.new_tokens, usages=usages)
    finally:
        engine._shares_prefixes = True
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    return {**figures, "prompt_tokens": prompt, "cached_tokens": cached,
            "prefilled_tokens": prompt - cached}


def shared_prompt(results: common.Results, preset: Preset) -> None:
    """The shared-system-prompt case (:class:`SharedPrompt`) on a server of its own, without
    and with sharing across slots, into the results file's ``shared_prefix`` entry."""
    from turbospark_jax.testing.live_server import running

    case = preset.shared
    if case is None or results.out_of_time():
        return
    context = -(-(case.system_tokens + case.turn_tokens + case.new_tokens) // 128) * 128
    server = our_server(dataclasses.replace(preset, concurrency=(case.requests,),
                                            context=context))
    engine, vocab = server.engine, server.engine.producer.vocab_size
    try:
        with running(server) as url:
            # compile every program the runs reach on prompts they do not share: a session's
            # prompt, then its next turn (reused in its slot) and another prompt repeating
            # most of it (in another slot, from a copy)
            warm = prompts_for(2, case.system_tokens + case.turn_tokens, vocab, seed=30_000)
            session = {"session_id": "warm-up"}
            drive(url, [warm[0]], 2, [session])
            drive(url, [warm[0][:-1] + warm[1][-1:], warm[0][:-2] + warm[1][-2:]], 2,
                  [session, None])
            off = shared_prompt_run(url, engine, case, vocab, 40_000, shares=False)
            on = shared_prompt_run(url, engine, case, vocab, 50_000, shares=True)
    except Exception as exc:  # a failure is a result; the other cases stand
        results.data["errors"].append({"case": "shared_prefix",
                                       "error": f"{type(exc).__name__}: {exc}"[:600]})
    else:
        results.data["shared_prefix"] = {
            **dataclasses.asdict(case), "slots": len(engine.slots), "without": off, "with": on,
            "prefill_tokens_saved": off["prefilled_tokens"] - on["prefilled_tokens"],
            "tokens_per_s_ratio": on["tokens_per_s"] / off["tokens_per_s"],
            "ttft_p50_ratio": on["ttft_p50_s"] / off["ttft_p50_s"]}
        print(json.dumps({"shared_prefix": results.data["shared_prefix"]}), flush=True)
    results.write()


# -- transformers ---------------------------------------------------------------------------


def hf_runner(preset: Preset) -> Callable[[int], dict[str, Any]]:
    """transformers' model for the preset; returns ``measure(n)``, which times ``n``
    requests through ``generate_batch``."""
    import torch
    import transformers

    device, _ = common.torch_device()
    if preset.model == "embedded":
        from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path

        model = transformers.AutoModelForCausalLM.from_pretrained(
            embedded_model_path(DEFAULT_TARGET), dtype=getattr(torch, preset.dtype),
            attn_implementation="sdpa").to(device).eval()
    else:
        model = common.hf_model(preset.model, device, preset.dtype)
    vocab = model.config.vocab_size
    config = transformers.GenerationConfig(max_new_tokens=preset.new_tokens, do_sample=False,
                                           eos_token_id=-1, pad_token_id=0)
    warm = prompts_for(1, preset.prompt_tokens, vocab, seed=999)
    model.generate_batch(warm, generation_config=config, max_new_tokens=2)

    def measure(n: int) -> dict[str, Any]:
        prompts = prompts_for(n, preset.prompt_tokens, vocab, seed=n)
        start = time.perf_counter()
        outs = model.generate_batch(prompts, generation_config=config, record_timestamps=True)
        wall = time.perf_counter() - start
        ttft, gaps, tokens, first, last = [], [], 0, [], []
        for out in outs.values():
            stamps = out.timestamps or []
            tokens += len(out.generated_tokens)
            if stamps:
                ttft.append(stamps[0] - out.created_time)
                gaps += list(np.diff(stamps))
                first.append(out.created_time)
                last.append(stamps[-1])
        window = max(last) - min(first) if last else wall
        return {**latency_summary(ttft or [float("nan")], gaps, tokens, window), "call_s": wall}

    return measure


def run(preset: Preset, results: common.Results) -> None:
    from turbospark_jax.testing.live_server import running

    server = our_server(preset)
    vocab = server.engine.producer.vocab_size
    with running(server) as url:
        # compile the prefill, the batched step and the prefix-reuse path's programs on
        # prompts no timed level shares
        started = time.perf_counter()
        warm = prompts_for(2, preset.prompt_tokens, vocab, seed=10_000)
        for prompts in ([warm[0]], [warm[0][:-1] + warm[1][-1:], warm[1]]):
            drive(url, prompts, 2)
        results.data["meta"]["ours_warmup_s"] = time.perf_counter() - started
        theirs = None
        if preset.hf:
            try:
                theirs = hf_runner(preset)
            except Exception as exc:
                results.data["errors"].append({"system": "transformers_generate_batch",
                                               "error": f"{type(exc).__name__}: {exc}"[:600]})
        one_stream(results, url, server, preset)
        # level by level, ours then theirs: a budget that runs out cuts both alike
        for n in preset.concurrency:
            results.case({"system": "turbospark_jax", "concurrency": n,
                          "slots": max(preset.concurrency)},
                         lambda n=n: drive(url, prompts_for(n, preset.prompt_tokens, vocab,
                                                            seed=n), preset.new_tokens))
            if theirs is not None:
                results.case({"system": "transformers_generate_batch", "concurrency": n},
                             lambda n=n: theirs(n))
    shared_prompt(results, preset)
