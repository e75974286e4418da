"""The generation driver: one loop for every completion, plain or speculative.

:func:`stream_completion` is what the CLI, the session pool and chat call;
:func:`run_raw_completion` and
:func:`~turbospark_jax.generation.speculative_loop.run_raw_completion_speculative` run it to
the end. Every completion goes through the same steps, in order:

1. **Validate** once, where the request meets the producer (:func:`validate_request`; the
   request checked its own fields when it was made): bad input raises and leaves the
   caller's state exactly as it was.
2. **Reuse**: ``try_reuse_prefix`` on the state handed in; feed only the unreused suffix,
   never fewer than one token.
3. **Prefill** (:func:`prefill`): chunks through ``prefill_chunk_with_status`` when the
   producer is a :class:`~turbospark_jax.core.protocols.ChunkedPrefillRunner`, else
   ``produce_prefill`` token by token and ``produce`` for the last prompt token; a speculative
   completion primes the drafter over every known pair on the way.
4. **First token**: sampled on the host from the prefill logits with ``token_key(key, 0)``.
5. **Steps**: a :class:`Stepper` emits the rest, one step at a time, and the driver pushes
   each step's tokens through the :class:`~turbospark_jax.generation.completion.Emission`
   (a stop token ends generation without text; otherwise the incremental detokenizer's text
   goes through the stop matcher; a matched stop string or ``max_tokens`` ends it). The
   steppers:

   * :class:`HostSteps`: ``produce`` and one compiled draw per token (:func:`draw_step`);
   * :class:`ConstrainedSteps`: a constrained request's steps: the run of tokens the
     constraint forces, fed as one chunk, or one ``produce`` and one compiled draw from the
     logits with the forbidden ids masked out (the mask goes up packed in bits); a greedy
     one decodes optimistic bursts (plain greedy bursts kept up to the first token the
     constraint forbids);
   * :class:`DecodeBursts`: for a :class:`~turbospark_jax.core.protocols.DeviceDecoder`,
     bursts of decode steps (produce + sample + stop-token check in one jitted loop), each
     chained onto the one before it on the device before that one is read;
   * :class:`~turbospark_jax.generation.speculative_loop.DeviceRounds`: bursts of
     speculative rounds on the device;
   * :class:`~turbospark_jax.generation.speculative_loop.HostRounds`: speculative rounds
     through the protocol's methods, the reference the device rounds are tested against and
     the path for pairs that cannot run rounds on the device.

   Token ``i`` always samples with ``token_key(key, i)``, so the output depends on neither
   the burst lengths nor the stepper.
6. **Finish**: at the end the held-back text is flushed.

History bookkeeping: the completion reports ``fed_ids``, read from the producer's own fed
record. The last sampled token is never fed (nothing needs its logits). When a stop string
lands inside a device burst the tokens after it were fed (and those of the burst chained
after it): a producer that can rewind is moved back so its record matches token-by-token
decoding; others keep the longer, truthful record.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.core import sampling
from turbospark_jax.core.constraints import Constraint
from turbospark_jax.core.injection import Injection
from turbospark_jax.core.protocols import (
    NON_FINITE,
    ChunkedPrefillRunner,
    DeviceDecoder,
    LogitProducer,
    SpeculativeProducer,
    VerifyingTarget,
)
from turbospark_jax.core.streams import Stream, StreamEvent
from turbospark_jax.errors import BadInputError
from turbospark_jax.generation.completion import (
    NON_FINITE_LOGITS,
    PRODUCER_FAILURES,
    BurstSizer,
    Completion,
    CompletionRequest,
    Emission,
    FinishReason,
    add_to_history,
    require_request,
    rewind_overshoot,
    validate_request,
)

__all__ = [
    "Begin",
    "ConstrainedSteps",
    "DecodeBursts",
    "Decoding",
    "HostSteps",
    "PrefillProgress",
    "Step",
    "Stepper",
    "drive",
    "prefill",
    "prepare",
    "run_raw_completion",
    "stream_completion",
]

#: Called during a prefill as ``progress(fed, total)``: prompt tokens fed so far of the
#: ``total`` the prefill feeds (the unreused suffix), after each chunk or token.
PrefillProgress = Callable[[int, int], None]


@dataclasses.dataclass
class Decoding:
    """One completion's decoding as a stepper sees it.

    Fields:
      producer: the producer.
      request: the request (well formed and validated against the producer).
      params: its sampling params.
      key: its PRNG key (``request_key(seed)``).
      out: the emission: the tokens so far and the prompt.
      history: the penalty bookkeeping after every emitted token.
      constraint: the request's constraint, followed through the emitted tokens (``None``:
        unconstrained).
      plan: the kind of draw ``params`` need (:func:`~turbospark_jax.core.sampling.draw_plan`),
        so a host draw compiles without branching on them.
    """

    producer: Any
    request: CompletionRequest
    params: sampling.SamplingParams
    key: jax.Array
    out: Emission
    history: sampling.History
    constraint: Constraint | None = None
    plan: str = "any"

    @property
    def emitted(self) -> int:
        """Tokens emitted so far."""
        return len(self.out.tokens)

    @property
    def left(self) -> int:
        """Tokens the request may still emit."""
        return self.request.max_tokens - len(self.out.tokens)


@dataclasses.dataclass(frozen=True)
class Step:
    """What one step emits.

    Fields:
      tokens: the tokens, in order.
      rows: the logits row behind each token (``None`` where not recorded).
      history: the penalty bookkeeping after all of ``tokens``.
      error: when set, generation fails after these tokens with this reason.
      pending: the stepper holds tokens it has committed to that later steps emit (a
        constraint's forced run, emitted one step a token).
    """

    tokens: Sequence[int]
    rows: Sequence[Any]
    history: sampling.History
    error: str | None = None
    pending: bool = False


class Stepper(abc.ABC):
    """How a completion's tokens after the first are made.

    The driver calls :meth:`advance` until the emission ends the completion, pushing each
    step's tokens; then :meth:`settle` with how many of them it kept (all, or up to the one
    that ended the completion), and at the end :meth:`report`.
    """

    @abc.abstractmethod
    def advance(self, state: Any, run: Decoding) -> tuple[Step, Any]:
        """The next step's tokens and the state after it (the last emitted token is
        ``run.out.tokens[-1]``, not fed yet)."""

    def settle(self, state: Any, kept: int) -> Any:
        """The state once the driver kept ``kept`` of the last step's tokens. Default: as it
        is (an overshoot is rewound at the end)."""
        del kept
        return state

    def report(self, decode_s: float) -> Any:
        """What the completion's ``speculative`` field holds. Default: ``None``."""
        del decode_s


