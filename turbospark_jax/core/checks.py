"""Argument checks the public entry points share: integers that are integers, token ids inside
the vocabulary, flags that are flags.

Each check raises :class:`~turbospark_jax.errors.BadInputError` naming the argument and what it
got, and returns the value in plain Python form, so a caller checks and converts in one step.
Nothing is coerced: ``1.0``, ``True`` and ``"1"`` are refused where an id or a count goes
(numpy would quietly truncate the first and parse the last).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from typing import Any

import jax
import numpy as np

from turbospark_jax.errors import BadInputError

__all__ = ["as_bool", "as_int", "as_real", "as_token", "as_token_ids", "is_int"]


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer: a Python or numpy integer, or a 0-d integer array
    (never a bool, a float or a string)."""
    if isinstance(value, bool | np.bool_):
        return False
    if isinstance(value, Integral | np.integer):
        return True
    if isinstance(value, np.ndarray | jax.Array) and not isinstance(value, jax.core.Tracer):
        return value.ndim == 0 and np.issubdtype(value.dtype, np.integer)
    return False


def as_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int``, checked to lie in ``[low, high]`` (either bound optional).

    Raises:
      BadInputError: not an integer, or outside the bounds.
    """
    span = _span(low, high)
    if not is_int(value):
        raise BadInputError(f"{name} must be an integer{span}, got {value!r}")
    number = int(value)  # type: ignore[call-overload]
    if (low is not None and number < low) or (high is not None and number > high):
        raise BadInputError(f"{name} must be an integer{span}, got {number}")
    return number


def as_real(name: str, value: object, *, low: float | None = None,
            high: float | None = None) -> float:
    """``value`` as a finite ``float`` in ``[low, high]`` (either bound optional).

    Raises:
      BadInputError: not a real number (bools and strings are not), not finite, or outside
        the bounds.
    """
    span = _span(low, high)
    ok = not isinstance(value, bool | np.bool_) and (
        isinstance(value, Real | np.floating | np.integer)
        or (isinstance(value, np.ndarray | jax.Array) and value.ndim == 0
            and np.issubdtype(value.dtype, np.number))
    )
    number = float(value) if ok else math.nan  # type: ignore[arg-type]
    if not math.isfinite(number) or (low is not None and number < low) or (
        high is not None and number > high
    ):
        raise BadInputError(f"{name} must be a finite real number{span}, got {value!r}")
    return number


def as_bool(name: str, value: object) -> bool:
    """``value`` as a ``bool`` (a Python or numpy bool only).

    Raises:
      BadInputError: anything else (``0``, ``1`` and ``"yes"`` included).
    """
    if not isinstance(value, bool | np.bool_):
        raise BadInputError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def as_token(name: str, value: object, vocab_size: int) -> int:
    """A single token id in ``[0, vocab_size)``.

    Raises:
      BadInputError: not an integer, or outside the vocabulary.
    """
    if not is_int(value):
        raise BadInputError(f"{name} must be an integer token id, got {value!r}")
    token = int(value)  # type: ignore[call-overload]
    if not 0 <= token < vocab_size:
        raise BadInputError(f"{name} {token} is outside the vocabulary [0, {vocab_size})")
    return token


def as_token_ids(
    name: str, values: object, vocab_size: int, *, allow_empty: bool = False
) -> list[int]:
    """A 1-d sequence of token ids (a list, tuple, range or 1-d integer array) as ``list[int]``.

    Raises:
      BadInputError: not a sequence (a ``str`` is not one here), an array that is not 1-d or
        not integer, an element that is not an integer id inside ``[0, vocab_size)``, or an
        empty sequence when ``allow_empty`` is false.
    """
    if isinstance(values, np.ndarray | jax.Array) and not isinstance(values, jax.core.Tracer):
        if values.ndim != 1 or not (np.issubdtype(values.dtype, np.integer) or values.size == 0):
            raise BadInputError(
                f"{name} must be a 1-d sequence of integer token ids, got an array of shape "
                f"{values.shape} and dtype {values.dtype}"
            )
        ids = np.asarray(values).tolist()  # Python ints
    elif isinstance(values, list | tuple) and all(type(v) is int for v in values):
        # The common case, a prompt of plain ints, checked without the per-element
        # ``isinstance`` against the numeric ABCs below (costly for a long prompt, and paid
        # on the host before a prefill's first kernel while the device waits).
        # ``type(v) is int`` refuses bools, which subclass int.
        ids = list(values)
    elif isinstance(values, Sequence) and not isinstance(values, str | bytes | bytearray):
        ids = []
        for value in values:
            if not is_int(value):
                raise BadInputError(f"{name} must hold integer token ids, got {value!r}")
            ids.append(int(value))  # type: ignore[call-overload]
    else:
        kind = "a mapping" if isinstance(values, Mapping) else type(values).__name__
        raise BadInputError(
            f"{name} must be a sequence of integer token ids (a list, tuple or 1-d integer "
            f"array), got {kind}"
        )
    if not ids and not allow_empty:
        raise BadInputError(f"{name} is empty; expected at least one token id")
    if ids and not (min(ids) >= 0 and max(ids) < vocab_size):
        token = next(t for t in ids if not 0 <= t < vocab_size)
        raise BadInputError(f"token id {token} is outside the vocabulary [0, {vocab_size})")
    return ids


def _span(low: Any, high: Any) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""
