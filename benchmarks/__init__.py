"""Benchmarks: run on the GPU machine with ``python -m benchmarks.run --preset h200``.

Every benchmark runs under the XLA flags the package asks for (``turbospark_jax.device_flags``:
device loops as CUDA graphs), as the command line and a library user's process do: importing
the package here sets them before any benchmark can start a JAX backend.
``TURBOSPARK_LOOP_GRAPHS=0`` measures without.
"""

import turbospark_jax  # noqa: F401