#: The logits with the ids a constraint forbids set to minus infinity.
masked_logits = jax.jit(lambda logits, allowed: jnp.where(allowed, logits, -jnp.inf))

#: A constraint allowed no token at all (the engine's grammar has a dead end).
CONSTRAINT_DEAD_END = "the constraint allows no next token"


@functools.partial(jax.jit, static_argnames=("plan", "recorded"))
def draw_step(logits: jax.Array, words: jax.Array | None, params: sampling.SamplingParams,
              history: sampling.History, key: jax.Array, index: jax.Array, *, plan: str,
              recorded: bool) -> tuple[jax.Array, jax.Array, jax.Array, sampling.History,
                                       jax.Array | None]:
    """A host step's draw as one program: whether ``logits`` are all finite, the logits
    masked to the ids ``words`` allow (a mask packed as
    :meth:`~turbospark_jax.core.constraints.Constraint.allowed_words` packs it; ``None``:
    unmasked), the token :func:`~turbospark_jax.core.sampling.draw_as` draws from them under
    ``plan`` with ``token_key(key, index)``, and the history after it. Returns ``(token,
    finite, free, history, row)``: ``free`` whether the mask allows the unmasked greedy token
    (a masked greedy draw is that token then; always true unmasked or sampled), ``row`` the
    masked logits when ``recorded``, else ``None`` (so nothing of ``[V]`` need leave the
    device). Bitwise what masking with :data:`masked_logits` and drawing with
    ``sampling.sample`` give, in one call instead of four and with one read back instead of
    two."""
    finite = jnp.all(jnp.isfinite(logits))
    free = jnp.bool_(True)
    if words is not None:
        allowed = sampling.unpack_mask(words, logits.shape[0])
        if plan == "greedy":
            free = allowed[sampling.greedy_token(logits, params, history)]
        logits = jnp.where(allowed, logits, -jnp.inf)
    token = sampling.draw_as(plan, logits, params, history, sampling.token_key(key, index))
    return token, finite, free, history.add(token), logits if recorded else None


