"""Shared test settings: small hypothesis budgets (CI has 2 cores) and no deadlines (the first
example of a property compiles its program)."""

import gc
import os
import tempfile

import pytest
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
    # No size limit: with one, jax takes a file lock for every read and, for every write,
    # lists and stats the whole cache under that lock, which made a cold suite run slower
    # than no cache at all. A read that meets an entry still being written fails to
    # decompress, and jax then warns and compiles afresh.
else:  # nor may the library's own per-user cache fill the home folder from the tests
    os.environ.setdefault("TURBOSPARK_COMPILE_CACHE", "off")
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


def _mapped_regions() -> int | None:
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return None


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop jax's compiled programs after a test file once the process maps more than half
    of the kernel's limit on memory regions. Every XLA CPU executable maps about 20 regions
    and stays loaded while jax caches it, so a worker that compiles a few thousand programs
    reaches ``vm.max_map_count`` (65,530 by default), and the next compile or cache load
    then dies in XLA with a segmentation fault: measured here, a worker grew by about 1,000
    regions every 15 s of the suite, and the suite's workers crashed so after 15 minutes.
    Programs a later file needs again are compiled again (or read from the disk cache)."""
    yield
    regions = _mapped_regions()
    if regions is not None and regions > _map_limit() // 2:
        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="module")
def full_precision_products():
    """Float32 products at full precision for a whole test file (``pytestmark =
    pytest.mark.usefixtures("full_precision_products")``): on a GPU the default rounds their
    inputs to TF32, which misses the 1e-4 parity bars; a no-op on the CPU. Programs a file
    compares bitwise with each other are then all compiled under it."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture
def no_tensor_read(monkeypatch):
    """Fail the test if the loader reads a tensor (a refusal must come before any read)."""
    from turbospark_jax.io import loading

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(loading, "_read_params", refuse)


@pytest.fixture
def key_bounds_seen(monkeypatch):
    """The dense model declares ``bounds_keys`` in its row-invariant mode here too (on the CPU,
    where its XLA attention ignores the hint), and every ``max_keys`` its attention is handed
    while a program is traced goes into the list this returns (``None``: unbounded). The
    caches of traced programs are cleared first: a program an earlier test in the same worker
    traced would otherwise be reused untraced, and the list would miss it."""
    import jax

    from turbospark_jax.models.dense import model as dense

    jax.clear_caches()
    seen = []
    real = dense.cached_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("max_keys"))
        return real(*args, **kwargs)

    monkeypatch.setattr(dense, "cached_attention", spy)
    monkeypatch.setattr(dense.DenseModel, "bounds_keys",
                        property(lambda m: m.plan.row_invariant))
    return seen


@pytest.fixture
def requests_seen(monkeypatch):
    """Every request ``tsj.stream`` hands the driver goes into the list this returns."""
    from turbospark_jax import api

    seen = []
    original = api.stream_completion

    def recording(producer, request, **kwargs):
        seen.append(request)
        return original(producer, request, **kwargs)

    monkeypatch.setattr(api, "stream_completion", recording)
    return seen
