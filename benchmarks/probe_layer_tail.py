"""Probe: the persistent layer tail (one kernel) against the four kernels it replaces, on a GPU.

``turbospark_jax.models.pallas_layer_tail`` runs a decode step's work after the attention
(the o product, the residual add and post-attention norm, the gated and down products) as
one launch whose programs meet at grid-wide barriers. For each model shape (one layer's
weights of the 1B, 0.6B and 8B shapes, random) this checks and times it against the four
kernels a decode step runs today (the o matvec's partial sums, the norm kernel with the tree
sum, the gated matvec, the down matvec's partial sums):

* **bits**: ``h`` and the down product's partial sums bitwise equal at 1 and 4 rows, with
  the kernel at the multiprocessor count of programs and at an odd count below it (which
  programs take which column blocks changes no bit), and a control (one weight changed)
  that differs;
* **time**: each form (:data:`FORMS`: the four kernels, the tail kernel, with one program
  norming, with the next phases' first weight tiles loaded before each barrier, with more
  warps or stages) over a chain of up to :data:`CHAIN_LAYERS` of the shape's layers (each
  its own weights, streamed from memory as a decode step reads them; each layer's input
  norm kernel before its tail in every form, as the model runs it), in a device loop of
  :data:`STEPS` chains: the time a layer, what it saves against the four kernels, and the
  weights' bandwidth.

    PYTHONPATH=. python -m benchmarks.probe_layer_tail --out OUT.json

The kernel's programs wait for each other, so it cannot run in the Pallas interpreter with
more than one; ``tests/test_pallas_layer_tail.py`` checks its arithmetic there (one program)
and that it lowers for CUDA.
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
from turbospark_jax.models import pallas_layer_tail, rowinv
from turbospark_jax.models.pallas_row_norm import add_parts_rms_norm

#: (name, layers, D, K_o, F): the three shapes' layer tails.
SHAPES = (("llama-3.2-1b", 16, 2048, 2048, 8192), ("qwen3-0.6b", 28, 1024, 2048, 3072),
          ("llama-3.1-8b", 32, 4096, 4096, 14336))
EPS = 1e-5
#: The forms timed (the tail kernel's settings): today's kernels, the tail kernel, the tail
#: polling its barriers with volatile loads instead of atomic adds, loading its next phases'
#: first weight tiles ahead (with more warps to hold more of them), with one program
#: norming.
FORMS = {"four kernels": None, "persistent tail": {},
         "persistent tail, load spin": {"spin": "load"},
         "persistent tail, load spin, 2 tiles ahead": {"spin": "load", "ahead": 2},
         "persistent tail, load spin, 4 tiles ahead": {"spin": "load", "ahead": 4},
         "persistent tail, load spin, 4 tiles ahead, 8 warps": {"spin": "load", "ahead": 4,
                                                                "triton": (8, 4)},
         "persistent tail, load spin, shared norm": {"spin": "load", "shared_norm": True},
         "persistent tail, 2 tiles ahead": {"ahead": 2}}
#: Layers a chain runs at most (each its own weights: 4 of the smallest shape's are 92 MB,
#: past the 50 MB L2 cache, so every layer streams its weights from memory), fewer than a
#: model's to keep the compiles short (each layer's kernel compiles on its own: a form of 8
#: layers took 60-90 s on an H100).
CHAIN_LAYERS = 4
#: Chains a timed call runs, one after another in a device loop.
STEPS = 8


def layer_weights(key: jax.Array, d: int, k_o: int, f: int) -> dict:
    """One layer's bfloat16 weights, random (scaled by 1/sqrt(K)), norm weights near 1."""
    ks = jax.random.split(key, 6)

    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])).astype(
            jnp.bfloat16)

    return {"w_o": w(ks[0], (k_o, d)), "gate": w(ks[1], (d, f)), "up": w(ks[2], (d, f)),
            "down": w(ks[3], (f, d)),
            "post": (1 + 0.1 * jax.random.normal(ks[4], (d,))).astype(jnp.bfloat16),
            "input": (1 + 0.1 * jax.random.normal(ks[5], (d,))).astype(jnp.bfloat16)}


def four_kernels(attn: jax.Array, h: jax.Array, lw: dict) -> tuple[jax.Array, jax.Array]:
    """The tail as a decode step runs it today: ``(h, down partial sums)``."""
    k_o, d = lw["w_o"].shape
    f = lw["gate"].shape[1]
    o = rowinv.rowinv_matmul(attn, lw["w_o"], parts=True, schedule=rowinv.schedule_for(k_o, d),
                             label="o")
    h, normed = add_parts_rms_norm(h, o, lw["post"], EPS, tree=True)
    hidden = rowinv.rowinv_swiglu(normed, lw["gate"], lw["up"])
    parts = rowinv.rowinv_matmul(hidden, lw["down"], parts=True,
                                 schedule=rowinv.schedule_for(f, d), label="down")
    return h, parts


def tail_kernel(attn: jax.Array, h: jax.Array, lw: dict, count: Any = None,
                programs: int | None = None, shared_norm: bool = False,
                ahead: int = 0, triton: tuple[int, int] = (pallas_layer_tail.WARPS,
                                                           pallas_layer_tail.STAGES),
                spin: str = "atomic") -> tuple[jax.Array, jax.Array, jax.Array]:
    return pallas_layer_tail.layer_tail(attn, h, lw["w_o"], lw["post"], lw["gate"], lw["up"],
                                        lw["down"], EPS, count=count, programs=programs,
                                        shared_norm=shared_norm, ahead=ahead, triton=triton,
                                        spin=spin)