def host_token(logits: Any, run: Decoding, *, index: int | None = None,
               history: sampling.History | None = None) -> Step:
    """One token sampled on the host from ``logits`` (a prefill's or a host step's): token
    ``run.emitted`` samples with ``token_key(key, run.emitted)``; a constrained run samples
    from the masked logits (the row it records) and moves its constraint past the token.
    ``index`` and ``history`` stand for the token's index and the bookkeeping before it when
    tokens the step also emits come first (``None``: ``run``'s). One device call
    (:func:`draw_step`) and one read of its token and flags."""
    return _host_draw(logits, run, index, history)[0]


def _host_draw(logits: Any, run: Decoding, index: int | None = None,
               history: sampling.History | None = None) -> tuple[Step, bool]:
    """:func:`host_token`'s step, and whether the constraint allowed the unmasked greedy
    token (``draw_step``'s ``free``: what a greedy burst of one step would have kept)."""
    index = run.emitted if index is None else index
    history = run.history if history is None else history
    # The mask is computed before the draw is dispatched: the device works on the logits
    # meanwhile, and the draw waits for them on the device, not here.
    words = None if run.constraint is None else run.constraint.allowed_words()
    token, finite, free, after, row = draw_step(
        logits, words, run.params, history, run.key, index, plan=run.plan,
        recorded=run.request.record_logits)
    token, finite, free = jax.device_get((token, finite, free))
    if not finite:
        return Step(tokens=(), rows=(), history=history, error=NON_FINITE_LOGITS), True
    if words is not None and not words.any():
        return Step(tokens=(), rows=(), history=history, error=CONSTRAINT_DEAD_END), True
    token = int(token)
    if run.constraint is not None:
        run.constraint.advance(token)
    return Step(tokens=(token,), rows=(row,), history=after), bool(free)


def added(history: sampling.History, tokens: Sequence[int]) -> sampling.History:
    """``history`` after ``tokens``, in one call: the ids go as one array padded with ids the
    update drops, to a power-of-two length (a program per length bucket, not per count)."""
    if len(tokens) <= 1:
        return add_to_history(history, tokens[0]) if tokens else history
    ids = np.full(1 << (len(tokens) - 1).bit_length(), -1, np.int32)
    ids[: len(tokens)] = tokens
    return add_to_history(history, ids)


