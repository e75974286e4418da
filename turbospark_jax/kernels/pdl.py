"""Programmatic dependent launch (PDL) from inside our Triton kernels: speed only.

On Hopper a kernel launched with programmatic stream serialization may start before the
kernel ahead of it in the stream has finished; it must execute ``griddepcontrol.wait``
before it reads anything that kernel wrote. The kernel ahead lets it be scheduled early by
executing ``griddepcontrol.launch_dependents`` (without it, only once all its programs have
ended). XLA launches the kernels it compiles that way and puts the wait at each kernel's
entry (``--xla_gpu_enable_pdl``), so a decode step's kernels start as the one before them
ends, and still pay the latency of their first loads after it.

The decode kernels that take it (the matvec products, the gated product and the norm
kernel) ask more when compiled: every program executes ``launch_dependents`` first thing,
so the next kernel's programs are scheduled while this one streams, and waits
(``griddepcontrol.wait``) before its first read of the rows the kernel ahead produced.

The instructions go in as inline assembly, which Pallas marks pure: each returns a value
that the reads after it use (a mask that is all true at run time but opaque to the
compiler), so no compiler can drop it or move a dependent read above it. The Pallas
interpreter has no such instructions: there the helpers return None and the kernels read
without them. Neither changes an arithmetic step, so neither changes a bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _instruction(asm: str, like: jax.Array) -> jax.Array:
    """``asm`` executed by each thread, returning ``like`` (int32) through a register the
    compiler cannot see into."""
    from jax.experimental.pallas import triton as plgpu

    [out] = plgpu.elementwise_inline_asm(
        f"{asm}\n\tmov.u32 $0, $1;", args=[like], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(like.shape, jnp.int32)])
    return out


def start(on: bool) -> jax.Array | None:
    """At a kernel's top: execute ``launch_dependents`` (``on``: a compiled kernel, not one
    in the interpreter); a bool ``[1]`` (true) computed after it, for :func:`ready`, or None
    when not ``on``."""
    if not on:
        return None
    return _instruction("griddepcontrol.launch_dependents;", jnp.zeros((1,), jnp.int32)) >= 0


def ready(started: jax.Array | None) -> jax.Array | None:
    """Before the first read of the kernel ahead's output: execute ``griddepcontrol.wait``;
    a bool ``[1]`` (true) computed after it and after :func:`start`'s, to mask those reads
    with (:func:`masked`). None where :func:`start` gave None."""
    if started is None:
        return None
    after = _instruction("griddepcontrol.wait;", started.astype(jnp.int32))
    return (after >= 0) & started


def masked(live: jax.Array | None, gate: jax.Array | None, shape: tuple[int, ...]
           ) -> jax.Array | None:
    """``live`` (a bool mask of ``shape``, or None for all) and the gate of :func:`ready`
    (None when off), broadcast to ``shape``."""
    if gate is None:
        return live
    gate = jnp.broadcast_to(gate.reshape((1,) * len(shape)), shape)
    return gate if live is None else live & gate
