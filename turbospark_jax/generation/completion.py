"""What a completion asks for and what it returns, and the per-token work every step shares.

A :class:`CompletionRequest` checks its own fields when it is made, so a request that exists
is well formed; :func:`validate_request` adds, once, where the request meets a producer, what
only the producer can say (its vocabulary, its context, the state handed in). The generation
driver (:mod:`turbospark_jax.generation.driver`) pushes every token it emits through one
:class:`Emission` (stop tokens, the detokenizer, stop strings, ``max_tokens``, in the seed
loop's order) and ends with one :class:`Completion`. The session pool and chat return the same
:class:`Completion`, its :class:`Usage` naming the slot that served the turn.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from turbospark_jax.core import sampling
from turbospark_jax.core.checks import as_bool, as_int, as_token_ids
from turbospark_jax.core.constraints import ConstraintSpec
from turbospark_jax.core.detokenize import TOKENIZER_CALLS, IncrementalDetokenizer, provides
from turbospark_jax.core.injection import Injection
from turbospark_jax.core.protocols import LogitProducer
from turbospark_jax.core.sampling import SamplingConfig
from turbospark_jax.core.stop import StopMatcher
from turbospark_jax.core.streams import StreamEvent
from turbospark_jax.engine.batching import MAX_TOP_LOGPROBS
from turbospark_jax.errors import (
    BadInputError,
    ContextOverflowError,
    ProducerExhaustedError,
    ProducerFailedError,
)
from turbospark_jax.speculative.drafters.base import MAX_DRAFT

#: Token ids are int32 on the device: no vocabulary reaches past this.
_ID_LIMIT = 2**31 - 1

__all__ = [
    "NON_FINITE_LOGITS",
    "Completion",
    "CompletionRequest",
    "Emission",
    "FinishReason",
    "Timings",
    "TokenLogprob",
    "Usage",
    "open_block",
    "rewind_overshoot",
    "validate_request",
]

#: The error reason when a producer hands back NaN or infinite logits.
NON_FINITE_LOGITS = "the producer returned non-finite logits"

#: Failures a producer may raise mid-generation; the driver turns them into an ERROR finish.
PRODUCER_FAILURES = (ProducerExhaustedError, ProducerFailedError)

#: ``History.add`` compiled once; the host steps update the history with it.
add_to_history = jax.jit(sampling.History.add)


class FinishReason(enum.Enum):
    """Why a completion ended."""

    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    BLOCK_END = "block_end"
    LENGTH = "length"
    ERROR = "error"
    #: The constraint admits nothing more: the text is complete (no stop token was needed).
    CONSTRAINT_END = "constraint_end"
    #: ``max_tokens`` came before the text satisfied the constraint.
    CONSTRAINT_UNMET = "constraint_unmet"


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
      burst: tokens per host round trip when the producer decodes on the device (never
        changes the output). ``None`` (the default) sizes each call from the rate seen so
        far (:class:`BurstSizer`): the first call asks for 16 tokens, later ones for about
        a quarter of a second of decoding, so a fast model pays the fixed cost of a call
        rarely and a slow one still streams several times a second.
      record_logits: keep the logits each generated token was sampled from.
      logprobs: ``None`` for no log-probabilities; ``N`` to report each generated token's
        log-probability under the model's raw logits and its ``N`` likeliest alternatives
        (0..:data:`~turbospark_jax.engine.batching.MAX_TOP_LOGPROBS`) in
        :attr:`Completion.logprobs`. They are computed from
        the recorded logits, so asking for them records the logits too.
      stop_at_block_end: when the prompt ends inside a Python ``def`` or ``class``
        (:func:`open_block`), end the completion before the first generated line that leaves
        that block (a line indented no deeper than its header); a prompt outside any such
        block is unaffected. Needs a tokenizer (the text decides).
      parallel_prefill: use the producer's batched prefill when it has one: faster, but equal
        to the exact path only within a stated tolerance.
      draft_len: proposals per speculative round, 1..``speculative.MAX_DRAFT``; ``None``
        takes the default (4) when the producer can draft; ``0`` decodes plainly even with a
        speculative producer. A non-zero value needs a speculative producer.
      injection: embeddings injected at prompt positions (images in their placeholder
        spans, :mod:`turbospark_jax.core.injection`); needs a producer that
        ``accepts_embeddings`` and plain decoding. Prefix reuse compares its identities.
      constraint: what the generated text must match (a JSON schema, a regex or a grammar,
        :class:`~turbospark_jax.core.constraints.ConstraintSpec`); needs a tokenizer. Each
        token is sampled from the logits with the ids the constraint forbids masked out, a
        run the constraint forces is emitted without sampling, a stop token is allowed only
        once the text is complete, and the completion ends with ``CONSTRAINT_END`` when
        nothing more may follow, ``CONSTRAINT_UNMET`` when ``max_tokens`` comes first. In
        speculative rounds the proposals are checked against the constraint and each
        verified row is masked and sampled as plain decoding would
        (:class:`~turbospark_jax.generation.speculative_loop.ConstrainedRounds`): the same
        tokens as plain constrained decoding.

    Raises:
      BadInputError: a field of the wrong type or range (checked here, once; what depends on
        the producer is checked by :func:`validate_request`). The id sequences are kept as
        tuples of ``int`` and the stop strings as a tuple.
    """

    prompt_ids: Sequence[int]
    max_tokens: int = 128
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    include_stop_string: bool = False
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    seed: int = 0
    prefill_chunk_size: int = 256
    burst: int | None = None
    record_logits: bool = False
    logprobs: int | None = None
    stop_at_block_end: bool = False
    parallel_prefill: bool = False
    draft_len: int | None = None
    injection: Injection | None = None
    constraint: ConstraintSpec | None = None

    def __post_init__(self) -> None:
        def keep(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        keep("prompt_ids", tuple(as_token_ids("prompt_ids", self.prompt_ids, _ID_LIMIT)))
        keep("stop_token_ids", tuple(as_token_ids("stop_token_ids", self.stop_token_ids,
                                                  _ID_LIMIT, allow_empty=True)))
        for flag in ("include_stop_string", "record_logits", "parallel_prefill",
                     "stop_at_block_end"):
            keep(flag, as_bool(flag, getattr(self, flag)))
        if self.logprobs is not None:
            keep("logprobs", as_int("logprobs", self.logprobs, low=0, high=MAX_TOP_LOGPROBS))
            keep("record_logits", True)
        keep("max_tokens", as_int("max_tokens", self.max_tokens, low=1))
        keep("prefill_chunk_size", as_int("prefill_chunk_size", self.prefill_chunk_size, low=1))
        if self.burst is not None:
            keep("burst", as_int("burst", self.burst, low=1))
        if self.draft_len is not None:
            keep("draft_len", as_int("draft_len", self.draft_len, low=0, high=MAX_DRAFT))
        keep("stop_strings", StopMatcher(self.stop_strings).stop_strings)
        if not isinstance(self.sampling, SamplingConfig):
            raise BadInputError(
                f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}"
            )
        self.sampling.check()
        keep("seed", as_int("seed", self.seed, low=0, high=2**64 - 1))
        if self.injection is not None and not isinstance(self.injection, Injection):
            raise BadInputError(f"injection must be an Injection or None, got "
                                f"{type(self.injection).__name__}")
        if self.constraint is not None and not isinstance(self.constraint, ConstraintSpec):
            raise BadInputError(
                f"constraint must be a ConstraintSpec (ConstraintSpec.json_schema, .regex, "
                f".grammar) or None, got {type(self.constraint).__name__}")

    @property
    def params(self) -> sampling.SamplingParams:
        """The sampling settings as device params."""
        return self.sampling.to_params()


