"""Ctrl-C at any moment: one line on stderr and exit status 130.

Python turns SIGINT into ``KeyboardInterrupt`` only between bytecodes of the main thread, so
while XLA compiles or a device call runs the interrupt waits for native code to return, and
once raised it may land in a garbage-collection callback (where Python prints "Exception
ignored" and carries on) or unwind into an interpreter shutdown that races XLA's threads. So
the command catches SIGINT itself: the C-level handler writes to a wakeup pipe at once, a
watcher thread blocked on that pipe prints the line and ends the process with ``os._exit``
(no Python unwinding, no native destructors). Output the command writes as whole records
(a JSON line) is written under :data:`OUTPUT_LOCK`, which the watcher takes before it exits,
so a record is either all there or absent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

#: Exit status after an interrupt (128 + SIGINT), as shells report it.
INTERRUPTED = 130

#: Held while a whole record goes to stdout; the interrupt waits for it.
OUTPUT_LOCK = threading.Lock()

#: Seconds the interrupt waits for a record being written before it exits anyway.
_RECORD_WAIT_S = 5.0

#: What the command's own shutdown writes to the pipe to stop the watcher (not a signal
#: number).
_STOP = b"\xff"


def _exit(prog: str, stream: TextIO) -> None:
    """Print the line and end the process now (never returns)."""
    OUTPUT_LOCK.acquire(timeout=_RECORD_WAIT_S)
    with contextlib.suppress(Exception):
        # On a terminal the line may follow a spinner or text mid-line: start a fresh one.
        stream.write(f"{chr(10) if stream.isatty() else ''}{prog}: interrupted\n")
        stream.flush()
    os._exit(INTERRUPTED)


@contextlib.contextmanager
def exit_on_interrupt(prog: str, stderr: TextIO | None = None) -> Iterator[None]:
    """While inside, SIGINT prints ``<prog>: interrupted`` to ``stderr`` and exits with
    status 130 at once. Outside the main thread (where signals cannot be caught) it does
    nothing; the handlers before it are restored on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stream = stderr or sys.stderr
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)

    def watch() -> None:
        while True:
            try:
                data = os.read(read_end, 64)
            except OSError:
                return
            if not data or _STOP in data:
                return
            if signal.SIGINT in data:
                _exit(prog, stream)

    def handler(_signum: int, _frame: Any) -> None:
        # The watcher ends the process: the main thread may be inside a record it holds the
        # output lock for, and must be left to finish it.
        return

    previous = signal.signal(signal.SIGINT, handler)
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="turbospark-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous)
        with contextlib.suppress(OSError):
            os.write(write_end, _STOP)
        watcher.join(timeout=1.0)
        os.close(write_end)
        if not watcher.is_alive():
            os.close(read_end)
