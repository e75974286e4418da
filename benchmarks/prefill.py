"""Prefill tokens/s: the exact path (the block program, in blocks of the producer's prefill
width) and the parallel path (one wide pass per chunk), against transformers' sdpa forward over
the same prompt length. Each figure is the best of ``repeats`` calls on a fresh state, after
one that compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks import common


@dataclasses.dataclass(frozen=True)
class Preset:
    shapes: tuple[str, ...]
    lengths: tuple[int, ...]
    chunk: int
    repeats: int
    dtype: str
    hf: bool


_GPU = Preset(("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b", "qwen3.5-0.8b", "qwen3.5-4b",
               "gemma4-e2b"), (2048, 8192), 2048, 3, "bfloat16", hf=True)
PRESETS = {
    "smoke": Preset(("tiny",), (24,), 16, 1, "float32", hf=False),
    "cpu": Preset(("small-60m", "qwen3.5-tiny", "gemma4-tiny"), (256, 1024), 512, 2, "float32",
                  hf=True),
    "h100": _GPU,
    "h200": _GPU,
}


def prefill_rates(producer: Any, length: int, chunk: int, vocab: int,
                  repeats: int = 1) -> dict[str, float]:
    """Tokens/s of the exact prefill of a ``length``-token prompt and, where the producer has
    it, of the parallel prefill in chunks of ``chunk`` rows."""
    prompt = common.prompt_ids(length, vocab, seed=1)
    paths = {"exact": lambda: producer.prefill_chunk(producer.init_state(), prompt, 0)}
    if producer.supports_parallel_prefill():
        paths["parallel"] = lambda: producer.prefill_parallel(
            producer.init_state(), prompt, 0, chunk=min(chunk, length))
    out: dict[str, float] = {}
    for name, fn in paths.items():
        best, _ = common.best_seconds(fn, repeats)
        out[f"{name}_s"] = round(best, 5)
        out[f"{name}_tokens_per_s"] = round(length / best, 1)
    return out


def hf_prefill_rate(model: Any, length: int, vocab: int, repeats: int, device: str,
                    sync: Any) -> dict[str, float]:
    """transformers' forward over a ``length``-token prompt, tokens/s (best of ``repeats``)."""
    import time

    import torch

    ids = torch.tensor([common.prompt_ids(length, vocab, seed=1)], device=device)
    best = float("inf")
    with torch.inference_mode():
        model(ids)  # warm at this length
        for _ in range(max(1, repeats)):
            sync()
            t0 = time.perf_counter()
            model(ids)
            sync()
            best = min(best, time.perf_counter() - t0)
    return {"s": round(best, 5), "tokens_per_s": round(length / best, 1)}


def run(preset: Preset, results: common.Results) -> None:
    import jax

    for shape in preset.shapes:
        try:
            built = common.build(shape, capacity=max(preset.lengths) + 64, dtype=preset.dtype)
        except Exception as exc:
            results.data["errors"].append({"shape": shape,
                                           "error": f"{type(exc).__name__}: {exc}"[:600]})
            continue
        for length in preset.lengths:
            label = {"shape": shape, "impl": "turbospark_jax", "exact": built.exact,
                     "length": length, "prefill_width": built.producer.prefill_width}
            results.case(label, lambda n=length, b=built: prefill_rates(
                b.producer, n, preset.chunk, b.config.vocab_size, preset.repeats))
        del built
        jax.clear_caches()
        if preset.hf:
            hf_cases(shape, preset, results)


def hf_cases(shape: str, preset: Preset, results: common.Results) -> None:
    device, sync = common.torch_device()
    try:
        model = common.hf_model(shape, device, preset.dtype)
    except Exception as exc:
        results.data["errors"].append({"shape": shape, "impl": "transformers-sdpa",
                                       "error": f"{type(exc).__name__}: {exc}"[:600]})
        return
    vocab = common.SHAPES[shape]["vocab_size"]
    for length in preset.lengths:
        results.case({"shape": shape, "impl": "transformers-sdpa", "length": length},
                     lambda n=length: hf_prefill_rate(model, n, vocab, preset.repeats, device,
                                                      sync))
    model = None  # the memory back before JAX's next model
    common.release_torch(device)
