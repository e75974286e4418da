"""The XLA compiler options of the runtime's device loops.

A decode burst is one XLA while loop over chunks of decode steps, and a burst of speculative
rounds nests the drafter's and the judge's loops inside its own. XLA can record loops and
conditionals as CUDA graphs whose conditions run on the device instead of reading each loop's
predicate back to the host. The package asks for that per program, never globally (it reads
and writes no environment variable), and only for two kinds of program:

* a decode program of a model whose widths agree (a draw plan,
  :func:`~turbospark_jax.engine.program.compiled_program`): without the graphs XLA reads the
  loop's condition back every chunk of steps and the device drains and waits for the host's
  next launches. Its loop is the simplest one there is (no conditional; an inner loop of fixed
  trip count), and recorded it gives the same bits as step-by-step decoding;
* a greedy burst of speculative rounds in the fixed form
  (:data:`~turbospark_jax.speculative.rounds.FIXED_ROUNDS` rounds, every loop of known trip
  count).

Every other program, sampled bursts of rounds included, compiles with XLA's default command
buffers: nested loops recorded as graphs have hung and given wrong tokens there.
"""

from __future__ import annotations

import os

#: The command buffer kinds of a decode program: XLA's defaults and while loops. A
#: per-program option names them all.
DECODE_COMMAND_BUFFERS = ("FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,CONDITIONAL,"
                          "DYNAMIC_SLICE_FUSION,WHILE")


def add_xla_flag(flag: str) -> bool:
    """Append ``--name=value`` to ``XLA_FLAGS`` unless a flag of that name is there already
    (the user's choice stands); returns whether it was appended. For harnesses that set up
    a process before its backend starts (the simulated-device checks); the runtime itself
    never calls it."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=", 1)[0] in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    return True


def decode_program_options() -> dict[str, str]:
    """The compiler options of a decode program: while loops recorded as CUDA graphs."""
    return {"xla_gpu_enable_command_buffer": DECODE_COMMAND_BUFFERS}


def fixed_rounds_options(greedy: bool) -> dict[str, str] | None:
    """The compiler options of a burst of rounds in the fixed form (every loop of known trip
    count): a decode program's for a greedy burst; ``None`` (XLA's defaults) for a sampled
    one, whose fixed form gave wrong tokens with its while loops recorded."""
    return decode_program_options() if greedy else None
