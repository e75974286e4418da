"""The program store: whole executables kept on disk under a key made without tracing, read
back by a later store (a later process) with no trace and no lowering; anything the key
cannot describe exactly runs as an ordinary ``jit`` call."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.quant.tiny import QWEN35
from turbospark_jax.core import compile_cache
from turbospark_jax.core.compile_cache import ProgramStore
from turbospark_jax.core.constraints import ConstraintSpec
from turbospark_jax.models.qwen3_5.model import Qwen35Model


def _step(scale, state, tokens, *, shift):
    """A small program with a pytree argument, a donated one and a static keyword."""
    total = state["total"] + jnp.sum(tokens) * scale["w"] + shift
    return {"total": total}, total * 2


def _jitted():
    """A fresh jit of the same function (a new process would make its own)."""
    return jax.jit(functools.partial(_step), donate_argnums=(1,), static_argnames=("shift",))


def _args():
    return ({"w": np.float32(1.5)}, {"total": jnp.zeros((4,), jnp.float32)},
            np.arange(6, dtype=np.int32))


class _Traces:
    """Counts traces and lowerings while it listens."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration")

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._hear)
        return self

    def _hear(self, event, duration, **_):
        if event in self.EVENTS:
            self.count += 1

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._hear)


IDENTITY = ("tests.core._step", 1)

_JAX_CACHE = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
              "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture(autouse=True)
def fresh_jax_cache(tmp_path):
    """JAX's persistent cache in a folder of the test's own, as the command line keeps it:
    the store keeps only programs compiled afresh, never one JAX read back."""
    from jax.experimental.compilation_cache import compilation_cache

    own = {name: getattr(jax.config, name) for name in _JAX_CACHE}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()
    jax.clear_caches()
    yield
    for name, value in own.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def test_a_stored_program_is_read_back_untraced_with_the_same_results(tmp_path):
    tmp_path = tmp_path / "programs"
    first = ProgramStore(tmp_path)
    got = first.call(_jitted(), IDENTITY, _args(), {"shift": 2})
    assert (first.hits, first.writes) == (0, 1)
    assert len(list(tmp_path.glob("*.program"))) == 1
    expected = _jitted()(*_args(), shift=2)
    jax.clear_caches()  # nothing of the first store's work is left in memory
    second = ProgramStore(tmp_path)
    jitted, args, more_args = _jitted(), _args(), _args()
    with _Traces() as traces:
        again = second.call(jitted, IDENTITY, args, {"shift": 2})
        again_twice = second.call(jitted, IDENTITY, more_args, {"shift": 2})
    assert traces.count == 0 and (second.hits, second.writes) == (1, 0)
    for result in (got, again, again_twice):
        assert np.array_equal(result[1], expected[1])
        assert np.array_equal(result[0]["total"], expected[0]["total"])
    # the controls: another static value and another shape are new programs, traced and
    # stored beside it
    with _Traces() as traces:
        other = second.call(_jitted(), IDENTITY, _args(), {"shift": 3})
    assert traces.count > 0 and second.writes == 1
    assert not np.array_equal(other[1], expected[1])
    scale, state, tokens = _args()
    second.call(_jitted(), IDENTITY, (scale, state, tokens[:5]), {"shift": 2})
    assert second.writes == 2 and len(list(tmp_path.glob("*.program"))) == 3
    # another identity is another key; its program, the first one's, comes from JAX's
    # cache (deserialized: not stored again, see ProgramStore._compiled)
    with _Traces() as traces:
        same = second.call(_jitted(), ("tests.core._step", 2), _args(), {"shift": 2})
    assert traces.count > 0 and second.writes == 2
    assert np.array_equal(same[1], expected[1])


