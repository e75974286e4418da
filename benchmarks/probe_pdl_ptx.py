"""Probe: where do the compiled decode kernels wait for the kernel ahead of them?

XLA launches the kernels it compiles with programmatic dependent launch and, by its own
design, puts ``griddepcontrol.wait`` at each kernel's entry. Whether it does so for our
Pallas kernels too, and whether the wait of our own (``kernels/pdl.py``'s
``"trigger"``) is then the first one a program meets, is what this reads. It compiles a
small decode chain (a norm after partial sums, a matvec product, the gated product, another
matvec) under each mode with XLA's dump on, and reads each of our kernels' PTX: how many
``griddepcontrol.wait`` and ``launch_dependents`` it holds, and where the first of each sits
against its first global load (instruction lines from the kernel's entry).

    PYTHONPATH=. python -m benchmarks.probe_pdl_ptx --out OUT.json

Run it as its own process (it sets ``XLA_FLAGS`` before JAX starts).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

KERNEL_NAMES = ("rowinv_matvec", "row_rms_norm")


def kernel_bodies(ptx: str) -> dict[str, list[str]]:
    """Each ``.entry`` of a PTX text whose name holds one of :data:`KERNEL_NAMES`: its
    instruction lines, in order."""
    bodies: dict[str, list[str]] = {}
    for match in re.finditer(r"\.entry\s+([\w$]+)\s*\(", ptx):
        name = match.group(1)
        if not any(k in name for k in KERNEL_NAMES):
            continue
        start = ptx.find("{", match.end())
        depth, i = 0, start
        while i < len(ptx):
            depth += {"{": 1, "}": -1}.get(ptx[i], 0)
            if depth == 0:
                break
            i += 1
        lines = [ln.strip() for ln in ptx[start + 1:i].splitlines()]
        bodies[name] = [ln for ln in lines if ln and not ln.startswith(("//", ".reg", "$"))]
    return bodies


def placement(lines: list[str]) -> dict:
    """Counts and first positions of the PDL instructions and of the first global load."""
    def first(pattern: str) -> int | None:
        return next((i for i, ln in enumerate(lines) if re.search(pattern, ln)), None)

    return {"instructions": len(lines),
            "waits": sum("griddepcontrol.wait" in ln for ln in lines),
            "launch_dependents": sum("griddepcontrol.launch_dependents" in ln for ln in lines),
            "first_wait": first(r"griddepcontrol\.wait"),
            "first_launch_dependents": first(r"griddepcontrol\.launch_dependents"),
            "first_global_load": first(r"\bld\.global|\bcp\.async")}


def run_mode(mode: str) -> dict:
    """Compile the chain under ``mode`` in a child process with its own dump folder."""
    import subprocess

    dump = tempfile.mkdtemp(prefix=f"pdl_{mode}_")
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                      + f" --xla_dump_to={dump}").strip())
    code = ("import sys; from benchmarks.probe_pdl_ptx import compile_chain; "
            f"compile_chain({mode!r})")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode:
        return {"mode": mode, "error": proc.stderr[-2000:]}
    ptx_files = sorted(Path(dump).rglob("*.ptx"))
    found: dict[str, dict] = {}
    for f in ptx_files:
        for name, lines in kernel_bodies(f.read_text(errors="replace")).items():
            found[name] = placement(lines)
    # where else the instructions show (XLA may dump our kernels' IR in other files than
    # the module's PTX): each dumped file that names them, and how often
    mentions = {}
    for f in sorted(Path(dump).rglob("*")):
        if f.is_file():
            count = f.read_text(errors="replace").count("griddepcontrol")
            if count:
                mentions[f.name[:120]] = count
    return {"mode": mode, "ptx_files": len(ptx_files), "kernels": found,
            "files_naming_griddepcontrol": mentions}


def compile_chain(mode: str) -> None:
    """(In the child) run the chain once under ``mode`` so XLA compiles and dumps it."""
    import jax
    import jax.numpy as jnp

    from turbospark_jax.kernels import pdl as pallas_pdl
    from turbospark_jax.kernels import row_norm as pallas_row_norm
    from turbospark_jax.kernels import rowinv

    pallas_pdl.MODE = pallas_pdl.check_mode(mode)
    d, f = 2048, 8192
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    w = lambda k, shape: jax.random.normal(k, shape, jnp.bfloat16) / 64  # noqa: E731
    wo, gate, up, down = w(keys[0], (d, d)), w(keys[1], (d, f)), w(keys[2], (d, f)), w(
        keys[3], (f, d))
    norm_w = jnp.ones((d,), jnp.bfloat16)

    @jax.jit
    def chain(h, parts):
        h, normed = pallas_row_norm.add_parts_rms_norm(h, parts, norm_w, 1e-5)
        o = rowinv.rowinv_matmul(normed, wo, parts=True, label="o")
        h, normed = pallas_row_norm.add_parts_rms_norm(h, o, norm_w, 1e-5)
        hidden = rowinv.rowinv_swiglu(normed, gate, up)
        return h, rowinv.rowinv_matmul(hidden, down, parts=True, label="down")

    h = jnp.ones((1, d), jnp.bfloat16)
    parts = jnp.zeros((4, 1, d), jnp.float32)
    jax.block_until_ready(chain(h, parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    ap.add_argument("--modes", default="off,trigger")
    args = ap.parse_args(argv)
    import json

    records = []
    for mode in args.modes.split(","):
        rec = run_mode(mode)
        rec["date"] = time.strftime("%Y-%m-%d")
        records.append(rec)
        print(json.dumps(rec), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
