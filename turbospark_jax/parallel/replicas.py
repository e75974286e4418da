"""Data parallelism: several replicas of a model behind one session interface.

Each replica is a producer on its own device, or on its own group of devices split tensor
parallel (:func:`replicas_on_devices`), with its own
:class:`~turbospark_jax.sessions.session_pool.SessionPool`. A session is pinned to one replica on
its
first turn (the one with the fewest pinned sessions) and stays there until it is dropped: its
KV rows live in that replica's memory and never move. If its slot there is evicted, its next
turn starts fresh on the same replica; nothing is ever copied between replicas.

Turns of sessions on different replicas run concurrently (each pool locks its own slots);
turns within one replica are serialized per slot as :class:`SessionPool` says.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import jax

from turbospark_jax.core.streams import Stream
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, SessionError
from turbospark_jax.generation.completion import Completion, CompletionRequest
from turbospark_jax.parallel.sharding import ShardedProducer, tp_mesh
from turbospark_jax.sessions.session_pool import SessionId, SessionPool, _check_session_id

__all__ = ["ReplicaPool", "check_replica_count", "replicas_on_devices",
           "replicas_one_per_device"]


def replicas_on_devices(
    model: Any, params: Any, group_size: int = 1, devices: Sequence[jax.Device] | None = None,
    **producer_args: Any,
) -> list[ShardedProducer]:
    """One producer per group of ``group_size`` consecutive devices, each holding a full copy
    of ``params`` split tensor parallel over its group (a group of one: the whole model on
    that device).

    Args:
      model: a dense model (see :class:`~turbospark_jax.parallel.sharding.ShardedProducer`).
      params: its params, anywhere; each replica places its own copy.
      group_size: devices per replica.
      devices: the devices to use (default: every device of this process).
      producer_args: ``capacity``, ``width``, ... for each producer.

    Raises:
      SessionError: ``group_size`` does not divide the number of devices.
      BadInputError: as :class:`~turbospark_jax.parallel.sharding.ShardedProducer`.
    """
    devices = jax.local_devices() if devices is None else list(devices)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or (
        len(devices) % group_size
    ):
        raise SessionError(
            f"group_size={group_size!r} must be a positive divisor of the {len(devices)} "
            "devices, so that every replica gets the same number"
        )
    groups = [devices[i : i + group_size] for i in range(0, len(devices), group_size)]
    return [ShardedProducer(model, params, mesh=tp_mesh(g), **producer_args) for g in groups]


def check_replica_count(count: int, devices: Sequence[jax.Device] | None = None,
                        ) -> list[jax.Device]:
    """``devices`` (default: this process's), after checking that ``count`` replicas, one a
    device, fit on them.

    Raises:
      BadInputError: ``count`` is not an int from 1 to the number of devices.
    """
    devices = jax.local_devices() if devices is None else list(devices)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(devices):
        raise BadInputError(f"replicas={count!r} must be from 1 to the {len(devices)} devices "
                            "(one replica a device)")
    return devices


def replicas_one_per_device(
    model: Any, params: Any, count: int, devices: Sequence[jax.Device] | None = None,
    **producer_args: Any,
) -> list[BlockProducer]:
    """``count`` block producers, the ``i``-th with its own copy of ``params`` on the ``i``-th
    device (the server's replicas: :class:`~turbospark_jax.server.router.ReplicaRouter`). Each
    is a plain :class:`BlockProducer`, so it runs the same programs (kernels included) as one
    producer alone. One replica keeps ``params`` where they are.

    Args:
      model: any block model.
      params: its params, anywhere.
      count: replicas, at most the number of devices.
      devices: the devices to use (default: every device of this process).
      producer_args: ``capacity``, ``width``, ... for each producer.

    Raises:
      BadInputError: ``count`` below 1 or above the number of devices.
    """
    devices = check_replica_count(count, devices)
    if count == 1:
        return [BlockProducer(model, params, **producer_args)]
    return [BlockProducer(model, jax.device_put(params, d), **producer_args)
            for d in devices[:count]]


class ReplicaPool:
    """Sessions spread over replicas, each session pinned to one.

    Args:
      producers: one producer per replica (:func:`replicas_on_devices`); any producers work,
        on any devices.
      slots: session slots per replica.
      wait: as :class:`~turbospark_jax.sessions.session_pool.SessionPool`.

    Raises:
      SessionError: no producers, or as :class:`SessionPool` for ``slots`` and ``wait``.
      BadInputError: an element of ``producers`` is not a producer.
    """

    def __init__(
        self, producers: Sequence[Any], slots: int, *, wait: float | None = None
    ) -> None:
        producers = list(producers)
        if not producers:
            raise SessionError("a replica pool needs at least one producer")
        self.pools = [SessionPool(p, slots, wait=wait) for p in producers]
        self._pinned: dict[SessionId, int] = {}
        self._lock = threading.Lock()

    @property
    def replicas(self) -> int:
        """Number of replicas."""
        return len(self.pools)

    def replica_of(self, session_id: SessionId) -> int | None:
        """The replica ``session_id`` is pinned to, ``None`` before its first turn.

        Raises:
          SessionError: ``session_id`` is ``None`` or unhashable.
        """
        _check_session_id(session_id)
        with self._lock:
            return self._pinned.get(session_id)

    def load(self) -> list[int]:
        """Sessions pinned to each replica."""
        with self._lock:
            return self._counts()

    def _counts(self) -> list[int]:
        counts = [0] * len(self.pools)  # called with the lock held
        for r in self._pinned.values():
            counts[r] += 1
        return counts

    def stream(
        self, session_id: SessionId, request: CompletionRequest, *, tokenizer: Any | None = None
    ) -> Stream[Completion]:
        """A turn for ``session_id`` on its replica (pinned now if it has none); see
        :meth:`SessionPool.stream` for the stream, the result and the errors (a refused
        request pins nothing)."""
        replica, new = self._pin(session_id)
        try:
            return self.pools[replica].stream(session_id, request, tokenizer=tokenizer)
        except BaseException:
            if new:
                with self._lock:
                    self._pinned.pop(session_id, None)
            raise

    def generate(
        self, session_id: SessionId, request: CompletionRequest, *, tokenizer: Any | None = None
    ) -> Completion:
        """Run a turn for ``session_id`` to the end (see :meth:`stream`)."""
        return self.stream(session_id, request, tokenizer=tokenizer).drain()

    def pool_of(self, session_id: SessionId) -> SessionPool:
        """The session pool of the replica ``session_id`` is pinned to.

        Raises:
          SessionError: ``session_id`` is pinned to no replica.
        """
        replica = self.replica_of(session_id)
        if replica is None:
            raise SessionError(f"session {session_id!r} has run no turn here (or was dropped)")
        return self.pools[replica]

    def drop(self, session_id: SessionId) -> None:
        """Forget ``session_id`` on its replica and unpin it (its next turn may go elsewhere).

        Raises:
          SessionError: ``session_id`` is pinned to no replica.
        """
        pool = self.pool_of(session_id)
        if pool.slot_of(session_id) is not None:
            pool.drop(session_id)
        with self._lock:
            self._pinned.pop(session_id, None)

    def _pin(self, session_id: SessionId) -> tuple[int, bool]:
        """The replica of ``session_id``, pinning it to the least loaded one (the lowest
        index among equals) if it has none; and whether it was pinned just now."""
        _check_session_id(session_id)
        with self._lock:
            if session_id in self._pinned:
                return self._pinned[session_id], False
            counts = self._counts()
            self._pinned[session_id] = counts.index(min(counts))
            return self._pinned[session_id], True
