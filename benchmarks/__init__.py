"""The benchmark suites: ``python -m benchmarks --suite decode --preset h100``.

``decode``, ``prefill``, ``speculative``, ``serve``, ``kernels`` and ``train`` (``--suite all``
runs them in that order), each with presets ``smoke``, ``cpu``, ``h100`` and ``h200``, write
``benchmarks/results/<suite>_<preset>.json``; ``python -m benchmarks --report`` rebuilds
``benchmarks/results/REPORT.md`` and its plots from those files.

Every suite runs under the XLA settings the package chooses, as the command line and a
library user's process do: importing the package here applies them before any suite can
start a JAX backend.
"""

import turbospark_jax  # noqa: F401
