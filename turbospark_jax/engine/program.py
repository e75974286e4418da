"""One compiled program for every path a guarantee compares.

On a GPU a jitted ``lax.scan`` of a decode step is not bitwise equal to the same step called
token by token, and a batched pass over a chunk is not either
(docs/decisions/0001-one-block-program.md). What holds on both CPU and GPU is *one* executable
over a fixed-width block of ``W`` rows, called with different data: padding rows write nothing,
decode has one live row, a prefill chunk has ``W`` live rows, a verify has ``k + 1``. Wrapping
that block in a ``while_loop`` with a traced trip count keeps it one executable while serving
decode bursts and long chunks alike.

So this module compiles exactly one program per (model, ``W``, steps per call, donation), and
:class:`~turbospark_jax.engine.producer.BlockProducer` routes ``produce``, ``produce_prefill``,
``prefill_chunk``, ``verify`` and device-side decode bursts through it. A model family only
supplies :meth:`~turbospark_jax.models.base.BlockModel.block_forward`; :func:`feed_block` is
the step every path (the speculative rounds of :mod:`turbospark_jax.speculative.rounds` included)
feeds a
block through.

Each step of the loop:

1. feeds a block of ``W`` tokens at the cursor (``live`` of them real);
2. optionally computes the output head (``need_head``, a traced flag, so a headless prefill is
   the same program);
3. writes the ``W`` logits rows into the output at a per-step row offset;
4. in *feedback* (decode) mode samples the next token from the last live row, checks it
   against the stop ids, and feeds it at the next step.

Nothing about the request is static: sampling parameters, stop ids, step counts and live
counts are all data, so switching between them never compiles anything new.

A model whose programs of different widths agree bitwise (row-invariant kernels,
:attr:`~turbospark_jax.models.base.BlockModel.widths_agree`) needs no one program, and takes
two kinds more: a wide exact prefill that runs the head on each block's last row
(``last_row_head``), and decode programs compiled for the kind of draw a request's settings
ask for (``draw``, one of :data:`~turbospark_jax.core.sampling.DRAW_PLANS`). A decode program runs
the head on every step and draws with no ``lax.cond``: on a GPU each conditional copies its
predicate to the host and waits for it, a stall per token. At most three such programs
exist per width (greedy, sampled, truncated), however the settings' values change, and as
many again bounded by ``max_keys`` for a model that declares ``bounds_keys``: a short
context's decode (:data:`~turbospark_jax.engine.producer.SHORT_DECODE_KEYS`), whose attention
takes a faster kernel with the same bits.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from turbospark_jax.core import sampling
from turbospark_jax.core.compile_cache import program_store
from turbospark_jax.core.protocols import NON_FINITE, RUNNING, STOPPED_ON_TOKEN
from turbospark_jax.core.state import FedRecord, auxiliary, buffers_only, by_value, merge_parts
from turbospark_jax.engine import loop_graphs as device_flags
from turbospark_jax.models.base import BlockModel

#: How many stop token ids one decode burst checks on device.
MAX_STOP_IDS = 16

# XLA on the CPU cannot alias donated buffers and says so once per compile; that is expected.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


@struct.dataclass(kw_only=True)
class Snapshot:
    """The durable by-value leaves of a cache at one position, for reusing a prefix of a state
    that cannot be rewound (recurrent leaves summarise every fed token).

    Fields:
      count:  int32[]  the position it was taken at.
      digest: uint32[] the fed record's digest there: the snapshot serves a state only while
              that state's lineage passes through it.
      values: the cache with buffers and scratch set to ``None`` (references, not copies).
    """

    count: jax.Array
    digest: jax.Array
    values: Any


@struct.dataclass(kw_only=True)
class BlockState:
    """The state of a :class:`BlockProducer`.

    Fields:
      cache: the model's cache pytree (KV rows ``[L, T, KV, D]`` or recurrent leaves).
      fed:   what has been consumed, position by position (the cursor is ``fed.count``).
      snapshots: auxiliary (never seen by a compiled program): :class:`Snapshot` s of a
        recurrent model's state at the ends of earlier prompts, newest last.
    """

    cache: Any
    fed: FedRecord
    snapshots: tuple[Snapshot, ...] = auxiliary()

    @property
    def count(self) -> int:
        return int(self.fed.count)


@struct.dataclass(kw_only=True)
class Plan:
    """Per-step inputs of one program call; ``S`` steps of ``W`` rows, fixed shapes.

    Fields:
      tokens:     int32[S, W]  tokens to feed (decode mode overrides row 0 from step 1 on).
      live:       int32[S]     real rows in each step's block.
      need_head:  bool[S]      whether the output head runs on that step.
      out_offset: int32[S]     first row of the output that the step's ``W`` rows go to.
      injected:   int32[S, W]  identity of the embedding each row takes instead of its
                               token's (0: none); recorded in the fed record.
      embeds:     [S, W, D]    those embeddings, in the model's embedding dtype; ``None`` for
                               a model that does not accept embeddings. A text-only call
                               passes zeros kept on the device, so it is the same program.
    """

    tokens: jax.Array
    live: jax.Array
    need_head: jax.Array
    out_offset: jax.Array
    injected: jax.Array
    embeds: jax.Array | None


@struct.dataclass(kw_only=True)
class Control:
    """Decode-mode controls; all data, never static.

    Fields:
      feedback:  bool[]            decode mode: step ``i > 0`` feeds the token step ``i-1`` sampled.
      params:    SamplingParams    traced sampling settings.
      history:   History           penalty bookkeeping, updated with every sampled token.
      key:       PRNG key          the request's base key.
      gen_index: int32[]           index of the token step 0 samples (for ``token_key``).
      stop_ids:  int32[MAX_STOP_IDS]  padded with -1.
    """

    feedback: jax.Array
    params: sampling.SamplingParams
    history: sampling.History
    key: jax.Array
    gen_index: jax.Array
    stop_ids: jax.Array


@struct.dataclass(kw_only=True)
class StepOutput:
    """What one program call returns besides the new state.

    Fields:
      logits:  float32[S + W - 1, V]  logits rows written at each step's offset.
      sampled: int32[S]               decode mode: the token sampled at each step.
      steps:   int32[]                steps actually run (a stop ends the loop early).
      finish:  int32[]                RUNNING, STOPPED_ON_TOKEN or NON_FINITE.
      history: History                updated penalty bookkeeping.
    """

    logits: jax.Array
    sampled: jax.Array
    steps: jax.Array
    finish: jax.Array
    history: sampling.History


def feed_block(
    model: BlockModel,
    params: Any,
    state: BlockState,
    tokens: jax.Array,
    live: jax.Array,
    need_head: jax.Array,
    injected: jax.Array | None = None,
    embeds: jax.Array | None = None,
    last_row_head: bool = False,
    max_keys: int | None = None,
) -> tuple[jax.Array, BlockState]:
    """Feed ``tokens[:live]`` (int32 ``[W]``) at the state's cursor; return the ``[W, V]``
    logits (``[1, V]``, row ``live - 1``'s, with ``last_row_head``: a model whose widths
    agree) and the state with the rows appended to its cache and fed record (jittable).

    Rows with a non-zero ``injected`` identity (int32 ``[W]``) take their row of ``embeds``
    (``[W, D]``) instead of their token's embedding; a model is handed embeddings only when
    it declares ``accepts_embeddings``. ``max_keys`` (static): the caller's bound on every
    row's position + 1, handed to a model that declares ``bounds_keys`` (a speed hint)."""
    positions = state.fed.count + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    extra = {}
    if model.accepts_embeddings:
        if embeds is None:
            # Nothing injected, but as traced data: constants would let XLA fold the select
            # away and compile this step unlike the block program's, whose rows then differ
            # in their last bits (the speculative rounds must verify what decoding computes).
            nothing = jnp.where(live < 0, 1, 0).astype(jnp.int32)  # 0, unknown to XLA
            injected = jnp.broadcast_to(nothing, tokens.shape)
            embeds = jnp.broadcast_to(nothing.astype(model.embedding_dtype),
                                      (tokens.shape[0], model.embedding_size))
        extra = {"embeds": embeds, "embed_rows": injected != 0}
    if last_row_head:
        extra["last_row_head"] = True
    if max_keys is not None and model.bounds_keys:
        extra["max_keys"] = max_keys
    with jax.named_scope("block_forward"):
        logits, cache = model.block_forward(
            params, state.cache, tokens, positions, live, need_head, **extra
        )
    return logits, state.replace(cache=cache, fed=state.fed.append(tokens, live, injected))


