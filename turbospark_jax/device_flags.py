"""XLA settings the runtime's device loops run best under, applied before JAX starts a backend.

A decode burst is one XLA while loop over chunks of decode steps. Without command buffers for
loops, XLA's GPU runtime returns to the host at every iteration: it copies the loop's
predicate back, waits for the device to drain, and launches the next chunk's kernels one by
one, and the device idles meanwhile. With ``--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL``
the whole loop is recorded as one CUDA graph whose condition runs on the device.

Measured on an H100 (1B shape, row-invariant kernels, 128-step bursts; NOTES.md, "The
decode loop's costs beyond its kernels"): a traced burst's wall time fell from 1,464 to 1,338
us a token. The kernels and their order do not change, so neither does a bit of any result.

XLA reads ``XLA_FLAGS`` once, when the first backend starts; :func:`enable_loop_graphs` must
run before that, and importing ``turbospark_jax`` runs it first thing (so the command line,
the server, the benchmarks and a library user who imports the package before computing
anything with JAX all get it). A flag the user set for command buffers is left as it is, and
``TURBOSPARK_LOOP_GRAPHS=0`` turns the setting off.
"""

from __future__ import annotations

import os

#: Adds while loops and conditionals to the command buffer kinds XLA records by default.
LOOP_GRAPHS_FLAG = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
#: Environment switch: ``0`` leaves ``XLA_FLAGS`` alone.
OPT_OUT = "TURBOSPARK_LOOP_GRAPHS"


def add_xla_flag(flag: str) -> bool:
    """Append ``--name=value`` to ``XLA_FLAGS`` unless a flag of that name is there already
    (the user's choice stands); returns whether it was appended. Before a backend starts (the
    simulated-device checks use it, since importing this package has put a flag there)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=", 1)[0] in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    return True


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - JAX is a dependency
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if callable(started) else False


def enable_loop_graphs() -> bool:
    """Ask XLA to record device loops as CUDA graphs; returns whether ``XLA_FLAGS`` changed.

    Leaves the flags alone (and returns ``False``) when the user already chose a command
    buffer setting, when ``TURBOSPARK_LOOP_GRAPHS=0``, or when a JAX backend has already
    started (the setting would not take effect, and a half-applied one is worse than none).
    The flag is harmless on a CPU, which has no command buffers.
    """
    if os.environ.get(OPT_OUT, "1").strip() == "0" or _backends_started():
        return False
    return add_xla_flag(LOOP_GRAPHS_FLAG)