class ConstrainedSteps(Stepper):
    """A constrained request's steps (:class:`HostSteps` with a mask, and forced runs).

    Where the constraint allows a single path, its tokens are emitted without sampling and
    fed to the producer as one chunk before the next sampled token (a chunked producer feeds
    them in one call; a producer's chunk is bitwise the same as feeding token by token). With
    ``record_logits`` the forced tokens are fed one at a time instead, so each has the row it
    was chosen from (the logits masked to that token alone); the tokens are the same.

    ``optimistic`` (:func:`optimistic`: a greedy request without recorded rows on a
    :class:`~turbospark_jax.core.protocols.DeviceDecoder` that can go back, by rewinding or
    by rolling back to a checkpoint): where the last token is the only one not fed, a plain
    greedy burst runs on the device (with its rows) and the constraint takes the longest
    prefix of it that masked decoding would have drawn itself
    (:meth:`~turbospark_jax.core.constraints.Constraint.follow`: a masked argmax is the plain
    argmax whenever the mask allows it). At the first refused token the masked draw is made
    on the host from the row the burst drew that token from, and the state goes back to
    just after the last taken token (a rewind, or a rollback and the taken tokens fed again
    as one chunk). Where a forced run starts inside the burst, or a step fails, the state
    goes back to before the burst and the steps above take over. The tokens are those of
    the token-by-token path. The burst length adapts like a drafter's: after a refusal the
    next burst is sized to end on the token where the last refusal came (a constraint that
    the model breaks at a steady rhythm then needs no going back); past that point, and on
    a fresh run, it doubles after each burst taken whole. A burst sized to one step (the
    model broke the constraint at the last burst's first token) is a masked step instead:
    ``produce`` and the masked draw, whose ``free`` flag (:func:`draw_step`) says what the
    burst would have found, so the sizing learns as before and a model that breaks the
    constraint at every token pays what the token-by-token path pays.
    """

    def __init__(self, optimistic: bool = False) -> None:
        self.fed = 0  # generated tokens the producer has consumed
        self.queue: list[int] = []  # forced tokens taken from the constraint, not emitted
        self.optimistic = optimistic
        self.burst = BurstSizer.GRAIN  # the next optimistic burst's length, past a prediction
        self.streak = 0  # tokens bursts gave since the last masked or forced token
        self.period: int | None = None  # the tokens a burst gave before its last refusal

    def advance(self, state: Any, run: Decoding) -> tuple[Step, Any]:
        assert run.constraint is not None
        if not self.queue:
            self.queue = run.constraint.forced(run.left)
        if self.queue and not run.request.record_logits:
            tokens, self.queue = self.queue, []
            return Step(tokens=tokens, rows=[None] * len(tokens),
                        history=added(run.history, tokens)), state
        if self.optimistic and not self.queue and self.fed == run.emitted - 1:
            steps = self._burst_length(run)
            if steps == 1:  # a masked step: a burst of one step tells no more, costs more
                logits, state = self._feed(state, run)
                step, free = _host_draw(logits, run)
                if free:
                    self._kept_whole(1, 1)
                else:
                    self._refused(0)
                return step, state
            step, state = self._burst(state, run, steps)
            if step is not None:
                return step, state
        logits, state = self._feed(state, run)
        if not self.queue:
            return host_token(logits, run), state
        if not bool(np.all(np.isfinite(np.asarray(logits)))):
            return Step(tokens=(), rows=(), history=run.history, error=NON_FINITE_LOGITS), state
        token = self.queue.pop(0)
        allowed = np.zeros(run.producer.vocab_size, bool)
        allowed[token] = True
        return Step(tokens=(token,), rows=(masked_logits(logits, allowed),),
                    history=add_to_history(run.history, token),
                    pending=bool(self.queue)), state

    def _burst_length(self, run: Decoding) -> int:
        """The next optimistic burst's length (see the class)."""
        p = run.producer
        want = self.burst
        if self.period is not None and self.period >= self.streak:
            want = self.period - self.streak + 1  # to end on the refusal the last run saw
        steps = min(want, p.steps_per_call, run.left)
        if p.step_back_limit is not None:  # a burst the state cannot be taken back from
            steps = min(steps, p.step_back_limit)
        return steps

    def _kept_whole(self, taken: int, steps: int) -> None:
        """A burst of ``steps`` steps kept whole (``taken`` tokens, fewer where it stopped)."""
        self.streak += taken
        if self.period is not None and self.streak > self.period:
            self.period = None  # past the prediction: grow from the last run's length
        elif self.period is None and taken == steps:
            self.burst = min(2 * self.burst, BurstSizer.MOST)

    def _refused(self, taken: int) -> None:
        """A burst refused after ``taken`` tokens: the next one is sized to end there."""
        self.period, self.streak = self.streak + taken, 0
        self.burst = self.period + 1  # where growth resumes once past the prediction

    def _burst(self, state: Any, run: Decoding, steps: int) -> tuple[Step | None, Any]:
        """An optimistic burst of ``steps`` steps (see the class): the step of the tokens the
        constraint took (and the masked draw after a refused one), or ``None`` (the state as
        it was) for a masked step now."""
        p, req, c = run.producer, run.request, run.constraint
        assert c is not None
        before = len(run.out.prompt) + run.emitted - 1  # positions fed before the burst
        # A checkpoint whenever the producer takes one (it holds the small by-value leaves
        # only): a rewind cannot reach back past a sliding-window ring's margin.
        mark = p.checkpoint(state) if isinstance(p, VerifyingTarget) else None
        burst, state = p.decode(
            state, run.out.tokens[-1], steps, params=run.params, history=run.history,
            key=run.key, gen_index=run.emitted, stop_ids=list(req.stop_token_ids),
            record_logits=True,
        )
        taken = c.follow(burst.tokens)
        tokens = list(burst.tokens[:taken])
        whole = taken == len(burst.tokens)
        # the burst's own history where it was kept whole (the same bits), else one update
        history = burst.history if whole else added(run.history, tokens)
        if whole and burst.finish != NON_FINITE:
            # taken whole, or up to a stop id; an end's overshoot is rewound at the finish
            self.fed = run.emitted + taken - 1
            self._kept_whole(taken, steps)
            return Step(tokens=tokens, rows=[None] * taken, history=history), state
        if tokens and (tokens[-1] in req.stop_token_ids or c.is_done):
            return Step(tokens=tokens, rows=[None] * taken, history=history), state
        if whole or c.forced_next():
            # a failed step or a forced run: back to just after the last taken token (a
            # rewind) or to before the burst (a rollback; the next steps feed the taken
            # tokens as a chunk), and on as the token-by-token path goes
            state, rewound = _go_back(p, state, mark, before + taken)
            if rewound:
                self.fed = run.emitted + taken - 1
            self.streak, self.period = 0, None
            self.burst = max(1, taken)
            if not tokens:
                return None, state
            return Step(tokens=tokens, rows=[None] * taken, history=history), state
        # Refused: the masked draw comes from the row the refused token was drawn from, and
        # the state keeps what the burst fed up to the last taken token.
        fed = before + taken + 1
        if int(p.fed_record(state).count) > fed:
            state, rewound = _go_back(p, state, mark, fed)
            if not rewound:
                state = _feed_tokens(p, state, [run.out.tokens[-1], *tokens], before)[1]
        self._refused(taken)
        drawn = host_token(burst.logits[taken], run, index=run.emitted + taken,
                           history=history)
        self.fed = run.emitted + taken
        return Step(tokens=[*tokens, *drawn.tokens], rows=[None] * (taken + len(drawn.tokens)),
                    history=drawn.history, error=drawn.error), state

    def _feed(self, state: Any, run: Decoding) -> tuple[Any, Any]:
        """Feed the emitted tokens the producer has not consumed; the logits after them."""
        tokens = run.out.tokens[self.fed:]
        start = len(run.out.prompt) + self.fed
        self.fed = run.emitted
        return _feed_tokens(run.producer, state, tokens, start)