def test_the_key_sees_every_field_of_a_model():
    """Two models that differ only in one field are two programs, and so are two values
    that differ only in a field hidden from their repr; a class from outside the package
    (its code is not in the key) is not keyed at all."""
    store = ProgramStore("unused")
    signature = ("a signature",)
    model = Qwen35Model(QWEN35)
    pinned = model.interpreted()  # only the kernel plan differs
    keys = {store._key(m, signature) for m in (model, pinned, Qwen35Model(QWEN35))}
    assert None not in keys and len(keys) == 2
    hidden = [ConstraintSpec("regex", "a+", compiled) for compiled in ("one", "two")]
    assert repr(hidden[0]) == repr(hidden[1])
    assert store._key(hidden[0], signature) != store._key(hidden[1], signature)

    @dataclasses.dataclass(frozen=True)
    class Outside:
        size: int = 1

    assert store._key(("x", Outside()), signature) is None
    assert store._key(("x", object()), signature) is None


def test_an_undescribable_identity_runs_as_a_plain_jit_call(tmp_path):
    tmp_path = tmp_path / "programs"
    store = ProgramStore(tmp_path)
    result = store.call(_jitted(), ("x", object()), _args(), {"shift": 2})
    assert np.array_equal(result[1], _jitted()(*_args(), shift=2)[1])
    assert store.writes == 0 and not tmp_path.exists()


def test_inside_another_trace_the_call_is_inlined_and_nothing_is_stored(tmp_path):
    tmp_path = tmp_path / "programs"
    store = ProgramStore(tmp_path)
    jitted = _jitted()

    @jax.jit
    def outer(tokens):
        scale, state, _ = _args()
        return store.call(jitted, IDENTITY, (scale, state, tokens), {"shift": 2})[1]

    assert np.array_equal(outer(_args()[2]), _jitted()(*_args(), shift=2)[1])
    assert store.writes == 0 and not tmp_path.exists()


def test_a_damaged_entry_is_a_miss_and_is_removed(tmp_path):
    tmp_path = tmp_path / "programs"
    ProgramStore(tmp_path).call(_jitted(), IDENTITY, _args(), {"shift": 2})
    (entry,) = tmp_path.glob("*.program")
    entry.write_bytes(entry.read_bytes()[:100])  # a damaged entry
    store = ProgramStore(tmp_path)
    result = store.call(_jitted(), IDENTITY, _args(), {"shift": 2})
    assert (store.hits, store.writes) == (0, 0)
    assert np.array_equal(result[1], _jitted()(*_args(), shift=2)[1])
    assert not entry.exists()


def test_a_program_jax_read_back_is_not_stored(tmp_path):
    """A CPU executable that was itself deserialized serializes without some of its
    functions (a later process could not run it): only a fresh compile is stored."""
    _jitted()(*_args(), shift=2)  # compiled and written to JAX's cache
    jax.clear_caches()
    store = ProgramStore(tmp_path / "programs")
    result = store.call(_jitted(), IDENTITY, _args(), {"shift": 2})
    assert store.writes == 0 and not (tmp_path / "programs").exists()
    assert np.array_equal(result[1], _jitted()(*_args(), shift=2)[1])


def test_the_store_keeps_the_most_recent_entries(tmp_path, monkeypatch):
    tmp_path = tmp_path / "programs"
    monkeypatch.setattr(compile_cache, "MAX_PROGRAMS", 2)
    store = ProgramStore(tmp_path)
    for n in (3, 4, 5):
        scale, state, tokens = _args()
        store.call(_jitted(), IDENTITY, (scale, state, tokens[:n]), {"shift": 2})
    assert store.writes == 3 and len(list(tmp_path.glob("*.program"))) == 2


@pytest.fixture
def no_store():
    yield
    compile_cache.use_program_store(None)


def test_the_store_is_off_unless_asked_for(tmp_path, no_store):
    assert compile_cache.program_store() is None  # the library's default
    store = compile_cache.use_program_store(tmp_path)
    assert compile_cache.program_store() is store and store.folder == tmp_path
    assert compile_cache.use_program_store(None) is None
    assert compile_cache.program_store() is None
