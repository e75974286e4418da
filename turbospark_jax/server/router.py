"""Data-parallel serving: one :class:`~turbospark_jax.server.engine.Engine` per replica (a
producer on its own device), behind the engine's own interface, so the routes serve N
replicas as they serve one.

Where a request goes, decided when it is submitted:

1. a request naming a session that a replica holds (a slot it owns, or a request of it waiting
   or running there) goes to that replica: the session's KV rows live there and never move;
2. any other request goes to the replica whose slots (those no named session owns) have fed
   the longest prefix of its prompt, so the prefix is reused;
3. when no replica shares any of it, to the least loaded replica (fewest requests running
   and waiting; the lowest index among equals). A replica that takes no work is skipped in
   these two steps; a session held by one waits for it (or gets its 503).

A request's output is the same whichever replica serves it: every replica runs the same model
with the same programs, and prefix reuse never changes output (``tests/engine/test_batching.py``).
Each replica schedules its own requests (its own scheduler thread and batch); the replicas
share nothing but the metrics collector.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from turbospark_jax.core.checks import as_real
from turbospark_jax.errors import BadInputError, UnavailableError
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.requests import UNAVAILABLE_RETRY_S, ServeRequest, Sink, Ticket

__all__ = ["ReplicaRouter"]


class ReplicaRouter:
    """Requests spread over replica engines, each named session kept on one.

    Args:
      engines: one engine per replica, over producers of the same model and shape.

    Raises:
      BadInputError: no engines, or engines whose producers differ in context or vocabulary.
    """

    def __init__(self, engines: Sequence[Engine]) -> None:
        self.engines = list(engines)
        if not self.engines or not all(isinstance(e, Engine) for e in self.engines):
            raise BadInputError("a replica router needs one or more Engine instances")
        shapes = {(e.producer.max_positions, e.producer.vocab_size) for e in self.engines}
        if len(shapes) != 1:
            raise BadInputError(
                f"every replica must serve the same model shape; got (context, vocabulary) "
                f"pairs {sorted(shapes)}"
            )
        self.producer = self.engines[0].producer
        self._lock = threading.Lock()  # a route and its submit happen as one

    def start(self) -> ReplicaRouter:
        """Start every replica's scheduler; returns the router."""
        for e in self.engines:
            e.start()
        return self

    def stop(self) -> None:
        """Stop every replica's scheduler (see :meth:`Engine.stop`)."""
        for e in self.engines:
            e.stop()

    def run_once(self) -> None:
        """One scheduler iteration on every replica, in order (:meth:`Engine.run_once`; for
        tests that drive the replicas without :meth:`start`)."""
        for e in self.engines:
            e.run_once()

    @property
    def max_choices(self) -> int:
        """The most choices one request may ask for (:attr:`Engine.max_choices`; every
        choice of a request runs on one replica)."""
        return min(e.max_choices for e in self.engines)

    @property
    def idle(self) -> bool:
        """Whether no request waits or runs on any replica."""
        return all(e.idle for e in self.engines)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every replica has compiled (:meth:`Engine.wait_ready`)."""
        return all(e.wait_ready(timeout) for e in self.engines)

    @property
    def starting(self) -> bool:
        """Whether some replica is still compiling (:attr:`Engine.starting`)."""
        return any(e.starting for e in self.engines)

    @property
    def stopping(self) -> bool:
        """Whether every replica is shutting down (:attr:`Engine.stopping`)."""
        return all(e.stopping for e in self.engines)

    def drain(self, grace: float) -> int:
        """Shut every replica down gracefully under one grace period (:meth:`Engine.drain`);
        returns how many requests were cut off."""
        deadline = time.monotonic() + as_real("grace", grace, low=0.0)
        for e in self.engines:
            e.begin_drain()
        return sum(e.finish_drain(deadline) for e in self.engines)

    def unavailable(self) -> str | None:
        """Why no replica takes work, or ``None`` when one does."""
        reasons = [e.unavailable() for e in self.engines]
        if any(r is None for r in reasons):
            return None
        return "; ".join(f"replica {i}: {r}" for i, r in enumerate(reasons))

    def load(self) -> dict[str, int]:
        """The replicas' :meth:`Engine.load` counts added up, and the number of replicas."""
        total: dict[str, int] = {"replicas": len(self.engines)}
        for e in self.engines:
            for key, value in e.load().items():
                total[key] = total.get(key, 0) + value
        return total

    def route(self, request: ServeRequest) -> int:
        """The index of the replica ``request`` goes to (see the module docstring).

        Raises:
          UnavailableError: no replica takes work.
        """
        session = request.session_id
        if session is not None:
            for i, e in enumerate(self.engines):
                if e.holds(session):
                    return i
        open_ = [i for i, e in enumerate(self.engines) if e.unavailable() is None]
        if not open_:
            raise UnavailableError(f"{self.unavailable()}; retry later",
                                   retry_after=UNAVAILABLE_RETRY_S)
        prompt = list(request.completion.prompt_ids)
        shared = {i: self.engines[i].prefix_match(prompt) for i in open_}
        loads = {i: _busy(self.engines[i]) for i in open_}
        return max(open_, key=lambda i: (shared[i], -loads[i], -i))

    def submit(self, request: ServeRequest, sink: Sink) -> Ticket:
        """Submit ``request`` to the replica :meth:`route` picks (see :meth:`Engine.submit`
        for the events and errors)."""
        if not isinstance(request, ServeRequest):
            raise BadInputError(f"expected a ServeRequest, got {type(request).__name__}")
        with self._lock:
            return self.engines[self.route(request)].submit(request, sink)


def _busy(engine: Engine) -> int:
    load = engine.load()
    return load["running"] + load["waiting"]
