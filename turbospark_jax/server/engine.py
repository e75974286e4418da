"""The serving engine: one scheduler thread runs every request over the batched slot rows.

Requests arrive from any thread (:meth:`Engine.submit`) and wait in a bounded queue. The
scheduler thread owns the device and loops over ticks:

1. drop requests whose client went away (their slot is free from this point on);
2. give waiting requests slots (:func:`~turbospark_jax.server.slots.choose_slot`); a request
   whose session's slot is busy waits without holding up the others; a slot taken from above
   the busy ones is swapped down to the first idle row;
3. run **one prefill call** (:meth:`~turbospark_jax.engine.batching.BatchedDecoder.prefill`) for the
   oldest ``P`` requests still prefilling, each fed up to ``C`` more prompt tokens on its own
   row; a request whose prompt ends in the call draws its first token in it and joins the batch;
4. run **one batched decode step** for every row in the batch
   (:meth:`~turbospark_jax.engine.batching.BatchedDecoder.step`); each row's token goes through the
   request's own :class:`~turbospark_jax.generation.completion.Emission` (stop tokens, detokenizer,
   stop strings, ``max_tokens``), and a finished row leaves the batch.

So a tick's prompt work is bounded (``P * C`` tokens, at most ``C / W`` block steps): a long
prompt delays the streams in flight by one chunk per tick, not by its whole prefill, and
several prompts progress in the same call.

**The decode step costs the live rows, not the slots.** For a model whose rows keep their bits
for any row count (:func:`~turbospark_jax.engine.batching.rows_agree_in_batches`: the
row-invariant Pallas kernels), the decode program is compiled for a few row counts (buckets: the
powers of two below ``B``, and ``B``), each over the lowest rows of the stack, and a step runs
the smallest one holding every decoding row; any other model has the one of ``B`` rows. The
engine keeps the busy slots in the lowest rows: a slot is taken at the first idle row (its state
swapped down there if it sat higher), and a slot freed below the highest busy row swaps rows
with it (:mod:`~turbospark_jax.server.slots`; the swap is one device call over the two rows, and
the slot's record, owner, fed ids and kept copy go with its state). One stream therefore runs
the one-row program.

**Prefix reuse covers prompt rows only.** A slot remembers the prompt its last request
prefilled, and a later request reuses at most that prefix: the rows the batched decode program
wrote for the reply are rewound away and prefilled again when a new prompt repeats them. The
reason is measured, not assumed: on the CPU the vmapped decode program writes KV rows that
differ in the last bits from what the prefill program writes for the same tokens, so reusing
them would make a continued conversation differ from the same prompt served fresh
(``tests/engine/test_batching.py`` checks reuse against fresh bitwise). A model that cannot
rewind (a recurrent state, as Qwen3.5's) cannot move back to the prompt's end at all, so its
prefill stops one token short of each prompt's end and the slot keeps a copy of the row's
state there (:attr:`~turbospark_jax.server.slots.SlotRecord.saved`): the same prompt again, or
a longer one that repeats it (a session's next turn), restarts from the copy and feeds the
rest (``tests/server/test_server_reuse.py`` checks it against fresh bitwise).

**A prefix is shared across slots.** A request is not limited to what its own slot holds: when
another slot's row (busy or idle, any session's) holds a longer prefix of its prompt, ids and
image identities alike (:func:`~turbospark_jax.server.slots.choose_donor`), that row is copied
into the request's on the device (:meth:`~turbospark_jax.engine.batching.BatchedDecoder.copy_row`,
one program over the stack) and rewound to the shared prompt rows, never into the donor's
reply rows; a model that cannot rewind starts from the longest kept copy of any slot that the
prompt extends (:func:`~turbospark_jax.server.slots.choose_kept`). So many requests behind one
long system prompt prefill it once while a slot holds it. The donor's row is only read, so its
own request carries on with the same bits, and the copy is the rows its prefill wrote, so the
request is bitwise the same prompt served fresh (``tests/server/test_server_shared_prefix.py``).
The shared rows count in ``usage.prompt_tokens_details.cached_tokens`` as any reused rows do,
and in the metrics' shared prompt tokens. The donor is found by a linear scan of the ``B``
records (see :mod:`~turbospark_jax.server.slots`); a prefix lives only as long as some slot
keeps it (no cache beyond the slots, no pages).

A request's
output depends only on its own prompt, settings and seed: its prompt and first token are a row
of the fixed-shape prefill program, every later token a row of one of the fixed-shape decode
programs, no program's rows interact, and neither the bucket nor the row a request's state
sits in changes its bits (see :mod:`turbospark_jax.engine.batching`).

**Several choices** (``ServeRequest.n`` above 1) are one request each, run on their own rows
with their own seeds (:func:`~turbospark_jax.server.requests.choice_seed`; choice 0 keeps the
request's seed, so it is the same request with ``n = 1``). The prompt is prefilled once: the
first choice's prefill stops one token short of the prompt's end and keeps a copy of its row
there, and every other choice starts from that copy and feeds the last prompt token itself
(its first token is drawn from that token's logits with its own seed). By the block program's
guarantee (any split of a prompt gives the same bits) each choice is bitwise the same prompt
served alone with its seed (``tests/server/test_server_choices.py``). The other choices wait
for the copy, then take slots as any request does; a cancel of the request drops every choice.

**Images** (a completion with an ``injection``): a prefill chunk holding image positions runs
the batched prefill's variant with embeddings, and one call feeds chunks of one kind only, so
whether a chunk runs it depends on that chunk alone. Prefix reuse passes the prompt's image
identities to :meth:`~turbospark_jax.engine.producer.BlockProducer.try_reuse_prefix`, which
compares them with the row's fed record: another image at the same positions is a miss. A
model that cannot rewind keeps no ids-keyed copy of a prompt with images.

**Speculative requests** (an engine built with ``speculative=``) are not batched: a greedy
request without logprobs, constraint or images and with one choice runs the existing
speculative loop on a fresh state of its own, one
at a time, in a thread beside the scheduler; it holds no slot and reuses no prefix. Greedy
speculative decoding emits the same tokens as plain greedy decoding; sampled requests (and any
asking for logprobs) stay on the batched path, so no seed's output changes.

**Constrained requests** (a ``constraint`` on the completion) decode on the batched path with
a mask row each: the prefill or decode call that draws a constrained row's token takes a
bool[rows, V] mask whose free rows are all set (their logits pass through unchanged, so a
constrained neighbour never changes a free row's bits). A run of tokens the constraint forces
is drawn one step a token under a mask holding that token alone, so the tokens are those of
:func:`~turbospark_jax.generation.driver.stream_completion`.

**Shutting down** (:meth:`Engine.drain`) lets the requests in flight finish for a grace
period, then cuts off the rest between two device calls (see
:mod:`~turbospark_jax.server.lifecycle`).

Results go to a per-request ``sink`` callable, from the scheduler thread: zero or more
:class:`~turbospark_jax.server.requests.Delta`, then exactly one
:class:`~turbospark_jax.server.requests.Done` or
:class:`~turbospark_jax.server.requests.Failed` (none after a cancel).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

import jax
import numpy as np

from turbospark_jax.core import sampling
from turbospark_jax.core.checks import as_int
from turbospark_jax.core.kv_prefix import common_prefix
from turbospark_jax.core.protocols import SpeculativeProducer
from turbospark_jax.core.streams import Stream
from turbospark_jax.engine.batching import BatchedDecoder
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, OverloadedError
from turbospark_jax.generation.completion import (
    NON_FINITE_LOGITS,
    Completion,
    Emission,
    FinishReason,
    validate_request,
)
from turbospark_jax.generation.driver import stream_completion
from turbospark_jax.server.jobs import ChoiceGroup, Job, indexed_sink, run_speculative
from turbospark_jax.server.lifecycle import SchedulerThread
from turbospark_jax.server.requests import (
    SHUTDOWN_MESSAGE,
    Done,
    EngineObserver,
    Failed,
    ServeRequest,
    Sink,
    Ticket,
    choice_seed,
)
from turbospark_jax.server.slots import (
    SlotRecord,
    choose_donor,
    choose_kept,
    choose_slot,
    open_prefix,
    row_to_free,
    row_to_take,
    swap_rows,
)

__all__ = ["Engine"]


def _home_device(producer: BlockProducer) -> jax.Device | None:
    """The one device every param of ``producer`` lives on, else ``None`` (the default)."""
    devices = {d for leaf in jax.tree.leaves(producer.params) if isinstance(leaf, jax.Array)
               for d in leaf.devices()}
    return devices.pop() if len(devices) == 1 else None


class Engine(SchedulerThread):
    """Serve completions from ``slots`` session slots with batched decoding.

    Args:
      producer: the model as a :class:`~turbospark_jax.engine.producer.BlockProducer`.
      slots: session slots, which is also the decode batch ``B`` (the most rows a decode
        step runs; fewer when the model has buckets and fewer requests decode).
      tokenizer: for text, stop strings and deltas.
      max_waiting: requests that may wait while every slot is busy; more are refused with
        :class:`~turbospark_jax.errors.OverloadedError` (no unbounded queue).
      speculative: a speculative producer over the same target, for greedy requests.
      observer: told about requests and steps (metrics).
      prefill_rows: prompts one prefill call advances together (``P``, at most ``slots``).
      prefill_chunk: the most tokens of one prompt a prefill call feeds (``C``, rounded up to
        a multiple of the producer's width ``W``). A scheduler tick feeds at most ``P * C``
        prompt tokens and runs at most ``C / W`` block steps before its decode step: the
        budget that bounds how long prompts stall the streams in flight.
      decoder: the batched decoder class (the tests pass a row-mixing control).
      warm_up: compile every program a request can reach when the scheduler starts, before
        it takes requests (:meth:`warm_up`); off, each compiles on the first request that
        needs it (a toy model in a test, where start-up time matters more).

    Raises:
      BadInputError: an argument of the wrong kind or range.
    """

    #: Whether a request may start from a prefix another slot holds (off only in the tests'
    #: and the benchmark's comparison without it; not a serving option).
    _shares_prefixes = True

    def __init__(
        self,
        producer: BlockProducer,
        *,
        slots: int,
        tokenizer: Any | None = None,
        max_waiting: int = 64,
        speculative: SpeculativeProducer | None = None,
        observer: EngineObserver | None = None,
        prefill_rows: int = 4,
        prefill_chunk: int = 64,
        decoder: type[BatchedDecoder] = BatchedDecoder,
        warm_up: bool = True,
    ) -> None:
        if speculative is not None and not isinstance(speculative, SpeculativeProducer):
            raise BadInputError(
                f"speculative must be a SpeculativeProducer (a SpeculativePair), got "
                f"{type(speculative).__name__}"
            )
        self.producer = producer
        self.tokenizer = tokenizer
        self.max_waiting = as_int("max_waiting", max_waiting, low=0)
        self.speculative = speculative
        self.observer = observer or EngineObserver()
        super().__init__(warm_up=warm_up)
        # A replica's producer keeps its params on its own device: the stack and every fresh
        # state are made there too, not on the default device and moved on first use.
        self.device = _home_device(producer)

        def make_decoder() -> BatchedDecoder:
            with jax.default_device(self.device):
                return decoder(producer, slots, prefill_rows=prefill_rows,
                               prefill_chunk=prefill_chunk)

        self._make_decoder = make_decoder
        self.decoder = self._make_decoder()
        self.slots = [SlotRecord(index=i) for i in range(self.decoder.size)]
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._clock = 0
        self._speculating = 0  # speculative requests in flight (outside the slot rows)
        self._spec_lock = threading.Lock()
        self.evictions = 0

    # -- the thread's hooks ----------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def _in_flight(self) -> int:
        return len(self._waiting) + len(self._running) + self._speculating

    def _end_all(self, message: str, *, shutdown: bool) -> None:
        for job in [*self._waiting, *self._running]:
            job.sink(Failed(message, shutdown=shutdown))
            if job.slot is not None:
                job.slot.busy = False
                job.slot.forget()
        self._waiting.clear()
        self._running.clear()

    def _cut_off(self) -> int:
        """End every request waiting or running (the caller holds the lock, between two
        device calls): each gets :class:`~turbospark_jax.server.requests.Failed` with
        ``shutdown`` set."""
        jobs = [*self._waiting, *self._running]
        self._waiting.clear()
        for job in jobs:
            if job.slot is not None and job in self._running:
                self._release(job, job.fed_so_far())
            self.observer.request_ended("shutdown", len(job.emission.tokens))
            job.sink(Failed(SHUTDOWN_MESSAGE, shutdown=True))
        self._cond.notify_all()
        return len(jobs)

    # -- requests -------------------------------------------------------------------------

    def submit(self, request: ServeRequest, sink: Sink) -> Ticket:
        """Queue ``request``; its events go to ``sink`` (from the scheduler thread).

        Raises:
          BadInputError: the request is invalid (nothing is queued; no slot is touched).
          UnavailableError: the engine takes no work (:meth:`unavailable`).
          OverloadedError: the waiting queue is full.
        """
        if not isinstance(request, ServeRequest):
            raise BadInputError(f"expected a ServeRequest, got {type(request).__name__}")
        req = request.completion
        if request.top_logprobs is not None:
            as_int("top_logprobs", request.top_logprobs, low=0, high=20)
        n = as_int("n", request.n, low=1, high=self.max_choices)
        speculates = n == 1 and self._speculates(request)
        if speculates:  # validated against the pair now; it runs when the thread reads it
            stream = stream_completion(self.speculative, req, tokenizer=self.tokenizer)
        else:
            params = validate_request(self.producer, req, self.tokenizer)
        if request.session_id is not None and not isinstance(request.session_id, str):
            raise BadInputError(f"session_id must be a string, got {request.session_id!r}")
        self._refuse_if_unavailable()
        ticket = Ticket(self)
        if speculates:
            with self._cond:
                self._refuse_if_unavailable()
                self._speculating += 1
            threading.Thread(target=self._speculate, args=(stream, sink, ticket),
                             daemon=True).start()
            return ticket
        group = ChoiceGroup() if n > 1 else None
        submitted = time.perf_counter()
        jobs = []
        for i in range(n):
            one = req if i == 0 else dataclasses.replace(req, seed=choice_seed(req.seed, i))
            constraint = None if one.constraint is None else one.constraint.bind(
                self.tokenizer, self.producer.vocab_size, one.stop_token_ids)
            jobs.append(Job(
                request=dataclasses.replace(request, completion=one),
                sink=sink if group is None else indexed_sink(sink, i), ticket=ticket,
                params=params, emission=Emission(one, self.tokenizer,
                                                 [int(t) for t in one.prompt_ids]),
                submitted=submitted, constraint=constraint, index=i, group=group))
        with self._cond:
            self._refuse_if_unavailable()  # again: stop() may have begun since the first
            held = len(self._waiting) + len(self._running)
            if held + n > len(self.slots) + self.max_waiting:
                raise OverloadedError(
                    f"every one of the {len(self.slots)} slots is busy and {len(self._waiting)} "
                    f"requests already wait (at most {self.max_waiting}); retry shortly",
                    retry_after=1.0,
                )
            self._waiting.extend(jobs)
            self._cond.notify_all()
        if n > 1:
            self.observer.choices(n)
        return ticket

    @property
    def max_choices(self) -> int:
        """The most choices one request may ask for: the slots (each choice holds one)."""
        return len(self.slots)

    def holds(self, session_id: str) -> bool:
        """Whether ``session_id`` owns a slot here or has a request waiting or running here
        (a router keeps the session's next requests on this engine)."""
        with self._cond:
            return any(s.owner == session_id for s in self.slots) or any(
                j.request.session_id == session_id for j in [*self._waiting, *self._running])

    def prefix_match(self, prompt: list[int]) -> int:
        """How many leading tokens of ``prompt`` a slot here that no named session owns has
        fed (:func:`~turbospark_jax.server.slots.open_prefix`)."""
        with self._cond:
            return open_prefix(self.slots, prompt)

    def load(self) -> dict[str, int]:
        """Counts for health and metrics: slots, busy slots, running and waiting requests."""
        with self._cond:
            return {
                "slots": len(self.slots),
                "busy_slots": sum(s.busy for s in self.slots),
                "running": len(self._running),
                "waiting": len(self._waiting),
                "evictions": self.evictions,
            }

    # -- the scheduler --------------------------------------------------------------------

    def run_once(self) -> None:
        """One scheduler iteration: drop cancelled requests, admit waiting ones, one prefill
        chunk, one batched decode step. The scheduler thread loops over it; a test may call it
        directly (without :meth:`start`) to control exactly when each request arrives."""
        with self._cond:
            if self._cut:
                self._cut_off()
                return
            self._drop_cancelled()
            self._admit()
        try:
            with jax.default_device(self.device):
                self._prefill_once()
                self._decode_once()
        except Exception as exc:  # a device failure ends every running row
            self._fail_running(f"the model step failed: {type(exc).__name__}: {exc}")

    def warm_up(self) -> None:
        """Compile every program a request can reach, so no request pays a compile: the
        batched prefill and every bucket's decode in each variant a call picks, and the row
        swap and copy (:meth:`~turbospark_jax.engine.batching.BatchedDecoder.warm_up`, rows
        left as they were) and the producer's state work of a request's setup (a fresh state,
        a prefix reuse, a rewind where the model can rewind)."""
        with jax.default_device(self.device):
            self.decoder.warm_up()
            p = self.producer
            state = p.init_state()
            _, state = p.try_reuse_prefix(state, [0, 0])
            if p.can_rewind:
                state = p.rewind(state, 0)
            jax.block_until_ready(state)
        self._warm.set()

    @property
    def idle(self) -> bool:
        """Whether no request waits or runs."""
        with self._cond:
            return not self._has_work()

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.ticket.cancelled]:
            self._waiting.remove(job)
            self.observer.request_ended("cancelled", 0)
        for job in [j for j in self._running if j.ticket.cancelled]:
            self._release(job, job.fed_so_far())
            self.observer.request_ended("cancelled", len(job.emission.tokens))

    def _admit(self) -> None:
        for job in list(self._waiting):
            if job.follows and job.group.saved is None:
                continue  # the first choice has not prefilled the prompt yet
            choice = choose_slot(self.slots, job.session, job.prompt)
            if choice is None:
                continue
            slot = choice.slot
            # First: should the swap fail (a fault that ends the scheduler), the request is
            # still waiting, and the scheduler's end answers it.
            self._move(slot, row_to_take(self.slots, slot))
            self._waiting.remove(job)
            self._clock += 1
            slot.busy, slot.last_used = True, self._clock
            if choice.evicts:
                self.evictions += 1
            job.slot, job.evicted = slot, choice.evicts
            if choice.evicts or slot.owner != job.session:
                slot.owner = job.session
            if choice.evicts:
                slot.forget()
            self._running.append(job)

    def _release(self, job: Job, fed_ids: tuple[int, ...]) -> None:
        with self._cond:
            if job.slot.busy:
                self._move(job.slot, row_to_free(self.slots, job.slot))
            job.slot.busy = False
            if job.fed is not None or tuple(fed_ids) != job.slot.fed_ids:
                job.slot.holds(fed_ids, job.marks(len(fed_ids)) if fed_ids else None)
            if job in self._running:
                self._running.remove(job)
            self._cond.notify_all()

    def _move(self, slot: SlotRecord, other: SlotRecord | None) -> None:
        """Swap the rows of ``slot`` and ``other`` (``None``: nothing to move), states and
        records alike, so the busy slots stay the lowest rows. (On the engine's device, as
        every call of the ticks: the swap then runs the program warm-up compiled.)"""
        if other is not None:
            with jax.default_device(self.device):
                self.decoder.swap_rows(slot.row, other.row)
            swap_rows(slot, other)

    def _fail_running(self, message: str) -> None:
        # The stack may have been consumed by the failed call: start every row afresh.
        self.decoder = self._make_decoder()
        failed = list(self._running)
        with self._cond:  # choices still waiting for a copy that will never come fail too
            orphans = [j for j in self._waiting if j.follows and j.group.saved is None
                       and any(f.group is j.group for f in failed)]
            for job in orphans:
                self._waiting.remove(job)
        for job in failed:
            self._release(job, ())
        for job in [*failed, *orphans]:
            self.observer.request_ended("error", len(job.emission.tokens))
            job.sink(Failed(message))
        for slot in self.slots:
            slot.forget()

    # -- prefill --------------------------------------------------------------------------

    def _setup(self, job: Job) -> None:
        """Point the job's row at the longest prefix of its prompt that some slot holds (rows
        the prefill program wrote only; see the module docstring), and set its controls to
        draw the first token at the end of the prompt.

        The prefix comes from the job's own slot or, when another slot (busy or idle, any
        session's) holds a longer one, from that slot: its row is copied into the job's on
        the device and rewound to the shared prompt rows, or for a model that cannot rewind
        its kept copy is taken (:meth:`_kept_copy`, :meth:`_copy_donor`)."""
        p, slot = self.producer, job.slot
        marks = None if job.injection is None else job.injection.identity_map()
        kept = None if job.follows or p.can_rewind or marks is not None else self._kept_copy(job)
        if job.follows:  # another choice: from the first one's copy
            job.reused, state = len(job.prompt) - 1, job.group.saved
        elif kept is not None:  # a model that cannot rewind
            job.reused, state = len(kept.saved[0]), kept.saved[1]
            job.shared_from = None if kept is slot else kept
        else:
            self._copy_donor(job, marks)  # the row may now hold another slot's prefix
            job.reused, state = 0, p.init_state()
            if slot.fed_ids:
                state, held = self.decoder.take_row(slot.row), len(slot.fed_ids)
                if int(state.fed.count) > held:
                    # Back to the prompt rows the row's prefill wrote; a ring that no longer
                    # holds them (a sliding window past them) starts afresh.
                    state = (p.rewind(state, held)
                             if p.can_rewind and held >= p.rewind_floor(state)
                             else p.init_state())
                # The row's fed record keeps each position's image identity: a prompt reuses
                # a position only where it injects the same image there (or none, as the row
                # did).
                job.reused, state = p.try_reuse_prefix(state, job.prompt, injected=marks)
        self.decoder.put_row(slot.row, state)
        job.fed = job.reused
        self._keep_for_choices(job)
        self.decoder.start_row(slot.row, params=job.params, seed=job.request.completion.seed,
                               history=sampling.History.from_prompt(job.prompt, p.vocab_size))
        self.observer.request_started(len(job.prompt), job.reused, job.evicted)
        if job.shared_from is not None:
            self.observer.prefix_shared(job.reused)

    def _kept_copy(self, job: Job) -> SlotRecord | None:
        """For a model that cannot rewind: the slot whose kept copy stands for the longest
        proper prefix of the job's prompt (its own slot's on a tie; another slot's only while
        sharing is on), or ``None``."""
        own = job.slot
        return choose_kept(self.slots if self._shares_prefixes else [own], own, job.prompt)

    def _copy_donor(self, job: Job, marks: dict[int, int] | None) -> None:
        """When another slot's row holds a longer prefix of the job's prompt than the job's own
        row (ids and image identities alike), copy that row into the job's on the device and
        record in the job's slot the prompt rows the copy holds (the caller rewinds it there:
        rows past them are a reply the decode program wrote); else leave the job's row as it
        is. The donor's row is only read: its own request carries on with the same bits."""
        if not (self._shares_prefixes and self.producer.can_rewind):
            return
        slot = job.slot
        others = [(s, *self._held(s)) for s in self.slots if s is not slot]
        own = common_prefix(slot.fed_ids, slot.fed_marks, job.prompt, marks)
        donor = choose_donor(others, job.prompt, marks, beyond=own)
        if donor is not None:
            record, _ = donor
            self.decoder.copy_row(record.row, slot.row)
            slot.holds(*self._held(record))
            job.shared_from = record

    def _held(self, slot: SlotRecord) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """The prompt ids ``slot``'s row holds as the prefill wrote them, and their image
        identities: a running request's fed part once set up, else the slot's record."""
        job = next((j for j in self._running if j.slot is slot and j.fed is not None), None)
        if job is None:
            return slot.fed_ids, slot.fed_marks
        ids = job.fed_so_far()
        return ids, job.marks(len(ids))

    def _prefill_once(self) -> None:
        """One prefill call: the oldest ``P`` prompts still prefilling get up to ``C`` tokens
        each; a prompt that ends draws its first token in the same call and joins the batch.

        A chunk holding image positions runs the prefill variant with embeddings, and a call
        feeds chunks of one kind only (the oldest prompt's chunk decides): whether a chunk
        runs that variant then depends on the chunk alone, never on its neighbours, and
        text-only serving runs the plain variant throughout."""
        jobs: list[Job] = []
        images: list[tuple[np.ndarray, np.ndarray] | None] = []
        for job in [j for j in self._running if not j.decoding]:
            if len(jobs) == self.decoder.prefill_rows:
                break
            if job.fed is None:
                self._setup(job)
            rows = job.image_rows(self._chunk_end(job), self.producer.model)
            if jobs and (rows is None) != (images[0] is None):
                continue  # another kind of chunk: a later call feeds it
            jobs.append(job)
            images.append(rows)
        if not jobs:
            return
        feeds = [(job.slot.row, job.prompt[job.fed:self._chunk_end(job)],
                  self._chunk_end(job) == len(job.prompt)) for job in jobs]
        wants = any(job.request.top_logprobs is not None for job, (_, _, last)
                    in zip(jobs, feeds, strict=True) if last)
        allowed = self._masks([job if last else None for job, (_, _, last)
                               in zip(jobs, feeds, strict=True)], first=True)
        started = time.perf_counter()
        out = self.decoder.prefill(feeds, logprobs=wants, allowed=allowed,
                                   injected=None if images[0] is None else images)
        self.observer.prefill(len(feeds), sum(len(toks) for _, toks, _ in feeds))
        finishing = []
        for i, (job, (_, toks, last)) in enumerate(zip(jobs, feeds, strict=True)):
            job.fed += len(toks)
            if last:
                finishing.append((i, job))
            elif not self.producer.can_rewind and job.fed == len(job.prompt) - 1:
                # The copy is keyed on ids alone: a prompt with images keeps none.
                job.slot.saved = None if job.injection is not None else (
                    tuple(job.prompt[: job.fed]), self.decoder.take_row(job.slot.row))
            self._keep_for_choices(job)
        if finishing:
            self._emit(finishing, out, started, first=True)
            for _, job in finishing:
                job.decoding = job in self._running  # not when its first token ended it

    def _chunk_end(self, job: Job) -> int:
        """Where the job's next prefill chunk ends."""
        return min(job.fed + self.decoder.prefill_chunk, self._stop_at(job))

    def _stop_at(self, job: Job) -> int:
        """Where the job's next prefill call ends at the latest: the prompt's end, except that
        a model that cannot rewind stops one token short of it first, so the slot keeps a copy
        of the state there (:attr:`SlotRecord.saved`) from which the same prompt, or a longer
        one that repeats it, restarts; and so does the first of several choices, whose copy
        there the others start from."""
        short = len(job.prompt) - 1
        leads = job.group is not None and job.index == 0
        if (self.producer.can_rewind and not leads) or job.fed >= short:
            return len(job.prompt)
        return short

    def _keep_for_choices(self, job: Job) -> None:
        """Copy the first choice's row for the others once it stands one token short of the
        prompt's end."""
        group = job.group
        if (group is not None and job.index == 0 and group.saved is None
                and job.fed == len(job.prompt) - 1):
            group.saved = self.decoder.take_row(job.slot.row)

    # -- decode ---------------------------------------------------------------------------

    def _decode_once(self) -> None:
        rows = [(j.slot.row, j) for j in self._running if j.decoding]
        if not rows:
            return
        active = np.zeros((len(self.slots),), bool)
        active[[i for i, _ in rows]] = True
        started = time.perf_counter()
        wants = any(j.request.top_logprobs is not None for _, j in rows)
        by_slot: list[Job | None] = [None] * len(self.slots)
        for i, j in rows:
            by_slot[i] = j
        allowed = self._masks(by_slot, first=False)
        out = self.decoder.step(active, logprobs=wants, allowed=allowed)
        self._emit(rows, out, started, first=False)

    def _masks(self, jobs: list[Job | None], *, first: bool) -> np.ndarray | None:
        """The mask rows of a call's draws (entry ``i`` for ``jobs[i]``; ``None`` and free jobs
        all set), or ``None`` when no job drawing in it is constrained. A constrained job's row
        holds its forced token alone while it has a forced run to emit (taken from the
        constraint after its first token, as the plain driver takes it), else the
        constraint's mask."""
        if not any(j is not None and j.constraint is not None for j in jobs):
            return None
        allowed = np.ones((len(jobs), self.producer.vocab_size), bool)
        for i, job in enumerate(jobs):
            if job is not None and job.constraint is not None:
                job.constrain(allowed[i], first=first)
        return allowed

    def _emit(self, rows: list[tuple[int, Job]], out: Any, started: float, *,
              first: bool) -> None:
        """Push each row's drawn token (entry ``i`` of ``out`` for ``(i, job)``) through its
        job; a row with non-finite logits ends its request alone."""
        wanted = (out.sampled, out.finite, out.logprob, out.top_ids, out.top_logprobs)
        sampled, finite, lp, top_ids, top_lp = jax.device_get(wanted)
        logits = None
        if any(j.request.completion.record_logits for _, j in rows):
            logits = np.asarray(out.logits)
        now = time.perf_counter()
        if not first:
            self.observer.step(len(rows), now - started)
        for i, job in rows:
            if first:  # the first token is drawn in the prefill's own call
                job.prefill_s, job.first_token_s = now - job.submitted, 0.0
                self.observer.first_token(now - job.submitted)
            else:
                self.observer.next_token(now - job.last_token_at)
            job.last_token_at = now
            if not finite[i]:
                self._finish(job, FinishReason.ERROR, NON_FINITE_LOGITS, fed=())
                continue
            self._push_guarded(job, int(sampled[i]), None if logits is None else logits[i],
                               lp[i], top_ids[i], top_lp[i])

    def _push_guarded(self, job: Job, *args: Any) -> bool:
        """:meth:`_push`, with a failure in this request's own text work (its tokenizer, its
        stop matcher) ending this request alone."""
        try:
            return self._push(job, *args)
        except Exception as exc:  # the other rows must not pay for one request's fault
            self._release(job, ())
            self.observer.request_ended("error", len(job.emission.tokens))
            job.sink(Failed(f"{type(exc).__name__}: {exc}"))
            return True

    def _push(self, job: Job, token: int, row: Any, lp: Any, top_ids: Any, top_lp: Any) -> bool:
        """Emit one token; finish the job when it ends there. Returns whether it ended."""
        finish = job.push(token, row, lp, top_ids, top_lp)
        if finish is None:
            return False
        self._finish(job, finish, None, fed=() if finish is FinishReason.ERROR else job.prompt)
        return True

    def _finish(self, job: Job, finish: FinishReason, error: str | None,
                fed: tuple[int, ...]) -> None:
        tail_event, completion = job.emission.finish(
            self.producer, finish, error, None, reused=job.reused, started=job.submitted,
            prefill_s=job.prefill_s, first_token_s=job.first_token_s,
        )
        usage = dataclasses.replace(completion.usage, slot=job.slot.index, evicted=job.evicted)
        generated = () if finish is FinishReason.ERROR else job.emission.tokens[:-1]
        completion = dataclasses.replace(completion, usage=usage,
                                         fed_ids=(*job.prompt, *generated) if fed else ())
        self._release(job, fed)
        self.observer.request_ended(
            "error" if finish is FinishReason.ERROR else finish.value, len(completion.token_ids)
        )
        if finish is FinishReason.ERROR:
            job.sink(Failed(completion.error or "generation failed"))
        else:
            tail = tail_event.text if tail_event is not None else ""
            job.sink(Done(completion=completion, logprobs=job.logprobs, tail=tail))

    # -- speculative requests ---------------------------------------------------------------

    def _speculates(self, request: ServeRequest) -> bool:
        req = request.completion
        return (self.speculative is not None and req.draft_len != 0
                and req.constraint is None and req.injection is None
                and req.sampling.temperature == 0 and request.top_logprobs is None
                and not req.record_logits)

    def _speculate(self, stream: Stream[Completion], sink: Sink, ticket: Ticket) -> None:
        try:
            run_speculative(stream, sink, ticket, self.observer, self._spec_lock,
                            lambda: self._cut)
        except Exception as exc:  # the client must hear of it, not wait forever
            self.observer.request_ended("error", 0)
            sink(Failed(f"{type(exc).__name__}: {exc}"))
        finally:
            with self._cond:
                self._speculating -= 1
                self._cond.notify_all()
