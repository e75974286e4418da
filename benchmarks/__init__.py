"""The benchmark suites: ``python -m benchmarks --suite decode --preset h100``.

``decode``, ``prefill``, ``speculative``, ``serve``, ``kernels`` and ``train`` (``--suite all``
runs them in that order), each with presets ``smoke``, ``cpu``, ``h100`` and ``h200``, write
``benchmarks/results/<suite>_<preset>.json``; ``python -m benchmarks --report`` rebuilds
``benchmarks/results/REPORT.md`` and its plots from those files. The suites build models
through the package as a user's process does, so they measure its own compiler settings.
"""
