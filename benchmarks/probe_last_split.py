"""Probe: can a long context's attention fold its key splits in the last split's program?

At a long context a decode step's row-invariant attention is two launches a layer: the fused
RoPE-store and split kernel (one program per KV head, query tile and key split, each writing
its split's partial ``(acc, m, l)``) and the fold kernel (one program per KV head and query
tile, folding the partials in order). On an H200 the 1B's attention costs 238 us a token at
4k against 113 at 128, where one kernel folds on chip (docs/decisions/0010-decode-bound.md). With
``fold_in_split`` (:func:`~turbospark_jax.kernels.rope_store.rope_store_attention`,
the dense model's ``DenseModel.fold_in_split``) the split kernel's programs bump a counter
per (KV head, query tile) with an atomic add after their partial is stored; the one that
finds itself last folds that tile's partials with the fold kernel's own body
(:func:`~turbospark_jax.kernels.attention.fold_in_last_split`) and resets the
counter, which each call makes as zeros. The fold is elementwise across splits, in split
order, so the bits should be the two launches'.

For the 1B's, 0.6B's and 8B's attention shapes at 4k and 8k context this runs the model's
kernel both ways over a scan of decode steps (each writing its row into the caches it
carries, fresh queries each step), checks every step's rows and the caches bitwise (a
partial read before it was visible would show), and times a step of each.

    PYTHONPATH=. python -m benchmarks.probe_last_split --out OUT.json

``--interpret`` runs a small shape in the Pallas interpreter (the arithmetic and the
counters; its programs run one after another, so it proves nothing about visibility).
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.rowinv import add_record, best_time
from turbospark_jax.kernels import attention as pa
from turbospark_jax.kernels.layers import rope_cos_sin, rope_inv_freq
from turbospark_jax.kernels.rope_store import rope_store_attention

#: (name, query heads, KV heads, head width).
SHAPES = (("1b", 32, 8, 64), ("0.6b", 16, 8, 128), ("8b", 32, 8, 128))
CONTEXTS = (4096, 8192)
FORMS = {"two launches": False, "last split": True}


@functools.partial(jax.jit, static_argnames=("heads", "form", "interpret"))
def chain(qkv: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
          k: jax.Array, v: jax.Array, *, heads: int, form: str,
          interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Every step's rows ``[steps, 1, H, hd]`` (step ``i``: projection ``qkv[i]`` at
    ``positions[i]``, its key and value rows written into the caches) and the caches after
    the last step."""
    def body(caches, x):
        row, c, s, pos = x
        out, k, v = rope_store_attention(row, c, s, pos, *caches, pos, heads,
                                         interpret=interpret, fold_in_split=FORMS[form])
        return (k, v), out

    (k, v), outs = jax.lax.scan(body, (k, v), (qkv, cos, sin, positions))
    return outs, k, v


def _inputs(seed: int, steps: int, heads: int, kv_heads: int, head_dim: int, capacity: int,
            context: int) -> tuple[jax.Array, ...]:
    """A decode's steps from ``context - 1`` on: each step's q/k/v projection, rotary
    tables and position, and caches filled with keys and values."""
    rng = np.random.default_rng(seed)
    bf16 = jnp.bfloat16
    qkv = rng.standard_normal((steps, 1, (heads + 2 * kv_heads) * head_dim))
    positions = (context - 1 + np.arange(steps, dtype=np.int32))[:, None]
    inv, scale = rope_inv_freq(head_dim, 10000.0, None, capacity)
    cos, sin = jax.vmap(lambda p: rope_cos_sin(p, inv, scale, bf16))(jnp.asarray(positions))
    k = rng.standard_normal((capacity, kv_heads, head_dim))
    v = rng.standard_normal((capacity, kv_heads, head_dim))
    return (jnp.asarray(qkv, bf16), cos, sin, jnp.asarray(positions), jnp.asarray(k, bf16),
            jnp.asarray(v, bf16))


def _bits(a: jax.Array) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def probe(shapes: tuple, contexts: tuple, steps: int, repeats: int, seeds: int,
          interpret: bool, out: Path | None = None) -> list[dict]:
    """Each shape and context's bits (the last split's fold against the two launches) and
    step times, each record printed and written to ``out`` as it comes."""
    records = []
    for name, heads, kv_heads, head_dim in shapes:
        for context in contexts:
            capacity = context + max(steps, 192)
            rec: dict[str, Any] = {"shape": name, "context": context, "capacity": capacity,
                                   "steps": steps}
            rows = heads // kv_heads
            if pa.folds_on_chip(rows, capacity, pa.tiles_for(rows, head_dim)):
                rec["skipped"] = "one kernel folds this context on chip already"
                add_record(out, records, rec, date=time.strftime("%Y-%m-%d"))
                continue
            run = functools.partial(chain, heads=heads, interpret=interpret)
            equal = []
            for seed in range(seeds):
                args = _inputs(seed, steps, heads, kv_heads, head_dim, capacity, context)
                want, got = (run(*args, form=f) for f in FORMS)
                equal.append(all(np.array_equal(_bits(g), _bits(w))
                                 for g, w in zip(got, want, strict=True)))
            rec["bits_equal"] = all(equal)
            # control: a key every row sees, changed, shows in the rows
            args = _inputs(0, steps, heads, kv_heads, head_dim, capacity, context)
            want = run(*args, form="two launches")[0]
            moved = run(*args[:4], args[4].at[3].multiply(4), args[5], form="last split")[0]
            rec["control_differs"] = not np.array_equal(_bits(want), _bits(moved))
            if not interpret:
                for form in FORMS:
                    s = best_time(functools.partial(run, form=form), *args, repeats=repeats)
                    rec[f"us_per_step: {form}"] = round(s / steps * 1e6, 2)
            add_record(out, records, rec, date=time.strftime("%Y-%m-%d"))
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    ap.add_argument("--steps", type=int, default=128, help="decode steps a timed call")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls a case (best kept)")
    ap.add_argument("--seeds", type=int, default=2, help="input draws for the bit checks")
    ap.add_argument("--interpret", action="store_true",
                    help="the Pallas interpreter (small shapes, no timing)")
    args = ap.parse_args(argv)
    if args.interpret:
        shapes, contexts, steps = (("small", 4, 2, 16),), (1100,), min(args.steps, 2)
    else:
        shapes, contexts, steps = SHAPES, CONTEXTS, args.steps
    records = probe(shapes, contexts, steps, args.repeats, args.seeds, args.interpret,
                    args.out)
    checked = [r for r in records if "skipped" not in r]
    ok = bool(checked) and all(r["bits_equal"] and r["control_differs"] for r in checked)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
