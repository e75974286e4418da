"""JAX's persistent compilation cache, on by default for the command line, the server and
``tsj.load``.

Compiling the block programs dominates a short run; a compiled program written to disk is
read back by the next process that builds the same program, so a second identical command
skips most of its compile. The cache lives in a per-user folder
(``$XDG_CACHE_HOME/turbospark_jax/jax``, else ``~/.cache/turbospark_jax/jax``);
``TURBOSPARK_COMPILE_CACHE`` names another folder, or ``off`` turns it off, and
:func:`use_compile_cache` does either from Python (the command line's ``--compile-cache DIR``
and ``--no-compile-cache``).

Programs are cached whatever their size or compile time (JAX's defaults skip programs that
compile in under a second, which is most of ours on a fast machine). Several processes may
share the folder: with the ``filelock`` package present the cache is size-bounded
(:data:`MAX_BYTES`, least recently used entries go first), which makes JAX take a file lock
around every read and write; without it, a read that meets a half-written entry fails its
decompression and JAX compiles the program instead (a warning, never a wrong program).

A process whose JAX configuration already names a cache folder (``JAX_COMPILATION_CACHE_DIR``
or ``jax.config.update``) keeps it with its own settings: the default never overrides the
user's own choice (``TURBOSPARK_COMPILE_CACHE`` and an explicit folder do).

JAX's cache is keyed by the lowered program, so a process that reads a program back has
still traced and lowered it, which for the block program is most of a warm start.
:class:`ProgramStore` keeps whole executables under a key computed without tracing: the
package's source, the library versions, the backend and its CPU, the JAX configuration,
the environment's JAX and XLA settings, the model's every field and the call's argument
types. Anything it cannot describe exactly makes the call an ordinary ``jit`` call, so a
changed input is a miss, never a stale program. The command line turns it on
(:func:`use_program_store`, in the cache folder's ``programs``); the library leaves it off,
where a test may patch a model's code in memory without changing a source file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import importlib.util
import os
import pickle
import platform
import re
import sys
import threading
import zlib
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from turbospark_jax.errors import BadInputError

__all__ = [
    "ENVIRONMENT",
    "MAX_BYTES",
    "CacheSetting",
    "ProgramStore",
    "compile_cache_setting",
    "default_folder",
    "ensure_compile_cache",
    "program_store",
    "use_compile_cache",
    "use_program_store",
]

#: The environment variable that moves the cache (a folder) or turns it off (``off``).
ENVIRONMENT = "TURBOSPARK_COMPILE_CACHE"

#: The cache's bound when ``filelock`` is installed (the bound is what makes JAX lock).
MAX_BYTES = 4 << 30

#: Values of :data:`ENVIRONMENT` that turn the cache off.
_OFF = ("off", "0", "false", "no", "none")


@dataclasses.dataclass(frozen=True)
class CacheSetting:
    """Where compiled programs go.

    Fields:
      folder: the cache folder (``None``: off).
      source: what chose it: ``"default"``, ``"environment"``, ``"argument"`` or ``"jax"``
        (the process's own JAX setting).
      locked: whether processes sharing the folder take a file lock around each entry.
    """

    folder: Path | None
    source: str
    locked: bool = False

    def describe(self) -> str:
        """One phrase for ``--stats``: where the cache is, or that it is off and why."""
        if self.folder is None:
            why = {"environment": f" ({ENVIRONMENT}=off)", "argument": ""}.get(self.source, "")
            return f"compile cache off{why}"
        return f"compile cache {self.folder}" + (" (JAX's own setting)" if self.source == "jax"
                                                 else "")


#: The setting in force, once one was made (``None``: not yet).
_current: CacheSetting | None = None


def default_folder() -> Path:
    """``$XDG_CACHE_HOME/turbospark_jax/jax``, or ``~/.cache/turbospark_jax/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "turbospark_jax" / "jax"


def _from_environment() -> CacheSetting | None:
    value = os.environ.get(ENVIRONMENT, "").strip()
    if not value:
        return None
    if value.lower() in _OFF:
        return CacheSetting(None, "environment")
    return CacheSetting(Path(value).expanduser(), "environment")


#: The JAX settings this module changes.
_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")

#: Their values before this module first changed them: the process's own.
_own: dict[str, object] | None = None


def _jax_own() -> dict[str, object]:
    global _own
    if _own is None:
        import jax

        _own = {name: getattr(jax.config, name) for name in _SETTINGS}
    return _own


def _from_jax() -> CacheSetting | None:
    """The folder the process's own JAX configuration named before this module changed it
    (``JAX_COMPILATION_CACHE_DIR``, ``jax.config.update``), if any."""
    own = _jax_own()
    folder = own["jax_compilation_cache_dir"]
    if not folder:
        return None
    return CacheSetting(Path(str(folder)), "jax",
                        locked=own["jax_compilation_cache_max_size"] != -1)


def use_compile_cache(folder: str | os.PathLike[str] | bool | None = True) -> CacheSetting:
    """Turn the persistent compilation cache on in ``folder`` (``True``: the folder
    :data:`ENVIRONMENT` names; else the one the process's JAX configuration already names,
    kept with its own settings; else :func:`default_folder`) or off (``False``, ``None`` or
    ``"off"``); returns the setting. Programs compiled before the call stay where they
    were; later ones use the new setting.

    Raises:
      BadInputError: ``folder`` names a file, or a folder that cannot be made.
    """
    global _current
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    own = _jax_own()
    if folder is True:
        setting = _from_environment() or _from_jax() or CacheSetting(default_folder(),
                                                                     "default")
        if setting.source == "jax":  # the process's own JAX settings stand as they were
            for name, value in own.items():
                jax.config.update(name, value)
            jax_cache.reset_cache()
            _current = setting
            return setting
    elif folder is False or folder is None or (isinstance(folder, str)
                                               and folder.strip().lower() in _OFF):
        setting = CacheSetting(None, "argument")
    elif isinstance(folder, str | os.PathLike):
        setting = CacheSetting(Path(folder).expanduser(), "argument")
    else:
        raise BadInputError(f"compile_cache must be a folder path, True or False, got "
                            f"{type(folder).__name__}")
    if setting.folder is not None:
        if setting.folder.exists() and not setting.folder.is_dir():
            raise BadInputError(f"the compile cache {setting.folder} is a file, not a folder")
        try:
            setting.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInputError(f"cannot make the compile cache folder {setting.folder}: "
                                f"{exc.strerror or exc}") from exc
        locked = importlib.util.find_spec("filelock") is not None
        setting = dataclasses.replace(setting, locked=locked)
        jax.config.update("jax_compilation_cache_dir", str(setting.folder))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES if locked else -1)
    else:
        jax.config.update("jax_compilation_cache_dir", None)
    # A cache JAX already opened keeps its folder until it is reset.
    jax_cache.reset_cache()
    _current = setting
    return setting


