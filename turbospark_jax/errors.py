"""One exception hierarchy for the whole package.

Every failure a caller can cause or meet raises a subclass of :class:`TurbosparkError`, so
``except TurbosparkError`` catches all of ours and nothing of anybody else's. Messages name
what was wrong and what was expected, so a user can act on them without reading our source.
"""

from __future__ import annotations


class TurbosparkError(Exception):
    """Base of every error this package raises on purpose."""


class BadInputError(TurbosparkError, ValueError):
    """An argument is outside what the call accepts (empty prompt, id out of range, ...).

    Raised before any state is touched: the state passed in stays valid and unchanged.
    """


class ContextOverflowError(BadInputError):
    """The tokens asked for do not fit in the producer's preallocated context."""


class UnsupportedCapabilityError(TurbosparkError, NotImplementedError):
    """The producer does not offer this capability (a protocol default that refuses)."""


class ProducerExhaustedError(TurbosparkError):
    """A scripted producer was asked for more steps than its script holds."""


class ProducerFailedError(TurbosparkError):
    """A producer could not produce (for example it returned non-finite logits)."""


class ModelLoadError(TurbosparkError):
    """A model folder could not be loaded: missing file, unsupported type, bad tensor."""


class SessionError(BadInputError):
    """A session-pool request is invalid (unknown session, zero slots, slot in use)."""


class OverloadedError(TurbosparkError):
    """The server's queue of waiting requests is full; the request was not started.

    Retry after :attr:`retry_after` seconds (the HTTP layer sends it as ``Retry-After``).
    """

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class UnavailableError(OverloadedError):
    """The server cannot take work at all right now (it is shutting down, or its scheduler
    stopped or failed); the request was not started.

    Unlike a full queue this does not clear by itself within a step or two; retry after
    :attr:`retry_after` seconds, possibly elsewhere (the HTTP layer answers 503).
    """
