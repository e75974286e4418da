"""Prefix reuse keyed on what was fed: how much of a new prompt a previous state stands for.

A multi-turn conversation sends the whole history again each turn. The state left by the
previous turn has consumed the previous prompt and the reply as the model *generated* it; the
new prompt carries that reply back re-tokenized from text, which may split it differently. So
the reusable part is the longest common prefix of the ids the state FED and the new prompt,
compared position by position, never a count derived from the history's length.

Three rules, held by every producer that reuses a state (docs/design.md, "Keyed on what was
fed"):

* compare ids with the fed record, and stop at the first difference;
* stop at a position where the state consumed an injected embedding (an image in a
  placeholder span) unless the new prompt injects the same embedding identity there: the ids
  of a placeholder span are the same whatever picture filled it;
* never reuse the whole prompt: at least one token is fed, or there are no logits to sample
  the next token from.

A state whose leaves summarise the whole history (a recurrent model) cannot be moved back to
an earlier position; for it only a match of the *entire* record is reusable
(:func:`reusable_prefix` with ``rewindable=False``).

This module is plain Python with no device work: producers call it on a host copy of their
record (:meth:`turbospark_jax.core.state.HostFedRecord.reusable_prefix`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from turbospark_jax.errors import BadInputError

__all__ = ["NOT_INJECTED", "common_prefix", "reusable_prefix"]

#: Identity recorded where a position consumed its token id (no injected embedding).
NOT_INJECTED = 0


def common_prefix(
    fed_ids: Sequence[int],
    fed_injected: Sequence[int] | None,
    prompt_ids: Sequence[int],
    injected: Mapping[int, int] | None = None,
) -> int:
    """Length of the longest prefix of ``prompt_ids`` that the fed record stands for.

    Position ``i`` matches when ``fed_ids[i] == prompt_ids[i]`` and the embedding identity
    the state consumed there (``fed_injected[i]``) equals the one the new prompt injects there
    (``injected.get(i, NOT_INJECTED)``). The answer stops at the first position that does not
    match and never reaches ``len(prompt_ids)``: a full hit leaves the last prompt token to
    feed.

    Args:
      fed_ids: the ids the state consumed, in position order.
      fed_injected: for each fed position, the identity of the embedding injected there, or
        ``NOT_INJECTED``; ``None`` when nothing was injected anywhere.
      prompt_ids: the new prompt.
      injected: position -> identity of the embedding the new prompt injects there.

    Returns:
      ``n`` with ``0 <= n <= max(0, min(len(fed_ids), len(prompt_ids) - 1))``.

    Raises:
      BadInputError: ``fed_injected`` is not as long as ``fed_ids``.
    """
    if fed_injected is not None and len(fed_injected) != len(fed_ids):
        raise BadInputError(
            f"the fed record holds {len(fed_ids)} ids but {len(fed_injected)} injection "
            "identities; both describe the same positions and must be equally long"
        )
    wanted = injected or {}
    limit = min(len(fed_ids), len(prompt_ids) - 1)
    n = 0
    while n < limit:
        if int(fed_ids[n]) != int(prompt_ids[n]):
            break
        had = NOT_INJECTED if fed_injected is None else int(fed_injected[n])
        if had != int(wanted.get(n, NOT_INJECTED)):
            break
        n += 1
    return n


def reusable_prefix(
    fed_ids: Sequence[int],
    fed_injected: Sequence[int] | None,
    prompt_ids: Sequence[int],
    injected: Mapping[int, int] | None = None,
    *,
    rewindable: bool = True,
) -> int:
    """How many prompt tokens a producer may skip, given what its state can be moved back to.

    A rewindable state (KV rows behind a cursor) stops anywhere inside its record, so this is
    :func:`common_prefix`. A non-rewindable one (recurrent leaves that summarise every fed
    token) is exact only where it stands: it answers the whole record when the record is a
    strict prefix of the prompt, and 0 otherwise.

    Args:
      fed_ids, fed_injected, prompt_ids, injected: as for :func:`common_prefix`.
      rewindable: whether the state can be moved back to any earlier position.

    Returns:
      The number of leading prompt tokens to skip; the caller feeds the rest.

    Raises:
      BadInputError: ``fed_injected`` is not as long as ``fed_ids``.
    """
    n = common_prefix(fed_ids, fed_injected, prompt_ids, injected)
    if not rewindable and n != len(fed_ids):
        return 0
    return n