def ensure_compile_cache() -> CacheSetting:
    """The setting in force, making the default one on first use (:func:`use_compile_cache`
    with ``True``: the environment's folder, else the process's own JAX setting, else the
    per-user folder)."""
    return _current if _current is not None else use_compile_cache(True)


def compile_cache_setting() -> CacheSetting | None:
    """The setting in force (``None``: none was made in this process)."""
    return _current


#: Executables a :class:`ProgramStore` keeps; the least recently used go first past it.
MAX_PROGRAMS = 64

#: The suffix of a stored executable (JAX's own entries end in ``-cache``).
_PROGRAM_SUFFIX = ".program"

#: Bumped whenever what a stored entry holds, or how its key is made, changes.
_STORE_FORMAT = "turbospark-program-1"


#: Packages whose classes a key may name: this one (its source is in the key), and
#: NumPy's and JAX's, whose versions are.
_DESCRIBED_PACKAGES = ("turbospark_jax", "numpy", "jax", "jaxlib", "ml_dtypes")

#: The libraries whose versions go into every key (a trace runs their code).
_LIBRARIES = ("jax", "jaxlib", "numpy", "ml_dtypes", "flax", "chex")


class _Undescribable(Exception):
    """A value whose exact description is unknown: the call is not stored."""


def _describe(value: Any) -> Any:
    """A plain, repr-stable description of ``value`` (a model and its settings): every field
    of a dataclass (those hidden from its repr too), containers item by item, arrays by
    their bytes. Raises :class:`_Undescribable` for anything else."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return (type(value).__name__, repr(value))
    if isinstance(value, enum.Enum | type) or dataclasses.is_dataclass(value):
        cls = value if isinstance(value, type) else type(value)
        if cls.__module__.split(".")[0] not in _DESCRIBED_PACKAGES:
            # its code is not in the source digest: an edit to it would not change the key
            raise _Undescribable(f"{cls.__module__}.{cls.__qualname__}")
    if isinstance(value, enum.Enum):
        return ("enum", type(value).__qualname__, value.name)
    if isinstance(value, type):
        return ("type", value.__module__, value.__qualname__)
    if dataclasses.is_dataclass(value):
        cls = type(value)
        return ("dataclass", cls.__module__, cls.__qualname__,
                tuple((f.name, _describe(getattr(value, f.name)))
                      for f in dataclasses.fields(value)))
    if isinstance(value, tuple | list | frozenset | set):
        items = [_describe(v) for v in value]
        if isinstance(value, frozenset | set):
            items.sort(key=repr)
        return (type(value).__name__, tuple(items))
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((repr(k), _describe(v)) for k, v in value.items()),
                                     key=lambda kv: kv[0])))
    import numpy as np

    if isinstance(value, np.dtype):
        return ("dtype", value.str, value.name)
    if isinstance(value, np.generic | np.ndarray) or type(value).__module__.startswith("jax"):
        try:
            array = np.asarray(value)
        except Exception as exc:  # a tracer, a device-only value
            raise _Undescribable(type(value).__name__) from exc
        if array.dtype == object:
            raise _Undescribable("an object array")
        return ("array", array.shape, array.dtype.str,
                hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest())
    raise _Undescribable(type(value).__qualname__)


#: The package's source digest, made once per process.
_source_digest: str | None = None


def _package_digest() -> str:
    """A digest of every Python file of the package: any edit makes every key new."""
    global _source_digest
    if _source_digest is None:
        root = Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(b"\0")
            h.update(path.read_bytes())
        _source_digest = h.hexdigest()
    return _source_digest


def _cpu_features() -> str:
    """The host CPU's feature flags where the system tells them (an executable for the CPU
    is machine code for this processor)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[-1].strip()
    return platform.processor()


