"""One gated DeltaNet layer of the Qwen3.5 shapes (bf16, random weights) with its rows walked by
the Pallas kernel against the XLA row loop it replaces on a GPU: how close the two are, and
what one call of the layer costs for 1 and W live rows.

    PYTHONPATH=. python -m benchmarks.delta_rule_kernel [--out FILE]
    PYTHONPATH=. python -m benchmarks.delta_rule_kernel --shapes tiny --kernel interpret  # CPU

One JSON line per shape and live count: the largest difference between the two per output
leaf (layer output, conv state, recurrent state, conv tape, recurrent tape) and microseconds
per call of each.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q

#: (hidden size, key heads, value heads, key dim, value dim) of a DeltaNet layer: the
#: published shapes', and a tiny one for a run on the CPU.
SHAPES = {"qwen3.5-0.8b": (1024, 16, 16, 128, 128), "qwen3.5-4b": (2560, 16, 32, 128, 128),
          "tiny": (32, 2, 4, 16, 16)}


def _timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeats


def _layer(shape: tuple[int, ...], walk: str):
    """One DeltaNet layer of the shape, jitted: ``(params, h, state, live, tape) -> (out,
    state, tape)`` with the model's own code, its rows walked by ``walk``: ``"pallas"`` (the
    kernel, as a GPU runs it), ``"interpret"`` (the kernel in the Pallas interpreter) or
    ``"xla"`` (the XLA loop). The tape is not donated, so each call also copies it (the block
    program writes it in place)."""
    hidden, key_heads, value_heads, dk, dv = shape
    config = QC.Qwen35Config(
        vocab_size=16, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, head_dim=16, linear_key_head_dim=dk,
        linear_value_head_dim=dv, linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads, layer_types=(QC.LINEAR,))
    model = Q.Qwen35Model(config, dtype=jnp.bfloat16)
    if walk == "xla":
        model = model.for_mesh()
    elif walk == "interpret":
        model = model.interpreted()
    elif jax.default_backend() != "gpu":
        raise SystemExit("the compiled kernel runs on a GPU; --kernel interpret runs it here")
    return model, jax.jit(lambda lp, h, state, live, tape: model._delta_net(
        lp, h, state, live, tape))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--shapes", default="qwen3.5-0.8b,qwen3.5-4b")
    ap.add_argument("--kernel", choices=("pallas", "interpret"), default="pallas")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    w, records = args.width, []
    for name in args.shapes.split(","):
        hidden, _, value_heads, dk, dv = SHAPES[name]
        model, kernel = _layer(SHAPES[name], args.kernel)
        _, loop = _layer(SHAPES[name], "xla")
        lp = model.init_params(jax.random.PRNGKey(0))["layers"][0]
        h = jax.random.normal(jax.random.PRNGKey(1), (w, hidden), jnp.bfloat16)
        state = model._zero_states()[0]
        state = (state[0], jax.random.normal(jax.random.PRNGKey(2), state[1].shape) * 0.1)
        tape = jnp.zeros((model.tape_rows(), *state[1].shape), jnp.float32)
        for live in (1, w):
            n = jnp.int32(live)
            got, want = kernel(lp, h, state, n, tape), loop(lp, h, state, n, tape)
            diff = [float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
                    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
            t_kernel = _timed(kernel, lp, h, state, n, tape, repeats=args.repeats)
            t_loop = _timed(loop, lp, h, state, n, tape, repeats=args.repeats)
            rec = dict(shape=name, width=w, live=live, max_diff_leaves=diff,
                       layer_us_kernel=1e6 * t_kernel, layer_us_xla_loop=1e6 * t_loop,
                       kernel=args.kernel, state_mib=value_heads * dk * dv * 4 / 2**20,
                       device=str(jax.devices()[0]))
            print(json.dumps(rec), flush=True)
            records.append(rec)
    if args.out:
        args.out.write_text(json.dumps(records, indent=1) + "\n")
    return records


if __name__ == "__main__":
    main()
