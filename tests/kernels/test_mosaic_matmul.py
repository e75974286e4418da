"""The Mosaic GPU matrix kernel (kernels/mosaic_matmul.py) behind ``rowinv_matmul``.

On a Hopper GPU (``JAX_PLATFORMS=cuda python -m pytest tests/kernels/test_mosaic_matmul.py``): its
rows are bitwise the Triton kernels' (matmul and matvec) under the same schedule, for any
row count, several segments or one, float32 or rounded, weights side by side; the gated
product through it agrees with the gated matvec kernel a decode step runs; and a product on
another schedule differs (the control). Off such a GPU: what it refuses and when
``kernel="auto"`` takes it. (``tests/kernels/test_gpu_lowering.py`` lowers it for CUDA on the CPU.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import rowinv
from turbospark_jax.kernels.mosaic_matmul import MosaicTiles, mosaic_matmul
from turbospark_jax.kernels.rowinv import Schedule, Tiles, rowinv_matmul, rowinv_swiglu

HOPPER = rowinv._hopper()
on_hopper = pytest.mark.skipif(not HOPPER, reason="the Mosaic kernel runs on a Hopper GPU")
ROWS = 300  # not a multiple of the kernel's 128-row tile
TILINGS = {"default": MosaicTiles(), "64x128 rows": MosaicTiles(wg_rows=64, wg_cols=128,
                                                                split="rows", stages=3)}


@functools.cache
def _operands(k: int, widths: tuple[int, ...], rows: int = ROWS, dtype=jnp.bfloat16):
    rng = np.random.default_rng(k + sum(widths))
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    ws = tuple(jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype) for n in widths)
    return x, ws


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


#: K of one segment (4 tiles), of 3 segments (12 tiles), of 4 long ones (the 1B's down).
SHAPES = [(512, (256,)), (1536, (384, 128)), (8192, (256,))]


@on_hopper
@pytest.mark.parametrize(("k", "widths"), SHAPES)
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
@pytest.mark.parametrize("tiling", sorted(TILINGS))
def test_rows_are_the_triton_kernels_bits(k, widths, out, tiling):
    x, ws = _operands(k, widths)
    schedule = rowinv.schedule_for(k, sum(widths))
    common = dict(out_dtype=jnp.dtype(out), impl="pallas", schedule=schedule)
    mosaic = _bits(rowinv_matmul(x, ws, kernel="mosaic",
                                 tiles=Tiles(mosaic=TILINGS[tiling]), **common))
    assert np.array_equal(mosaic, _bits(rowinv_matmul(x, ws, kernel="matmul", **common)))
    # a decode step's rows, from the matvec kernel, and the rows of a narrower call
    assert np.array_equal(_bits(rowinv_matmul(x[5:9], ws, kernel="matvec", **common)),
                          mosaic[5:9])
    assert np.array_equal(_bits(rowinv_matmul(x[:256], ws, kernel="mosaic", **common)),
                          mosaic[:256])


@on_hopper
def test_control_another_schedule_changes_rows():
    """The check above can fail: the same product on segments of two tiles, not four."""
    x, ws = _operands(1536, (384, 128))
    common = dict(out_dtype=jnp.float32, impl="pallas", kernel="mosaic")
    mine = _bits(rowinv_matmul(x, ws, schedule=rowinv.schedule_for(1536, 512), **common))
    other = _bits(rowinv_matmul(x, ws, schedule=Schedule(segment_tiles=2), **common))
    assert not np.array_equal(mine, other)


@on_hopper
def test_gated_rows_are_the_gated_matvec_kernels_bits():
    x, (gate, up) = _operands(1024, (384, 384))
    wide = _bits(rowinv_swiglu(x, gate, up, impl="pallas", kernel="mosaic"))
    assert np.array_equal(wide, _bits(rowinv_swiglu(x, gate, up, impl="pallas",
                                                    kernel="matmul")))
    for at in (0, 17, 299):
        row = rowinv_swiglu(x[at:at + 1], gate, up, impl="pallas", kernel="matvec")
        assert np.array_equal(_bits(row)[0], wide[at]), at


@on_hopper
def test_gating_in_the_epilogue_keeps_the_gated_kernels_bits():
    """The gated product with SwiGLU's gating in the Mosaic kernel's epilogue: every row as
    the gated matvec kernel (a decode step) and the gated Triton matmul kernel give it; a K
    of 3,072 as the 0.6B's down input is not (the gate's K), so 1,024 and 2,048 here."""
    for k, f in ((1024, 384), (2048, 1024)):
        x, (gate, up) = _operands(k, (f, f))
        wide = _bits(rowinv_swiglu(x, gate, up, impl="pallas", kernel="mosaic"))
        assert np.array_equal(wide, _bits(rowinv_swiglu(x, gate, up, impl="pallas",
                                                        kernel="matmul")))
        for at in (0, 17, 299):
            row = rowinv_swiglu(x[at:at + 1], gate, up, impl="pallas", kernel="matvec")
            assert np.array_equal(_bits(row)[0], wide[at]), (k, at)


@on_hopper
def test_auto_takes_the_mosaic_kernel_for_many_rows():
    x, ws = _operands(512, (256,), rows=512)
    auto = jax.jit(lambda x, w: rowinv_matmul(x, w, impl="pallas")).lower(x, ws[0]).as_text()
    assert "rowinv_mosaic" in auto
    few = jax.jit(lambda x, w: rowinv_matmul(x, w, impl="pallas")).lower(x[:64], ws[0])
    assert "rowinv_mosaic" not in few.as_text()


def test_refusals_name_the_problem():
    x, ws = _operands(512, (256,), rows=8)
    with pytest.raises(BadInputError, match="Hopper GPU only"):
        rowinv_matmul(x, ws, impl="interpret", kernel="mosaic")
    with pytest.raises(BadInputError, match="Hopper GPU only"):
        rowinv_swiglu(x, ws[0], ws[0], impl="xla", kernel="mosaic")
    # past the platform check: what the kernel itself cannot take
    call = functools.partial(rowinv._rowinv_matmul, nk=False, impl="pallas", kernel="mosaic",
                             schedule=Schedule(), tiles=Tiles())
    x32, w32 = _operands(512, (256,), rows=8, dtype=jnp.float32)
    with pytest.raises(BadInputError, match="float32 operands"):
        call(x32, w32, out_dtype=jnp.dtype(jnp.float32))
    with pytest.raises(BadInputError, match="multiple of 128"):
        call(x, (ws[0][:, :200],), out_dtype=jnp.dtype(jnp.bfloat16))
    with pytest.raises(BadInputError, match=r"\[N, K\]"):
        rowinv._rowinv_matmul(x, (ws[0].T,), True, jnp.dtype(jnp.bfloat16), "pallas", "mosaic",
                              Schedule(), Tiles())
    with pytest.raises(BadInputError, match="no Mosaic tiling"):
        call(x, ws, out_dtype=jnp.dtype(jnp.bfloat16), tiles=Tiles(mosaic=None))
    with pytest.raises(BadInputError, match="128 x 64"):
        MosaicTiles(wg_rows=128, wg_cols=128)
    with pytest.raises(BadInputError, match="'rows' or 'cols'"):
        MosaicTiles(split="k")
    with pytest.raises(BadInputError, match="M % 128"):
        mosaic_matmul(x, ws, seg_cols=512, out_dtype=jnp.bfloat16)


def test_auto_keeps_the_triton_kernels_off_hopper(monkeypatch):
    """``kernel="auto"`` takes the Mosaic kernel only on a Hopper GPU, from
    ``MOSAIC_MIN_ROWS`` rows, for operands it fits."""
    x, _ = _operands(512, (256,), rows=rowinv.MOSAIC_MIN_ROWS)
    tiles = Tiles()
    monkeypatch.setattr(rowinv, "_hopper", lambda: False)
    assert not rowinv._use_mosaic("auto", x, (256,), False, tiles)
    monkeypatch.setattr(rowinv, "_hopper", lambda: True)
    assert rowinv._use_mosaic("auto", x, (256,), False, tiles)
    assert not rowinv._use_mosaic("auto", x[:-1], (256,), False, tiles)
    assert not rowinv._use_mosaic("auto", x, (200,), False, tiles)
    assert not rowinv._use_mosaic("auto", x, (256,), True, tiles)
    assert not rowinv._use_mosaic("auto", x, (256,), False, Tiles(mosaic=None))
    assert not rowinv._use_mosaic("matmul", x, (256,), False, tiles)
