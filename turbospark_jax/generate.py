"""The generation loop: ``run_raw_completion`` and its streaming form.

One implementation, :class:`CompletionStream`, does the work; ``run_raw_completion`` drains it.

The loop, in order:

1. **Validate** the whole request before touching any state (bad input raises and leaves the
   caller's state exactly as it was).
2. **Reuse**: ``try_reuse_prefix`` on the state handed in; feed only the unreused suffix,
   never fewer than one token.
3. **Prefill**: ``prefill_chunk_with_status`` in chunks when the producer is a
   :class:`~turbospark_jax.protocols.ChunkedPrefillRunner`, else ``produce_prefill`` token by
   token and ``produce`` for the last prompt token.
4. **Decode**: sample the first token on the host from the prefill logits; then, when the
   producer can decode on the device (:class:`DeviceDecoder`), bursts of up to ``burst``
   steps (produce + sample + stop-token check in one jitted loop) per host round trip;
   otherwise ``produce`` + a jitted sampler per token. Token ``i`` always samples with
   ``token_key(key, i)`` and the same program runs every burst, so the output does not depend
   on the burst length.
5. **Text**, per token and in this order: a stop token ends generation (its text is not
   emitted); otherwise the incremental detokenizer turns it into text, the stop matcher holds
   back what could still become a stop string and releases the rest; a matched stop string
   ends generation. At the end the held-back text is flushed.

History bookkeeping: the completion reports ``fed_ids``, read back from the producer's own
fed record. The last sampled token is never fed (nothing needs its logits), and when a stop
string lands inside a device burst the tokens after it *were* fed: the record says so, and the
next turn's prefix reuse keys on it.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from turbospark_jax import sampling
from turbospark_jax.block_program import NON_FINITE
from turbospark_jax.errors import (
    BadInputError,
    ContextOverflowError,
    ProducerExhaustedError,
    ProducerFailedError,
)
from turbospark_jax.protocols import ChunkedPrefillRunner, LogitProducer
from turbospark_jax.state import FedRecord, find_fed

#: The error reason when a producer hands back NaN or infinite logits.
NON_FINITE_LOGITS = "the producer returned non-finite logits"
#: ``History.add`` compiled once; both loops update the history on the host side with it.
add_to_history = jax.jit(sampling.History.add)


@runtime_checkable
class DeviceDecoder(Protocol):
    """A producer that runs decode bursts on the device (see ``BlockProducer.decode``)."""

    steps_per_call: int

    def decode(self, state: Any, token: int, steps: int, **kwargs: Any) -> tuple[Any, Any]: ...


class FinishReason(enum.Enum):
    """Why a completion ended."""

    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    LENGTH = "length"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Host-side sampling settings; see :mod:`turbospark_jax.sampling` for the order."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def to_params(self) -> sampling.SamplingParams:
        """Validated device params; raises BadInputError naming a bad setting."""
        return sampling.SamplingParams.make(**dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """One raw completion.

    Args:
      prompt_ids: the token ids to continue (at least one).
      max_tokens: the most tokens to generate (>= 1).
      stop_token_ids: ids that end generation when sampled (not fed, text not emitted).
      stop_strings: texts that end generation when they appear in the output.
      include_stop_string: keep a matched stop string in the text.
      sampling: the sampling settings.
      seed: the request's PRNG seed (same seed, same output).
      prefill_chunk_size: tokens per ``prefill_chunk`` call.
      burst: device decode steps per host round trip (never changes the output).
      record_logits: keep the logits each generated token was sampled from.
      parallel_prefill: use the producer's batched prefill (``prefill_parallel``) when it has
        one: faster, but equal to the exact path only within a stated tolerance.
    """

    prompt_ids: Sequence[int]
    max_tokens: int = 128
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    include_stop_string: bool = False
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0
    prefill_chunk_size: int = 256
    burst: int = 16
    record_logits: bool = False
    parallel_prefill: bool = False


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of one completion."""

    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int


@dataclasses.dataclass(frozen=True)
class Timings:
    """Wall-clock seconds spent in each phase."""

    prefill_s: float
    first_token_s: float
    decode_s: float
    total_s: float

    def decode_tokens_per_s(self, generated: int) -> float:
        return (generated - 1) / self.decode_s if generated > 1 and self.decode_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Completion:
    """The result of a raw completion.

    Fields:
      token_ids: every generated token, including a final stop token.
      text: the emitted text (equals the concatenation of the stream's deltas).
      finish_reason: why it ended; ``error`` carries the reason when it is ERROR.
      stop_string: the stop string that matched, if any.
      usage, timings: counts and seconds.
      fed_ids: what the producer's state consumed, position by position (prompt included).
      state: the producer state after the completion, for the next turn's reuse; ``None``
        after an error (such a state is never offered for reuse).
      logits: with ``record_logits``, float32 ``[len(token_ids), V]``: row ``i`` is what
        token ``i`` was sampled from.
      speculative: the speculative loop's statistics, ``None`` for the plain loop.
    """

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    error: str | None
    stop_string: str | None
    usage: Usage
    timings: Timings
    fed_ids: tuple[int, ...]
    state: Any
    logits: np.ndarray | None = None
    speculative: Any = None


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """One step of a stream: text released and the tokens it came with."""

    text: str
    token_ids: list[int]


