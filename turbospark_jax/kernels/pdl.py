"""Programmatic dependent launch (PDL) from inside our Triton kernels: speed only.

On Hopper a kernel launched with programmatic stream serialization may start before the
kernel ahead of it in the stream has finished; it must execute ``griddepcontrol.wait``
before it reads anything that kernel wrote. The kernel ahead lets it be scheduled early by
executing ``griddepcontrol.launch_dependents`` (without it, only once all its programs have
ended). XLA launches the kernels it compiles that way and puts the wait at each kernel's
entry (``--xla_gpu_enable_pdl``), so a decode step's kernels start as the one before them
ends, and still pay the latency of their first loads after it (the fixed cost a kernel
that ``benchmarks/decode_bound.py`` fits to every product).

:data:`MODE` ``"trigger"`` (the default) asks more of the decode kernels that take it (the
matvec products, the gated product and the norm kernel): every program executes
``launch_dependents`` first thing, so the next kernel's programs are scheduled while this
one streams, and waits (``griddepcontrol.wait``) before its first read of the rows the
kernel ahead produced. ``benchmarks/rowinv_h200.sh 37`` greps the compiled kernels' PTX for
the instructions and times the modes.

The instructions go in as inline assembly, which Pallas marks pure: each returns a value
that the reads after it use (a mask that is all true at run time but opaque to the
compiler), so no compiler can drop it or move a dependent read above it. The Pallas
interpreter has no such instructions: there (and with ``"off"``) the helpers return None
and the kernels read as they always did. No mode changes an arithmetic step, so none
changes a bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

MODES = ("off", "trigger")
#: The decode kernels' PDL mode (a kernel's program is compiled for the mode it was traced
#: under; ``benchmarks/rowinv_model.py --pdl`` sets it). ``"trigger"`` decoded 0.9-2.1%
#: faster end to end on an H100 (1B and 0.6B shapes, 128 and 4k context), with the same bits.
MODE = "trigger"


def mode_for(interpret: bool) -> str:
    """The mode a kernel compiles under: :data:`MODE`, or ``"off"`` in the interpreter."""
    return "off" if interpret else MODE


def _instruction(asm: str, like: jax.Array) -> jax.Array:
    """``asm`` executed by each thread, returning ``like`` (int32) through a register the
    compiler cannot see into."""
    from jax.experimental.pallas import triton as plgpu

    [out] = plgpu.elementwise_inline_asm(
        f"{asm}\n\tmov.u32 $0, $1;", args=[like], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(like.shape, jnp.int32)])
    return out


def start(mode: str) -> jax.Array | None:
    """At a kernel's top: under ``"trigger"`` execute ``launch_dependents``; a bool ``[1]``
    (true) computed after it, for :func:`ready`."""
    if mode == "off":
        return None
    return _instruction("griddepcontrol.launch_dependents;", jnp.zeros((1,), jnp.int32)) >= 0


def ready(mode: str, started: jax.Array | None) -> jax.Array | None:
    """Before the first read of the kernel ahead's output: execute ``griddepcontrol.wait``;
    a bool ``[1]`` (true) computed after it and after :func:`start`'s, to mask those reads
    with (:func:`masked`)."""
    if mode == "off":
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


def check_mode(mode: Any) -> str:
    from turbospark_jax.errors import BadInputError

    if mode not in MODES:
        raise BadInputError(f"the PDL mode must be one of {MODES}; got {mode!r}")
    return mode
