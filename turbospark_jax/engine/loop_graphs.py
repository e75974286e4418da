"""XLA settings for the runtime's device loops, applied before JAX starts a backend; off
unless asked for.

A decode burst is one XLA while loop over chunks of decode steps, and a burst of speculative
rounds nests the drafter's and the judge's loops inside its own. XLA can record loops and
conditionals as CUDA graphs whose conditions run on the device
(``--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL``) instead of reading each loop's
predicate back to the host.

Until 2026-12-06 importing the package asked for that setting in every program. On an H100
(jax 0.11.2) it made the speculative rounds' nested loops hang (a sampled draft-model burst
ran for minutes) and give wrong tokens now and then (recurrent targets' device rounds against
the host loop's, a greedy host loop once), where the same tests pass without it (NOTES.md,
"The loop graphs out of every program but decode"). So the package leaves ``XLA_FLAGS``
alone unless ``TURBOSPARK_LOOP_GRAPHS=1`` asks for the setting in every program (to measure
it: it is not known safe).

Two kinds of program keep the loops in graphs. The first is a decode program of a model
whose widths agree (a draw plan, :func:`~turbospark_jax.engine.program.compiled_program`),
compiled with :func:`decode_program_options`. Its loop is what the graphs were for: without
them XLA reads the loop's condition back every chunk of steps and the device drains and waits
for the host's next launches, 6-7% of the 1B's and 0.6B's decode on that H100. Its shape is the
simplest of the loops (no conditional; an inner loop of fixed trip count), and every bitwise
check of those programs on the GPU since the setting came in (each burst against
step-by-step decoding, the benchmarks' exact part at three shapes) ran them with it.
``TURBOSPARK_LOOP_GRAPHS=0`` takes it from them too. The second kind is a greedy burst of
speculative rounds in the fixed form (:data:`~turbospark_jax.speculative.rounds.FIXED_ROUNDS`
rounds,
every loop of known trip count: :func:`fixed_rounds_options`); sampled bursts are left out.

XLA reads ``XLA_FLAGS`` once, when the first backend starts; :func:`enable_loop_graphs` must
run before that, and importing ``turbospark_jax`` runs it first thing. A flag the user set for
command buffers is left as it is.
"""

from __future__ import annotations

import os

#: Adds while loops and conditionals to the command buffer kinds XLA records by default.
LOOP_GRAPHS_FLAG = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
#: Environment switch: ``1`` asks for the loop graphs; anything else (or nothing) leaves
#: ``XLA_FLAGS`` alone.
OPT_IN = "TURBOSPARK_LOOP_GRAPHS"


def add_xla_flag(flag: str) -> bool:
    """Append ``--name=value`` to ``XLA_FLAGS`` unless a flag of that name is there already
    (the user's choice stands); returns whether it was appended. Before a backend starts (the
    simulated-device checks use it, since importing this package has put a flag there)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=", 1)[0] in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    return True


#: The command buffer kinds of a decode program: XLA's defaults in jax 0.10 and 0.11
#: (as ``XLA_FLAGS`` leaves them) and while loops. A per-program option names them all.
DECODE_COMMAND_BUFFERS = ("FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,CONDITIONAL,"
                          "DYNAMIC_SLICE_FUSION,WHILE")


def decode_program_options() -> dict[str, str] | None:
    """The compiler options of a decode program (while loops in command buffers), or ``None``
    when the switch is ``0``, or when ``XLA_FLAGS`` already says what to record (the user's
    choice, or the switch's ``1`` for every program)."""
    if os.environ.get(OPT_IN, "").strip() == "0":
        return None
    if "--xla_gpu_enable_command_buffer" in os.environ.get("XLA_FLAGS", ""):
        return None
    return {"xla_gpu_enable_command_buffer": DECODE_COMMAND_BUFFERS}


#: Environment switch for the speculative rounds' fixed form: ``0`` compiles those programs
#: with XLA's default command buffers (each round's conditional then reads its predicate back
#: to the host whenever the round holds a loop: a draft model's, the MTP head's chain).
FIXED_ROUNDS_GRAPHS = "TURBOSPARK_FIXED_ROUNDS_GRAPHS"


def fixed_rounds_options(greedy: bool) -> dict[str, str] | None:
    """The compiler options of a burst of rounds in the fixed form (every loop of known trip
    count): a decode program's (:func:`decode_program_options`, while loops recorded) for a
    greedy burst, ``None`` (XLA's defaults) for a sampled one or when
    :data:`FIXED_ROUNDS_GRAPHS` is ``0``.

    Sampled bursts are left out because on an H100 (jax 0.11.2) their fixed form gave wrong
    tokens with while loops recorded; greedy ones gave the ``while_loop``'s bits in every GPU
    test (NOTES.md, session 49)."""
    if not greedy or os.environ.get(FIXED_ROUNDS_GRAPHS, "").strip() == "0":
        return None
    return decode_program_options()


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - JAX is a dependency
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if callable(started) else False


def enable_loop_graphs() -> bool:
    """Ask XLA to record device loops as CUDA graphs when ``TURBOSPARK_LOOP_GRAPHS=1``;
    returns whether ``XLA_FLAGS`` changed.

    Leaves the flags alone (and returns ``False``) unless the switch is ``1``, when the user
    already chose a command buffer setting, or when a JAX backend has already started (the
    setting would not take effect, and a half-applied one is worse than none). The flag is
    harmless on a CPU, which has no command buffers.
    """
    if os.environ.get(OPT_IN, "").strip() != "1" or _backends_started():
        return False
    return add_xla_flag(LOOP_GRAPHS_FLAG)
