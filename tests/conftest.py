"""Shared test settings: small hypothesis budgets (CI has 2 cores) and no deadlines (the first
example of a property compiles its program)."""

import os
import tempfile

from hypothesis import HealthCheck, settings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the whole run: the workers, and the subprocesses some tests start
# (CLI runs, notebooks, the multi-device checks), compile many of the same programs; each is
# compiled once and read back after. Keyed on the program and the jax version, so a stale
# entry cannot be used. Set TSJ_TEST_COMPILE_CACHE= (empty) to compile everything afresh.
_cache = os.environ.get("TSJ_TEST_COMPILE_CACHE",
                        os.path.join(tempfile.gettempdir(), "tsj-test-compile-cache"))
if _cache:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # A size limit turns on the cache's file lock; without one, jax writes an entry in place
    # and a process reading it meanwhile can load half an executable (a worker died so, in
    # XLA's deserialisation, twice in local runs with several processes sharing the cache).
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(32 << 30))
if os.environ["JAX_PLATFORMS"] == "cpu" and "XLA_FLAGS" not in os.environ:
    # The tests' models are tiny: compiling, not running, is most of the suite's time. Less
    # LLVM optimisation compiles about 30% faster; the arithmetic is the same (no fast-math
    # reassociation either way), and every bitwise property compares programs compiled alike.
    os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 "
                               "--xla_llvm_disable_expensive_passes=true")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers may share one accelerator: none may claim most of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Examples a property, by profile (HYPOTHESIS_PROFILE): "ci" by default; "quick" for checks
# on the GPU machine, whose time is rationed; "thorough" for hunting rare cases by hand.
for name, examples in {"ci": 15, "quick": 5, "thorough": 300}.items():
    settings.register_profile(
        name,
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
