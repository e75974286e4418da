"""Stop strings over streamed text, which may span any number of pushes.

A :class:`StopMatcher` sits after the detokenizer: it receives the text of each decoded token
and answers what may be shown now. Text that could still turn out to be (the start of) a stop
string is held back, and released as soon as it cannot.

Which match wins: the one that starts EARLIEST in the text; among matches starting at the same
place, the LONGEST. That rule is decided on the whole text, so a stop is declared only once it is
certain: while a stop string that starts earlier (or at the same place and is longer) could still
complete, the matcher keeps holding and the caller keeps generating. With stop strings "ab" and
"abc", the text "ab" is therefore not yet a stop; "abx" is (at "ab"), and so is "abc" (at "abc").
:meth:`StopMatcher.flush` settles whatever is still pending when generation ends. As a result the
emitted text and the match never depend on how the text was split into pushes.

Matching is on code points (Python ``str``), so a Korean syllable or an emoji is one unit; the
matcher does not know about grapheme clusters (an emoji with a skin-tone modifier is two code
points, and a stop string equal to the first of them matches).
"""

from __future__ import annotations

from collections.abc import Iterable

from turbospark_jax.core.checks import as_bool
from turbospark_jax.errors import BadInputError

__all__ = ["StopMatcher"]


class StopMatcher:
    """Streams text through, cutting it at the first stop string.

    Args:
      stop_strings: the stop strings; duplicates are ignored, an empty collection matches nothing.
      include_stop: emit the matched stop string itself (default: cut just before it).

    Raises:
      BadInputError: a stop string is empty or not a ``str``, or ``stop_strings`` is a bare
        ``str`` (which would otherwise be read as one stop string per character).
    """

    def __init__(self, stop_strings: Iterable[str], include_stop: bool = False) -> None:
        if isinstance(stop_strings, str):
            raise BadInputError(
                f"stop_strings must be a collection of strings, got the string {stop_strings!r}; "
                "wrap it in a list"
            )
        try:
            given = list(stop_strings)
        except TypeError as exc:  # not iterable (a number, a 0-d array...)
            raise BadInputError(
                f"stop_strings must be a collection of strings, got {type(stop_strings).__name__}"
            ) from exc
        stops: list[str] = []
        for stop in given:
            if not isinstance(stop, str):
                raise BadInputError(f"every stop string must be a str, got {stop!r}")
            if not stop:
                raise BadInputError("stop strings must be non-empty, got ''")
            if stop not in stops:
                stops.append(stop)
        self._stops = tuple(stops)
        self._include_stop = as_bool("include_stop", include_stop)
        self._held = ""  # text received but not emitted; starts where a match might start
        self._emitted: list[str] = []
        self._matched: str | None = None
        self._flushed = False

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings, duplicates removed, in the order given."""
        return self._stops

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched (nothing more will be emitted)."""
        return self._matched is not None

    @property
    def matched(self) -> str | None:
        """The stop string that matched, or ``None`` while none has."""
        return self._matched

    @property
    def held(self) -> str:
        """Text received but held back because it may still start a stop string."""
        return self._held

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def push(self, text: str) -> tuple[str, bool]:
        """Take the next piece of text.

        Args:
          text: newly decoded text (possibly empty).

        Returns:
          ``(emit, stopped)``: the text that is safe to show now, and whether a stop string has
          matched. Once stopped, every further push returns ``("", True)``.

        Raises:
          BadInputError: ``text`` is not a ``str``, or the matcher was already flushed.
        """
        if not isinstance(text, str):
            raise BadInputError(f"push takes a str, got {type(text).__name__}")
        if self._flushed:
            raise BadInputError("push after flush: the stream has already ended")
        if self._matched is not None:
            return "", True
        self._held += text
        return self._settle(final=False), self._matched is not None

    def flush(self) -> str:
        """End the stream: release the held text, or cut it at a match that is now certain.

        Returns:
          The text still to show. After it :attr:`matched` says whether the end of the text
          completed a stop. Calling flush again returns ``""``.
        """
        if self._flushed or self._matched is not None:
            self._flushed = True
            return ""
        self._flushed = True
        return self._settle(final=True)

    def _settle(self, final: bool) -> str:
        """Emit what is certain about ``self._held``; record a match once it is decided.

        ``final``: no more text will come, so nothing is pending any longer.
        """
        held = self._held
        match = self._earliest_match(held)
        pending = len(held) if final else self._earliest_pending(held)
        if match is not None:
            start, stop = match
            # A stop string that may still complete at ``pending`` wins if it starts earlier;
            # at ``start`` itself it would be longer than ``stop`` (it runs past the end of
            # ``held``, which contains ``stop``), so it would win the tie too.
            if pending > start:
                self._matched = stop
                self._held = ""
                return self._emit(held[:start] + (stop if self._include_stop else ""))
            pending = min(pending, start)
        self._held = held[pending:]
        return self._emit(held[:pending])

    def _earliest_match(self, held: str) -> tuple[int, str] | None:
        """``(start, stop)`` of the earliest complete match in ``held``, longest on ties."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = held.find(stop)
            if start < 0:
                continue
            if best is None or start < best[0] or (start == best[0] and len(stop) > len(best[1])):
                best = (start, stop)
        return best

    def _earliest_pending(self, held: str) -> int:
        """The first index where a stop string could begin and run past the end of ``held``.

        ``len(held)`` when there is none. Only the last ``longest - 1`` positions can qualify.
        """
        longest = max((len(s) for s in self._stops), default=0)
        for start in range(max(0, len(held) - longest + 1), len(held)):
            tail = held[start:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                return start
        return len(held)

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text
