"""What the command shows on stderr while it works: a spinner while loading and compiling,
progress bars with tokens/s, and a clock of jax's compile time."""

from __future__ import annotations

import threading
import time
from typing import Any, TextIO

from turbospark_jax.cli.arguments import PROG

#: Seconds a prefill or a generation runs before its progress bar appears.
PROGRESS_DELAY_S = 1.0


class Spinner:
    """A progress line on stderr while loading and compiling (plain lines when not a
    terminal)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._label = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.perf_counter()

    def set(self, label: str) -> None:
        self._label = label
        if not self._stream.isatty():
            print(f"[{PROG}] {label}", file=self._stream, flush=True)
        elif self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()

    def _spin(self) -> None:
        frames = "|/-\\"
        i = 0
        while not self._stop.wait(0.1):
            elapsed = time.perf_counter() - self._t0
            self._stream.write(f"\r{frames[i % 4]} {self._label} ({elapsed:.1f}s)\x1b[K")
            self._stream.flush()
            i += 1

    def done(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._stream.write("\r\x1b[K")
            self._stream.flush()


class Bar:
    """A tqdm bar on stderr with tokens/s, shown once the work has taken PROGRESS_DELAY_S;
    nothing at all when progress is off."""

    def __init__(self, enabled: bool, stream: TextIO, desc: str, total: int) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="tok", file=stream, leave=False,
                             delay=PROGRESS_DELAY_S, dynamic_ncols=True)

    def to(self, done: int) -> None:
        if self._bar is not None:
            self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class CompileClock:
    """Seconds jax spent tracing and compiling while it listens (jax.monitoring events), and
    how many programs the persistent compile cache gave back or took (a program read back
    from the program store counts as read back)."""

    _EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
               "/jax/core/compile/jaxpr_to_mlir_module_duration",
               "/jax/core/compile/backend_compile_duration")
    _HIT = "/jax/compilation_cache/cache_hits"
    _WRITE = "/jax/compilation_cache/cache_misses"  # recorded as a compiled program is written

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cache_hits = 0
        self.cache_writes = 0
        self._store_hits = 0

    def _hear(self, event: str, duration: float, **_: Any) -> None:
        if event in self._EVENTS:
            self.seconds += duration

    def _count(self, event: str, **_: Any) -> None:
        if event == self._HIT:
            self.cache_hits += 1
        elif event == self._WRITE:
            self.cache_writes += 1

    def __enter__(self) -> CompileClock:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._hear)
        jax.monitoring.register_event_listener(self._count)
        self._store_hits = _store_hits()
        return self

    def __exit__(self, *exc: object) -> None:
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._hear)
        jax.monitoring.unregister_event_listener(self._count)
        self.cache_hits += _store_hits() - self._store_hits


def _store_hits() -> int:
    """Programs the program store has read back so far in this process."""
    from turbospark_jax.core.compile_cache import program_store

    store = program_store()
    return 0 if store is None else store.hits