def chain(form: str, layers: list[dict], steps: int) -> Any:
    """``steps`` passes over the layers in a device loop: each layer's input norm kernel
    (adding the layer before's partial sums), then its tail in ``form``."""
    def one_pass(h: jax.Array, parts: jax.Array, attn: jax.Array) -> tuple:
        count = None
        for lw in layers:
            h, _ = add_parts_rms_norm(h, parts, lw["input"], EPS)
            if form == "four kernels":
                h, parts = four_kernels(attn, h, lw)
            else:
                h, parts, count = tail_kernel(attn, h, lw, count, **FORMS[form])
        return h, parts

    def run(h: jax.Array, parts: jax.Array, attn: jax.Array) -> tuple:
        return jax.lax.fori_loop(0, steps, lambda i, c: one_pass(*c, attn), (h, parts))

    return jax.jit(run)


def _bits(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _equal(a: tuple, b: tuple) -> bool:
    return all(np.array_equal(_bits(x), _bits(y)) for x, y in zip(a, b, strict=True))


def probe(shapes: tuple, repeats: int, out: Path | None, forms: tuple = tuple(FORMS),
          ) -> list[dict]:
    records: list[dict] = []
    sms = pallas_layer_tail.multiprocessors()
    for name, model_layers, d, k_o, f in shapes:
        n_layers = min(model_layers, CHAIN_LAYERS)
        rec: dict[str, Any] = {"shape": name, "layers": n_layers, "D": d, "K_o": k_o, "F": f,
                               "multiprocessors": sms}
        keys = jax.random.split(jax.random.PRNGKey(0), n_layers + 1)
        layers = [layer_weights(k, d, k_o, f) for k in keys[1:]]
        plan = pallas_layer_tail.plan(k_o, d, f, sms)
        rec["items_o_gated_down"] = [plan.o.items, plan.gated.items, plan.down.items]
        rec["block_widths_o_gated_down"] = [plan.o.bn, plan.gated.bn, plan.down.bn]
        lw = layers[0]
        for rows in (1, 4):
            r = np.random.default_rng(rows)
            attn = jnp.asarray(r.standard_normal((rows, k_o)), jnp.bfloat16)
            h = jnp.asarray(r.standard_normal((rows, d)), jnp.bfloat16)
            want = jax.jit(four_kernels)(attn, h, lw)
            for programs, settings in ((sms // 2 + 1, {}),
                                       *((sms, FORMS[f]) for f in forms if FORMS[f] is not None)):
                got = jax.jit(functools.partial(tail_kernel, programs=programs,
                                                **settings))(attn, h, lw)
                tag = f"rows{rows}_programs{programs}" + "".join(
                    f"_{k}_{v}".replace(" ", "") for k, v in settings.items())
                rec[f"bits_equal_{tag}"] = _equal(got[:2], want)
                rec[f"counter_back_to_zero_{tag}"] = int(got[2][0]) == 0
            moved = dict(lw, down=lw["down"].at[0, 0].multiply(3))
            rec[f"control_differs_rows{rows}"] = not _equal(jax.jit(four_kernels)(attn, h, moved),
                                                            want)
        attn = jnp.asarray(np.random.default_rng(0).standard_normal((1, k_o)), jnp.bfloat16)
        h = jnp.zeros((1, d), jnp.bfloat16).at[0].set(1)
        parts = jnp.zeros((plan.down.segments, 1, d), jnp.float32)
        weight_bytes = sum(a.size * 2 for a in jax.tree.leaves(layers))
        meta = {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0].device_kind)}
        add_record(out, records, rec, **meta)  # the bits first: a time limit keeps them
        base = None
        for form in ("four kernels", *(f for f in forms if f != "four kernels")):
            t = best_time(chain(form, layers, STEPS), h, parts, attn, repeats=repeats) / STEPS
            us = t / n_layers * 1e6
            base = us if base is None else base
            add_record(out, records, {
                "shape": name, "form": form, "us_per_layer": round(us, 2),
                "us_saved_per_layer": round(base - us, 2),
                "weights_TBps": round(weight_bytes / t / 1e12, 2)}, **meta)
        del layers
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls a shape (best kept)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                    help="comma-separated shapes of " + ", ".join(s[0] for s in SHAPES))
    ap.add_argument("--forms", default=";".join(FORMS),
                    help="forms to time, separated by semicolons (the four kernels always, first): "
                         + "; ".join(FORMS))
    args = ap.parse_args(argv)
    forms = tuple(f.strip() for f in args.forms.split(";") if f.strip())
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        ap.error(f"no such form: {unknown} (the forms: {list(FORMS)})")
    if jax.default_backend() != "gpu":
        ap.error("the persistent kernel needs a GPU (its programs wait for each other)")
    chosen = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    records = probe(tuple(chosen), args.repeats, args.out, forms)
    ok = all(all(v for k, v in r.items() if k.startswith(("bits_equal", "counter_back",
                                                          "control_differs")))
             for r in records if "form" not in r)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