#: Steps a decode program (a draw plan, :func:`compiled_program`) runs between two checks
#: of its loop's condition. On a GPU each check copies the condition to the host and waits
#: for it, a stall per check; the steps of a chunk are a loop of known trip count, which the
#: GPU runs without one. A call's steps past its count or past a stop run idle (no row fed,
#: nothing returned changes): at most ``DECODE_CHUNK - 1`` of them, at a call's end.
DECODE_CHUNK = 8


def _run_blocks(
    model: BlockModel,
    params: Any,
    buffers: BlockState,
    values: BlockState,
    plan: Plan,
    control: Control,
    n_steps: jax.Array,
    last_row_head: bool = False,
    draw: str = "any",
    max_keys: int | None = None,
) -> tuple[BlockState, BlockState, StepOutput]:
    # The state arrives split so that only its append-only buffers are donated: by-value
    # leaves (cursor, recurrent state) may still be held by a checkpoint.
    state = merge_parts(buffers, values)
    steps_cap, width = plan.tokens.shape
    vocab = model.vocab_size
    # last_row_head: each step's one row of logits goes to output row i (a prefill).
    rows_out = 1 if last_row_head else width
    out0 = jnp.zeros((steps_cap + rows_out - 1, vocab), jnp.float32)

    def cond(carry):
        i, _, _, _, finish, _, _ = carry
        return (i < n_steps) & (finish == RUNNING)

    def body(carry, active=None):
        # ``active`` (a decode program's chunks): whether this step is one of the call's;
        # one that is not feeds no row and changes nothing the call returns.
        i, st, out, sampled, finish, history, pending = carry
        at_i = i if active is None else jnp.minimum(i, steps_cap - 1)
        tokens = plan.tokens[at_i]
        tokens = jnp.where(control.feedback & (i > 0), tokens.at[0].set(pending), tokens)
        live = plan.live[at_i] if active is None else jnp.where(active, plan.live[at_i], 0)
        # A decode program (a draw plan) needs every step's logits: the head runs unbranched.
        need_head = True if draw != "any" else plan.need_head[at_i]
        logits, st = feed_block(model, params, st, tokens, live, need_head,
                                plan.injected[at_i],
                                None if plan.embeds is None else plan.embeds[at_i],
                                last_row_head=last_row_head, max_keys=max_keys)
        at = at_i if last_row_head else plan.out_offset[at_i]
        if active is not None:  # an idle step writes its row's own contents back
            logits = jnp.where(active, logits, jax.lax.dynamic_slice(out, (at, 0), logits.shape))
        out = jax.lax.dynamic_update_slice(out, logits, (at, 0))
        last = logits[0] if last_row_head else logits[live - 1]
        finite = jnp.all(jnp.isfinite(last)) | ~plan.need_head[at_i]

        with jax.named_scope("sample"):
            # Sampled unconditionally and kept by a select: a cond here would cost a
            # device-to-host round trip per token on a GPU, and a greedy draw (what the idle
            # control of a prefill or verify asks for) is one argmax.
            keep = control.feedback & finite
            if active is not None:
                keep &= active
            key = sampling.token_key(control.key, control.gen_index + i)
            if draw == "any":
                drawn = sampling.sample(last, control.params, history, key)
            else:  # the host classified the settings: no branch on them here
                drawn = sampling.draw_as(draw, last, control.params, history, key)
            drawn = drawn.astype(jnp.int32)
            tok = jnp.where(keep, drawn, jnp.int32(-1))
            history = history.add(tok)  # -1 is outside the vocabulary: recorded as nothing
        hit = control.feedback & jnp.any(control.stop_ids == tok)
        ended = jnp.where(~finite, NON_FINITE, jnp.where(hit, STOPPED_ON_TOKEN, RUNNING))
        if active is None:
            return i + 1, st, out, sampled.at[i].set(tok), ended, history, tok
        return (i + active.astype(jnp.int32), st, out,
                sampled.at[i].set(tok, mode="drop"),  # past the end: dropped
                jnp.where(active, ended, finish), history, jnp.where(active, tok, pending))

    def chunk(carry):
        """:data:`DECODE_CHUNK` steps, those past the call's end or a stop idle: a loop of
        known trip count, which runs with no look at its condition from the host."""
        def one(_, carry):
            return body(carry, active=cond(carry))

        return jax.lax.fori_loop(0, DECODE_CHUNK, one, carry)

    carry = (
        jnp.int32(0),
        state,
        out0,
        jnp.full((steps_cap,), -1, jnp.int32),
        jnp.int32(RUNNING),
        control.history,
        jnp.int32(-1),
    )
    # A decode program checks its condition once per chunk of steps (on a GPU each check
    # copies it to the host and waits); the one program, once per step.
    loop_body = body if draw == "any" else chunk
    steps, state, out, sampled, finish, history, _ = jax.lax.while_loop(cond, loop_body, carry)
    return buffers_only(state), by_value(state), StepOutput(
        logits=out, sampled=sampled, steps=steps, finish=finish, history=history
    )