def fed_ids_of(state: Any) -> tuple[int, ...]:
    """The ids a producer state has consumed, in position order."""
    fed = find_fed(state)
    if isinstance(fed, FedRecord):
        return fed.to_host().ids
    record = getattr(state, "fed", None)
    if isinstance(record, tuple):
        return tuple(int(t) for t in record)
    raise TypeError(f"{type(state).__name__} keeps no fed-token record")


def validate_request(
    producer: LogitProducer, request: CompletionRequest, tokenizer: Any | None
) -> sampling.SamplingParams:
    """Check everything about ``request`` that can be checked without running the producer.

    Returns the device sampling params. Raises BadInputError (ContextOverflowError for
    length) naming the problem.
    """
    vocab = producer.vocab_size
    prompt = list(request.prompt_ids)
    if not prompt:
        raise BadInputError("the prompt is empty; give at least one token id")
    for name, ids in (("prompt", prompt), ("stop token", list(request.stop_token_ids))):
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < vocab:
                raise BadInputError(f"{name} id {t!r} is outside the vocabulary [0, {vocab})")
    if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or (
        request.max_tokens < 1
    ):
        raise BadInputError(f"max_tokens must be an integer >= 1, got {request.max_tokens!r}")
    if request.prefill_chunk_size < 1 or request.burst < 1:
        raise BadInputError(
            f"prefill_chunk_size and burst must be >= 1, got {request.prefill_chunk_size} and "
            f"{request.burst}"
        )
    limit = producer.max_positions
    if limit is not None and len(prompt) + request.max_tokens > limit:
        raise ContextOverflowError(
            f"a prompt of {len(prompt)} tokens plus max_tokens={request.max_tokens} needs "
            f"{len(prompt) + request.max_tokens} positions; the producer holds {limit}"
        )
    from turbospark_jax.stop import StopMatcher

    if request.stop_strings and tokenizer is None:
        raise BadInputError("stop strings need a tokenizer to see text; pass tokenizer=")
    StopMatcher(list(request.stop_strings), include_stop=request.include_stop_string)
    params = request.sampling.to_params()
    sampling.request_key(request.seed)
    return params


class Emission:
    """Per-token bookkeeping both loops share: stop tokens, text, stop strings, max_tokens.

    :meth:`push` takes one sampled token (and the logits it came from) and says what to
    stream and whether generation ends there, in the seed loop's order: a stop token ends
    generation without text; otherwise the detokenizer's text goes through the stop matcher.
    """

    def __init__(self, request: CompletionRequest, tokenizer: Any | None, prompt: list[int]):
        self.request = request
        self.tokens: list[int] = []
        self.rows: list[Any] = []
        self.text = _TextPipeline(tokenizer, prompt, request)

    def push(self, token: int, row: Any) -> tuple[StreamEvent | None, FinishReason | None]:
        req = self.request
        self.tokens.append(token)
        if req.record_logits:
            self.rows.append(row)
        if token in req.stop_token_ids:
            return None, FinishReason.STOP_TOKEN
        delta, hit = self.text.push(token)
        event = StreamEvent(text=delta, token_ids=[token]) if delta or not hit else None
        if hit:
            return event, FinishReason.STOP_STRING
        if len(self.tokens) >= req.max_tokens:
            return event, FinishReason.LENGTH
        return event, None

    def finish(
        self,
        finish: FinishReason,
        error: str | None,
        state: Any,
        *,
        prompt_len: int,
        reused: int,
        started: float,
        prefill_s: float,
        first_token_s: float,
        speculative: Any = None,
    ) -> tuple[StreamEvent | None, Completion]:
        """The closing event (held-back text) and the completion.

        ``started`` is the ``time.perf_counter()`` reading the request began at; decode time is
        what is left of the total after prefill and the first token.
        """
        total_s = time.perf_counter() - started
        usage = Usage(prompt_len, reused, prompt_len - reused, len(self.tokens))
        timings = Timings(prefill_s, first_token_s, total_s - prefill_s - first_token_s, total_s)
        if finish is FinishReason.ERROR:
            state = None  # never offered for reuse
        tail = "" if finish is FinishReason.STOP_STRING else self.text.flush()
        if finish is FinishReason.LENGTH and self.text.matched is not None:
            finish = FinishReason.STOP_STRING  # the flush settled a held-back stop string
        completion = Completion(
            token_ids=self.tokens,
            text=self.text.emitted,
            finish_reason=finish,
            error=error,
            stop_string=self.text.matched,
            usage=usage,
            timings=timings,
            fed_ids=fed_ids_of(state) if state is not None else (),
            state=state,
            logits=np.stack([np.asarray(r) for r in self.rows]) if self.rows else None,
            speculative=speculative,
        )
        return (StreamEvent(text=tail, token_ids=[]) if tail else None), completion


