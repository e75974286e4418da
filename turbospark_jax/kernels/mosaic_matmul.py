"""Row-invariant matrix products on Hopper's tensor cores, through Pallas' Mosaic GPU backend.

Our Triton matrix kernel (``rowinv._matmul``) runs a prefill block's products well below
cuBLAS's rate. This kernel keeps that kernel's arithmetic and changes how
the operands reach the tensor cores: a warp-specialised pipeline (one warpgroup issues TMA
loads into a ring of shared-memory stages; two compute warpgroups issue ``wgmma``), over a
persistent grid of one program per multiprocessor.

The arithmetic is :class:`rowinv.Schedule`'s: each segment of K is summed from zero by one
chain of tensor-core steps in K order, and the segments' sums are folded in order into a
float32 total that starts at ``-0.0``; the total is rounded once to the output dtype. Our
Triton kernels do the same, so a row's bits do not depend on which kernel computed it, nor
on the rows beside it (checked on the GPU by the kernel's tests; JAX's own example kernel
agrees with ours at one segment and, called once a segment with the running total as its
addend, at many).

The running total lives in registers beside the segment's accumulator, so a warpgroup's tile
is at most 128 x 64 float32 of each (64 + 64 registers a thread).

One kernel body serves two forms: :func:`mosaic_matmul` (weights side by side, as q/k/v)
and :func:`mosaic_gated` (gate and up loaded together, K in one segment, SwiGLU's gating in
the epilogue: what a prefill block's MLP runs). Decode sizes stay on the Triton matvec
kernel, which streams the weights faster there.
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
      stages: pipeline stages in shared memory (five: the faster of four and five at the
        model shapes' prefill products).
      minor: the persistent grid walks output tiles along ``"rows"`` or ``"cols"`` first,
      band: in bands of this many tiles (a snake), so neighbours share operands in L2.
    """

    wg_rows: int = 128
    wg_cols: int = 64
    split: str = "cols"
    k_step: int = 64
    stages: int = 5
    minor: str = "rows"
    band: int = 8

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


#: The epilogue writes the output through shared memory in tiles of this many rows, and of
#: one 128-byte swizzle row's columns (64 of bfloat16, 32 of float32).
EPILOGUE_ROWS = 64


def _epilogue_cols(dtype: Any) -> int:
    return 128 // jnp.dtype(dtype).itemsize