def _feed_tokens(p: Any, state: Any, tokens: list[int], start: int) -> tuple[Any, Any]:
    """``tokens`` fed from position ``start``: one chunk where the producer takes chunks,
    else one token at a time; the logits after the last and the state."""
    if len(tokens) > 1 and isinstance(p, ChunkedPrefillRunner):
        return p.prefill_chunk_with_status(state, tokens, start, False)
    for i, t in enumerate(tokens[:-1]):
        state = p.produce_prefill(state, t, start + i)
    return p.produce(state, tokens[-1], start + len(tokens) - 1)


def _go_back(p: Any, state: Any, mark: Any, count: int) -> tuple[Any, bool]:
    """``state`` moved back to ``count`` positions fed: a rewind where the producer can and
    still holds the rows (a sliding-window ring past its margin does not), else the rollback
    to ``mark``, taken before the burst (the caller feeds the kept tokens again). ``True``
    where it rewound."""
    if p.can_rewind and (mark is None or p.rewind_floor(state) <= count):
        return p.rewind(state, count), True
    return p.rollback(state, mark), False


class HostSteps(Stepper):
    """One ``produce`` and one host-side sample per token."""

    def advance(self, state: Any, run: Decoding) -> tuple[Step, Any]:
        position = len(run.out.prompt) + run.emitted - 1
        logits, state = run.producer.produce(state, run.out.tokens[-1], position)
        return host_token(logits, run), state


class DecodeBursts(Stepper):
    """Bursts of decode steps on a :class:`~turbospark_jax.core.protocols.DeviceDecoder`.

    The next burst goes to the device before this one is read (``continue_decode``), so the
    device runs it while the host reads, emits and checks this one's tokens (after a stop id
    it runs no step; after a stop string it is rewound with the rest of the overshoot).
    """

    def __init__(self, burst: int | None) -> None:
        self.sizer = BurstSizer(burst)
        self.launched: Any = None  # a burst on its way
        self.since = 0.0  # when the last one was read

    def advance(self, state: Any, run: Decoding) -> tuple[Step, Any]:
        p, req = run.producer, run.request
        if self.launched is None:
            steps = min(self.sizer.next(), p.steps_per_call, run.left)
            self.since = time.perf_counter()
            self.launched, state = p.launch_decode(
                state, run.out.tokens[-1], steps, params=run.params, history=run.history,
                key=run.key, gen_index=run.emitted, stop_ids=list(req.stop_token_ids),
                record_logits=req.record_logits,
            )
        ahead = run.left - self.launched.steps
        if p.max_positions is not None:
            ahead = min(ahead, p.max_positions - self.launched.reach)
        queued = None
        if ahead > 0:
            queued, state = p.continue_decode(
                state, self.launched, min(self.sizer.next(), p.steps_per_call, ahead))
        burst = p.collect(self.launched)
        self.launched = queued
        now = time.perf_counter()
        self.sizer.observed(len(burst.tokens), now - self.since)
        self.since = now
        return device_step(burst), state


