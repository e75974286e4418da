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
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

from turbospark_jax.errors import BadInputError

__all__ = [
    "ENVIRONMENT",
    "MAX_BYTES",
    "CacheSetting",
    "compile_cache_setting",
    "default_folder",
    "ensure_compile_cache",
    "use_compile_cache",
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
