"""Tensor-parallel decode throughput against the aggregate memory-bandwidth roofline.

For each model shape and each tensor-parallel size the machine has devices for, a random
bf16 dense model is made directly in its shards (no device ever holds it whole), a context
is filled through the exact block program, and greedy decode bursts are timed. The roofline
of a split model is the aggregate bandwidth (``tp`` times one device's measured copy
bandwidth) over the bytes a decode step reads (every weight once, plus the KV rows of the
context); a step also pays two all-reduces a layer, which the roofline does not count.

Presets:
  ``h200``: an 8B shape (llama-3.1-8b) at TP 1/2/4/8 and a 70B shape (llama-3.1-70b, which
  does not fit one GPU in bf16) at TP 4/8, each only where that many GPUs are present.
  ``smoke``: the tiny shape at TP 1/2/4/8 on simulated CPU devices (the flag is set here when
  the environment has not set it), to check the harness: its timings mean nothing.

Usage: ``python -m benchmarks.tensor_parallel --preset h200 --out benchmarks/results``;
records go to ``<out>/tensor_parallel.json`` and a table to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.run import SHAPES, Shape, copy_bandwidth, kv_bytes, weight_bytes

#: A 70B-shaped llama (Llama 3.1 70B's config): ~141 GB of bf16 weights.
LLAMA_70B = Shape("llama-3.1-70b", "llama", 8192, 80, 64, 8, 128, 28672, 128256, False)
#: A one-layer toy whose 8 query and 8 KV heads split over 1, 2, 4 or 8 devices.
TINY_TP = Shape("tiny-tp", "qwen3", 64, 1, 8, 8, 8, 128, 256, True)


@dataclasses.dataclass(frozen=True)
class Preset:
    #: (shape, tensor-parallel sizes to try) pairs; a size past the device count is skipped.
    runs: tuple[tuple[Shape, tuple[int, ...]], ...]
    contexts: tuple[int, ...]
    new_tokens: int
    width: int
    burst: int
    bandwidth_bytes: int


PRESETS = {
    "h200": Preset(
        runs=((SHAPES["llama-3.1-8b"], (1, 2, 4, 8)), (LLAMA_70B, (4, 8))),
        contexts=(128, 4096),
        new_tokens=256,
        width=16,
        burst=64,
        bandwidth_bytes=4 << 30,
    ),
    "smoke": Preset(
        runs=((TINY_TP, (1, 2, 4, 8)),),
        contexts=(16,),
        new_tokens=8,
        width=4,
        burst=4,
        bandwidth_bytes=16 << 20,
    ),
}


def random_sharded_params(model: Any, mesh: Any, seed: int = 0) -> Any:
    """Random bf16 params in the list layout, made leaf by leaf straight into their shards
    (one leaf's temporaries at a time, so a 70B model never needs more than its shards)."""
    import jax
    import jax.numpy as jnp

    from turbospark_jax.models.dense.model import init_params, unstack_layers
    from turbospark_jax.parallel.sharding import check_divisible, param_shardings, tp_size

    check_divisible(model.config, tp_size(mesh))
    shapes = jax.eval_shape(lambda: unstack_layers(
        init_params(model.config, jax.random.PRNGKey(0), model.dtype)))
    shardings = param_shardings(mesh, model.config, shapes)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    programs: dict[Any, Any] = {}  # one compile per distinct leaf shape and sharding
    made = []
    for leaf, sharding, key in zip(leaves, jax.tree.leaves(shardings), keys, strict=True):
        def draw(k: Any, leaf: Any = leaf) -> Any:
            scale = 0.02 if len(leaf.shape) > 1 else 1.0  # matrices small, norms near 1
            return (jax.random.normal(k, leaf.shape, jnp.float32) * scale).astype(leaf.dtype)

        which = (leaf.shape, leaf.dtype, sharding)
        if which not in programs:
            programs[which] = jax.jit(draw, out_shardings=sharding)
        made.append(programs[which](key))
    return jax.tree.unflatten(treedef, made)


def decode_rate(producer: Any, context: int, new_tokens: int, burst: int,
                vocab: int) -> dict[str, Any]:
    """Fill ``context`` tokens through the exact program, then time greedy decode bursts."""
    from turbospark_jax.core import sampling

    prompt = [int(t) for t in np.random.default_rng(0).integers(0, vocab, context)]
    greedy, key = sampling.SamplingParams.greedy(), sampling.request_key(0)

    def run(prompt_ids: list[int], tokens: int) -> tuple[float, list[int]]:
        logits, state = producer.prefill_chunk(producer.init_state(), prompt_ids, 0)
        tok = int(np.argmax(np.asarray(logits)))
        history, out = sampling.History.empty(vocab), []
        t0 = time.perf_counter()
        while len(out) < tokens:
            b, state = producer.decode(state, tok, min(burst, tokens - len(out)),
                                       params=greedy, history=history, key=key,
                                       gen_index=len(out) + 1, record_logits=False)
            out += b.tokens
            tok, history = b.tokens[-1], b.history
        return time.perf_counter() - t0, out

    run(prompt[: min(context, 8)], burst)  # compile
    dt, out = run(prompt, new_tokens)
    return {"decode_s": dt, "tokens_per_s": new_tokens / dt, "first_tokens": out[:4]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.preset == "smoke":
        from turbospark_jax.engine.loop_graphs import add_xla_flag

        add_xla_flag("--xla_force_host_platform_device_count=8")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import jax
    import jax.numpy as jnp

    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel
    from turbospark_jax.parallel.sharding import ShardedProducer, tp_mesh

    devices = jax.devices()
    bandwidth = copy_bandwidth(preset.bandwidth_bytes)  # one device's
    meta = {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": devices[0].device_kind, "devices": len(devices),
            "copy_bandwidth_bytes_per_s": bandwidth}
    records: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    for shape, sizes in preset.runs:
        config = DenseConfig.from_hf_dict(shape.hf_dict())
        model = DenseModel(config, jnp.bfloat16, scan_layers=False)
        for tp in (t for t in sizes if t <= len(devices)):
            mesh = tp_mesh(devices[:tp])
            params = random_sharded_params(model, mesh)
            wb = weight_bytes(params, config)
            for ctx in preset.contexts:
                producer = ShardedProducer(
                    model, params, mesh=mesh, capacity=ctx + preset.new_tokens + preset.width,
                    width=preset.width, steps_per_call=preset.burst,
                )
                r = decode_rate(producer, ctx, preset.new_tokens, preset.burst,
                                config.vocab_size)
                roof = tp * bandwidth / (wb + kv_bytes(config, ctx))
                record = {"shape": shape.name, "tp": tp, "context": ctx, "width": preset.width,
                          "weight_bytes": wb, "roofline_tokens_per_s": roof,
                          "fraction_of_roofline": r["tokens_per_s"] / roof, **r}
                records.append(record)
                print(json.dumps(record), flush=True)
                (args.out / "tensor_parallel.json").write_text(
                    json.dumps({"meta": meta, "records": records}, indent=1))
                del producer
            del params
    print("| shape | TP | context | tokens/s | roofline | fraction |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['shape']} | {r['tp']} | {r['context']} | {r['tokens_per_s']:.1f} | "
              f"{r['roofline_tokens_per_s']:.1f} | {r['fraction_of_roofline']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