def _parallel_block(
    model: BlockModel, params: Any, buffers: BlockState, values: BlockState,
    tokens: jax.Array, live: jax.Array, key_limit: int | None, fresh: bool,
    head: bool = False,
) -> tuple[BlockState, BlockState] | tuple[BlockState, BlockState, jax.Array]:
    """One wide pass: the parallel prefill's fast path (not the exact program). Headless, or
    with ``head`` (a model that declares ``parallel_head``) also the float32 ``[V]`` logits
    of its last live row."""
    state = merge_parts(buffers, values)
    width = tokens.shape[0]
    positions = state.fed.count + jnp.arange(width, dtype=jnp.int32)
    extra = {"last_row_head": True} if head else {}
    logits, cache = model.block_forward(
        params, state.cache, tokens, positions, live, True if head else jnp.bool_(False),
        key_limit=key_limit, fresh=fresh, **extra,
    )
    state = state.replace(cache=cache, fed=state.fed.append(tokens, live))
    if head:
        return buffers_only(state), by_value(state), logits[0]
    return buffers_only(state), by_value(state)


@functools.cache
def compiled_parallel(model: BlockModel, donate: bool) -> Any:
    fn = functools.partial(_parallel_block, model)
    return jax.jit(fn, donate_argnums=(1,) if donate else (),
                   static_argnames=("key_limit", "fresh", "head"))


