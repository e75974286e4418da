"""The training recipe's step: tokens/s, model FLOPs utilisation and peak memory per recipe
preset and batch size.

Each case compiles the recipe's own train step (:func:`turbospark_recipe.train.make_train_step`,
the one ``recipe`` runs) on random token rows (no corpus needed), runs two steps to warm, then
times ``steps`` steps. MFU is the recipe's FLOP count per token
(:func:`turbospark_recipe.flops.training_flops_per_token`) at the measured rate over the
device's dense bf16 peak; ``None`` where the device has no known peak (a CPU). Beside the
Qwen3.5 presets' step at their largest batch stands the ceiling their matrix products alone
allow (:func:`benchmarks.train_bound.matmul_bound`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from benchmarks import common


@dataclasses.dataclass(frozen=True)
class Preset:
    #: recipe presets (:data:`turbospark_recipe.train.PRESETS`)
    models: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    seq_len: int
    steps: int
    #: the presets whose matmul bound is measured (Qwen3.5 ones), at the largest batch
    bound: tuple[str, ...] = ()


_GPU = Preset(("target35", "draft"), (16, 32, 64), 1024, 5, bound=("target35",))
PRESETS = {
    "smoke": Preset(("tiny",), (2,), 32, 1),
    "cpu": Preset(("tiny", "tiny35"), (4,), 128, 2, bound=("tiny35",)),
    "h100": _GPU,
    "h200": _GPU,
}


def step_case(name: str, batch: int, seq_len: int, steps: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path
    from turbospark_jax.io.tokenizer import Tokenizer
    from turbospark_recipe import train as rt
    from turbospark_recipe.flops import mfu, training_flops_per_token

    config = rt.model_config(name, Tokenizer.from_folder(embedded_model_path(DEFAULT_TARGET)))
    tc = rt.TrainConfig(steps=1000, batch_size=batch, seq_len=seq_len, warmup_steps=10)
    step_fn = rt.make_train_step(rt.build_model(config, tc.compute_dtype), tc)
    state = rt.init_state(config, tc)
    rng = np.random.default_rng(0)
    rows = jax.device_put(rng.integers(3, config.vocab_size, (4 * batch, seq_len + 1),
                                       dtype=np.int32))
    order = [jnp.asarray(rng.permutation(4 * batch)[:batch].astype(np.int32))
             for _ in range(steps + 3)]
    t0 = time.perf_counter()
    state, metrics = step_fn(state, rows, order[0])
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    for i in (1, 2):
        state, metrics = step_fn(state, rows, order[i])
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for i in range(steps):
        state, metrics = step_fn(state, rows, order[3 + i])
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - t0) / steps
    tokens_per_s = batch * seq_len / step_s
    flops = training_flops_per_token(config, state.params, seq_len)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {"compile_s": round(compile_s, 2), "step_s": round(step_s, 5),
            "tokens_per_s": round(tokens_per_s, 1), "flops_per_token": flops,
            "mfu": mfu(tokens_per_s, flops, getattr(device, "device_kind", "?")),
            "peak_bytes": stats.get("peak_bytes_in_use"),
            "loss": float(jax.device_get(metrics["loss"]))}


def run(preset: Preset, results: common.Results) -> None:
    import jax

    for name in preset.models:
        for batch in preset.batch_sizes:
            results.case({"model": name, "batch": batch, "seq_len": preset.seq_len},
                         lambda n=name, b=batch: step_case(n, b, preset.seq_len, preset.steps))
            jax.clear_caches()
        if name in preset.bound:
            batch = max(preset.batch_sizes)
            results.case({"model": name, "batch": batch, "seq_len": preset.seq_len,
                          "workload": "matmul_bound"},
                         lambda n=name, b=batch: bound_case(n, b, preset))


def bound_case(name: str, batch: int, preset: Preset) -> dict[str, Any]:
    """The matmul bound's totals and shape groups (the product list is left out)."""
    from benchmarks.train_bound import matmul_bound

    record = matmul_bound(name, batch, preset.seq_len, iters=max(2, preset.steps),
                          repeats=max(1, preset.steps))
    keep = ("matmul_flops", "attention_flops", "delta_rule_chunk_flops", "unaccounted_flops",
            "time_s", "tflops", "fraction_of_peak", "model_flops_per_step", "mfu_ceiling",
            "groups")
    return {"products": len(record["products"]), **{k: record[k] for k in keep}}