def optimistic(producer: Any, request: CompletionRequest,
               params: sampling.SamplingParams) -> bool:
    """Whether a constrained request runs optimistic bursts (:class:`ConstrainedSteps`):
    greedy, no recorded rows, and a device decoder whose state can go back to before a
    burst."""
    return (isinstance(producer, DeviceDecoder) and params.is_greedy
            and not request.record_logits
            and (producer.can_rewind or isinstance(producer, VerifyingTarget)))


def device_step(burst: Any) -> Step:
    """A device burst (:class:`~turbospark_jax.core.protocols.DeviceBurst`) as a step: one
    transfer for its rows (slicing a device array row by row costs a dispatch per token)."""
    n = len(burst.tokens)
    rows = np.asarray(burst.logits) if burst.logits is not None else [None] * n
    return Step(tokens=burst.tokens, rows=rows, history=burst.history,
                error=NON_FINITE_LOGITS if burst.finish == NON_FINITE else None)


def stream_completion(
    producer: LogitProducer,
    request: CompletionRequest,
    *,
    tokenizer: Any | None = None,
    state: Any | None = None,
    progress: PrefillProgress | None = None,
) -> Stream[Completion]:
    """Start a completion with the stepper that fits; iterate for text, then read ``.result``.

    Speculative rounds run when ``producer`` is a
    :class:`~turbospark_jax.core.protocols.SpeculativeProducer` and ``request.draft_len`` is not
    0; plain decoding otherwise.

    Args:
      producer: any :class:`~turbospark_jax.core.protocols.LogitProducer`.
      request: what to generate.
      tokenizer: for text, stop strings and streaming deltas (optional).
      state: a state to continue from (prefix reuse); a fresh one when ``None``. With a
        donating producer its buffers are consumed; use the completion's ``state`` next.
      progress: told how far the prefill has got (:data:`PrefillProgress`), for a progress
        bar over a long prompt.

    Raises:
      BadInputError: an invalid request, producer, tokenizer or state (also: a non-zero
        ``draft_len`` for a producer that cannot draft); raised now, before any state is
        touched.

    Once iteration starts the state handed in belongs to the driver (a donating producer
    consumes its buffers), whatever happens next. Non-finite logits, a producer failure or a
    generated id the tokenizer cannot decode end the completion with ``finish_reason ==
    FinishReason.ERROR`` (``error`` says why; the tokens before stay; no state is offered).
    An exception raised by the caller's own tokenizer is not ours to reinterpret: it
    propagates unchanged, and no completion (so no state) comes back.
    """
    return Stream(start(producer, request, tokenizer, state, progress))


def run_raw_completion(
    producer: LogitProducer,
    request: CompletionRequest,
    *,
    tokenizer: Any | None = None,
    state: Any | None = None,
) -> Completion:
    """Decode plainly to the end and return the completion (the seed's entry point).

    Arguments as for :func:`stream_completion`; a speculative producer decodes plainly here
    (through its target).

    Raises:
      BadInputError: an invalid request; the state is untouched.
    """
    if require_request(request).draft_len:
        raise BadInputError(
            "run_raw_completion decodes plainly; use run_raw_completion_speculative or "
            "stream_completion for draft_len > 0"
        )
    return Stream(start(producer, request, tokenizer, state, speculative=False)).drain()


def start(
    producer: LogitProducer,
    request: CompletionRequest,
    tokenizer: Any | None,
    state: Any | None,
    progress: PrefillProgress | None = None,
    *,
    speculative: bool | None = None,
) -> Generator[StreamEvent, None, Completion]:
    """Validate the completion now and return the driver's generator, which runs as it is
    consumed. ``speculative``: ``None`` picks as :func:`stream_completion` says; ``True``
    asks for speculative rounds, ``False`` for plain decoding."""
    begin = prepare(producer, request, tokenizer, speculative=speculative)
    if state is not None:
        producer.check_state(state)
    return begin(state, progress)


