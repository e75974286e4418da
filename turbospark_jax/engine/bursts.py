"""The device-side decode of a block producer: bursts launched, chained and collected.

:class:`BlockBursts` is the :class:`~turbospark_jax.core.protocols.DeviceDecoder` side of
:class:`~turbospark_jax.engine.producer.BlockProducer`, which it is a part of (it is not used
alone: it feeds through the producer's state checks, plans and program call). A burst is one
program call that feeds a token and decodes up to ``steps`` tokens on the device; the host
does not wait for it, and a burst chained onto it (:meth:`BlockBursts.continue_decode`) takes
its first token and index from the one before on the device (:func:`chained_inputs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.core import sampling
from turbospark_jax.core.checks import as_bool, as_int, as_token, as_token_ids
from turbospark_jax.core.protocols import (
    NON_FINITE,
    RUNNING,
    DeviceBurst,
    DeviceDecoder,
    LaunchedBurst,
)
from turbospark_jax.engine.program import MAX_STOP_IDS, BlockState, Control, Plan
from turbospark_jax.engine.sizing import MAX_CAPACITY
from turbospark_jax.errors import BadInputError, ContextOverflowError

__all__ = ["BlockBursts", "BurstCall", "chained_inputs", "require_launched_state"]


class BlockBursts(DeviceDecoder):
    """Decode bursts on the device for :class:`~turbospark_jax.engine.producer.BlockProducer`
    (see :class:`~turbospark_jax.core.protocols.DeviceDecoder`)."""

    @property
    def step_back_limit(self) -> int | None:
        return self.model.rewind_reach()

    def launch_decode(
        self,
        state: BlockState,
        token: int,
        steps: int,
        *,
        params: sampling.SamplingParams,
        history: sampling.History,
        key: jax.Array,
        gen_index: int,
        stop_ids: Sequence[int] = (),
        record_logits: bool = True,
    ) -> tuple[LaunchedBurst, BlockState]:
        """Feed ``token`` and decode up to ``steps`` tokens on the device in one call, without
        waiting for it (:meth:`collect` reads it back).

        Step ``i`` samples with ``token_key(key, gen_index + i)``, so the tokens do not depend
        on how a generation is split into bursts. The burst ends early after sampling a stop
        id (which is returned but not fed) or on non-finite logits. The last sampled token is
        never fed: the next burst starts with it.
        """
        count = self._require_state(state)
        steps = as_int("steps", steps, low=1, high=self.steps_per_call)
        stop_ids = as_token_ids("stop_ids", stop_ids, self.vocab_size, allow_empty=True)
        if len(stop_ids) > MAX_STOP_IDS:
            raise BadInputError(f"at most {MAX_STOP_IDS} stop ids, got {len(stop_ids)}")
        sampling.check_sampling_args(params, history, key, self.vocab_size)
        gen_index = as_int("gen_index", gen_index, low=0, high=MAX_CAPACITY)
        record_logits = as_bool("record_logits", record_logits)
        token = as_token("token", token, self.vocab_size)
        self._check_feed([token], count, count, "token")
        self._check_reach(count, steps)
        stops = np.full((MAX_STOP_IDS,), -1, np.int32)
        stops[: len(stop_ids)] = list(stop_ids)
        # A model whose widths agree may decode in a program of its own (its rows are the
        # same bits in any program), so that program draws by the settings' plan with no
        # branch on them; otherwise decode runs the one program prefill and verify run.
        draw = sampling.draw_plan(params, self.vocab_size) if self.model.widths_agree else "any"
        # Host scalars and arrays go to the program as they are: the call transfers them with
        # its arguments, where an eager jnp op per field costs a dispatch each on a GPU.
        call = BurstCall(
            producer=self.identity, params=params, key=key, stop_ids=stops, draw=draw,
            record_logits=record_logits, first=np.int32(token), gen_index=np.int32(gen_index),
            ended=np.bool_(False), out=None, cursor=None,
        )
        plan = self._decode_plan(steps, first=token)
        return self._launch(state, call, plan, history, np.int32(steps), count, steps)

    def continue_decode(
        self, state: BlockState, after: LaunchedBurst, steps: int
    ) -> tuple[LaunchedBurst, BlockState]:
        """Chain up to ``steps`` more tokens onto ``after`` without waiting for it (see
        :meth:`~turbospark_jax.core.protocols.DeviceDecoder.continue_decode`). Nothing here reads
        the device: the checks hold ``state`` to the one ``after``'s launch returned, and the
        context to ``after.reach``."""
        prior = self._own_call(after, "continue_decode continues")
        require_launched_state(state, state, prior.cursor)
        steps = as_int("steps", steps, low=1, high=self.steps_per_call)
        self._check_reach(after.reach, steps)
        plan = self._decode_plan(steps, first=0)
        # The first token, its index and whether the generation already ended come from the
        # burst before, on the device: the host never waits for it here.
        tokens, gen_index, n_steps, first, ended = chained_inputs(
            prior.out.steps, prior.out.sampled, prior.out.finish, prior.first,
            prior.gen_index, prior.ended, plan.tokens, np.int32(steps),
        )
        call = dataclasses.replace(prior, first=first, gen_index=gen_index, ended=ended)
        return self._launch(state, call, plan.replace(tokens=tokens), prior.out.history,
                            n_steps, after.reach, steps)

    def collect(self, launched: LaunchedBurst) -> DeviceBurst:
        """Wait for a launched burst and read its tokens (and logits, when recorded) back."""
        call = self._own_call(launched, "collect reads")
        out = call.out
        # One transfer for the scalars and tokens; slicing on the device by a count that
        # changes from call to call would compile a new program per count.
        n, finish, sampled = jax.device_get((out.steps, out.finish, out.sampled))
        n, finish = int(n), int(finish)
        toks = [int(t) for t in sampled[:n]]
        if finish == NON_FINITE:
            toks = toks[: n - 1]
        logits = np.asarray(out.logits)[: len(toks)] if call.record_logits else None
        return DeviceBurst(tokens=toks, finish=finish, history=out.history, logits=logits)

    def _own_call(self, launched: Any, doing: str) -> BurstCall:
        """The record of a burst this producer launched; anything else is refused."""
        if not isinstance(launched, LaunchedBurst) or not isinstance(
            launched.call, BurstCall
        ) or launched.call.producer != self.identity:
            raise BadInputError(
                f"{doing} a burst this producer launched (launch_decode or continue_decode); "
                f"got {type(launched).__name__}"
            )
        return launched.call

    def _check_reach(self, count: int, steps: int) -> None:
        if count + steps > self.capacity:
            raise ContextOverflowError(
                f"decoding {steps} tokens from position {count} overflows the "
                f"context of {self.capacity} positions"
            )

    def _decode_plan(self, steps: int, first: int) -> Plan:
        return self._plan([[first]] + [[0]] * (steps - 1), head_on_last=False, head_all=True,
                          offsets=np.arange(self.steps_per_call, dtype=np.int32))

    def _launch(
        self, state: BlockState, call: BurstCall, plan: Plan, history: Any, n_steps: Any,
        count: int, steps: int,
    ) -> tuple[LaunchedBurst, BlockState]:
        control = Control(
            feedback=np.bool_(True),
            params=call.params,
            history=history,
            key=call.key,
            gen_index=call.gen_index,
            stop_ids=call.stop_ids,
        )
        # Every row this burst feeds (padding rows too) sits below count + steps + W - 1.
        out, state = self._call(state, plan, control, n_steps, draw=call.draw,
                                max_keys=self.key_bound(count + steps + self.width - 1))
        call = dataclasses.replace(call, out=out, cursor=state.fed.count)
        return LaunchedBurst(steps=steps, reach=count + steps, call=call), state


def require_launched_state(state: Any, target: Any, cursor: Any) -> None:
    """Refuse to chain a device call onto anything but the state the call before it returned
    (``target``: that state's block-producer part, whose cursor leaf must be ``cursor``),
    and a state whose buffers a later call consumed. Reads nothing from the device."""
    if not isinstance(target, BlockState) or target.fed.count is not cursor:
        raise BadInputError(
            "continue with the state its launch returned (and nothing since): a chained "
            "call starts where the one before it stops"
        )
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
        raise BadInputError(
            "this state's buffers were consumed by an earlier call (the producer donates "
            "them); continue from the state that call returned"
        )



@dataclasses.dataclass(frozen=True)
class BurstCall:
    """A launched decode burst's record: its outputs, what a burst chained onto it takes
    from them (the token step 0 fed, the index it sampled, whether an earlier burst ended
    the generation), the settings it keeps, and the returned state's cursor leaf (a chained
    burst must continue that very state)."""

    out: Any
    first: Any
    gen_index: Any
    ended: Any
    cursor: Any
    producer: int
    params: Any
    key: Any
    stop_ids: Any
    draw: str
    record_logits: bool


@jax.jit
def chained_inputs(
    steps_run: jax.Array, sampled: jax.Array, finish: jax.Array, first: jax.Array,
    gen_index: jax.Array, ended: jax.Array, tokens: jax.Array, steps: jax.Array,
) -> tuple[jax.Array, ...]:
    """A chained burst's inputs from the burst before it, on the device: its plan's tokens
    with the last token that burst sampled first (the token it fed itself when it ran no
    step), the index its first step samples, its step count (none once a burst has stopped
    on a stop id or non-finite logits), and the token and flag a burst after it takes."""
    last = jnp.where(steps_run > 0, sampled[jnp.maximum(steps_run - 1, 0)], first)
    done = ended | (finish != RUNNING)
    n_steps = jnp.where(done, jnp.int32(0), steps).astype(jnp.int32)
    return tokens.at[0, 0].set(last), gen_index + steps_run, n_steps, last, done