def _swizzled(plgpu: Any, cols: int, dtype: Any) -> tuple[Any, ...]:
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _store(out: jax.Array, out_smem: Any, o_gmem: Any) -> None:
    """A warpgroup's finished tile ``out`` to its place ``o_gmem`` in the output, through its
    two shared-memory slots ``out_smem`` (each copy issued once the slot's previous one has
    left)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    er, ec = out_smem.shape[-2:]
    rows, cols = out.shape
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for i in range(rows // er):
        for j in range(cols // ec):
            slot = (i * (cols // ec) + j) % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_smem[slot] = out[i * er:(i + 1) * er, j * ec:(j + 1) * ec]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[slot],
                                    o_gmem.at[pl.ds(i * er, er), pl.ds(j * ec, ec)])


def _kernel(x_gmem: Any, *refs: Any, t: MosaicTiles, stages: int, seg_steps: int,
            groups: tuple[int, ...], epilogue: Any = None) -> None:
    """One program per multiprocessor, walking output tiles.

    The weights come in ``groups`` of column tiles: weight ``i`` owns the output's column tiles
    ``groups[i]`` up to ``groups[i + 1]`` (q/k/v side by side). With an ``epilogue`` the kernel
    is the gated product instead: its two weights (gate, up) share every column tile, each
    pipeline step loads both, K is one segment, and the tile written is
    ``epilogue(gate, up)`` of the two float32 totals."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    *w_gmems, o_gmem = refs
    gated = epilogue is not None
    per_step = 2 if gated else 1  # weight tiles a pipeline step loads
    m, k = x_gmem.shape
    bm, bn = t.block
    m_tiles, n_tiles, steps = m // bm, groups[-1], k // t.k_step
    segments = 1  # a program walks all of K for its tile
    one_segment = seg_steps == steps  # no fold in the pipeline's loop
    in_transforms = _swizzled(plgpu, t.k_step, x_gmem.dtype)
    w_spec = plgpu.BlockSpec((t.k_step, bn), lambda s: (s, 0), transforms=in_transforms,
                             memory_space=plgpu.SMEM)

    def pipeline(body: Any, context: Any) -> Any:
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps // segments,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=context,
            in_specs=[plgpu.BlockSpec((bm, t.k_step), lambda s: (0, s),
                                      transforms=in_transforms, memory_space=plgpu.SMEM)]
            + [w_spec] * per_step)

    unused = lambda *_, **__: None  # noqa: E731  (the allocations ignore the bodies)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(unused, unused).get_allocations(x_gmem, *w_gmems[:per_step]),
        out_smem=plgpu.SMEM((2, 2, EPILOGUE_ROWS, _epilogue_cols(o_gmem.dtype)), o_gmem.dtype,
                            transforms=_swizzled(plgpu, _epilogue_cols(o_gmem.dtype),
                                                 o_gmem.dtype)),
        collective_axes="wg",
    )
    def _scope(allocations: Any, out_smem: Any) -> None:
        wg = jax.lax.axis_index("wg")
        if t.split == "rows":
            wg_m, wg_n = pl.ds(wg * t.wg_rows, t.wg_rows), slice(None)
        else:
            wg_m, wg_n = slice(None), pl.ds(wg * t.wg_cols, t.wg_cols)

        @plgpu.nd_loop((m_tiles * n_tiles * segments,), collective_axes="sm")
        def _tile(info: Any) -> None:
            (at,) = info.index
            seg, at = jax.lax.rem(at, segments), jax.lax.div(at, segments)
            mi, ni = plgpu.planar_snake(at, (m_tiles, n_tiles), 0 if t.minor == "rows" else 1,
                                        t.band)
            rows, cols = pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)
            k_cols = pl.ds(seg * seg_steps * t.k_step, seg_steps * t.k_step)
            o_tile = o_gmem.at[rows, cols].at[wg_m, wg_n]

            def filled(value: float) -> jax.Array:
                return plgpu.layout_cast(jnp.full((t.wg_rows, t.wg_cols), value, jnp.float32),
                                         plgpu.Layout.WGMMA)

            def context(run: Any) -> None:
                start = filled(-0.0)  # the schedule's total starts at -0.0
                if gated:
                    gate, up = run((filled(0.0), filled(0.0)))
                    out = epilogue(start + gate, start + up)
                else:
                    acc, total = run((filled(0.0), start))
                    if seg_steps == steps:  # nothing was folded in the loop
                        total = total + acc
                    out = total.astype(o_gmem.dtype)
                _store(out, out_smem.at[wg], o_tile)

            def body(idx: Any, x_smem: Any, *rest: Any) -> Any:
                *w_smems, carry = rest

                def step(acc_refs: Any) -> None:
                    for acc_ref, w_smem in zip(acc_refs, w_smems, strict=True):
                        plgpu.wgmma(acc_ref, x_smem.at[wg_m], w_smem.at[:, wg_n])

                if gated:
                    return pl.run_state(step)(tuple(plgpu.ACC.init(a) for a in carry))
                acc, total = carry
                (acc,) = pl.run_state(step)((plgpu.ACC.init(acc),))
                if one_segment:
                    return acc, total
                (s,) = idx
                return jax.lax.cond(jax.lax.rem(s + 1, seg_steps) == 0,
                                    lambda: (filled(0.0), total + acc), lambda: (acc, total))

            weights = [tuple(w_gmems)] if gated else [(w,) for w in w_gmems]
            for i, group in enumerate(weights):
                def run(group: tuple[Any, ...] = group, first: int = groups[i]) -> None:
                    pipeline(body, context)(
                        x_gmem.at[rows, k_cols],
                        *(w.at[k_cols, pl.ds((ni - first) * bn, bn)] for w in group),
                        allocations=allocations)

                if len(weights) == 1:
                    run()
                else:
                    pl.when((ni >= groups[i]) & (ni < groups[i + 1]))(run)

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
    gate value). Shapes as
    :func:`mosaic_matmul`'s."""
    m, k = x.shape
    bm, bn = tiles.block
    if m % bm or k % tiles.k_step or gate.shape != up.shape or gate.shape[0] != k or (
            gate.shape[1] % bn):
        raise BadInputError(f"mosaic_gated needs M % {bm}, K % {tiles.k_step} and F % {bn} "
                            f"zero and gate and up of one shape [K, F]; got x {x.shape}, "
                            f"gate {gate.shape}, up {up.shape}")
    body = functools.partial(_kernel, t=tiles, stages=min(tiles.stages, GATED_STAGES),
                             seg_steps=k // tiles.k_step, groups=(0, gate.shape[1] // bn),
                             epilogue=epilogue)
    return _call(body, name, jax.ShapeDtypeStruct((m, gate.shape[1]), out_dtype), sms)(
        x, gate, up)


def _check(x: jax.Array, ws: tuple[jax.Array, ...], seg_cols: int, tiles: MosaicTiles) -> None:
    m, k = x.shape
    bm, bn = tiles.block
    if (m % bm or k % seg_cols or seg_cols % tiles.k_step or any(w.shape[1] % bn for w in ws)
            or any(w.shape[0] != k for w in ws)):
        raise BadInputError(f"the Mosaic kernel needs M % {bm}, every N % {bn}, K % "
                            f"{seg_cols} and {seg_cols} % {tiles.k_step} all zero; got x "
                            f"{x.shape} and w {[w.shape for w in ws]}")


def _groups(ws: tuple[jax.Array, ...], tiles: MosaicTiles) -> tuple[int, ...]:
    """Where each weight's column tiles start in the output, and where the last ends."""
    offsets = [0]
    for w in ws:
        offsets.append(offsets[-1] + w.shape[1] // tiles.block[1])
    return tuple(offsets)


def mosaic_matmul(x: jax.Array, ws: tuple[jax.Array, ...], *, seg_cols: int, out_dtype: Any,
                  tiles: MosaicTiles = MosaicTiles(), sms: int | None = None,
                  name: str = "rowinv_mosaic") -> jax.Array:
    """``x [M, K] @ w [K, N]`` for each ``w`` of ``ws``, side by side (``[M, N1 + N2 + ...]``,
    one launch), with K summed in segments of ``seg_cols`` columns (see the module
    docstring). ``M``, every ``N`` and ``K`` must already be multiples of the tiles
    (:func:`rowinv.rowinv_matmul` pads them); ``sms``: programs (the GPU's multiprocessors
    when None); ``name``: the kernel's name in a profile."""

    m = x.shape[0]
    _check(x, ws, seg_cols, tiles)
    body = functools.partial(_kernel, t=tiles, stages=tiles.stages,
                             seg_steps=seg_cols // tiles.k_step, groups=_groups(ws, tiles))
    out = jax.ShapeDtypeStruct((m, sum(w.shape[1] for w in ws)), out_dtype)
    return _call(body, name, out, sms)(x, *ws)
