"""What a drafter is to :class:`~turbospark_jax.speculative.pair.SpeculativePair`.

Two kinds, declared by :attr:`Drafter.stateless`:

* **lookup drafters** (n-gram, oracle) keep no state: they read the committed sequence (the
  target's fed record) and are always where the target is;
* **model drafters** keep their own state value with its own fed record, primed over the
  committed tokens and rewound when a round rejects what they drafted.

Step-wise drafters return full logits per step, so the loop can shape them like the target's
and keep the proposal distribution for rejection sampling; block drafters return a list of
proposals and are deterministic (their proposal distribution is a point mass).

A drafter that can run inside the device speculative rounds returns its on-device form from
:meth:`Drafter.on_device` (a :class:`DeviceDrafter`); one that cannot (a Python-only drafter)
still runs through the host rounds.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax

from turbospark_jax.core.checks import as_int
from turbospark_jax.errors import BadInputError, UnsupportedCapabilityError
from turbospark_jax.speculative.bounded_loops import bounded_while, loop_within

#: The most tokens one speculative round drafts (the judgement is compiled for this size).
MAX_DRAFT = 8
#: Proposals per round when a request leaves ``draft_len`` unset.
DEFAULT_DRAFT_LEN = 4


class DeviceDrafter(abc.ABC):
    """A drafter's pure functions for the device speculative rounds (frozen, hashable: static
    under ``jit``).

    Declarations:
      point_mass: proposals are deterministic, so their proposal distribution is a point mass
        and :meth:`propose` returns no ``q``.
      loop_free: in a greedy burst (``sampler.greedy``), :meth:`propose` and :meth:`commit`
        hold no loop whose trip count is data when ``sampler.bounded`` asks (their loops
        through :func:`~turbospark_jax.speculative.bounded_loops.loop_within`), so the burst
        runs as a loop of known trip count
        (:data:`~turbospark_jax.speculative.rounds.FIXED_ROUNDS`): on a GPU such a call reads
        nothing back to the host and returns at once, and the next call is queued while it
        runs.
      sampled_loop_free: in a sampled burst too, :meth:`propose` and :meth:`commit` hold no
        loop at all, so on an accelerator a sampled burst runs as a loop of known trip count
        as well, its judge shaping every row side by side
        (:func:`~turbospark_jax.speculative.rounds.judge` with ``bounded``). A round holding a
        loop would be a conditional that XLA's default command buffers cannot record, and a
        sampled burst is not compiled with while loops recorded
        (``device_flags.fixed_rounds_options`` says why).
      catches_up: :meth:`catch_up` has work to do; a chain of device rounds runs it first.
    """

    point_mass: ClassVar[bool] = True
    loop_free: ClassVar[bool] = False
    sampled_loop_free: ClassVar[bool] = False
    catches_up: ClassVar[bool] = False

    @abc.abstractmethod
    def propose(
        self,
        params: Any,
        state: Any,
        target: Any,
        pending: jax.Array,
        m: jax.Array,
        sampler: Any,
    ) -> tuple[jax.Array, jax.Array | None, jax.Array, Any]:
        """Draft up to ``m`` tokens after ``pending`` (the last emitted token, at position
        ``target.fed.count``, not fed to the target yet).

        Args:
          params: the drafter's params (a pytree of arrays; ``()`` for lookup drafters).
          state: the drafter's state.
          target: the target's state (a ``BlockState``): its fed record holds the ids of every
            committed position; a head-style drafter also reads what the target's cache
            records per position.
          pending: int32 ``[]``.
          m: int32 ``[]``, at most :data:`MAX_DRAFT`.
          sampler: :class:`~turbospark_jax.speculative.rounds.DraftSampler`: params, history and
          keys of
            the request, for drafters that sample.

        Returns:
          ``(proposals int32[MAX_DRAFT], q float32[MAX_DRAFT, V] or None, count, state)``:
          ``count <= m`` proposals are real; ``q`` holds each one's proposal distribution
          (``None`` for point-mass drafters).
        """

    def commit(self, state: Any, keep: jax.Array) -> Any:
        """The state after a round whose committed sequence now has ``keep`` positions (the
        drafter may hold fewer: it never consumed the last proposal). Default: no state."""
        del keep
        return state

    def catch_up(self, params: Any, state: Any, target: Any) -> Any:
        """The state brought to within one verify block (the target program's width) of the
        target's committed positions, with what :meth:`propose` would compute on the way: a
        drafter that catches up inside its rounds runs this before a call of device rounds
        (``launch_rounds`` does), so that each round catches up one block at most and its
        loop is bounded. Default: nothing to catch up."""
        del params, target
        return state


class CatchUpDevice(DeviceDrafter):
    """A device drafter that catches up with the target inside its rounds (the MTP head, the
    block drafter), in blocks of the target program's ``width`` positions.

    Its subclass declares a ``caught_up`` field: the form the device rounds run (what
    ``on_device`` returns), where the pair has run :meth:`catch_up` before the chain, so a
    round catches up one block at most (a round commits at most ``width`` positions) and its
    loop is bounded; the host rounds draft with the other form, which catches up as far as the
    target is.
    """

    catches_up = True
    caught_up: bool
    width: int

    @property
    def loop_free(self) -> bool:  # type: ignore[override]
        return self.caught_up

    def _round_catch_up(self, base: jax.Array, block: Any, init: Any) -> Any:
        """A round's catch-up loop: ``block`` while the drafter's fed record (each carry's
        second element) is short of position ``base``."""
        def behind(c: Any) -> jax.Array:
            return c[1].count < base

        if self.caught_up:  # one block: a conditional, no loop
            return bounded_while(behind, block, init, 1, unroll=True)
        return jax.lax.while_loop(behind, block, init)

    def _whole_blocks(self, base: jax.Array, block: Any, init: Any) -> Any:
        """:meth:`catch_up`'s loop: ``block`` while more than one block is left before
        position ``base`` (``init[1]`` and each carry's second element: the drafter's fed
        record)."""
        return jax.lax.while_loop(lambda c: base - c[1].count > self.width, block, init)


def draft_loop(cond: Any, body: Any, init: Any, sampler: Any) -> Any:
    """A drafter's loop inside a round, of at most :data:`MAX_DRAFT` iterations, in the form
    the rounds' sampler asks for (:func:`~turbospark_jax.speculative.bounded_loops.loop_within`):
    bounded in a burst of known trip count; a ``while_loop`` in a ``while_loop`` burst or
    without a sampler (the host rounds' :func:`propose_compiled`)."""
    return loop_within(cond, body, init, MAX_DRAFT, sampler is not None and sampler.bounded)


@functools.partial(jax.jit, static_argnums=0)
def catch_up_compiled(device: DeviceDrafter, params: Any, state: Any, target: Any) -> Any:
    """``device``'s :meth:`~DeviceDrafter.catch_up` as one compiled call."""
    return device.catch_up(params, state, target)


@functools.partial(jax.jit, static_argnums=0)
def propose_compiled(device: DeviceDrafter, params: Any, state: Any, target: Any,
                     pending: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
    """``device``'s :meth:`~DeviceDrafter.propose` as one compiled call, for a drafter that
    does not sample: the proposals, how many are real and the new state. The host rounds draft
    with it, so it runs the program the device rounds run."""
    proposals, _, count, state = device.propose(params, state, target, pending, m, None)
    return proposals, count, state


class Drafter(abc.ABC):
    """A source of draft tokens.

    Declarations:
      stateless: a lookup drafter (see the module docstring): :meth:`init_state` is ``()``,
        and priming or rewinding it does nothing.
      drafts_blocks: proposes a whole block in one call (:meth:`block`) instead of stepping.
      catches_up: keeps a state but brings it up to the target's position itself when it
        drafts (it reads the target's state), so the loop never primes it; it is only ever
        rewound.
    """

    stateless: ClassVar[bool] = False
    drafts_blocks: ClassVar[bool] = False
    catches_up: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """The vocabulary the drafter's ids and logits refer to."""

    def init_state(self) -> Any:
        """A fresh drafter state."""
        return ()

    @property
    def max_positions(self) -> int | None:
        """How many positions a drafter state holds, or ``None`` when unbounded (the default:
        lookup drafters keep no positions)."""
        return None

    def check_state(self, state: Any) -> None:
        """Refuse a value that is not a state of this drafter (a lookup drafter's is ``()``).

        Raises:
          BadInputError: naming what was wrong.
        """
        if self.stateless and state != ():
            raise BadInputError(
                f"{type(self).__name__} keeps no state; its state is (), got {type(state).__name__}"
            )

    def position(self, state: Any) -> int:
        """How many positions a model drafter has consumed (lookup drafters: never asked)."""
        raise UnsupportedCapabilityError(f"{type(self).__name__} keeps no position")

    def prime(self, state: Any, tokens: Sequence[int], start: int) -> Any:
        """Consume the committed ``tokens`` at positions ``start, start + 1, ...`` without
        drafting. Default: nothing to consume."""
        del tokens, start
        return state

    def rewind(self, state: Any, position: int, known: Callable[[], Sequence[int]]) -> Any:
        """The state having consumed exactly the first ``position`` committed ids; ``known()``
        gives them when the drafter must feed them again. Default: nothing to rewind."""
        del position, known
        return state

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

        Returns ``(proposals, logits, state)``: the sampled tokens (fewer than ``count`` when
        the drafter's logits turned non-finite) and the float32 ``[count, V]`` drafter logits
        each was sampled from.
        """
        del state, token, position, count, params, history, key, index
        raise UnsupportedCapabilityError(f"{type(self).__name__} has no device bursts")

    def block(self, state: Any, known: Sequence[int], count: int, *,
              target: Any = None) -> tuple[list[int], Any]:
        """Propose up to ``count`` tokens following ``known`` (fewer when it has none);
        ``target`` is the target's state, for drafters that read it (a head's hidden rows)."""
        del state, known, count, target
        raise UnsupportedCapabilityError(f"{type(self).__name__} drafts step by step")

    def on_device(self) -> tuple[DeviceDrafter, Any] | None:
        """The drafter's device form and its params, or ``None`` when it has none (the
        speculative rounds then run on the host). Default: none."""
        return None


class LookupDrafter(Drafter):
    """A lookup drafter (see the module docstring) that proposes whole blocks of ids below its
    own ``vocab_size``.

    Raises:
      BadInputError: ``vocab_size`` is not a positive integer.
    """

    stateless = True
    drafts_blocks = True

    def __init__(self, vocab_size: int) -> None:
        self._vocab = as_int("vocab_size", vocab_size, low=1)

    @property
    def vocab_size(self) -> int:
        return self._vocab


class CatchUpDrafter(Drafter):
    """A block drafter that :attr:`~Drafter.catches_up`, with its own fed record in its state
    (``state.fed``): its position is that record's count, and a rewind only moves the record
    back (the rows past the position are dropped; drafting rebuilds the ones it lacks, so
    ``known`` is never read)."""

    drafts_blocks = True
    catches_up = True

    def position(self, state: Any) -> int:
        return int(state.fed.count)

    def rewind(self, state: Any, position: int, known: Callable[[], Sequence[int]]) -> Any:
        del known
        return state.replace(fed=state.fed.moved_to(min(position, int(state.fed.count))))
