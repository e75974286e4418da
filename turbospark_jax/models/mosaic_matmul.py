"""Row-invariant matrix products on Hopper's tensor cores, through Pallas' Mosaic GPU backend.

The exact prefill's products ran on our Triton matrix kernel (``rowinv._matmul``) at about
half of cuBLAS's rate on an H100. This kernel keeps that kernel's arithmetic and changes how
the operands reach the tensor cores: a warp-specialised pipeline (one warpgroup issues TMA
loads into a ring of shared-memory stages; two compute warpgroups issue ``wgmma``), over a
persistent grid of one program per multiprocessor.

The arithmetic is :class:`rowinv.Schedule`'s: each segment of K is summed from zero by one
chain of tensor-core steps in K order, and the segments' sums are folded in order into a
float32 total that starts at ``-0.0``; the total is rounded once to the output dtype. Our
Triton kernels do the same, so a row's bits do not depend on which kernel computed it, nor
on the rows beside it (checked on the GPU: ``tests/test_mosaic_matmul.py``;
``benchmarks/probe_mosaic_matmul.py`` showed JAX's own example kernel agreeing with ours at
one segment and, called once a segment with the running total as its addend, at many).

The running total lives in registers beside the segment's accumulator, so a warpgroup's tile
is at most 128 x 64 float32 of each (64 + 64 registers a thread).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from turbospark_jax.errors import BadInputError


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """The kernel's tiling; speed only, never a bit of the result.

    Attributes:
      wg_rows, wg_cols: one compute warpgroup's output tile (its accumulator and its total
        are each ``wg_rows * wg_cols / 128`` float32 registers a thread).
      split: the two compute warpgroups' tiles side by side along ``"cols"`` or ``"rows"``.
      k_step: K columns a pipeline stage holds (64 bfloat16: one 128-byte swizzle row).
      stages: pipeline stages in shared memory (five: the fastest of four and five at the
        1B and 8B shapes' prefill products on an H100, ``benchmarks/probe_mosaic_rowinv.py``).
      minor: the persistent grid walks output tiles along ``"rows"`` or ``"cols"`` first,
      band: in bands of this many tiles (a snake), so neighbours share operands in L2.
      gate_in_epilogue: the gated product gates in the kernel's epilogue
        (:func:`mosaic_gated`) instead of writing both products for a Triton gating kernel.
        Off until its bits are checked on a GPU (``tests/test_mosaic_matmul.py``): the
        elementwise probe found Mosaic's SiLU and gating bitwise Triton's, but the fused
        kernel itself has not run yet.
    """

    wg_rows: int = 128
    wg_cols: int = 64
    split: str = "cols"
    k_step: int = 64
    stages: int = 5
    minor: str = "rows"
    band: int = 8
    gate_in_epilogue: bool = False

    def __post_init__(self) -> None:
        if self.split not in ("cols", "rows") or self.minor not in ("cols", "rows"):
            raise BadInputError(f"split and minor must be 'rows' or 'cols'; got {self.split!r}, "
                                f"{self.minor!r}")
        if self.wg_rows % 64 or self.wg_cols % 64 or self.wg_rows * self.wg_cols > 128 * 64:
            raise BadInputError(f"a warpgroup's tile must be multiples of 64 of at most "
                                f"128 x 64 elements; got {self.wg_rows} x {self.wg_cols}")

    @property
    def block(self) -> tuple[int, int]:
        """A program's output tile: the two warpgroups' tiles side by side."""
        return (self.wg_rows * (2 if self.split == "rows" else 1),
                self.wg_cols * (2 if self.split == "cols" else 1))


#: The epilogue writes the output through shared memory in tiles of this size.
EPILOGUE_TILE = 64


def _swizzled(plgpu: Any, cols: int, dtype: Any) -> tuple[Any, ...]:
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _store(out: jax.Array, out_smem: Any, o_gmem: Any) -> None:
    """A warpgroup's finished tile ``out`` to its place ``o_gmem`` in the output, through its
    two shared-memory slots ``out_smem`` in tiles of :data:`EPILOGUE_TILE` (each copy issued
    once the slot's previous one has left)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    epi = EPILOGUE_TILE
    rows, cols = out.shape
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for i in range(rows // epi):
        for j in range(cols // epi):
            slot = (i * (cols // epi) + j) % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_smem[slot] = out[i * epi:(i + 1) * epi, j * epi:(j + 1) * epi]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[slot],
                                    o_gmem.at[pl.ds(i * epi, epi), pl.ds(j * epi, epi)])


def _kernel(x_gmem: Any, *refs: Any, t: MosaicTiles, seg_steps: int,
            offsets: tuple[int, ...]) -> None:
    """One program per multiprocessor, walking output tiles; weight ``i`` owns column tiles
    ``offsets[i]`` up to ``offsets[i + 1]`` of the output."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    *w_gmems, o_gmem = refs
    m, k = x_gmem.shape
    bm, bn = t.block
    m_tiles, n_tiles, steps = m // bm, offsets[-1], k // t.k_step
    in_transforms = _swizzled(plgpu, t.k_step, x_gmem.dtype)
    epi = EPILOGUE_TILE
    out_dtype = o_gmem.dtype

    def pipeline(body: Any, context: Any) -> Any:
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=t.stages, compute_context=context,
            in_specs=[
                plgpu.BlockSpec((bm, t.k_step), lambda s: (0, s), transforms=in_transforms,
                                memory_space=plgpu.SMEM),
                plgpu.BlockSpec((t.k_step, bn), lambda s: (s, 0), transforms=in_transforms,
                                memory_space=plgpu.SMEM),
            ])

    unused = lambda *_, **__: None  # noqa: E731  (the allocations ignore the bodies)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(unused, unused).get_allocations(x_gmem, w_gmems[0]),
        out_smem=plgpu.SMEM((2, 2, epi, epi), out_dtype,
                            transforms=_swizzled(plgpu, epi, out_dtype)),
        collective_axes="wg",
    )
    def _scope(allocations: Any, out_smem: Any) -> None:
        wg = jax.lax.axis_index("wg")
        if t.split == "rows":
            wg_m, wg_n = pl.ds(wg * t.wg_rows, t.wg_rows), slice(None)
        else:
            wg_m, wg_n = slice(None), pl.ds(wg * t.wg_cols, t.wg_cols)

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tile(info: Any) -> None:
            (at,) = info.index
            mi, ni = plgpu.planar_snake(at, (m_tiles, n_tiles), 0 if t.minor == "rows" else 1,
                                        t.band)
            rows, cols = pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)

            def fresh() -> jax.Array:
                return plgpu.layout_cast(jnp.zeros((t.wg_rows, t.wg_cols), jnp.float32),
                                         plgpu.Layout.WGMMA)

            def context(run: Any) -> None:
                start = plgpu.layout_cast(jnp.full((t.wg_rows, t.wg_cols), -0.0, jnp.float32),
                                          plgpu.Layout.WGMMA)
                acc, total = run((fresh(), start))
                if seg_steps == steps:  # one segment: nothing folded in the loop
                    total = total + acc
                _store(total.astype(out_dtype), out_smem.at[wg],
                       o_gmem.at[rows, cols].at[wg_m, wg_n])

            def body(idx: Any, x_smem: Any, w_smem: Any, carry: Any) -> Any:
                acc, total = carry

                def step(acc_ref: Any) -> None:
                    plgpu.wgmma(acc_ref, x_smem.at[wg_m], w_smem.at[:, wg_n])

                acc = pl.run_state(step)(plgpu.ACC.init(acc))
                if seg_steps == steps:
                    return acc, total
                (s,) = idx
                return jax.lax.cond(jax.lax.rem(s + 1, seg_steps) == 0,
                                    lambda: (fresh(), total + acc), lambda: (acc, total))

            for i, w_gmem in enumerate(w_gmems):
                def run(w_gmem: Any = w_gmem, first: int = offsets[i]) -> None:
                    pipeline(body, context)(x_gmem.at[rows, :],
                                            w_gmem.at[:, pl.ds((ni - first) * bn, bn)],
                                            allocations=allocations)

                if len(w_gmems) == 1:
                    run()
                else:
                    pl.when((ni >= offsets[i]) & (ni < offsets[i + 1]))(run)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _gated_kernel(x_gmem: Any, gate_gmem: Any, up_gmem: Any, o_gmem: Any, *, t: MosaicTiles,
                  stages: int, epilogue: Any) -> None:
    """The gated product: each program's tile of both products over all of K as one segment
    (the gated schedule), then ``epilogue(gate, up)`` of the two float32 totals, in
    registers. One pipeline step loads an x tile and the gate's and the up weight's tiles."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x_gmem.shape
    bm, bn = t.block
    m_tiles, n_tiles, steps = m // bm, gate_gmem.shape[1] // bn, k // t.k_step
    in_transforms = _swizzled(plgpu, t.k_step, x_gmem.dtype)
    w_spec = plgpu.BlockSpec((t.k_step, bn), lambda s: (s, 0), transforms=in_transforms,
                             memory_space=plgpu.SMEM)

    def pipeline(body: Any, context: Any) -> Any:
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=context,
            in_specs=[plgpu.BlockSpec((bm, t.k_step), lambda s: (0, s),
                                      transforms=in_transforms, memory_space=plgpu.SMEM),
                      w_spec, w_spec])

    unused = lambda *_, **__: None  # noqa: E731

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(unused, unused).get_allocations(x_gmem, gate_gmem, up_gmem),
        out_smem=plgpu.SMEM((2, 2, EPILOGUE_TILE, EPILOGUE_TILE), o_gmem.dtype,
                            transforms=_swizzled(plgpu, EPILOGUE_TILE, o_gmem.dtype)),
        collective_axes="wg",
    )
    def _scope(allocations: Any, out_smem: Any) -> None:
        wg = jax.lax.axis_index("wg")
        if t.split == "rows":
            wg_m, wg_n = pl.ds(wg * t.wg_rows, t.wg_rows), slice(None)
        else:
            wg_m, wg_n = slice(None), pl.ds(wg * t.wg_cols, t.wg_cols)

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tile(info: Any) -> None:
            (at,) = info.index
            mi, ni = plgpu.planar_snake(at, (m_tiles, n_tiles), 0 if t.minor == "rows" else 1,
                                        t.band)
            rows, cols = pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)

            def zeros() -> jax.Array:
                return plgpu.layout_cast(jnp.zeros((t.wg_rows, t.wg_cols), jnp.float32),
                                         plgpu.Layout.WGMMA)

            def context(run: Any) -> None:
                gate, up = run((zeros(), zeros()))
                start = plgpu.layout_cast(jnp.full((t.wg_rows, t.wg_cols), -0.0, jnp.float32),
                                          plgpu.Layout.WGMMA)  # the total, as the schedule's
                _store(epilogue(start + gate, start + up), out_smem.at[wg],
                       o_gmem.at[rows, cols].at[wg_m, wg_n])

            def body(_: Any, x_smem: Any, g_smem: Any, u_smem: Any, carry: Any) -> Any:
                def step(refs: Any) -> None:
                    plgpu.wgmma(refs[0], x_smem.at[wg_m], g_smem.at[:, wg_n])
                    plgpu.wgmma(refs[1], x_smem.at[wg_m], u_smem.at[:, wg_n])

                return pl.run_state(step)((plgpu.ACC.init(carry[0]), plgpu.ACC.init(carry[1])))

            pipeline(body, context)(x_gmem.at[rows, :], gate_gmem.at[:, cols],
                                    up_gmem.at[:, cols], allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


#: Pipeline stages of the gated kernel: a step holds three tiles, so five would pass the
#: shared memory a program may have.
GATED_STAGES = 4


def _call(body: Any, name: str, out: jax.ShapeDtypeStruct, sms: int | None) -> Any:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if sms is None:
        device = jax.devices()[0]
        sms = device.core_count if device.platform == "gpu" else 132

    def named(*refs: Any) -> None:
        body(*refs)

    named.__name__ = name
    return plgpu.kernel(
        named, out_type=out, grid=(sms,), grid_names=("sm",), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def mosaic_gated(x: jax.Array, gate: jax.Array, up: jax.Array, *, epilogue: Any,
                 out_dtype: Any, tiles: MosaicTiles = MosaicTiles(), sms: int | None = None,
                 name: str = "rowinv_mosaic_gated") -> jax.Array:
    """``epilogue(x @ gate, x @ up)`` of the two float32 products, each over all of K as one
    segment, computed and gated in one launch (``[M, F]`` in ``out_dtype``). ``epilogue``
    must be elementwise; the row-invariant gated product passes its own (``rowinv._swiglu``,
    whose bits Mosaic's compilation was found to share with Triton's over every bfloat16
    gate value: ``benchmarks/probe_mosaic_elementwise.py``). Shapes as
    :func:`mosaic_matmul`'s."""
    m, k = x.shape
    bm, bn = tiles.block
    if m % bm or k % tiles.k_step or gate.shape != up.shape or gate.shape[0] != k or (
            gate.shape[1] % bn):
        raise BadInputError(f"mosaic_gated needs M % {bm}, K % {tiles.k_step} and F % {bn} "
                            f"zero and gate and up of one shape [K, F]; got x {x.shape}, "
                            f"gate {gate.shape}, up {up.shape}")
    body = functools.partial(_gated_kernel, t=tiles, stages=min(tiles.stages, GATED_STAGES),
                             epilogue=epilogue)
    return _call(body, name, jax.ShapeDtypeStruct((m, gate.shape[1]), out_dtype), sms)(
        x, gate, up)


def mosaic_matmul(x: jax.Array, ws: tuple[jax.Array, ...], *, seg_cols: int, out_dtype: Any,
                  tiles: MosaicTiles = MosaicTiles(), sms: int | None = None,
                  name: str = "rowinv_mosaic") -> jax.Array:
    """``x [M, K] @ w [K, N]`` for each ``w`` of ``ws``, side by side (``[M, N1 + N2 + ...]``,
    one launch), with K summed in segments of ``seg_cols`` columns (see the module
    docstring). ``M``, every ``N`` and ``K`` must already be multiples of the tiles
    (:func:`rowinv.rowinv_matmul` pads them); ``sms``: programs (the GPU's multiprocessors
    when None); ``name``: the kernel's name in a profile."""

    m, k = x.shape
    bm, bn = tiles.block
    widths = tuple(w.shape[1] for w in ws)
    if (m % bm or k % seg_cols or seg_cols % tiles.k_step or any(n % bn for n in widths)
            or any(w.shape[0] != k for w in ws)):
        raise BadInputError(f"mosaic_matmul needs M % {bm}, every N % {bn}, K % {seg_cols} "
                            f"and {seg_cols} % {tiles.k_step} all zero; got x {x.shape} and "
                            f"w {[w.shape for w in ws]}")
    offsets = [0]
    for n in widths:
        offsets.append(offsets[-1] + n // bn)
    body = functools.partial(_kernel, t=tiles, seg_steps=seg_cols // tiles.k_step,
                             offsets=tuple(offsets))
    return _call(body, name, jax.ShapeDtypeStruct((m, sum(widths)), out_dtype), sms)(x, *ws)
