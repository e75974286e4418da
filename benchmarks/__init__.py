"""Benchmarks: run on the GPU machine with ``python -m benchmarks.run --preset h200``.

Every benchmark runs under the XLA settings the package chooses
(``turbospark_jax.engine.loop_graphs``:
a row-invariant model's decode programs with their loops as CUDA graphs, nothing else), as the
command line and a library user's process do: importing the package here applies them before
any benchmark can start a JAX backend. ``TURBOSPARK_LOOP_GRAPHS=0`` measures without the
graphs, ``TURBOSPARK_LOOP_GRAPHS=1`` with them in every program.
"""

import turbospark_jax  # noqa: F401
