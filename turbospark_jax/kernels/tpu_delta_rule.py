"""The gated delta rule's walk over the rows of a block in Pallas' TPU dialect (Mosaic TPU).

The exact path of a gated DeltaNet layer runs its recurrence row by row (each row's state
update reads the last). Written as an XLA loop, every row reads and writes the float32
state ``[Hv, dk, dv]`` through memory; here a program per value head and block of ``BV``
state columns holds its ``[dk, BV]`` slice of the state in VMEM for the whole block, walks
the live rows, and writes the state out once. With a tape, each live row's state is copied
into it where it lies in HBM (the rows past the live count are neither read nor written).

The preamble (the causal conv with its SiLU, the L2 norms of q and k, the decay ``g`` and
the strength ``beta``) stays in XLA: it is elementwise work and reductions within a row,
one fused program over the block on a TPU, and a TPU's XLA loop does not return to the host
between rows (the reason the GPU kernel, :mod:`~turbospark_jax.kernels.delta_rule`, takes
the preamble in). The kernel takes its results: q and k per key head, v, ``g`` and
``beta`` per value head, all float32.

Layout: the state's ``dk`` on sublanes and ``dv`` on lanes, so the reads ``S^T k`` and
``S^T q`` reduce over sublanes into a row of ``BV`` lanes, and the update ``S += k (x)
delta`` broadcasts a column of ``dk`` against that row. q and k come transposed (``[dk,
W]`` per key head) and a row's column is picked out of them by a select and a maximum over
the lanes (exact: one candidate against ``-inf``, ``-0.0`` included); v, ``g`` and ``beta``
likewise; each output row is placed by a select. No slice starts at a data-dependent lane,
which Mosaic does not take.

Exactness: the rows are walked by one loop body (``fori_loop`` over ``0..live``), so a row
runs the same instructions whether the block holds one live row or all of them, and its
reductions are over ``dk`` alone, in shapes that do not follow the block's width; the state
passes between calls through float32 memory unchanged. So a row's bits do not depend on the
rows beside it or on the live count, and chunked == token by token holds bitwise within
this walk. Columns of the state never mix, so splitting ``dv`` over programs changes no
result. The kernel and the XLA loop are different programs and agree within float32
rounding, not bitwise. Nothing here has run on a TPU: the interpreter
(``impl="tpu_interpret"``) and the lowering for a TPU are what the tests check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.tpu_products import LANES, TPU_IMPLS


def supported(key_dim: int, value_dim: int) -> bool:
    """Whether a TPU runs the kernel at these head sizes: ``dk`` whole sublanes of float32
    and ``dv`` whole lane blocks (in the interpreter any sizes run)."""
    return key_dim % 8 == 0 and value_dim % LANES == 0


def _value_tile(dv: int) -> int:
    """State columns per program: one lane block where ``dv`` is made of them, else all."""
    return LANES if dv % LANES == 0 else dv


def _kernel(live_ref, qt_ref, kt_ref, v_ref, gb_ref, s_ref, *refs, tile: int) -> None:
    if len(refs) == 5:
        # with a tape: its input (aliased to its output), out, state, the tape in HBM and a
        # row's state in VMEM
        _, out_ref, s_out_ref, tape_ref, row_ref = refs
    else:
        (out_ref, s_out_ref), tape_ref = refs, None
    head, part = pl.program_id(0), pl.program_id(1)
    f32 = jnp.float32
    width = v_ref.shape[0]
    lanes = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
    rows = jax.lax.broadcasted_iota(jnp.int32, (width, 1), 0)
    qt, kt, v, gb = qt_ref[...], kt_ref[...], v_ref[...], gb_ref[...]

    def column(a: jax.Array, r: jax.Array) -> jax.Array:  # [n, W] -> row r as [n, 1]
        return jnp.max(jnp.where(lanes == r, a, -jnp.inf), axis=1, keepdims=True)

    def step(r, carry):
        s, out = carry
        q, k = column(qt, r), column(kt, r)  # [dk, 1]
        v_r = jnp.max(jnp.where(rows == r, v, -jnp.inf), axis=0, keepdims=True)  # [1, BV]
        g_beta = column(gb, r)  # [2, 1]
        decayed = s * jnp.exp(g_beta[0:1])  # [dk, BV] * [1, 1]
        read = jnp.sum(decayed * k, axis=0, keepdims=True)  # [1, BV]
        s = decayed + k * ((v_r - read) * g_beta[1:2])
        out = jnp.where(rows == r, jnp.sum(s * q, axis=0, keepdims=True), out)
        if tape_ref is not None:  # the live rows' states alone go out, one copy each
            row_ref[...] = s
            pltpu.sync_copy(row_ref, tape_ref.at[r, head, :, pl.ds(part * tile, tile)])
        return s, out

    s, out = jax.lax.fori_loop(0, live_ref[0], step,
                               (s_ref[...], jnp.zeros(out_ref.shape, f32)))
    out_ref[...] = out  # padding rows: zeros
    s_out_ref[...] = s


@functools.partial(jax.jit, static_argnames=("impl",))
def _tpu_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                    state: jax.Array, live: jax.Array, tape: jax.Array | None,
                    impl: str) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    f32 = jnp.float32
    width, key_heads, dk = q.shape
    heads, dv = v.shape[1:]
    per_key = heads // key_heads
    tile = _value_tile(dv)
    with_tape = tape is not None
    qt, kt = (a.astype(f32).transpose(1, 2, 0) for a in (q, k))  # [Hk, dk, W]
    vh = v.astype(f32).transpose(1, 0, 2)  # [Hv, W, dv]
    gb = jnp.stack([g, beta], axis=0).astype(f32).transpose(2, 0, 1)  # [Hv, 2, W]

    def key_block(h, j, live_ref):
        # lax.div, not //: jnp's floor division lowers through sign, which Mosaic's lowering
        # resolves by asking the TPU's generation (no TPU at export time)
        return jax.lax.div(h, per_key), 0, 0

    state_spec = pl.BlockSpec((None, dk, tile), lambda h, j, live_ref: (h, 0, j))
    # the tape stays where it is (HBM): the kernel writes the live rows' states into it
    tape_spec = pl.BlockSpec(memory_space=pl.ANY)
    rows_spec = pl.BlockSpec((None, width, tile), lambda h, j, live_ref: (h, 0, j))
    interpret = impl == "tpu_interpret"
    params = {"interpret": pltpu.InterpretParams()} if interpret else {
        "compiler_params": pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))}
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(heads, dv // tile),
        in_specs=[pl.BlockSpec((None, dk, width), key_block),
                  pl.BlockSpec((None, dk, width), key_block),
                  rows_spec,
                  pl.BlockSpec((None, 2, width), lambda h, j, live_ref: (h, 0, 0)),
                  state_spec] + ([tape_spec] if with_tape else []),
        out_specs=[rows_spec, state_spec] + ([tape_spec] if with_tape else []),
        scratch_shapes=[pltpu.VMEM((dk, tile), f32)] if with_tape else [],
    )
    results = pl.pallas_call(
        functools.partial(_kernel, tile=tile),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((heads, width, dv), f32),
                   jax.ShapeDtypeStruct((heads, dk, dv), f32)]
        + ([jax.ShapeDtypeStruct(tape.shape, f32)] if with_tape else []),
        input_output_aliases={6: 2} if with_tape else {},
        name="tpu_delta_rule",
        **params,
    )(jnp.reshape(live, (1,)).astype(jnp.int32), qt, kt, vh, gb, state.astype(f32),
      *([tape.astype(f32)] if with_tape else []))
    return results[0].transpose(1, 0, 2), results[1], results[2] if with_tape else None


def tpu_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                   state: jax.Array, live: jax.Array, tape: jax.Array | None = None, *,
                   impl: str = "tpu") -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The first ``live`` rows of the gated delta rule on a TPU (see the module docstring).

    Row ``r < live``, per value head ``h`` of key head ``h // (Hv / Hk)``: ``S = S *
    exp(g[r, h])``; ``S += k (x) ((v - S^T k) * beta[r, h])``; ``out[r, h] = S^T q``.

    Args:
      q, k: ``[W, Hk, dk]``, L2-normalised (q also scaled by ``dk ** -0.5``).
      v: ``[W, Hv, dv]``; g, beta: ``[W, Hv]`` (the log decay and the write strength).
        Every input is read as float32.
      state: float32 ``[Hv, dk, dv]``.
      live: int32 scalar, ``0 <= live <= W``.
      tape: float32 ``[R, Hv, dk, dv]`` with ``R >= W``, or ``None``: row ``r < live`` of it
        becomes the state after row ``r``; the other rows keep what they held. It is
        updated in place where the caller's buffer can be (inside a jitted program that does
        not read it again).
      impl: ``"tpu"`` (compiled by Mosaic) or ``"tpu_interpret"`` (Pallas' TPU interpreter,
        on any backend).

    Returns:
      ``(out [W, Hv, dv] float32, state after row live - 1, the tape or None)``; padding
      rows' outputs are zeros.

    Raises:
      BadInputError: an unknown ``impl``, shapes that do not fit together, a tape of fewer
        than ``W`` rows.
    """
    if impl not in TPU_IMPLS:
        raise BadInputError(f"impl must be one of {', '.join(TPU_IMPLS)}; got {impl!r}")
    width = v.shape[0]
    heads, dk, dv = state.shape
    if (q.ndim != 3 or q.shape != k.shape or q.shape[0] != width or q.shape[2] != dk
            or v.shape != (width, heads, dv) or g.shape != (width, heads)
            or beta.shape != g.shape or heads % q.shape[1]):
        raise BadInputError(
            f"tpu_delta_rule takes q and k [W, Hk, dk], v [W, Hv, dv], g and beta [W, Hv] "
            f"and a state [Hv, dk, dv] (Hv a multiple of Hk); got q {q.shape}, k {k.shape}, "
            f"v {v.shape}, g {g.shape}, beta {beta.shape}, state {state.shape}")
    if tape is not None and (tape.shape[0] < width or tape.shape[1:] != state.shape):
        raise BadInputError(f"a tape [R, Hv, dk, dv] must hold the block's {width} rows of "
                            f"states {state.shape}; got {tape.shape}")
    return _tpu_delta_rule(q, k, v, g, beta, state, jnp.asarray(live), tape, impl)
