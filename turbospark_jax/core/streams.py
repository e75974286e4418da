"""One stream type for every way of generating: raw completions, pool turns and chat turns.

A :class:`Stream` wraps a generator that yields :class:`StreamEvent` s and *returns* its
result. Iterate it for text as it is produced, or :meth:`Stream.drain` it; either way the
result is then in :attr:`Stream.result`. :meth:`Stream.close` (or leaving a ``with`` block)
abandons the work: the generator's own cleanup runs, so a pool turn gives its slot back and a
chat turn leaves the history as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterator
from typing import Generic, TypeVar

__all__ = ["Stream", "StreamEvent"]

Result = TypeVar("Result")


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """One step of a stream: text released and the tokens it came with.

    Fields:
      text: the text released now (possibly empty while a stop string is undecided).
      token_ids: the generated tokens this event accounts for.
    """

    text: str
    token_ids: list[int]


class Stream(Iterator[StreamEvent], Generic[Result]):
    """Iterate for :class:`StreamEvent` s; :attr:`result` is set once the stream is exhausted.

    Args:
      events: a generator yielding the events and returning the result.
    """

    def __init__(self, events: Generator[StreamEvent, None, Result]) -> None:
        self._events = events
        self.result: Result | None = None

    def __next__(self) -> StreamEvent:
        try:
            return next(self._events)
        except StopIteration as stop:
            self.result = stop.value
            raise

    def drain(self) -> Result:
        """Run to the end and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        """Abandon the stream; its cleanup runs now. Closing a finished stream does nothing."""
        self._events.close()

    def __enter__(self) -> Stream[Result]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
