"""A gated DeltaNet layer's walk over the rows of a block as one GPU kernel (Pallas, Triton),
its preamble included.

The exact path runs the recurrence row by row (each row's state update depends on the last).
Done by XLA that is a handful of small kernels per row and layer inside a loop whose trip
count is the block's live count, and on a GPU every pass of such a loop returns to the host
to test its condition; and the preamble that feeds it (the causal depthwise conv with its
SiLU, the L2 norms of q and k, the decay ``g`` and the write strength ``beta``) is several
more small kernels a layer. This kernel does both in one launch per layer: each program
takes one value head and a tile of ``BV`` of its ``dv`` state columns, holds that ``[dk,
BV]`` slice of the float32 state in registers, and for each live row convolves the channels
it needs (its key head's ``dk`` q and k channels, its ``BV`` v channels: every tile of a
head repeats the q/k work, ``2 * K * dk`` multiply-adds against the ``[dk, BV]`` state
update's several times that, where sharing it would take a second launch), normalises q and
k, forms ``g`` and ``beta`` from the row's ``a`` and ``b``, and applies the delta rule.

Exactness: the rows are walked by one loop body (``fori_loop`` over ``0..live``), so a row's
preamble and update run the same instructions whether the block holds one live row or all of
them, and the state passes between calls through float32 memory unchanged; chunked == token
by token therefore holds bitwise within this program, as it does for the XLA loop. Columns of
the state never mix (the delta rule's reads ``S^T k`` and ``S^T q`` reduce over ``dk`` only),
so splitting ``dv`` over programs changes no result. The kernel and the XLA loop are different
programs and agree within float32 rounding, not bitwise.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class GateColumns:
    """Where value head ``h``'s ``b`` and ``a`` sit among the columns of the projected rows:
    ``b_start + (h // r) * stride + h % r`` and ``a_start + (h // r) * stride + h % r``,
    ``r`` the value heads per key head (a layout that keeps them per value head has
    ``stride == r``; one that groups them per key head, ``2 * r``)."""

    b_start: int
    a_start: int
    stride: int


def _kernel(live_ref, buf_ref, proj_ref, weight_ref, a_log_ref, dt_bias_ref, s_ref, *refs,
            width: int, taps: int, key_heads: int, per_key: int, dv: int, tile: int,
            gates: GateColumns) -> None:
    if len(refs) == 4:  # with a tape: its input (aliased to its output), out, state, tape
        _, out_ref, s_out_ref, tape_ref = refs
    else:
        (out_ref, s_out_ref), tape_ref = refs, None
    f32, dtype = jnp.float32, buf_ref.dtype
    dk = s_ref.shape[0]
    head, part = pl.program_id(0), pl.program_id(1)
    key_head = head // per_key
    q_at, k_at = key_head * dk, (key_heads + key_head) * dk
    v_at = 2 * key_heads * dk + head * dv + part * tile
    gate = key_head * gates.stride + head % per_key
    live = live_ref[()]

    def conv_weights(at: jax.Array, n: int) -> list[jax.Array]:
        return [weight_ref[pl.ds(t, 1), pl.ds(at, n)].astype(f32) for t in range(taps)]

    w_q, w_k, w_v = conv_weights(q_at, dk), conv_weights(k_at, dk), conv_weights(v_at, tile)
    decay = -jnp.exp(a_log_ref[pl.ds(head, 1)].astype(f32))  # [1]
    dt_bias = dt_bias_ref[pl.ds(head, 1)].astype(f32)

    def conv(r: jax.Array, at: jax.Array, weights: list[jax.Array]) -> jax.Array:
        # The causal depthwise conv over the K inputs ending at row r (the window starts
        # with the K - 1 inputs before the block), its SiLU, rounded as the model's dtype.
        n = weights[0].shape[1]
        acc = sum(buf_ref[pl.ds(r + t, 1), pl.ds(at, n)].astype(f32) * weights[t]
                  for t in range(taps))
        return jax.nn.silu(acc).astype(dtype).astype(f32)  # [1, n]

    def unit(x: jax.Array) -> jax.Array:  # [1, dk] -> L2-normalised [dk, 1]
        x = x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + 1e-6)
        return x.reshape(dk, 1)

    def step(r, s):
        q = unit(conv(r, q_at, w_q)) * dk**-0.5  # [dk, 1]
        k = unit(conv(r, k_at, w_k))
        v = conv(r, v_at, w_v)  # [1, BV]
        a = proj_ref[pl.ds(r, 1), pl.ds(gates.a_start + gate, 1)].astype(f32)  # [1, 1]
        b = proj_ref[pl.ds(r, 1), pl.ds(gates.b_start + gate, 1)].astype(f32)
        g = decay * jax.nn.softplus(a + dt_bias)
        beta = jax.nn.sigmoid(b).astype(dtype).astype(f32)  # as the model's dtype
        decayed = s * jnp.exp(g)  # [dk, BV] * [1, 1]
        read = jnp.sum(decayed * k, axis=0, keepdims=True)  # [1, BV]
        s = decayed + k * ((v - read) * beta)
        out_ref[pl.ds(r, 1), pl.ds(head * dv + part * tile, tile)] = jnp.sum(
            s * q, axis=0, keepdims=True).astype(out_ref.dtype)
        if tape_ref is not None:
            tape_ref[pl.ds(r, 1), :, :] = s[None]
        return s

    s = jax.lax.fori_loop(0, live, step, s_ref[...])
    s_out_ref[...] = s

    def pad(r, carry):  # padding rows read as zeros
        out_ref[pl.ds(r, 1), pl.ds(head * dv + part * tile, tile)] = jnp.zeros(
            (1, tile), out_ref.dtype)
        return carry

    jax.lax.fori_loop(live, width, pad, 0)


@functools.partial(jax.jit, static_argnames=("key_heads", "gates", "interpret"))
def delta_net_rows(
    buf: jax.Array,
    proj: jax.Array,
    conv_weight: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    state: jax.Array,
    live: jax.Array,
    tape: jax.Array | None = None,
    *,
    key_heads: int,
    gates: GateColumns,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The first ``live`` rows of a gated DeltaNet layer from its conv inputs to the delta
    rule's outputs, in one kernel.

    Row ``r`` (for ``r < live``), per value head ``h`` of key head ``h // (Hv / Hk)``: the
    conv channels ``c = silu(sum_t buf[r + t] * conv_weight[t])`` (float32, rounded to the
    inputs' dtype), split into q, k (``Hk * dk`` channels each) and v (``Hv * dv``); q and k
    L2-normalised, q scaled by ``dk ** -0.5``; ``g = -exp(a_log) * softplus(a + dt_bias)``
    and ``beta = sigmoid(b)`` from the row's ``a`` and ``b`` (:class:`GateColumns` of
    ``proj``); then ``S = S * exp(g)``; ``S += k (x) ((v - S^T k) * beta)``; ``out[r] = S^T
    q``.

    Args:
      buf: ``[K - 1 + W, C]``: the conv state (the ``K - 1`` inputs before the block) and the
        block's conv inputs, channels ``[q | k | v]``; its dtype is the model's.
      proj: ``[W, N]``: the block's projected rows, holding ``a`` and ``b`` where ``gates``
        says.
      conv_weight: ``[K, C]``; a_log, dt_bias: ``[Hv]``.
      state: float32 ``[Hv, dk, dv]``.
      live: int32 scalar, ``0 <= live <= W``.
      tape: float32 ``[R, Hv, dk, dv]`` with ``R >= W``, or ``None``: row ``r < live`` of it
        becomes the state after row ``r``; the other rows keep what they held. It is
        updated in place where the caller's buffer can be (inside a jitted program that
        does not read it again).
      key_heads: ``Hk``.
      gates: where each value head's ``b`` and ``a`` are in ``proj``.
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      ``(out [W, Hv * dv] in buf's dtype, state after row live - 1, the tape or None)``;
      padding rows' outputs are zeros.

    Raises:
      BadInputError: a tape of fewer than ``W`` rows.
    """
    heads, dk, dv = state.shape
    taps, width = conv_weight.shape[0], proj.shape[0]
    if tape is not None and tape.shape[0] < width:
        raise BadInputError(f"a tape of {tape.shape[0]} rows cannot hold a block of {width}")
    tile = VALUE_TILE if dv % VALUE_TILE == 0 else dv
    f32 = jnp.float32
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=1)
    with_tape = tape is not None
    whole = pl.BlockSpec()  # the kernel picks its rows and columns itself
    state_spec = pl.BlockSpec((None, dk, tile), lambda h, j: (h, 0, j))
    tape_spec = pl.BlockSpec((tape.shape[0] if with_tape else 1, None, dk, tile),
                             lambda h, j: (0, h, 0, j))
    results = pl.pallas_call(
        functools.partial(_kernel, width=width, taps=taps, key_heads=key_heads,
                          per_key=heads // key_heads, dv=dv, tile=tile, gates=gates),
        grid=(heads, dv // tile),
        in_specs=[pl.BlockSpec((), lambda h, j: ()), whole, whole, whole, whole, whole,
                  state_spec] + ([tape_spec] if with_tape else []),
        out_specs=[whole, state_spec] + ([tape_spec] if with_tape else []),
        out_shape=[
            jax.ShapeDtypeStruct((width, heads * dv), buf.dtype),
            jax.ShapeDtypeStruct((heads, dk, dv), f32),
        ] + ([jax.ShapeDtypeStruct(tape.shape, f32)] if with_tape else []),
        input_output_aliases={7: 2} if with_tape else {},
        interpret=interpret,
        name="delta_net_rows",
        **kwargs,
    )(jnp.asarray(live, jnp.int32), buf, proj, conv_weight, a_log, dt_bias, state.astype(f32),
      *([tape.astype(f32)] if with_tape else []))
    return results[0], results[1], results[2] if with_tape else None
