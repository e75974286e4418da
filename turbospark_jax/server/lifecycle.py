"""The scheduler thread's life: start, stop, a graceful drain, a fault.

:class:`SchedulerThread` owns the thread, the lock every request queue is guarded by, and
the flags that say whether work is taken; the serving engine
(:class:`~turbospark_jax.server.engine.Engine`) builds its ticks on it.

**Shutting down** (:meth:`SchedulerThread.drain`): the engine stops admitting (a new request
gets :class:`~turbospark_jax.errors.UnavailableError`, :attr:`SchedulerThread.stopping`
holds), lets the requests in flight, speculative ones included, finish for up to a grace
period, then ends the rest with :class:`~turbospark_jax.server.requests.Failed` marked
``shutdown`` (the scheduler does it at the start of its next tick, so no row is cut in the
middle of a device call) and frees their slots.
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Self

from turbospark_jax.core.checks import as_real
from turbospark_jax.errors import UnavailableError
from turbospark_jax.server.requests import UNAVAILABLE_RETRY_S

__all__ = ["SchedulerThread"]


class SchedulerThread(abc.ABC):
    """The thread that runs a scheduler's ticks, and how it starts and ends.

    A subclass says what a tick is (:meth:`run_once`), what compiling ahead means
    (:meth:`warm_up`), how much work is in flight and how to end it; this class decides when
    ticks run and when work is refused.

    Args:
      warm_up: whether the thread compiles (:meth:`warm_up`) before its first tick.
    """

    def __init__(self, *, warm_up: bool) -> None:
        self._cond = threading.Condition()
        self._stopping = False
        self._draining = False  # refusing new work while the work in flight ends (drain)
        self._cut = False  # end every request now (a drain's grace is over)
        self._fault: str | None = None  # why the scheduler thread died, if it did
        self._thread: threading.Thread | None = None
        self._warm = threading.Event()  # every program compiled (start() warms them first)
        if not warm_up:
            self._warm.set()

    # -- what a subclass provides -----------------------------------------------------------

    @abc.abstractmethod
    def run_once(self) -> None:
        """One tick of the scheduler."""

    @abc.abstractmethod
    def warm_up(self) -> None:
        """Compile what a tick can reach; sets the ready event when done."""

    @abc.abstractmethod
    def _has_work(self) -> bool:
        """Whether a request waits or runs on the scheduler's rows (the thread ticks then)."""

    @abc.abstractmethod
    def _in_flight(self) -> int:
        """How many requests (choices counted one by one) are waiting or running anywhere."""

    @abc.abstractmethod
    def _cut_off(self) -> int:
        """End every request now (the caller holds the lock); returns how many."""

    @abc.abstractmethod
    def _end_all(self, message: str, *, shutdown: bool) -> None:
        """Fail every request left when the thread ends (the caller holds the lock)."""

    # -- the thread -------------------------------------------------------------------------

    def start(self) -> Self:
        """Start the scheduler thread (idempotent; restarts one that failed); returns the
        engine. The thread first compiles every program a request can reach
        (:meth:`warm_up`), so :attr:`starting` holds until then; requests submitted meanwhile
        wait for it."""
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._stopping, self._fault = False, None
                self._draining = self._cut = False
                self._thread = threading.Thread(target=self._loop, name="turbospark-scheduler",
                                                daemon=True)
                self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the scheduler; requests still waiting or running fail, and later ones are
        refused (:class:`~turbospark_jax.errors.UnavailableError`) until :meth:`start`."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def drain(self, grace: float) -> int:
        """Shut down gracefully: stop admitting now (:meth:`begin_drain`), let the requests
        in flight finish for up to ``grace`` seconds, then end the rest with
        :class:`~turbospark_jax.server.requests.Failed` (``shutdown`` set) and free their
        slots (:meth:`finish_drain`). The scheduler keeps running; :meth:`stop` it after.
        Returns how many requests (choices counted one by one) were cut off.

        Raises:
          BadInputError: ``grace`` is negative or not a number.
        """
        self.begin_drain()
        return self.finish_drain(time.monotonic() + as_real("grace", grace, low=0.0))

    def begin_drain(self) -> None:
        """Refuse new requests from now on (:class:`~turbospark_jax.errors.UnavailableError`,
        :attr:`stopping`); the ones in flight carry on."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()

    def finish_drain(self, deadline: float) -> int:
        """Wait until no request is in flight or ``deadline`` (a :func:`time.monotonic`
        time) passes, then cut off the rest; returns how many were cut off."""
        with self._cond:
            while not self._drained() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._drained():
                return 0
            self._cut = True
            self._cond.notify_all()
            thread = self._thread
            if thread is None or not thread.is_alive() or not self._warm.is_set():
                return self._cut_off()  # no scheduler tick will come soon: cut them here
            count = self._in_flight()
            while not self._drained():
                self._cond.wait(0.05)
            return count

    @property
    def stopping(self) -> bool:
        """Whether a graceful shutdown (:meth:`drain`) has begun: no new requests, the ones
        in flight finish (after :meth:`stop` the engine is :meth:`unavailable` instead)."""
        return self._draining

    def _drained(self) -> bool:
        return self._in_flight() == 0

    def unavailable(self) -> str | None:
        """Why the engine takes no work now, or ``None`` when it does: after :meth:`stop`
        (until :meth:`start`), or once the scheduler thread has failed. An engine never
        started takes work (a test drives it with :meth:`run_once`)."""
        if self._fault is not None:
            return f"the scheduler failed ({self._fault})"
        if self._stopping or self._draining:
            return "the server is shutting down"
        return None

    def _refuse_if_unavailable(self) -> None:
        reason = self.unavailable()
        if reason is not None:
            raise UnavailableError(f"{reason}; retry later", retry_after=UNAVAILABLE_RETRY_S)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until :meth:`warm_up` has run (or ``timeout`` seconds); whether it has."""
        return self._warm.wait(timeout)

    @property
    def starting(self) -> bool:
        """Whether the scheduler runs but is still compiling (:meth:`warm_up`)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._warm.is_set()

    def _loop(self) -> None:
        message = "the server is shutting down"
        try:
            if not self._warm.is_set():
                self.warm_up()
            while True:
                with self._cond:
                    while not (self._stopping or self._has_work()):
                        self._cond.wait()
                    if self._stopping:
                        break
                self.run_once()
        except Exception as exc:  # a fault outside the device calls: take no more work
            self._fault = f"{type(exc).__name__}: {exc}"
            message = f"the scheduler failed: {self._fault}"
        with self._cond:
            self._end_all(message, shutdown=self._fault is None)