#: A validated completion waiting for its state: ``begin(state, progress)`` is the driver's
#: generator (once).
Begin = Callable[[Any, PrefillProgress | None], Generator[StreamEvent, None, Completion]]


def prepare(
    producer: LogitProducer,
    request: CompletionRequest,
    tokenizer: Any | None,
    *,
    speculative: bool | None = None,
) -> Begin:
    """Validate a completion (all but the state it will start from) and pick its stepper;
    returns what starts it. For a caller that holds the state itself (the session pool takes
    a slot's only once the turn begins), so the request is still checked once.

    Raises:
      BadInputError: as :func:`stream_completion`.
    """
    from turbospark_jax.generation.speculative_loop import rounds_stepper  # imports this module

    require_request(request)
    if speculative is None:
        speculative = isinstance(producer, SpeculativeProducer) and request.draft_len != 0
    if speculative:
        stepper = rounds_stepper(producer, request)
    elif request.draft_len:
        raise BadInputError(
            f"draft_len={request.draft_len} asks for speculative decoding, but "
            f"{type(producer).__name__} cannot draft; pair it with a drafter "
            "(turbospark_jax.speculative.pair.SpeculativePair) or leave draft_len unset"
        )
    params = validate_request(producer, request, tokenizer)
    spec = request.constraint
    if spec is not None and not speculative:
        stepper = ConstrainedSteps(optimistic=optimistic(producer, request, params))
    elif not speculative:
        stepper = (DecodeBursts(request.burst) if isinstance(producer, DeviceDecoder)
                   else HostSteps())
    # The text pipeline is built now too: a prompt id the tokenizer refuses is bad input.
    out = Emission(request, tokenizer, list(request.prompt_ids))

    # The constraint is bound now too: the engine's matcher is built before any device work.
    constraint = None if spec is None else spec.bind(
        tokenizer, producer.vocab_size, request.stop_token_ids)

    def begin(state: Any, progress: PrefillProgress | None = None) -> Generator[
            StreamEvent, None, Completion]:
        return drive(producer, out, params, state, stepper, progress,
                     primes_drafter=speculative, constraint=constraint)

    return begin


def drive(
    producer: LogitProducer,
    out: Emission,
    params: sampling.SamplingParams,
    state: Any | None,
    stepper: Stepper,
    progress: PrefillProgress | None = None,
    *,
    primes_drafter: bool = False,
    constraint: Constraint | None = None,
) -> Generator[StreamEvent, None, Completion]:
    """The driver: reuse, prefill, the first token, ``stepper``'s steps, the overshoot's
    rewind and the completion (see the module docstring). The request is ``out.request``,
    already validated against ``producer``; ``constraint`` is its bound constraint."""
    t0 = time.perf_counter()
    req, prompt = out.request, out.prompt
    state = state if state is not None else producer.init_state()
    injection = req.injection
    if injection is None:
        reused, state = producer.try_reuse_prefix(state, prompt)
    else:
        reused, state = producer.try_reuse_prefix(state, prompt,
                                                  injected=injection.identity_map())
    run = Decoding(producer=producer, request=req, params=params,
                   key=sampling.request_key(req.seed), out=out,
                   history=sampling.History.from_prompt(prompt, producer.vocab_size),
                   constraint=constraint, plan=sampling.draw_plan(params, producer.vocab_size))
    finish, error, first_token_s = None, None, 0.0
    try:
        logits, state = prefill(
            producer, state, prompt[reused:], reused, req.prefill_chunk_size,
            req.parallel_prefill, progress, injection, primes_drafter=primes_drafter,
        )
        # A device call returns before its work is done: the prefill ends when its logits
        # exist, not when the call that will make them returns.
        logits = jax.block_until_ready(logits)
    except PRODUCER_FAILURES as exc:
        finish, error = FinishReason.ERROR, str(exc)
    prefill_s = time.perf_counter() - t0
    if finish is None:
        step = host_token(logits, run)
        first_token_s = time.perf_counter() - t0 - prefill_s
        finish, error, _ = yield from _emit(step, run)
    while finish is None:
        try:
            step, state = stepper.advance(state, run)
        except PRODUCER_FAILURES as exc:
            finish, error = FinishReason.ERROR, str(exc)
            break
        finish, error, kept = yield from _emit(step, run)
        state = stepper.settle(state, kept)
    if finish is not FinishReason.ERROR:
        state = rewind_overshoot(producer, state, len(prompt) + len(out.tokens) - 1)
    decode_s = time.perf_counter() - t0 - prefill_s - first_token_s
    event, completion = out.finish(
        producer, finish, error, state, reused=reused, started=t0, prefill_s=prefill_s,
        first_token_s=first_token_s, speculative=stepper.report(decode_s),
    )
    if event is not None:
        yield event
    return completion


