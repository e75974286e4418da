"""The gated delta rule over the rows of a block as one GPU kernel (Pallas, Triton).

The exact path runs the recurrence row by row (each row's state update depends on the last).
Done by XLA that is a handful of small kernels per row and layer inside a loop whose trip
count is the block's live count, and on a GPU every pass of such a loop returns to the host
to test its condition: a Qwen3.5-0.8B decode step made 18 such trips. This kernel keeps the
whole walk on the device: one launch per layer, each program holding a ``[dk, BV]`` slice of
one value head's float32 state in registers while it walks the live rows.

Exactness: the rows are walked by one loop body (``fori_loop`` over ``0..live``), so a row's
update runs the same instructions whether the block holds one live row or all of them, and
the state passes between calls through float32 memory unchanged; chunked == token by token
therefore holds bitwise within this program, as it does for the XLA loop. Columns of the
state never mix (the delta rule's reads ``S^T k`` and ``S^T q`` reduce over ``dk`` only), so
splitting ``dv`` over programs changes no result. The kernel and the XLA loop are different
programs and agree within float32 rounding, not bitwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from turbospark_jax.errors import BadInputError

#: State columns (of ``dv``) per program (all of them where ``dv`` is no multiple of it).
VALUE_TILE = 16


def supported(key_dim: int, value_dim: int) -> bool:
    """Whether the kernel handles these head sizes (Triton wants power-of-two tiles)."""
    def pow2(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    return pow2(key_dim) and pow2(value_dim) and value_dim % VALUE_TILE == 0


def _kernel(live_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, *refs, rows: int) -> None:
    if len(refs) == 4:  # with a tape: its input (aliased to its output), out, state, tape
        _, out_ref, s_out_ref, tape_ref = refs
    else:
        (out_ref, s_out_ref), tape_ref = refs, None
    live = live_ref[()]

    def step(r, s):
        q = q_ref[:, pl.ds(r, 1)]  # [dk, 1]
        k = k_ref[:, pl.ds(r, 1)]
        v = v_ref[pl.ds(r, 1), :]  # [1, BV]
        decayed = s * jnp.exp(g_ref[:, pl.ds(r, 1)])  # [dk, BV] * [1, 1]
        read = jnp.sum(decayed * k, axis=0, keepdims=True)  # [1, BV]
        delta = (v - read) * beta_ref[:, pl.ds(r, 1)]
        s = decayed + k * delta
        out_ref[pl.ds(r, 1), :] = jnp.sum(s * q, axis=0, keepdims=True)
        if tape_ref is not None:
            tape_ref[pl.ds(r, 1), :, :] = s[None]
        return s

    s = jax.lax.fori_loop(0, live, step, s_ref[...])
    s_out_ref[...] = s

    def pad(r, carry):  # padding rows read as zeros
        out_ref[pl.ds(r, 1), :] = jnp.zeros((1, out_ref.shape[1]), out_ref.dtype)
        return carry

    jax.lax.fori_loop(live, rows, pad, 0)


def tape_rows(width: int) -> int:
    """Rows of the block the kernel walks for blocks of up to ``width`` rows (a power of two of
    at least 16): a tape it writes into must hold at least this many."""
    return max(16, 1 << (width - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("interpret",))
def delta_rule_rows(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    live: jax.Array,
    tape: jax.Array | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The first ``live`` rows of the gated delta rule from ``state``, in one kernel.

    Row ``r`` (for ``r < live``): ``S = S * exp(g[r])``; ``S += k[r] (x) ((v[r] - S^T k[r]) *
    beta[r])``; ``out[r] = S^T q[r]``, per value head.

    Args:
      q, k: float32 ``[W, Hv, dk]`` (q already scaled, both L2-normalised).
      v: float32 ``[W, Hv, dv]``.
      g, beta: float32 ``[W, Hv]``: log decay and write strength.
      state: float32 ``[Hv, dk, dv]``.
      live: int32 scalar, ``0 <= live <= W``.
      tape: float32 ``[R, Hv, dk, dv]`` with ``R >= tape_rows(W)``, or ``None``: row ``r <
        live`` of it becomes the state after row ``r``; the other rows keep what they held.
        It is updated in place where the caller's buffer can be (inside a jitted program
        that does not read it again).
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      ``(out [W, Hv, dv], state after row live - 1, the tape or None)``; padding rows'
      outputs are zeros.

    Raises:
      BadInputError: a tape of fewer than ``tape_rows(W)`` rows.
    """
    width, heads, dk = q.shape
    dv = v.shape[-1]
    rows = tape_rows(width)  # a power-of-two block of rows
    pad = rows - width
    f32 = jnp.float32

    def columns(x: jax.Array) -> jax.Array:  # [W, Hv, d] -> [Hv, d, rows]
        return jnp.pad(x.astype(f32), ((0, pad), (0, 0), (0, 0))).transpose(1, 2, 0)

    def scalars(x: jax.Array) -> jax.Array:  # [W, Hv] -> [Hv, 1, rows]
        return jnp.pad(x.astype(f32), ((0, pad), (0, 0))).T[:, None, :]

    vr = jnp.pad(v.astype(f32), ((0, pad), (0, 0), (0, 0))).transpose(1, 0, 2)  # [Hv, rows, dv]
    tile = VALUE_TILE if dv % VALUE_TILE == 0 else dv
    tiles = dv // tile
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=1)
    with_tape = tape is not None
    if with_tape and tape.shape[0] < rows:
        raise BadInputError(f"a tape of {tape.shape[0]} rows; blocks of {width} rows need "
                            f"{rows} (tape_rows)")
    state_spec = pl.BlockSpec((None, dk, tile), lambda h, j: (h, 0, j))
    tape_spec = pl.BlockSpec((tape.shape[0] if with_tape else 1, None, dk, tile),
                             lambda h, j: (0, h, 0, j))
    results = pl.pallas_call(
        functools.partial(_kernel, rows=rows),
        grid=(heads, tiles),
        in_specs=[
            pl.BlockSpec((), lambda h, j: ()),
            pl.BlockSpec((None, dk, rows), lambda h, j: (h, 0, 0)),
            pl.BlockSpec((None, dk, rows), lambda h, j: (h, 0, 0)),
            pl.BlockSpec((None, rows, tile), lambda h, j: (h, 0, j)),
            pl.BlockSpec((None, 1, rows), lambda h, j: (h, 0, 0)),
            pl.BlockSpec((None, 1, rows), lambda h, j: (h, 0, 0)),
            state_spec,
        ] + ([tape_spec] if with_tape else []),
        out_specs=[pl.BlockSpec((None, rows, tile), lambda h, j: (h, 0, j)), state_spec]
        + ([tape_spec] if with_tape else []),
        out_shape=[
            jax.ShapeDtypeStruct((heads, rows, dv), f32),
            jax.ShapeDtypeStruct((heads, dk, dv), f32),
        ] + ([jax.ShapeDtypeStruct(tape.shape, f32)] if with_tape else []),
        input_output_aliases={7: 2} if with_tape else {},
        interpret=interpret,
        name="delta_rule_rows",
        **kwargs,
    )(jnp.asarray(live, jnp.int32), columns(q), columns(k), vr, scalars(g), scalars(beta),
      state.astype(f32), *([tape.astype(f32)] if with_tape else []))
    out, new_state = results[0], results[1]
    return out.transpose(1, 0, 2)[:width], new_state, results[2] if with_tape else None
