"""What a drafter is to :class:`~turbospark_jax.drafters.pair.SpeculativePair`.

A drafter keeps its own state value and sees the committed token sequence (``known``: the
ids at positions ``0 .. len(known) - 1`` that the target has consumed). Step-wise drafters
return full logits per step, so the loop can shape them like the target's and keep the
proposal distribution for rejection sampling; block drafters return a list of proposals and
are deterministic (their proposal distribution is a point mass).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import jax

from turbospark_jax.errors import UnsupportedCapabilityError


class Drafter(abc.ABC):
    """A source of draft tokens with an explicit state value."""

    #: True when the drafter proposes a whole block in one call (:meth:`block`).
    drafts_blocks: bool = False

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """The vocabulary the drafter's ids and logits refer to."""

    @abc.abstractmethod
    def init_state(self) -> Any:
        """A fresh drafter state."""

    @abc.abstractmethod
    def prime(self, state: Any, known: Sequence[int], position: int) -> Any:
        """Learn the committed token at ``position`` (``known[position]``) without drafting."""

    def step(self, state: Any, token: int, position: int) -> tuple[jax.Array, Any]:
        """Feed ``token`` at ``position`` and return logits for ``position + 1``."""
        del state, token, position
        raise UnsupportedCapabilityError(f"{type(self).__name__} drafts whole blocks")

    def supports_bursts(self) -> bool:
        """Whether :meth:`burst` runs several draft steps in one device call. Default: no."""
        return False

    def burst(
        self, state: Any, token: int, position: int, count: int, *,
        params: Any, history: Any, key: jax.Array, index: int,
    ) -> tuple[list[int], jax.Array, Any]:
        """``count`` step-wise draft steps in one call: feed ``token`` at ``position``, sample,
        feed the sample, and so on; token ``i`` samples with ``token_key(key, index + i)``,
        exactly as ``count`` calls of :meth:`step` plus host sampling would.

        Returns ``(proposals, logits, state)``: the ``count`` sampled tokens and the float32
        ``[count, V]`` drafter logits each was sampled from.
        """
        del state, token, position, count, params, history, key, index
        raise UnsupportedCapabilityError(f"{type(self).__name__} has no device bursts")

    def block(self, state: Any, known: Sequence[int], block: int) -> tuple[list[int], Any]:
        """Propose up to ``block`` tokens following ``known`` (fewer when it has none)."""
        del state, known, block
        raise UnsupportedCapabilityError(f"{type(self).__name__} drafts step by step")

    @abc.abstractmethod
    def rewind(self, state: Any, known: Sequence[int], position: int) -> Any:
        """Return the state having consumed exactly ``known[:position]``."""

    @abc.abstractmethod
    def consumed(self, state: Any) -> int:
        """How many positions the drafter has consumed."""
