"""Programmatic dependent launch inside the decode kernels (``kernels/pdl.py``).

Off a GPU: the compiled kernels lower for CUDA with the instructions in them (and without
them when the helpers are stubbed out, the comparison's baseline), and the interpreter never
takes them. On a GPU (``JAX_PLATFORMS=cuda python -m pytest tests/kernels/test_pdl.py``): the
matvec, gated and norm kernels give bitwise what they give without the instructions, at 1
and 16 rows, and a changed weight still changes them (the control)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.kernels import pdl as pallas_pdl
from turbospark_jax.kernels import row_norm as pallas_row_norm
from turbospark_jax.kernels import rowinv
from turbospark_jax.kernels.rowinv import Schedule, Tiles
from turbospark_jax.testing.cuda_export import cuda_text

BF16 = jnp.bfloat16
S = jax.ShapeDtypeStruct
ON_GPU = jax.default_backend() == "gpu"


def _matvec(x, ws, nk=False):
    return rowinv._rowinv_matmul(x, ws, nk, jnp.dtype(jnp.float32), "pallas", "auto",
                                 Schedule(), Tiles())


def _gated(x, g, u):
    return rowinv._rowinv_swiglu(x, g, u, "pallas", "auto", Tiles(), "gate_up")


def _norm(r, p, w):
    return pallas_row_norm._add_parts_rms_norm(r, p, w, 1e-5, "pallas")


KERNELS = {
    "matvec, two weights": (lambda x, a, b: _matvec(x, (a, b)), S((1, 1024), BF16),
                            S((1024, 384), BF16), S((1024, 128), BF16)),
    "matvec, [N, K] weight": (lambda x, w: _matvec(x, (w,), True), S((1, 256), BF16),
                              S((1000, 256), BF16)),
    "gated matvec": (_gated, S((3, 256), BF16), S((256, 384), BF16), S((256, 384), BF16)),
    "norm after partial sums": (_norm, S((1, 256), BF16), S((4, 1, 256), jnp.float32),
                                S((256,), BF16)),
}


def _without_pdl(monkeypatch) -> None:
    """The helpers stubbed to give nothing: the kernels as they read without the
    instructions (a baseline for the tests, not a mode of the library)."""
    monkeypatch.setattr(pallas_pdl, "start", lambda on: None)
    monkeypatch.setattr(pallas_pdl, "ready", lambda started: None)


@pytest.mark.parametrize("pdl", [True, False], ids=["with", "without"])
@pytest.mark.parametrize("name", KERNELS)
def test_the_compiled_kernels_lower_with_the_instructions(name, pdl, monkeypatch):
    fn, *args = KERNELS[name]
    if not pdl:
        _without_pdl(monkeypatch)
    jax.clear_caches()  # a kernel is traced for the helpers it meets
    text = cuda_text(fn, *args)
    jax.clear_caches()
    assert "xla.gpu.triton" in text
    # (the Triton IR travels serialised: look for the instruction's name in its bytes)
    assert ("griddepcontrol" in text) == pdl


def test_the_interpreter_never_takes_the_instructions():
    assert pallas_pdl.start(False) is None and pallas_pdl.ready(None) is None
    live = jnp.ones((2, 3), bool)
    assert pallas_pdl.masked(live, None, (2, 3)) is live


def _run(fn, args, pdl, monkeypatch):
    with monkeypatch.context() as patch:
        if not pdl:
            _without_pdl(patch)
        jax.clear_caches()
        out = jax.jit(fn)(*args)
        jax.clear_caches()
    return [np.asarray(o) for o in jax.tree.leaves(out)]


def _values(rows: int, name: str) -> tuple:
    _, *shapes = KERNELS[name]
    rng = np.random.default_rng(rows)
    vals = []
    for i, s in enumerate(shapes):
        shape = (rows, *s.shape[1:]) if i == 0 else s.shape
        if len(shape) == 3:  # partial sums [S, M, D]
            shape = (shape[0], rows, shape[2])
        vals.append(jnp.asarray(rng.standard_normal(shape), s.dtype))
    return tuple(vals)


@pytest.mark.skipif(not ON_GPU, reason="the instructions run on a Hopper GPU")
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("name", KERNELS)
def test_the_instructions_keep_every_bit(name, rows, monkeypatch):
    """The kernels with the instructions give bitwise their output without them; a changed
    weight (the control, with them) still changes it."""
    fn = KERNELS[name][0]
    args = _values(rows, name)
    want = _run(fn, args, False, monkeypatch)
    got = _run(fn, args, True, monkeypatch)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8))
    moved = (args[0], *(a.at[(0,) * a.ndim].multiply(3) for a in args[1:]))
    control = _run(fn, moved, True, monkeypatch)
    assert any(not np.array_equal(c, w) for c, w in zip(control, want, strict=True))