def _emit(step: Step, run: Decoding) -> Generator[
        StreamEvent, None, tuple[FinishReason | None, str | None, int]]:
    """Push ``step``'s tokens until one ends the completion; returns the finish, its error
    (``None``: the emission's own, if any) and how many tokens were pushed."""
    finish, kept = None, 0
    for token, row in zip(step.tokens, step.rows, strict=True):
        event, finish = run.out.push(token, row)
        kept += 1
        if event is not None:
            yield event
        if finish is not None:
            break
    run.history = step.history
    if finish is None and step.error is not None:
        return FinishReason.ERROR, step.error, kept
    c = run.constraint
    if c is not None:
        if finish is None and c.is_done and not step.pending:
            finish = FinishReason.CONSTRAINT_END
        elif finish is FinishReason.LENGTH and not c.is_satisfied:
            finish = FinishReason.CONSTRAINT_UNMET
    return finish, None, kept


def prefill(
    producer: LogitProducer,
    state: Any,
    suffix: list[int],
    start: int,
    chunk_size: int,
    parallel: bool = False,
    progress: PrefillProgress | None = None,
    injection: Injection | None = None,
    *,
    primes_drafter: bool = False,
) -> tuple[Any, Any]:
    """Feed the unreused prompt suffix; return the logits after its last token and the state.

    Chunks through ``prefill_chunk_with_status`` when the producer has chunked prefill,
    otherwise ``produce_prefill`` per token and ``produce`` for the last. With ``parallel``,
    the producer's ``prefill_parallel`` fast path is used when it supports one. ``progress``
    hears after each chunk (or token) how many of the suffix's tokens are in. An
    ``injection`` (images) goes to every call, which takes the rows on its own positions;
    it always takes the exact path, never the parallel one.

    ``primes_drafter`` (a :class:`~turbospark_jax.core.protocols.SpeculativeProducer`): the
    drafter is primed over every known pair on the way, in chunks through
    ``prefill_chunk_priming_drafter`` when the producer supports it, otherwise token by token
    (``produce_prefill`` for the target only when ``supports_headless_prefill``, else
    ``produce``) with ``prime_drafter``.
    """
    total = len(suffix)
    extra = {} if injection is None else {"injection": injection}

    def told(done: int) -> None:
        if progress is not None:
            progress(done, total)

    chunked = (producer.supports_chunked_drafter_prefill() if primes_drafter
               else isinstance(producer, ChunkedPrefillRunner))
    if chunked:
        if (not primes_drafter and parallel and injection is None
                and producer.supports_parallel_prefill()):
            out = producer.prefill_parallel(state, suffix, start, chunk=chunk_size)
            told(total)
            return out
        logits = None
        for a in range(0, total, chunk_size):
            chunk = suffix[a : a + chunk_size]
            final = a + chunk_size >= total
            if primes_drafter:
                after = None if final else suffix[a + chunk_size]
                logits, state = producer.prefill_chunk_priming_drafter(state, chunk, start + a,
                                                                       after)
            else:
                logits, state = producer.prefill_chunk_with_status(state, chunk, start + a,
                                                                   final, **extra)
            told(a + len(chunk))
        return logits, state
    headless = not primes_drafter or producer.supports_headless_prefill()
    for i, tok in enumerate(suffix[:-1]):
        if headless:
            state = producer.produce_prefill(state, tok, start + i, **extra)
        else:
            state = producer.produce(state, tok, start + i)[1]
        if primes_drafter:
            state = producer.prime_drafter(state, suffix[i + 1], start + i)
        told(i + 1)
    out = producer.produce(state, suffix[-1], start + total - 1, **extra)
    told(total)
    return out