class CompletionStream(Iterator[StreamEvent]):
    """Iterate to receive :class:`StreamEvent` s; :attr:`completion` is set once exhausted.

    Construction validates the request (raising before any state is touched); the work runs
    as the stream is consumed.
    """

    def __init__(
        self,
        producer: LogitProducer,
        request: CompletionRequest,
        *,
        tokenizer: Any | None = None,
        state: Any | None = None,
    ) -> None:
        self._params = validate_request(producer, request, tokenizer)
        self.producer = producer
        self.request = request
        self.tokenizer = tokenizer
        self._state = state
        self.completion: Completion | None = None
        self._events = self._run()

    def __next__(self) -> StreamEvent:
        return next(self._events)

    def _begin(self) -> tuple[float, list[int], Any, int, Emission, jax.Array, Any]:
        """What every loop starts with: clock, prompt, reused state, emission, key, history."""
        p, req = self.producer, self.request
        t0 = time.perf_counter()
        prompt = [int(t) for t in req.prompt_ids]
        state = self._state if self._state is not None else p.init_state()
        reused, state = p.try_reuse_prefix(state, prompt)
        out = Emission(req, self.tokenizer, prompt)
        key = sampling.request_key(req.seed)
        history = sampling.History.from_prompt(prompt, p.vocab_size)
        return t0, prompt, state, reused, out, key, history

    # The loop proper; a generator so streaming and non-streaming share every line.
    def _run(self) -> Iterator[StreamEvent]:
        p, req = self.producer, self.request
        t0, prompt, state, reused, out, key, history = self._begin()
        device = isinstance(p, DeviceDecoder)
        finish, error = None, None
        first_token_s = 0.0
        try:
            logits, state = prefill(
                p, state, prompt[reused:], reused, req.prefill_chunk_size, req.parallel_prefill
            )
        except (ProducerExhaustedError, ProducerFailedError) as exc:
            finish, error = FinishReason.ERROR, str(exc)
        prefill_s = time.perf_counter() - t0

        while finish is None:
            if not out.tokens or not device:
                # One token sampled on the host from ``logits`` (prefill's or a host step's).
                if not bool(np.all(np.isfinite(np.asarray(logits)))):
                    finish, error = FinishReason.ERROR, NON_FINITE_LOGITS
                    break
                index_key = sampling.token_key(key, len(out.tokens))
                new = [int(sampling.sample(logits, self._params, history, index_key))]
                history = add_to_history(history, new[0])
                new_rows, failed = [logits], False
            else:
                new, new_rows, failed, history, state = self._device_burst(
                    state, out.tokens[-1], len(out.tokens), history, key
                )
            if not out.tokens:
                first_token_s = time.perf_counter() - t0 - prefill_s
            for tok, row in zip(new, new_rows, strict=True):
                event, finish = out.push(tok, row)
                if event is not None:
                    yield event
                if finish is not None:
                    break
            if finish is None and failed:
                finish, error = FinishReason.ERROR, NON_FINITE_LOGITS
            if finish is None and not device:
                try:
                    position = len(prompt) + len(out.tokens) - 1
                    logits, state = p.produce(state, out.tokens[-1], position)
                except (ProducerExhaustedError, ProducerFailedError) as exc:
                    finish, error = FinishReason.ERROR, str(exc)
        if finish is not FinishReason.ERROR:
            state = _rewind_overshoot(p, state, prompt + out.tokens)
        event, self.completion = out.finish(
            finish, error, state, prompt_len=len(prompt), reused=reused, started=t0,
            prefill_s=prefill_s, first_token_s=first_token_s,
        )
        if event is not None:
            yield event

    def _device_burst(self, state, pending, index, history, key):
        req, p = self.request, self.producer
        steps = min(req.burst, p.steps_per_call, req.max_tokens - index)
        burst, state = p.decode(
            state, pending, steps, params=self._params, history=history, key=key,
            gen_index=index, stop_ids=list(req.stop_token_ids),
        )
        rows = list(burst.logits) if req.record_logits else [None] * len(burst.tokens)
        return burst.tokens, rows, burst.finish == NON_FINITE, burst.history, state