class BurstSizer:
    """How many tokens a device loop asks of its next call.

    A fixed ``burst`` is used as it is. ``None`` adapts: the first call asks for
    :attr:`FIRST` tokens; after each call the next asks for what :attr:`TARGET_S` seconds
    of decoding give at the rate measured so far, between :attr:`FIRST` and :attr:`MOST`,
    rounded down to a multiple of :attr:`GRAIN` (the loops clamp it further to what one call
    can hold). A call costs a fixed amount beyond its steps (launch, transfers, the host's
    bookkeeping), which matters most when a step is cheap; the tokens never depend on the
    burst sizes. Calls of :attr:`TARGET_S` seconds pay that cost rarely, and a stream still
    updates several times a second. The grain is the decode programs' chunk
    (:data:`~turbospark_jax.engine.program.DECODE_CHUNK`): a call of another count runs the
    rest of its last chunk idle.
    """

    FIRST, MOST, TARGET_S, GRAIN = 16, 256, 0.25, 8

    def __init__(self, burst: int | None) -> None:
        self._fixed = burst
        self._tokens, self._seconds = 0, 0.0

    def next(self) -> int:
        if self._fixed is not None:
            return int(self._fixed)
        if self._tokens == 0 or self._seconds <= 0.0:
            return self.FIRST
        want = int(self._tokens / self._seconds * self.TARGET_S)
        return max(self.FIRST, min(self.MOST, want)) // self.GRAIN * self.GRAIN

    def observed(self, tokens: int, seconds: float) -> None:
        """A call that emitted ``tokens`` in ``seconds`` (host wall time)."""
        self._tokens += int(tokens)
        self._seconds += float(seconds)


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of one completion, and where it ran.

    Fields:
      prompt_tokens: length of the prompt.
      reused_tokens: leading prompt tokens the state already held (not fed again).
      prefilled_tokens: prompt tokens fed (``prompt_tokens - reused_tokens``).
      generated_tokens: tokens generated, a final stop token included.
      slot: the session-pool slot that served it (``None`` outside a pool).
      evicted: whether taking that slot discarded a different session's non-empty state.
    """

    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    slot: int | None = None
    evicted: bool = False

    def summary(self) -> str:
        """One line for a log or a status bar."""
        line = (
            f"prompt {self.prompt_tokens} token{'' if self.prompt_tokens == 1 else 's'} "
            f"(reused {self.reused_tokens}, prefilled {self.prefilled_tokens}), generated "
            f"{self.generated_tokens}"
        )
        if self.slot is not None:
            line += f", slot {self.slot}"
        return line + (", evicted another session" if self.evicted else "")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's raw logits, and alternatives.

    Fields:
      token: the id generated.
      logprob: ``log softmax(logits)[token]`` (before temperature, penalties or filters).
      top: the likeliest ``(id, logprob)`` pairs, best first.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]

    @classmethod
    def of_row(cls, row: Any, token: int, top: int) -> TokenLogprob:
        """From one logits row (host or device), in float32 as the sampler reads it."""
        logits = np.asarray(row, np.float32)
        shifted = logits - logits.max()
        logp = shifted - np.log(np.exp(shifted).sum())
        best = np.argsort(-logp, kind="stable")[:top] if top else np.zeros((0,), np.int64)
        return cls(int(token), float(logp[token]),
                   tuple((int(i), float(logp[i])) for i in best))


@dataclasses.dataclass(frozen=True)
class Timings:
    """Wall-clock seconds spent in each phase.

    Every phase ends when its result is on the host or its device work has finished (the
    clock is read after blocking on it), so work a device runs asynchronously is counted in
    its own phase.

    Fields:
      prefill_s: reuse and feeding the prompt (the first call's compile included).
      first_token_s: sampling the first token after the prefill.
      decode_s: everything after the first token.
      total_s: the whole completion.
    """

    prefill_s: float
    first_token_s: float
    decode_s: float
    total_s: float

    def decode_tokens_per_s(self, generated: int) -> float:
        """Tokens per second after the first one (0 when there is nothing to measure)."""
        return (generated - 1) / self.decode_s if generated > 1 and self.decode_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Completion:
    """The result of a completion, a pool turn or a chat turn.

    Fields:
      token_ids: every generated token, including a final stop token.
      text: the emitted text (equals the concatenation of the stream's deltas).
      finish_reason: why it ended; ``error`` carries the reason when it is ERROR.
      stop_string: the stop string that matched, if any.
      usage, timings: counts and seconds.
      prompt_ids: the prompt as it was sent (for a chat turn: the rendered history).
      fed_ids: what the producer's state consumed, position by position (prompt included).
      state: the producer state after the completion, for the next turn's reuse; ``None``
        after an error (such a state is never offered for reuse) and for pool turns (the pool
        keeps it).
      logits: with ``record_logits``, float32 ``[len(token_ids), V]``: row ``i`` is what
        token ``i`` was sampled from.
      speculative: the speculative rounds' statistics, ``None`` for plain decoding.
      logprobs: with ``logprobs``, one :class:`TokenLogprob` per generated token.
    """

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    error: str | None
    stop_string: str | None
    usage: Usage
    timings: Timings
    prompt_ids: tuple[int, ...]
    fed_ids: tuple[int, ...]
    state: Any
    logits: np.ndarray | None = None
    speculative: Any = None
    logprobs: list[TokenLogprob] | None = None

    def summary(self) -> str:
        """:meth:`Usage.summary` plus the decode speed when there is one to report."""
        rate = self.timings.decode_tokens_per_s(self.usage.generated_tokens)
        return self.usage.summary() + (f", {rate:.1f} tokens/s" if rate > 0 else "")


def require_request(request: object) -> CompletionRequest:
    """``request`` when it is a :class:`CompletionRequest` (which checked its own fields when
    it was made); BadInputError otherwise."""
    if not isinstance(request, CompletionRequest):
        raise BadInputError(f"request must be a CompletionRequest, got {type(request).__name__}")
    return request


def validate_request(
    producer: LogitProducer,
    request: CompletionRequest,
    tokenizer: Any | None,
    state: Any | None = None,
) -> sampling.SamplingParams:
    """Check what a well-formed request cannot say alone: that it fits the producer (its
    vocabulary, its context, the images it takes), that the tokenizer can serve it, and that
    the state handed in is the producer's.

    Returns the device sampling params. Raises BadInputError (ContextOverflowError for
    length) naming the problem.
    """
    if not isinstance(producer, LogitProducer):
        raise BadInputError(
            f"producer must be a LogitProducer (a BlockProducer, a SpeculativePair...), got "
            f"{type(producer).__name__}"
        )
    require_request(request)
    vocab = producer.vocab_size
    for name in ("prompt_ids", "stop_token_ids"):
        ids = getattr(request, name)
        if ids and max(ids) >= vocab:
            raise BadInputError(
                f"{name}: token id {max(ids)} is outside the vocabulary [0, {vocab}) of "
                f"{type(producer).__name__}"
            )
    if tokenizer is not None and not provides(tokenizer, TOKENIZER_CALLS):
        raise BadInputError(
            f"tokenizer must have decode(ids, skip_special_tokens=...) and id_to_token(id) "
            f"(turbospark_jax.io.tokenizer.Tokenizer has both), got {type(tokenizer).__name__}"
        )
    prompt = request.prompt_ids
    limit = producer.max_positions
    if limit is not None and len(prompt) + request.max_tokens > limit:
        raise ContextOverflowError(
            f"a prompt of {len(prompt)} tokens plus max_tokens={request.max_tokens} needs "
            f"{len(prompt) + request.max_tokens} positions; the producer holds {limit}"
        )
    if request.stop_strings and tokenizer is None:
        raise BadInputError("stop strings need a tokenizer to see text; pass tokenizer=")
    if request.stop_at_block_end and tokenizer is None:
        raise BadInputError("stop_at_block_end needs a tokenizer to see text; pass tokenizer=")
    if request.constraint is not None and tokenizer is None:
        raise BadInputError(
            f"a {request.constraint.kind} constraint needs a tokenizer to see text; pass "
            "tokenizer=")
    check_injection(producer, request.injection, len(prompt))
    if state is not None:
        producer.check_state(state)
    return request.params


def check_injection(producer: LogitProducer, injection: Any, prompt_length: int) -> None:
    """Refuse an injection the producer cannot take or whose positions leave the prompt."""
    if injection is None:
        return
    if not producer.accepts_embeddings:
        raise BadInputError(
            f"{type(producer).__name__} takes token ids only: this model cannot be given "
            "images (load a model folder with a vision tower, or leave the images out)"
        )
    if len(injection.positions) and int(injection.positions[-1]) >= prompt_length:
        raise BadInputError(
            f"the injection reaches position {int(injection.positions[-1])} but the prompt "
            f"has {prompt_length} tokens"
        )


class Emission:
    """Per-token bookkeeping every completion shares: stop tokens, text, stop strings,
    max_tokens.

    :meth:`push` takes one sampled token (and the logits it came from) and says what to
    stream and whether generation ends there, in the seed loop's order: a stop token ends
    generation without text; otherwise the detokenizer's text goes through the stop matcher.
    """

    def __init__(self, request: CompletionRequest, tokenizer: Any | None, prompt: list[int]):
        self.request = request
        self.prompt = prompt
        self.tokens: list[int] = []
        self.rows: list[Any] = []
        #: Why the text pipeline ended generation, when it did (a token it cannot decode).
        self.failure: str | None = None
        self.text = _TextPipeline(tokenizer, prompt, request)

    def push(self, token: int, row: Any) -> tuple[StreamEvent | None, FinishReason | None]:
        req = self.request
        self.tokens.append(token)
        if req.record_logits:
            self.rows.append(row)
        if token in req.stop_token_ids:
            return None, FinishReason.STOP_TOKEN
        try:
            delta, hit = self.text.push(token)
        except BadInputError as exc:
            # The model generated an id the tokenizer does not know (a model vocabulary padded
            # past the tokenizer's): no text for it, and generation cannot go on truthfully.
            self.failure = f"the tokenizer cannot decode generated token {token}: {exc}"
            return None, FinishReason.ERROR
        event = StreamEvent(text=delta, token_ids=[token]) if delta or not hit else None
        if hit is not None:
            return event, hit
        if len(self.tokens) >= req.max_tokens:
            return event, FinishReason.LENGTH
        return event, None

    def finish(
        self,
        producer: LogitProducer,
        finish: FinishReason,
        error: str | None,
        state: Any,
        *,
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
        n = len(self.prompt)
        usage = Usage(n, reused, n - reused, len(self.tokens))
        timings = Timings(prefill_s, first_token_s, total_s - prefill_s - first_token_s, total_s)
        if finish is FinishReason.ERROR:
            state = None  # never offered for reuse
            error = error if error is not None else self.failure
        tail = "" if finish in (FinishReason.STOP_STRING, FinishReason.BLOCK_END) else (
            self.text.flush())
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
            prompt_ids=tuple(self.prompt),
            fed_ids=producer.fed_record(state).to_host().ids if state is not None else (),
            state=state,
            logits=np.stack([np.asarray(r) for r in self.rows]) if self.rows else None,
            speculative=speculative,
            logprobs=None if self.request.logprobs is None else [
                TokenLogprob.of_row(row, token, self.request.logprobs)
                for token, row in zip(self.tokens, self.rows, strict=True)],
        )
        return (StreamEvent(text=tail, token_ids=[]) if tail else None), completion


class _TextPipeline:
    """Detokenizer, stop matcher, then the block end, in the loop's order; text-free without a
    tokenizer."""

    def __init__(self, tokenizer: Any | None, prompt: list[int], req: CompletionRequest) -> None:
        self.emitted = ""
        self.matched: str | None = None
        self._detok = None
        self._block: _BlockEnd | None = None
        if tokenizer is not None:
            self._detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
            if req.stop_at_block_end:
                opened = open_block(tokenizer.decode(prompt, skip_special_tokens=True))
                self._block = None if opened is None else _BlockEnd(*opened)
        self._stop = StopMatcher(req.stop_strings, include_stop=req.include_stop_string)

    def push(self, token: int) -> tuple[str, FinishReason | None]:
        if self._detok is None:
            return "", None
        out, hit = self._stop.push(self._detok.push(token))
        if hit:
            self.matched = self._stop.matched
        out, ended = self._through_block(out)
        self.emitted += out
        if ended:
            return out, FinishReason.BLOCK_END
        return out, FinishReason.STOP_STRING if hit else None

    def _through_block(self, text: str) -> tuple[str, bool]:
        if self._block is None:
            return text, False
        out, ended = self._block.push(text)
        if ended:
            self.matched = None  # the block ended first
        return out, ended

    def flush(self) -> str:
        if self._detok is None:
            return ""
        out, hit = self._stop.push(self._detok.flush())
        if not hit:
            # A stop string still undecided at the end (held for a longer candidate) is
            # settled here, so ``matched`` is read after the flush.
            out += self._stop.flush()
        self.matched = self._stop.matched
        out, ended = self._through_block(out)
        if not ended and self._block is not None:
            out += self._block.flush()
        self.emitted += out
        return out


#: What opens a block whose end :func:`open_block` finds.
_HEADERS = ("def ", "async def ", "class ")


def open_block(text: str) -> tuple[int, bool] | None:
    """The innermost Python ``def`` or ``class`` that ``text`` ends inside: ``(its header's
    indentation, whether text ends at the start of a line)``; ``None`` when it ends inside no
    such block. A header encloses the end when every non-blank line after it is indented
    deeper (the lines of a header split over several lines are)."""
    deepest = None  # the least indentation seen so far, from the end
    for line in reversed(text.split("\n")):
        body = line.lstrip()
        if not body:
            continue
        indent = len(line) - len(body)
        if body.startswith(_HEADERS) and (deepest is None or indent < deepest):
            return indent, text.endswith("\n")
        deepest = indent if deepest is None else min(deepest, indent)
    return None


class _BlockEnd:
    """Holds back the whitespace that starts each generated line until the line's first
    character shows its indentation; a line indented no deeper than the block's header ends
    the completion before its newline."""

    def __init__(self, indent: int, at_line_start: bool) -> None:
        self.indent = indent
        self.held = ""  # the newline and whitespace of a line not yet decided
        self.column: int | None = 0 if at_line_start else None  # None: mid-line

    def push(self, text: str) -> tuple[str, bool]:
        out = []
        for c in text:
            if self.column is None:
                if c == "\n":
                    self.held, self.column = c, 0
                else:
                    out.append(c)
            elif c == "\n":
                self.held, self.column = self.held + c, 0  # a blank line decides nothing
            elif c in " \t\r\f":
                self.held, self.column = self.held + c, self.column + 1
            elif self.column <= self.indent:
                self.held = ""
                return "".join(out), True
            else:
                out.append(self.held + c)
                self.held, self.column = "", None
        return "".join(out), False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def rewind_overshoot(producer: LogitProducer, state: Any, count: int) -> Any:
    """Leave the state having consumed ``count`` positions when it fed more and can rewind.

    A device burst keeps feeding after a token whose text completes a stop string (the host
    sees text only after the burst), so a producer that can rewind exactly is moved back and
    the fed record is the same whichever way generation stopped; others keep the longer,
    still truthful, record (so does a sliding-window ring that no longer holds the rows).
    """
    if producer.can_rewind and int(producer.fed_record(state).count) > count and (
        producer.rewind_floor(state) <= count
    ):
        return producer.rewind(state, count)
    return state
