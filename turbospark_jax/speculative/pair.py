"""(target, drafter) as one :class:`~turbospark_jax.core.protocols.SpeculativeProducer`.

The pair's state is the two states side by side; the committed sequence is the target's fed
record, the one record there is: lookup drafters read it, model drafters are primed from it.
When the target is a :class:`~turbospark_jax.engine.producer.BlockProducer` and the drafter has
a device form, whole rounds run on the device (:mod:`turbospark_jax.speculative.rounds`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from turbospark_jax.core import sampling
from turbospark_jax.core.checks import as_bool, as_int, as_token, as_token_ids, is_int
from turbospark_jax.core.protocols import (
    RUNNING,
    ChunkedPrefillRunner,
    DeviceBurst,
    LaunchedBurst,
    SpeculativeProducer,
    VerifyingTarget,
    require_prompt,
)
from turbospark_jax.core.sampling import check_sampling_args
from turbospark_jax.core.state import (
    FedRecord,
    buffers_only,
    by_value,
    merge_parts,
    with_auxiliary,
    without_auxiliary,
)
from turbospark_jax.engine.bursts import require_launched_state
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.engine.program import MAX_STOP_IDS
from turbospark_jax.errors import BadInputError, ContextOverflowError
from turbospark_jax.speculative.drafters.base import MAX_DRAFT, Drafter, catch_up_compiled
from turbospark_jax.speculative.rounds import (
    RoundControl,
    RoundsSpec,
    burst_limit,
    compiled_rounds,
)


@struct.dataclass(kw_only=True)
class PairState:
    """Fields:
      target:  the target producer's state (its fed record is the committed sequence).
      drafter: the drafter's state (``()`` for a lookup drafter).
    """

    target: Any
    drafter: Any


class SpeculativePair(SpeculativeProducer[PairState, Any]):
    """Pair a verifying target with a drafter.

    Args:
      target: a :class:`~turbospark_jax.core.protocols.VerifyingTarget` (``BlockProducer``).
      drafter: a :class:`~turbospark_jax.speculative.drafters.base.Drafter` with the same
      vocabulary.
      device_rounds: run whole rounds on the device when target and drafter allow it (the
        default); ``False`` keeps the host rounds, the reference the tests compare against.

    Raises:
      BadInputError: the vocabularies differ, or an argument has the wrong type.

    Every method refuses a state that is not a :class:`PairState` of this pair's target and
    drafter, and arguments of the wrong type or range, before any work.
    """

    def __init__(self, target: VerifyingTarget, drafter: Drafter, *,
                 device_rounds: bool = True) -> None:
        if not isinstance(target, VerifyingTarget):
            raise BadInputError(
                f"the target must be a VerifyingTarget (a BlockProducer), got "
                f"{type(target).__name__}"
            )
        if not isinstance(drafter, Drafter):
            raise BadInputError(f"the drafter must be a Drafter, got {type(drafter).__name__}")
        if target.vocab_size != drafter.vocab_size:
            raise BadInputError(
                f"the drafter's vocabulary has {drafter.vocab_size} ids but the target's has "
                f"{target.vocab_size}; a drafter must share the target's tokenizer"
            )
        device_rounds = as_bool("device_rounds", device_rounds)
        self.target = target
        self.drafter = drafter
        device = drafter.on_device() if device_rounds else None
        self._device = device if isinstance(target, BlockProducer) else None

    # -- plain producer: the target ------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def max_positions(self) -> int | None:
        """The target's context, or the draft model's when that is shorter: the drafter is
        primed over every committed position, so both must hold them."""
        limits = [n for n in (self.target.max_positions, self.drafter.max_positions)
                  if n is not None]
        return min(limits) if limits else None

    def init_state(self) -> PairState:
        return PairState(target=self.target.init_state(), drafter=self.drafter.init_state())

    def check_state(self, state: PairState) -> None:
        self._pair(state)
        self.target.check_state(state.target)
        self.drafter.check_state(state.drafter)

    def fed_record(self, state: PairState) -> FedRecord:
        return self.target.fed_record(self._pair(state).target)

    @property
    def can_rewind(self) -> bool:
        return self.target.can_rewind

    def rewind_floor(self, state: PairState) -> int:
        return self.target.rewind_floor(state.target)

    def rewind(self, state: PairState, count: int) -> PairState:
        self.check_state(state)
        target = self.target.rewind(state.target, count)
        return self._drafter_to(state.replace(target=target), count)

    def try_reuse_prefix(
        self, state: PairState, prompt_ids: Sequence[int], *,
        injected: Mapping[int, int] | None = None,
    ) -> tuple[int, PairState]:
        self.check_state(state)
        require_prompt(prompt_ids, self.vocab_size)
        n, target = self.target.try_reuse_prefix(state.target, prompt_ids, injected=injected)
        return n, self._drafter_to(state.replace(target=target), n)

    def produce(self, state: PairState, token: int, position: int) -> tuple[jax.Array, PairState]:
        logits, target = self.target.produce(self._pair(state).target, token, position)
        return logits, state.replace(target=target)

    def produce_prefill(self, state: PairState, token: int, position: int) -> PairState:
        target = self.target.produce_prefill(self._pair(state).target, token, position)
        return state.replace(target=target)

    def prefill_chunk(
        self, state: PairState, tokens: Sequence[int], start_position: int
    ) -> tuple[jax.Array, PairState]:
        if not isinstance(self.target, ChunkedPrefillRunner):
            raise BadInputError(f"{type(self.target).__name__} has no chunked prefill")
        logits, target = self.target.prefill_chunk(self._pair(state).target, tokens,
                                                   start_position)
        return logits, state.replace(target=target)

    # -- drafter side ----------------------------------------------------------------------

    def drafter_position(self, state: PairState) -> int:
        self._pair(state)
        if self.drafter.stateless or self.drafter.catches_up:
            # a lookup drafter is always where the target is; one that catches itself up
            # will be by the time it drafts
            return int(self.fed_record(state).count)
        return self.drafter.position(state.drafter)

    def prime_drafter(self, state: PairState, next_token: int, position: int) -> PairState:
        # The drafter consumes the committed token at ``position``; ``next_token`` (known
        # during the prompt) is what a head-style drafter would pair it with.
        self.check_state(state)
        as_token("next_token", next_token, self.vocab_size)
        fed = self.fed_record(state)
        if not is_int(position) or not 0 <= int(position) < int(fed.count):
            raise BadInputError(
                f"prime_drafter at position {position}, but the target has consumed only "
                f"{int(fed.count)} positions; feed the target first"
            )
        position = int(position)
        token = int(fed.ids[position])
        return state.replace(drafter=self.drafter.prime(state.drafter, [token], position))

    def supports_chunked_drafter_prefill(self) -> bool:
        return isinstance(self.target, ChunkedPrefillRunner)

    def prefill_chunk_priming_drafter(
        self, state: PairState, tokens: Sequence[int], start_position: int,
        next_token: int | None,
    ) -> tuple[jax.Array, PairState]:
        # Everything the drafter needs is checked before the target consumes its state.
        self.check_state(state)
        if next_token is not None:
            as_token("next_token", next_token, self.vocab_size)
        tokens = as_token_ids("tokens", tokens, self.vocab_size)
        primed = not (self.drafter.stateless or self.drafter.catches_up)
        if primed and self.drafter.position(state.drafter) != start_position:
            raise BadInputError(
                f"the drafter has consumed {self.drafter.position(state.drafter)} positions, "
                f"not start_position={start_position!r}; rewind_drafter first"
            )
        limit = self.max_positions
        if limit is not None and is_int(start_position) and start_position + len(tokens) > limit:
            raise ContextOverflowError(
                f"a chunk of {len(tokens)} tokens at position {start_position} overflows the "
                f"{limit} positions target and drafter both hold"
            )
        if not isinstance(self.target, ChunkedPrefillRunner):
            raise BadInputError(f"{type(self.target).__name__} has no chunked prefill")
        logits, target = self.target.prefill_chunk_with_status(
            state.target, tokens, start_position, next_token is None
        )
        state = state.replace(target=target)
        # Prime every position whose next token is known: all of the chunk but, when the
        # chunk ends the prompt, its last token (left for the first draft step).
        primed = list(tokens)[: len(tokens) - (1 if next_token is None else 0)]
        drafter = self.drafter.prime(state.drafter, primed, start_position)
        return logits, state.replace(drafter=drafter)

    def draft_step(
        self, state: PairState, token: int, position: int
    ) -> tuple[jax.Array, PairState]:
        logits, drafter = self.drafter.step(self._pair(state).drafter, token, position)
        return logits, state.replace(drafter=drafter)

    def supports_draft_bursts(self) -> bool:
        return self.drafter.supports_bursts()

    def draft_burst(
        self, state: PairState, token: int, position: int, count: int, **sampling: Any
    ) -> tuple[list[int], jax.Array, PairState]:
        count = as_int("count", count, low=1)
        proposals, logits, drafter = self.drafter.burst(
            self._pair(state).drafter, token, position, count, **sampling
        )
        return proposals, logits, state.replace(drafter=drafter)

    def drafts_block_passes(self) -> bool:
        return self.drafter.drafts_blocks

    def draft_block(
        self, state: PairState, anchor: int, base: int, block: int
    ) -> tuple[list[int], PairState]:
        self.check_state(state)
        anchor = as_token("anchor", anchor, self.vocab_size)
        committed = self._known(state)
        base = as_int("base", base, low=0, high=len(committed))
        block = as_int("block", block, low=1)
        known = (*committed[:base], anchor)
        proposals, drafter = self.drafter.block(state.drafter, known, block, target=state.target)
        return proposals, state.replace(drafter=drafter)

    def rewind_drafter(self, state: PairState, position: int) -> PairState:
        self.check_state(state)
        position = as_int("position", position, low=0,
                          high=int(self.fed_record(state).count))
        drafter = self.drafter.rewind(state.drafter, position, lambda: self._known(state))
        return state.replace(drafter=drafter)

    def supports_headless_prefill(self) -> bool:
        # Skipping the target's output head is safe for every drafter: the rows a head-style
        # or block drafter reads (hidden rows, tapped layers) are recorded before the head.
        return True

    # -- target side -----------------------------------------------------------------------

    def checkpoint(self, state: PairState) -> Any:
        return self.target.checkpoint(self._pair(state).target)

    def rollback(self, state: PairState, point: Any) -> PairState:
        return state.replace(target=self.target.rollback(self._pair(state).target, point))

    def supports_retaining_rollback(self) -> bool:
        return self.target.supports_retaining_rollback()

    def retaining_rollback_keeps(self, verified_rows: int, keep_rows: int) -> bool:
        return self.target.retaining_rollback_keeps(verified_rows, keep_rows)

    def rollback_retaining(self, state: PairState, point: Any, keep_rows: int) -> PairState:
        target = self.target.rollback_retaining(self._pair(state).target, point, keep_rows)
        return state.replace(target=target)

    def record_committed(self, state: PairState, tokens: Sequence[int], pos0: int) -> PairState:
        target = self.target.record_committed(self._pair(state).target, tokens, pos0)
        return state.replace(target=target)

    def verify(
        self, state: PairState, feed: Sequence[int], base: int
    ) -> tuple[jax.Array, PairState]:
        rows, target = self.target.verify(self._pair(state).target, feed, base)
        return rows, state.replace(target=target)

    # -- whole rounds on the device ---------------------------------------------------------

    def device_draft_limit(self) -> int:
        if self._device is None:
            return 0
        return min(MAX_DRAFT, self.target.width - 1)

    def launch_rounds(
        self, state: PairState, pending: int, *, draft_len: int, budget: int, params: Any,
        history: Any, key: jax.Array, gen_index: int, remaining: int,
        stop_ids: Sequence[int] = (), record_logits: bool = True,
    ) -> tuple[LaunchedBurst, PairState]:
        """Runs the rounds of :mod:`turbospark_jax.speculative.rounds` in one device call, without
        waiting
        for it (:meth:`collect_rounds` reads it back).

        Raises:
          UnsupportedCapabilityError: ``draft_len`` is past :meth:`device_draft_limit`.
          BadInputError: a wrong state, an argument of the wrong type or range.
          ContextOverflowError: the rounds could write past what target or drafter hold.
        """
        self._pair(state)
        target: BlockProducer = self.target  # type: ignore[assignment]
        count = target._require_state(state.target)  # the check_state check, and the cursor
        self.drafter.check_state(state.drafter)
        draft_len = as_int("draft_len", draft_len, low=1)
        limit = self.device_draft_limit()
        if draft_len > limit:
            return super().launch_rounds(
                state, pending, draft_len=draft_len, budget=budget, params=params,
                history=history, key=key, gen_index=gen_index, remaining=remaining,
                stop_ids=stop_ids, record_logits=record_logits,
            )
        pending = as_token("pending", pending, self.vocab_size)
        budget = as_int("budget", budget, low=1)
        remaining = as_int("remaining", remaining, low=1)
        gen_index = as_int("gen_index", gen_index, low=0, high=2**31 - 1)
        stop_ids = as_token_ids("stop_ids", stop_ids, self.vocab_size, allow_empty=True)
        if len(stop_ids) > MAX_STOP_IDS:
            raise BadInputError(f"at most {MAX_STOP_IDS} stop ids, got {len(stop_ids)}")
        record_logits = as_bool("record_logits", record_logits)
        check_sampling_args(params, history, key, self.vocab_size)
        stops = np.full((MAX_STOP_IDS,), -1, np.int32)
        stops[: len(stop_ids)] = list(stop_ids)
        # Host scalars go in with the call's arguments (an eager jnp op each would cost a
        # dispatch each on a GPU).
        call = _RoundsCall(
            pair=self, params=params, key=key, draft_len=draft_len, stop_ids=stops,
            record_logits=record_logits, pending=np.int32(pending),
            gen_index=np.int32(gen_index), remaining=np.int32(remaining), left=remaining,
            out=None, cursor=None,
        )
        return self._launch_rounds(state, call, history, budget, count, first=True)

    def continue_rounds(
        self, state: PairState, after: LaunchedBurst, budget: int
    ) -> tuple[LaunchedBurst, PairState]:
        """Chain rounds for up to ``budget`` more tokens onto ``after`` without waiting for
        it (see :meth:`~turbospark_jax.core.protocols.SpeculativeProducer.continue_rounds`).
        Nothing here reads the device: the checks hold ``state`` to the one ``after``'s
        launch returned and the context to ``after.reach``."""
        prior = self._own_call(after, "continue_rounds continues")
        require_launched_state(state, state.target if isinstance(state, PairState) else None,
                               prior.cursor)
        budget = as_int("budget", budget, low=1)
        # The rounds before emit a token at least, unless they end the generation (then these
        # run none): at most ``left - 1`` tokens remain.
        if prior.left <= 1:
            raise BadInputError(
                "the rounds this would continue may emit every token the request has left; "
                "collect them first"
            )
        pending, gen_index, remaining = _chained_round_inputs(
            prior.out.count, prior.out.tokens, prior.out.finish, prior.pending,
            prior.gen_index, prior.remaining,
        )
        call = dataclasses.replace(prior, pending=pending, gen_index=gen_index,
                                   remaining=remaining, left=prior.left - 1)
        return self._launch_rounds(state, call, prior.out.history, budget, after.reach)

    def collect_rounds(self, launched: LaunchedBurst) -> DeviceBurst:
        """Wait for launched rounds and read their tokens (and logits, when recorded) back."""
        call = self._own_call(launched, "collect_rounds reads")
        out = call.out
        # One transfer for everything small; slicing on the device by a count that changes
        # from call to call would compile a new program per count.
        n, rounds, finish, tokens, sizes = jax.device_get(
            (out.count, out.rounds, out.finish, out.tokens, out.sizes)
        )
        return DeviceBurst(
            tokens=[int(t) for t in tokens[: int(n)]],
            finish=int(finish),
            history=out.history,
            logits=np.asarray(out.logits)[: int(n)] if call.record_logits else None,
            rounds=tuple((int(d), int(a)) for d, a in sizes[: int(rounds)]),
        )

    def _own_call(self, launched: Any, doing: str) -> _RoundsCall:
        """The record of rounds this pair launched; anything else is refused."""
        if not isinstance(launched, LaunchedBurst) or not isinstance(
            launched.call, _RoundsCall
        ) or launched.call.pair is not self:
            raise BadInputError(
                f"{doing} rounds this pair launched (launch_rounds or continue_rounds); got "
                f"{type(launched).__name__}"
            )
        return launched.call

    def _launch_rounds(
        self, state: PairState, call: _RoundsCall, history: Any, budget: int, count: int,
        first: bool = False,
    ) -> tuple[LaunchedBurst, PairState]:
        target: BlockProducer = self.target  # type: ignore[assignment]
        # A round feeds at most up to the last position the request may still emit into, and
        # a burst stops within one round (MAX_DRAFT) of its budget.
        steps = min(budget, burst_limit(call.record_logits))
        reach = count + min(call.left, steps + MAX_DRAFT)
        limit_positions = self.max_positions or target.capacity
        if reach > limit_positions:
            raise ContextOverflowError(
                f"speculative rounds from position {count} with {call.left} tokens to go "
                f"could write up to position {reach - 1}, past the {limit_positions} "
                "positions that target and drafter hold"
            )
        device, device_params = self._device
        control = RoundControl(
            params=call.params, history=history, key=call.key, gen_index=call.gen_index,
            remaining=call.remaining, budget=np.int32(steps),
            draft_len=np.int32(call.draft_len), stop_ids=call.stop_ids,
        )
        # Every verify block sits below reach + W (its padding rows too): within the target's
        # short-context bound, the rounds verify in the program bounded by it.
        spec = RoundsSpec.choose(target.model, device, target.width,
                                 greedy=sampling.is_greedy(call.params),
                                 record_logits=call.record_logits,
                                 max_keys=target.key_bound(reach + target.width))
        program = compiled_rounds(spec, target.donate)
        bare, held = without_auxiliary(state.target)
        drafter_state = state.drafter
        if first and device.catches_up:
            # A chain's first call: the drafter brought within one block of the target (a
            # round commits at most a block, so every later round and chained call stays
            # there and catches up in one bounded step).
            drafter_state = catch_up_compiled(device, device_params, drafter_state, bare)
        buffers, values, drafter, out = program(
            target.params, device_params, buffers_only(bare), by_value(bare),
            drafter_state, call.pending, control, *target.nothing_injected,
        )
        target_state = with_auxiliary(merge_parts(buffers, values), held)
        call = dataclasses.replace(call, out=out, cursor=target_state.fed.count)
        return (LaunchedBurst(steps=steps, reach=reach, call=call),
                PairState(target=target_state, drafter=drafter))

    # -- internals --------------------------------------------------------------------------

    def _pair(self, state: Any) -> PairState:
        """``state`` when it is a :class:`PairState`; its parts are checked by whoever uses
        them (the target's methods check the target's part)."""
        if not isinstance(state, PairState):
            raise BadInputError(
                f"expected a state of this pair (a PairState from init_state()), got "
                f"{type(state).__name__}"
            )
        return state

    def _known(self, state: PairState) -> tuple[int, ...]:
        return self.fed_record(state).to_host().ids

    def _drafter_to(self, state: PairState, n: int) -> PairState:
        """Leave a model drafter at exactly ``n`` committed positions."""
        if self.drafter.stateless:
            return state
        drafter = self.drafter.rewind(state.drafter, n, lambda: self._known(state))
        return state.replace(drafter=drafter)


@dataclasses.dataclass(frozen=True)
class _RoundsCall:
    """Launched rounds' record: their outputs, what rounds chained onto them take from them
    (the token the first round fed, the index of the first token emitted, the tokens the
    request had left, all on the device), the settings they keep, ``left`` (the host's bound
    on the tokens the request had left) and the returned target state's cursor leaf."""

    out: Any
    pending: Any
    gen_index: Any
    remaining: Any
    left: int
    cursor: Any
    pair: Any
    params: Any
    key: Any
    draft_len: int
    stop_ids: Any
    record_logits: bool


@jax.jit
def _chained_round_inputs(
    count: jax.Array, tokens: jax.Array, finish: jax.Array, pending: jax.Array,
    gen_index: jax.Array, remaining: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chained rounds' inputs from the rounds before them, on the device: the token to feed
    first (the last one those emitted; their own when they emitted none), the index of the
    first token they emit, and the tokens the request has left (none once a stop id or
    non-finite logits ended it, so the chained rounds run none)."""
    last = jnp.where(count > 0, tokens[jnp.maximum(count - 1, 0)], pending)
    left = jnp.where(finish != RUNNING, jnp.int32(0), remaining - count).astype(jnp.int32)
    return last.astype(jnp.int32), gen_index + count, left