def prefill(
    producer: LogitProducer,
    state: Any,
    suffix: list[int],
    start: int,
    chunk_size: int,
    parallel: bool = False,
) -> tuple[Any, Any]:
    """Feed the unreused prompt suffix; return the logits after its last token and the state.

    Chunks through ``prefill_chunk_with_status`` when the producer has chunked prefill,
    otherwise ``produce_prefill`` per token and ``produce`` for the last. With ``parallel``,
    a producer's ``prefill_parallel`` fast path is used instead when it has one.
    """
    fast = getattr(producer, "prefill_parallel", None)
    if parallel and fast is not None:
        return fast(state, suffix, start, chunk=chunk_size)
    if isinstance(producer, ChunkedPrefillRunner):
        logits = None
        for a in range(0, len(suffix), chunk_size):
            chunk = suffix[a : a + chunk_size]
            final = a + chunk_size >= len(suffix)
            logits, state = producer.prefill_chunk_with_status(state, chunk, start + a, final)
        return logits, state
    for i, tok in enumerate(suffix[:-1]):
        state = producer.produce_prefill(state, tok, start + i)
    return producer.produce(state, suffix[-1], start + len(suffix) - 1)


def _rewind_overshoot(producer: LogitProducer, state: Any, sequence: list[int]) -> Any:
    """Leave the state having fed ``sequence[:-1]``, as token-by-token decoding would.

    A device burst keeps feeding after a token whose text completes a stop string (the host
    sees text only after the burst). Producers that can rewind exactly (``can_rewind``) are
    moved back, so the fed record is the same whichever way generation stopped; others keep
    the longer, still truthful, record.
    """
    if not getattr(producer, "can_rewind", False):
        return state
    fed = find_fed(state)
    if fed is None or int(fed.count) < len(sequence):  # nothing fed past the last token
        return state
    n, rewound = producer.try_reuse_prefix(state, sequence)
    if n != len(sequence) - 1:
        raise ProducerFailedError(
            f"the state's fed record diverges from the generated sequence at {n}"
        )
    return rewound


class _TextPipeline:
    """Detokenizer then stop matcher, in the loop's order; text-free without a tokenizer."""

    def __init__(self, tokenizer: Any | None, prompt: list[int], req: CompletionRequest) -> None:
        from turbospark_jax.stop import StopMatcher

        self.emitted = ""
        self.matched: str | None = None
        self._detok = None
        if tokenizer is not None:
            from turbospark_jax.detokenize import IncrementalDetokenizer

            self._detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
        self._stop = StopMatcher(list(req.stop_strings), include_stop=req.include_stop_string)

    def push(self, token: int) -> tuple[str, bool]:
        if self._detok is None:
            return "", False
        out, hit = self._stop.push(self._detok.push(token))
        self.emitted += out
        if hit:
            self.matched = self._stop.matched
        return out, hit

    def flush(self) -> str:
        if self._detok is None:
            return ""
        out, hit = self._stop.push(self._detok.flush())
        if not hit:
            # A stop string still undecided at the end (held for a longer candidate) is
            # settled here, so ``matched`` is read after the flush.
            out += self._stop.flush()
        self.matched = self._stop.matched
        self.emitted += out
        return out


def stream_raw_completion(
    producer: LogitProducer,
    request: CompletionRequest,
    *,
    tokenizer: Any | None = None,
    state: Any | None = None,
) -> CompletionStream:
    """Start a streaming completion; iterate for text deltas, then read ``.completion``.

    Raises BadInputError (before touching ``state``) for an invalid request.
    """
    return CompletionStream(producer, request, tokenizer=tokenizer, state=state)


def run_raw_completion(
    producer: LogitProducer,
    request: CompletionRequest,
    *,
    tokenizer: Any | None = None,
    state: Any | None = None,
) -> Completion:
    """Run a completion to the end and return it.

    Args:
      producer: any :class:`~turbospark_jax.protocols.LogitProducer`.
      request: what to generate.
      tokenizer: for text, stop strings and streaming deltas (optional).
      state: a state to continue from (prefix reuse); a fresh one when ``None``. With a
        donating producer its buffers are consumed; use the completion's ``state`` next.

    Raises:
      BadInputError: an invalid request; the state is untouched.
    """
    stream = CompletionStream(producer, request, tokenizer=tokenizer, state=state)
    for _ in stream:
        pass
    assert stream.completion is not None
    return stream.completion


__all__ = [
    "Completion",
    "CompletionRequest",
    "CompletionStream",
    "DeviceDecoder",
    "Emission",
    "FinishReason",
    "SamplingConfig",
    "StreamEvent",
    "Timings",
    "Usage",
    "fed_ids_of",
    "prefill",
    "run_raw_completion",
    "stream_raw_completion",
    "validate_request",
]