#: The block program's static arguments (keywords).
_STATICS = ("last_row_head", "draw", "max_keys")


class BlockPrograms:
    """The jitted block program: one jit for every path, and for a model whose widths agree
    a second jit of the same function for its decode programs (a ``draw`` other than
    ``"any"``), compiled with :func:`~turbospark_jax.engine.loop_graphs.decode_program_options`
    (their loops as CUDA graphs). Both take the same arguments. While a program store is in
    force (:func:`~turbospark_jax.core.compile_cache.use_program_store`, the command line's),
    a call runs the executable stored for it, which a warm process then neither traces nor
    lowers."""

    def __init__(self, model: BlockModel, donate: bool, **jit_options: Any) -> None:
        fn = functools.partial(_run_blocks, model)
        options = dict(donate_argnums=(1,) if donate else (),  # 1: the append-only buffers
                       static_argnames=_STATICS, **jit_options)
        self.any = jax.jit(fn, **options)
        decode = device_flags.decode_program_options() if model.widths_agree else None
        self.decode = self.any if decode is None else jax.jit(
            fn, compiler_options=decode, **options)
        # What decides the programs besides their arguments, for a program store; a pinned
        # layout (a device mesh) is not stored.
        self._identity = None if jit_options else (
            "engine.program._run_blocks", model, donate, decode)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        decoding = kwargs.get("draw", "any") != "any"
        jitted = self.decode if decoding else self.any
        store = program_store()
        if store is None or self._identity is None or not kwargs.keys() <= set(_STATICS):
            return jitted(*args, **kwargs)
        return store.call(jitted, (*self._identity, decoding), args, kwargs)


@functools.cache
def compiled_program(model: BlockModel, donate: bool) -> BlockPrograms:
    """The one jitted program for ``model`` (shapes specialise it per ``W`` and ``S``; a
    model whose widths agree also has a ``last_row_head`` form for the exact prefill, and
    decode forms that draw by a plan the host chose from the request's settings, ``draw``
    other than ``"any"``: :func:`~turbospark_jax.core.sampling.draw_as`, compiled with their
    loops in command buffers; a model that declares ``bounds_keys`` also has decode forms
    bounded by ``max_keys``, for short contexts)."""
    return BlockPrograms(model, donate)


def pinned_program(model: BlockModel, donate: bool, out_shardings: Any) -> BlockPrograms:
    """The program of :func:`compiled_program` with its outputs' shardings pinned: a state
    sharded over a device mesh then keeps its layout from call to call, whatever layout the
    compiler would have picked (:mod:`turbospark_jax.parallel.sharding`)."""
    return BlockPrograms(model, donate, out_shardings=out_shardings)


@functools.cache
def compiled_init(model: BlockModel, capacity: int) -> Any:
    """A fresh state in one device program (a per-layer cache is dozens of buffers; made one by
    one, each would be a dispatch of its own)."""
    return jax.jit(
        lambda owner: BlockState(cache=model.init_cache(capacity),
                                 fed=FedRecord.empty(capacity, owner))
    )