def _setting_digest() -> str:
    """What besides the program decides its executable: library versions, the backend and
    its devices, the host CPU, the JAX configuration (global and this thread's) and the
    environment's JAX and XLA settings."""
    import importlib.metadata

    import jax
    from jax._src import config as jax_config

    versions = [sys.version]
    for name in _LIBRARIES:
        try:
            versions.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            versions.append((name, None))
    devices = [(d.platform, d.device_kind, d.id, getattr(d.client, "platform_version", ""))
               for d in jax.devices()]
    config = sorted((name, repr(value)) for name, value in jax.config.values.items())
    # Outside any trace (the store passes tracers by) the context's objects are the empty
    # defaults, whose reprs differ from process to process only by their addresses.
    trace_context = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(jax_config.trace_context())
                           if hasattr(jax_config, "trace_context") else "")
    environment = sorted((k, v) for k, v in os.environ.items()
                         if k.startswith(("JAX_", "XLA_", "TF_", "TURBOSPARK_", "LIBTPU",
                                          "CUDA", "NVIDIA_", "TPU_")))
    text = repr((versions, devices, platform.machine(), _cpu_features(), config,
                 trace_context, environment))
    return hashlib.sha256(text.encode()).hexdigest()


def _signature(args: tuple[Any, ...], statics: dict[str, Any]) -> Hashable | None:
    """The call's argument types as a hashable key (``None``: a call the store passes by:
    an argument on several devices, or one that is not an array)."""
    import jax

    leaves, tree = jax.tree.flatten(args)
    types = []
    default = None
    for leaf in leaves:
        if isinstance(leaf, jax.core.Tracer):  # called inside another trace: inlined there
            return None
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:  # a host value: it goes to the default device
            if default is None:
                default = jax.config.jax_default_device or jax.devices()[0]
                default = getattr(default, "id", default)
            device = default
        elif len(sharding.device_set) == 1:
            device = next(iter(sharding.device_set)).id
        else:
            return None
        try:
            types.append((jax.typeof(leaf), device))
        except TypeError:
            return None
    try:
        return tree, tuple(sorted(statics.items())), tuple(types)
    except TypeError:  # an unhashable static
        return None


class _Heard:
    """Whether the compile it wraps compiled afresh: JAX asked its persistent cache and did
    not find the program (no event at all: this process had it in memory). JAX tells its
    listeners in the thread that compiles, so another thread's compile is not heard."""

    def __enter__(self) -> _Heard:
        import jax.monitoring

        self._events: set[str] = set()
        self._thread = threading.get_ident()
        jax.monitoring.register_event_listener(self._hear)
        return self

    def _hear(self, event: str, **_: Any) -> None:
        if threading.get_ident() == self._thread:
            self._events.add(event)

    def __exit__(self, *exc: object) -> None:
        import jax.monitoring

        jax.monitoring.unregister_event_listener(self._hear)

    @property
    def fresh(self) -> bool:
        return ("/jax/compilation_cache/compile_requests_use_cache" in self._events
                and "/jax/compilation_cache/cache_hits" not in self._events)


