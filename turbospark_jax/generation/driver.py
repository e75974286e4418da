"""The generation loop (``run_raw_completion``) and the one entry that picks a loop.

:func:`stream_completion` is what the CLI, the session pool and chat call: it runs the
speculative loop (:mod:`turbospark_jax.generation.speculative_loop`) when the producer can draft
and the
request does not say ``draft_len=0``, and the plain loop below otherwise.

The plain loop, in order:

1. **Validate** the whole request before touching any state (bad input raises and leaves the
   caller's state exactly as it was).
2. **Reuse**: ``try_reuse_prefix`` on the state handed in; feed only the unreused suffix,
   never fewer than one token.
3. **Prefill**: ``prefill_chunk_with_status`` in chunks when the producer is a
   :class:`~turbospark_jax.core.protocols.ChunkedPrefillRunner`, else ``produce_prefill`` token by
   token and ``produce`` for the last prompt token.
4. **Decode**: sample the first token on the host from the prefill logits; then, when the
   producer decodes on the device (:class:`~turbospark_jax.core.protocols.DeviceDecoder`), bursts
   of up to ``burst`` steps (produce + sample + stop-token check in one jitted loop) per host
   round trip, each burst chained onto the one before it on the device before that one is
   read (``continue_decode``), so the device never waits for the host between bursts;
   otherwise ``produce`` + a jitted sampler per token. Token ``i`` always samples with
   ``token_key(key, i)`` and the same program runs every burst, so the output does not
   depend on the burst length.
5. **Text**, per token and in this order: a stop token ends generation (its text is not
   emitted); otherwise the incremental detokenizer turns it into text, the stop matcher holds
   back what could still become a stop string and releases the rest; a matched stop string
   ends generation. At the end the held-back text is flushed.

History bookkeeping: the completion reports ``fed_ids``, read from the producer's own fed
record. The last sampled token is never fed (nothing needs its logits), and when a stop string
lands inside a device burst the tokens after it were fed (and those of the burst chained
after it): a producer that can rewind is moved back so its record matches token-by-token
decoding; others keep the longer, truthful record.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from turbospark_jax.core import sampling
from turbospark_jax.core.injection import Injection
from turbospark_jax.core.protocols import (
    NON_FINITE,
    ChunkedPrefillRunner,
    DeviceDecoder,
    LogitProducer,
    SpeculativeProducer,
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
from turbospark_jax.generation.speculative_loop import speculative_events

__all__ = ["PrefillProgress", "prefill", "run_raw_completion", "stream_completion"]

#: Called during a prefill as ``progress(fed, total)``: prompt tokens fed so far of the
#: ``total`` the prefill feeds (the unreused suffix), after each chunk or token.
PrefillProgress = Callable[[int, int], None]

def stream_completion(
    producer: LogitProducer,
    request: CompletionRequest,
    *,
    tokenizer: Any | None = None,
    state: Any | None = None,
    progress: PrefillProgress | None = None,
) -> Stream[Completion]:
    """Start a completion with the loop that fits; iterate for text, then read ``.result``.

    The speculative loop runs when ``producer`` is a
    :class:`~turbospark_jax.core.protocols.SpeculativeProducer` and ``request.draft_len`` is not
    0; the plain loop otherwise.

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

    Once iteration starts the state handed in belongs to the loop (a donating producer
    consumes its buffers), whatever happens next. Non-finite logits, a producer failure or a
    generated id the tokenizer cannot decode end the completion with ``finish_reason ==
    FinishReason.ERROR`` (``error`` says why; the tokens before stay; no state is offered).
    An exception raised by the caller's own tokenizer is not ours to reinterpret: it
    propagates unchanged, and no completion (so no state) comes back.
    """
    require_request(request)
    if isinstance(producer, SpeculativeProducer) and request.draft_len != 0:
        return Stream(speculative_events(producer, request, tokenizer, state, progress))
    if request.draft_len:
        raise BadInputError(
            f"draft_len={request.draft_len} asks for speculative decoding, but "
            f"{type(producer).__name__} cannot draft; pair it with a drafter "
            "(turbospark_jax.speculative.pair.SpeculativePair) or leave draft_len unset"
        )
    return Stream(plain_events(producer, request, tokenizer, state, progress))


def run_raw_completion(
    producer: LogitProducer,
    request: CompletionRequest,
    *,
    tokenizer: Any | None = None,
    state: Any | None = None,
) -> Completion:
    """Run the plain loop to the end and return the completion (the seed's entry point).

    Arguments as for :func:`stream_completion`; a speculative producer decodes plainly here
    (through its target).

    Raises:
      BadInputError: an invalid request; the state is untouched.
    """
    require_request(request)
    if request.draft_len:
        raise BadInputError(
            "run_raw_completion is the plain loop; use run_raw_completion_speculative or "
            "stream_completion for draft_len > 0"
        )
    return Stream(plain_events(producer, request, tokenizer, state)).drain()


def plain_events(
    producer: LogitProducer,
    request: CompletionRequest,
    tokenizer: Any | None,
    state: Any | None,
    progress: PrefillProgress | None = None,
) -> Generator[StreamEvent, None, Completion]:
    """The plain loop as a generator: validates now, runs as it is consumed."""
    params = validate_request(producer, request, tokenizer, state)
    # The text pipeline is built now too: a prompt id the tokenizer refuses is bad input.
    out = Emission(request, tokenizer, [int(t) for t in request.prompt_ids])
    return _plain_loop(producer, request, out, state, params, progress)


def _plain_loop(
    p: LogitProducer,
    req: CompletionRequest,
    out: Emission,
    state: Any | None,
    params: sampling.SamplingParams,
    progress: PrefillProgress | None,
) -> Generator[StreamEvent, None, Completion]:
    t0 = time.perf_counter()
    prompt = out.prompt
    state = state if state is not None else p.init_state()
    injection = req.injection
    if injection is None:
        reused, state = p.try_reuse_prefix(state, prompt)
    else:
        reused, state = p.try_reuse_prefix(state, prompt, injected=injection.identity_map())
    key = sampling.request_key(req.seed)
    history = sampling.History.from_prompt(prompt, p.vocab_size)
    device = isinstance(p, DeviceDecoder)
    sizer = BurstSizer(req.burst)
    launched, since = None, 0.0  # a device burst on its way, and when the last one was read
    finish, error = None, None
    first_token_s = 0.0
    try:
        logits, state = prefill(
            p, state, prompt[reused:], reused, req.prefill_chunk_size, req.parallel_prefill,
            progress, injection,
        )
    except PRODUCER_FAILURES as exc:
        finish, error = FinishReason.ERROR, str(exc)
    prefill_s = time.perf_counter() - t0

    while finish is None:
        if not out.tokens or not device:
            # One token sampled on the host from ``logits`` (prefill's or a host step's).
            if not bool(np.all(np.isfinite(np.asarray(logits)))):
                finish, error = FinishReason.ERROR, NON_FINITE_LOGITS
                break
            index_key = sampling.token_key(key, len(out.tokens))
            new = [int(sampling.sample(logits, params, history, index_key))]
            history = add_to_history(history, new[0])
            rows, failed = [logits], False
        else:
            if launched is None:
                steps = min(sizer.next(), p.steps_per_call, req.max_tokens - len(out.tokens))
                since = time.perf_counter()
                launched, state = p.launch_decode(
                    state, out.tokens[-1], steps, params=params, history=history, key=key,
                    gen_index=len(out.tokens), stop_ids=list(req.stop_token_ids),
                    record_logits=req.record_logits,
                )
            # The next burst goes to the device before this one is read, so the device runs
            # it while the host reads, emits and checks this one's tokens (after a stop id it
            # runs no step; after a stop string it is rewound with the rest of the overshoot).
            ahead = req.max_tokens - len(out.tokens) - launched.steps
            if p.max_positions is not None:
                ahead = min(ahead, p.max_positions - launched.reach)
            queued = None
            if ahead > 0:
                queued, state = p.continue_decode(
                    state, launched, min(sizer.next(), p.steps_per_call, ahead))
            burst = p.collect(launched)
            launched = queued
            new, history, failed = burst.tokens, burst.history, burst.finish == NON_FINITE
            now = time.perf_counter()
            sizer.observed(len(new), now - since)
            since = now
            # One transfer for the burst's rows (slicing a device array row by row costs a
            # dispatch per token).
            rows = np.asarray(burst.logits) if burst.logits is not None else [None] * len(new)
        if not out.tokens:
            first_token_s = time.perf_counter() - t0 - prefill_s
        for tok, row in zip(new, rows, strict=True):
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
            except PRODUCER_FAILURES as exc:
                finish, error = FinishReason.ERROR, str(exc)
    if finish is not FinishReason.ERROR:
        state = rewind_overshoot(p, state, len(prompt) + len(out.tokens) - 1)
    event, completion = out.finish(
        p, finish, error, state, reused=reused, started=t0, prefill_s=prefill_s,
        first_token_s=first_token_s,
    )
    if event is not None:
        yield event
    return completion


def prefill(
    producer: LogitProducer,
    state: Any,
    suffix: list[int],
    start: int,
    chunk_size: int,
    parallel: bool = False,
    progress: PrefillProgress | None = None,
    injection: Injection | None = None,
) -> tuple[Any, Any]:
    """Feed the unreused prompt suffix; return the logits after its last token and the state.

    Chunks through ``prefill_chunk_with_status`` when the producer has chunked prefill,
    otherwise ``produce_prefill`` per token and ``produce`` for the last. With ``parallel``,
    the producer's ``prefill_parallel`` fast path is used when it supports one. ``progress``
    hears after each chunk (or token) how many of the suffix's tokens are in. An
    ``injection`` (images) goes to every call, which takes the rows on its own positions;
    it always takes the exact path, never the parallel one.
    """
    total = len(suffix)
    extra = {} if injection is None else {"injection": injection}

    def told(done: int) -> None:
        if progress is not None:
            progress(done, total)

    if isinstance(producer, ChunkedPrefillRunner):
        if parallel and injection is None and producer.supports_parallel_prefill():
            out = producer.prefill_parallel(state, suffix, start, chunk=chunk_size)
            told(total)
            return out
        logits = None
        for a in range(0, total, chunk_size):
            chunk = suffix[a : a + chunk_size]
            final = a + chunk_size >= total
            logits, state = producer.prefill_chunk_with_status(state, chunk, start + a, final,
                                                               **extra)
            told(a + len(chunk))
        return logits, state
    for i, tok in enumerate(suffix[:-1]):
        state = producer.produce_prefill(state, tok, start + i, **extra)
        told(i + 1)
    out = producer.produce(state, suffix[-1], start + total - 1, **extra)
    told(total)
    return out
