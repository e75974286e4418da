"""Embeddings injected into a prompt: which positions take which rows, and whose rows they are.

An image in a prompt is a run of placeholder ids (the image token, one per soft token) whose
positions consume the vision tower's output instead of the placeholder's own embedding. An
:class:`Injection` says that for a whole prompt: the absolute positions, the embedding row for
each, and each row's identity (the image's content hash). Every producer call of the prompt
gets the same value and takes the rows that fall into what it feeds, so a prompt split into
any chunks (or fed token by token) injects the same rows at the same positions; the fed record
keeps the identities, and prefix reuse compares them (:mod:`turbospark_jax.core.kv_prefix`).

:func:`placeholder_spans` finds the runs in a prompt and :func:`span_injection` checks them
against the images' soft tokens (count and lengths) and builds the value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from turbospark_jax.core.kv_prefix import NOT_INJECTED
from turbospark_jax.errors import BadInputError


@dataclasses.dataclass(frozen=True, eq=False)
class Injection:
    """Embedding rows that replace the token embedding at some prompt positions.

    Fields:
      positions:  int64 ``[N]`` absolute prompt positions, strictly increasing.
      embeds:     ``[N, D]`` the rows (numpy or a device array), in the model's embedding space.
      identities: int32 ``[N]`` each row's identity, never ``NOT_INJECTED`` (0).

    Raises:
      BadInputError: lengths that differ, positions that are negative or not increasing,
        an identity of 0 or outside int32, embeds that are not 2-D.
    """

    positions: np.ndarray
    embeds: Any
    identities: np.ndarray

    def __post_init__(self) -> None:
        positions = np.asarray(self.positions, np.int64).reshape(-1)
        identities = np.asarray(self.identities, np.int64).reshape(-1)
        shape = tuple(getattr(self.embeds, "shape", ()))
        if len(shape) != 2 or shape[0] != len(positions) or len(identities) != len(positions):
            raise BadInputError(
                f"an injection needs one embedding row and one identity per position: got "
                f"{len(positions)} positions, embeds of shape {list(shape)} and "
                f"{len(identities)} identities"
            )
        if len(positions) and (positions[0] < 0 or np.any(np.diff(positions) <= 0)):
            raise BadInputError("injected positions must be >= 0 and strictly increasing")
        if np.any(identities == NOT_INJECTED) or np.any(identities >= 2**31) or np.any(
                identities < -(2**31)):
            raise BadInputError(f"injected identities must be non-zero int32 values "
                                f"({NOT_INJECTED} means nothing injected)")
        object.__setattr__(self, "positions", positions)
        object.__setattr__(self, "identities", identities.astype(np.int32))

    @property
    def width(self) -> int:
        """``D``: the length of each embedding row."""
        return int(self.embeds.shape[1])

    def identity_map(self) -> dict[int, int]:
        """position -> identity, what ``try_reuse_prefix`` compares against the fed record."""
        return {int(p): int(i) for p, i in zip(self.positions, self.identities, strict=True)}

    def rows_for(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """For the ``count`` positions from ``start``: the index of each one's row in
        :attr:`embeds` (-1 where nothing is injected) and its identity (0 there)."""
        rows = np.full(count, -1, np.int64)
        identities = np.full(count, NOT_INJECTED, np.int32)
        inside = (self.positions >= start) & (self.positions < start + count)
        offsets = self.positions[inside] - start
        rows[offsets] = np.flatnonzero(inside)
        identities[offsets] = self.identities[inside]
        return rows, identities


def placeholder_spans(prompt_ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """The runs of ``token_id`` in the prompt as ``(start, length)``, in order."""
    spans: list[tuple[int, int]] = []
    for i, t in enumerate(prompt_ids):
        if int(t) != token_id:
            continue
        if spans and spans[-1][0] + spans[-1][1] == i:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((i, 1))
    return spans


def span_injection(
    prompt_ids: Sequence[int],
    token_id: int,
    images: Sequence[tuple[Any, int]],
) -> Injection | None:
    """Put each image's rows into the prompt's placeholder runs, in order.

    Args:
      prompt_ids: the prompt, with one run of ``token_id`` per image.
      token_id: the placeholder id (the image token).
      images: per image, ``(embeds [n, D], identity)``; its run must be ``n`` long.

    Returns:
      The injection, or ``None`` when there are no images and no runs.

    Raises:
      BadInputError: the number of runs is not the number of images, or a run's length is
        not its image's soft-token count (both named).
    """
    spans = placeholder_spans(prompt_ids, token_id)
    if len(spans) != len(images):
        raise BadInputError(
            f"the prompt has {len(spans)} image placeholder span(s) (runs of token "
            f"{token_id}) but {len(images)} image(s) were given; give one image per span"
        )
    for k, ((start, length), (embeds, _)) in enumerate(zip(spans, images, strict=True)):
        if length != int(embeds.shape[0]):
            raise BadInputError(
                f"image {k} fills {int(embeds.shape[0])} soft tokens but its placeholder span "
                f"at position {start} is {length} tokens long"
            )
    if not images:
        return None
    positions = np.concatenate([np.arange(s, s + n) for s, n in spans])
    identities = np.concatenate([np.full(n, ident) for (_, n), (_, ident) in
                                 zip(spans, images, strict=True)])
    embeds = np.concatenate([np.asarray(e) for e, _ in images])
    return Injection(positions, embeds, identities)