class ProgramStore:
    """Compiled programs kept on disk under a key that needs no tracing (see the module
    docstring); at most :data:`MAX_PROGRAMS` of them, the least recently used evicted.

    Fields:
      folder: where the entries live.
      hits: programs this process read back from the folder.
      writes: programs this process compiled and wrote to it.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.hits = 0
        self.writes = 0
        self._loaded: dict[Hashable, Any] = {}

    def call(self, jitted: Any, identity: Any, args: tuple[Any, ...],
             statics: dict[str, Any]) -> Any:
        """``jitted(*args, **statics)`` (every keyword static), run by the executable stored
        for ``identity`` (what, besides the arguments, decides the program: the function,
        its model, its jit options) and these argument types; compiled and stored first
        when there is none. An identity or argument the store cannot describe exactly runs
        ``jitted`` as it is."""
        signature = _signature(args, statics)
        if signature is None:
            return jitted(*args, **statics)
        compiled = self._loaded.get((jitted, signature))
        if compiled is None:
            compiled = self._compiled(jitted, identity, args, statics, signature)
            if compiled is None:
                return jitted(*args, **statics)
            self._loaded[jitted, signature] = compiled
        return compiled(*args)

    def _key(self, identity: Any, signature: Hashable) -> str | None:
        """The entry's name (``None``: a call the store cannot key exactly, which runs as an
        ordinary ``jit`` call)."""
        try:
            text = repr((_STORE_FORMAT, _package_digest(), _setting_digest(),
                         _describe(identity), signature))
        except Exception:  # undescribable, or a JAX without what the key reads
            return None
        return hashlib.sha256(text.encode()).hexdigest()

    def _compiled(self, jitted: Any, identity: Any, args: tuple[Any, ...],
                  statics: dict[str, Any], signature: Hashable) -> Any:
        from jax.experimental import serialize_executable

        key = self._key(identity, signature)
        if key is None:
            return None
        path = self.folder / f"{key}{_PROGRAM_SUFFIX}"
        compiled = self._read(path)
        if compiled is not None:
            self.hits += 1
            return compiled
        lowered = jitted.trace(*args, **statics).lower()
        with _Heard() as heard:
            compiled = lowered.compile()
        if not heard.fresh:
            # Read from JAX's cache, or compiled earlier in this process: a CPU executable
            # that was itself deserialized serializes without some of its functions.
            return compiled
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            blob = pickle.dumps((zlib.compress(payload, 1), in_tree, out_tree))
        except Exception:  # a program this backend or JAX cannot serialize: not stored
            return compiled
        self._write(path, blob)
        return compiled

    def _read(self, path: Path) -> Any:
        """The executable stored at ``path`` (``None``: none, or one that does not load: a
        half-written or foreign entry is a miss, and is written again)."""
        from jax.experimental import serialize_executable

        try:
            blob = path.read_bytes()
        except OSError:
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(blob)
            compiled = serialize_executable.deserialize_and_load(
                zlib.decompress(payload), in_tree, out_tree)
        except Exception:  # any failure to load is a miss: the program compiles instead
            with contextlib.suppress(OSError):
                path.unlink()  # entries are written whole: this one will never load
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used
        return compiled

    def _write(self, path: Path, blob: bytes) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            scratch.write_bytes(blob)
            os.replace(scratch, path)  # readers see a whole entry or none
        except OSError:
            return  # a read-only or full disk: the run goes on uncached
        self.writes += 1
        self._evict()

    def _evict(self) -> None:
        entries = []
        for entry in self.folder.glob(f"*{_PROGRAM_SUFFIX}"):
            with contextlib.suppress(OSError):
                entries.append((entry.stat().st_mtime, entry))
        entries.sort()
        for _, entry in entries[:max(0, len(entries) - MAX_PROGRAMS)]:
            with contextlib.suppress(OSError):
                entry.unlink()


#: The store in force (``None``: off, the default).
_store: ProgramStore | None = None


def use_program_store(
        folder: str | os.PathLike[str] | ProgramStore | None) -> ProgramStore | None:
    """Keep whole executables in ``folder`` from now on (a store: that one; ``None``: stop);
    returns the store in force."""
    global _store
    _store = folder if folder is None or isinstance(folder, ProgramStore) else ProgramStore(
        folder)
    return _store


def program_store() -> ProgramStore | None:
    """The store in force (``None``: off)."""
    return _store

