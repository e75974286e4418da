"""Decode tokens/s at batch 1, greedy and sampled, short and long context, per model shape.

Each case fills ``context`` random tokens, then generates ``new_tokens`` through
``run_raw_completion`` (the loop the CLI and ``tsj.generate`` run, with its own burst sizing,
no stop id) and reports the rate after the first token, the best of ``repeats`` runs. Beside
it: the weight-read roofline (the bytes a step must read over the device's copy bandwidth,
measured in the same run) and the share of it reached. Dense shapes run on the exact path and,
where a preset asks, on the fast path exact at one width only. transformers' eager
forward loop (and on a GPU its static-cache compiled decode) runs the same shapes greedy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks import common


@dataclasses.dataclass(frozen=True)
class Preset:
    shapes: tuple[str, ...]
    contexts: tuple[int, ...]
    new_tokens: int
    repeats: int
    exact_modes: tuple[bool, ...]
    dtype: str
    copy_bytes: int
    hf: bool
    hf_compile: bool = False
    #: transformers runs Qwen3.5's delta rule in plain PyTorch: contexts past this are left out
    hf_max_context: int = 4096


_GPU = Preset(
    shapes=("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b", "qwen3.5-0.8b", "qwen3.5-4b",
            "gemma4-e2b"),
    contexts=(128, 4096, 16384), new_tokens=256, repeats=3, exact_modes=(True, False),
    dtype="bfloat16", copy_bytes=4 << 30, hf=True, hf_compile=True)
PRESETS = {
    "smoke": Preset(("tiny",), (16,), 8, 1, (True,), "float32", 1 << 20, hf=False),
    "cpu": Preset(("small-60m", "qwen3.5-tiny", "gemma4-tiny"), (128, 1024), 32, 2, (True,),
                  "float32", 64 << 20, hf=True),
    "h100": _GPU,
    "h200": _GPU,
}
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}


def completion_rate(producer: Any, context: int, new_tokens: int, sampling: str,
                    repeats: int, vocab: int) -> dict[str, Any]:
    """Decode tokens/s after the first token of a ``context``-token prompt, best of
    ``repeats`` (after one run that compiles every program the loop takes)."""
    import turbospark_jax as tsj

    settings = tsj.SamplingConfig(**SAMPLED) if sampling == "sampled" else tsj.SamplingConfig()
    request = tsj.CompletionRequest(prompt_ids=common.prompt_ids(context, vocab),
                                    max_tokens=new_tokens, sampling=settings, seed=3,
                                    parallel_prefill=True)
    tsj.run_raw_completion(producer, request)
    runs = [tsj.run_raw_completion(producer, request) for _ in range(max(1, repeats))]
    rates = [r.timings.decode_tokens_per_s(len(r.token_ids)) for r in runs]
    return {"tokens_per_s": round(max(rates), 2), "runs_tokens_per_s": [round(r, 2) for r in rates],
            "generated": len(runs[0].token_ids)}


def run(preset: Preset, results: common.Results) -> None:
    import jax

    bandwidth = common.copy_bandwidth(preset.copy_bytes)
    results.data["meta"]["copy_bandwidth_bytes_per_s"] = bandwidth
    capacity = max(preset.contexts) + preset.new_tokens + 64
    for shape in preset.shapes:
        for exact in preset.exact_modes:
            if not exact and not common.has_choice(common.model_of(shape)[2]):
                continue  # a family without the choice has one path, measured once
            try:
                built = common.build(shape, capacity=capacity, exact=exact,
                                     burst=min(64, preset.new_tokens), dtype=preset.dtype)
            except Exception as exc:  # out of memory, say: recorded, next shape
                results.data["errors"].append({"shape": shape, "exact": exact,
                                               "error": f"{type(exc).__name__}: {exc}"[:600]})
                continue
            width = built.producer.width
            for context in preset.contexts:
                need = common.step_bytes(built.config, built.params, context)
                roof = bandwidth / need
                for sampling in ("greedy", "sampled"):
                    label = {"shape": shape, "impl": "turbospark_jax", "exact": exact,
                             "width": width, "context": context, "sampling": sampling,
                             "step_bytes": need, "roofline_tokens_per_s": round(roof, 2)}
                    case = results.case(label, lambda b=built, c=context, s=sampling:
                                        completion_rate(b.producer, c, preset.new_tokens, s,
                                                        preset.repeats, b.config.vocab_size))
                    if case is not None:
                        case["fraction_of_roofline"] = round(case["tokens_per_s"] / roof, 4)
                        results.write()
            del built
            jax.clear_caches()
        if preset.hf:
            hf_cases(shape, preset, results)


def hf_cases(shape: str, preset: Preset, results: common.Results) -> None:
    """transformers on ``shape``: the eager forward loop at each context (up to
    ``hf_max_context``), and where asked the compiled static-cache decode at the shortest."""
    import torch

    device, sync = common.torch_device()
    try:
        model = common.hf_model(shape, device, preset.dtype)
    except Exception as exc:  # a shape transformers cannot build is a result, not a crash
        results.data["errors"].append({"shape": shape, "impl": "transformers",
                                       "error": f"{type(exc).__name__}: {exc}"[:600]})
        return
    vocab = common.SHAPES[shape]["vocab_size"]
    for context in (c for c in preset.contexts if c <= preset.hf_max_context):
        ids = torch.tensor([common.prompt_ids(context, vocab)], device=device)
        label = {"shape": shape, "impl": "transformers-eager", "context": context,
                 "sampling": "greedy"}
        results.case(label, lambda ids=ids: {"tokens_per_s": round(
            preset.new_tokens / common.hf_decode_seconds(model, ids, preset.new_tokens, sync),
            2)})
    if preset.hf_compile and device == "cuda":
        context = preset.contexts[0]
        ids = torch.tensor([common.prompt_ids(context, vocab)], device=device)
        label = {"shape": shape, "impl": "transformers-static-compile", "context": context,
                 "sampling": "greedy"}
        results.case(label, lambda: {"tokens_per_s": round(preset.new_tokens / (
            common.hf_compiled_decode_seconds(model, ids, preset.new_tokens, sync)), 2)})
    model = None  # the memory back before JAX's next model
    common.release_torch(device)
