"""``BlockProducer``: the producer protocols served through the one block program.

Every method routes through :func:`~turbospark_jax.engine.program.compiled_program` (one
executable per model and shape), so prefill chunks, verifies and decode bursts that a
guarantee compares are the same program called with different data.

This module holds the state, the prefill and the plans and program call every path shares;
the target side of speculative decoding is :mod:`~turbospark_jax.engine.verifying`, the
device-side decode bursts :mod:`~turbospark_jax.engine.bursts`, and the block widths and
memory checks :mod:`~turbospark_jax.engine.sizing`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.core import sampling
from turbospark_jax.core.checks import as_bool, as_int, as_token, as_token_ids, is_int
from turbospark_jax.core.injection import Injection
from turbospark_jax.core.kv_prefix import common_prefix, reusable_prefix
from turbospark_jax.core.protocols import (
    ChunkedPrefillRunner,
    require_prompt,
)
from turbospark_jax.core.state import (
    FedRecord,
    buffers_only,
    by_value,
    durable_values,
    merge_parts,
    restore_durable,
    with_auxiliary,
    without_auxiliary,
)
from turbospark_jax.engine.bursts import BlockBursts
from turbospark_jax.engine.program import (
    MAX_STOP_IDS,
    BlockState,
    Control,
    Plan,
    Snapshot,
    StepOutput,
    compiled_init,
    compiled_parallel,
    compiled_program,
)
from turbospark_jax.engine.sizing import (
    MAX_CAPACITY,
    check_prefill_width,
    prefill_block_widths,
    require_memory,
)
from turbospark_jax.engine.verifying import BlockVerifying
from turbospark_jax.errors import (
    BadInputError,
    ContextOverflowError,
)
from turbospark_jax.models.base import BlockModel

#: Prompt-end snapshots a state of a recurrent model keeps (the newest).
MAX_SNAPSHOTS = 4

#: Blocks a program call holds by default (the longest decode burst). Large enough that the
#: fixed cost of a call (launch, transfers, the host's checks) is a few percent of a burst
#: at the burst sizer's quarter second; the per-call
#: buffers it sizes (plan, sampled ids, a float32 logits row per block) stay small.
STEPS_PER_CALL = 128

#: A decode burst whose rows all sit below this many positions runs a program bounded by it,
#: for a model that declares ``bounds_keys`` (the dense family's row-invariant attention on
#: a GPU): its attention then folds the one or two key splits such a context has in one
#: launch a layer, where the unbounded program launches a program for every split of the
#: cache and a fold kernel after them. The same bits either way; a second decode program
#: compiles, the first time a burst runs past the bound.
SHORT_DECODE_KEYS = 512

#: Rows one call of the ``prefill_width`` program holds at least (whole blocks, at least one):
#: a call returns to the host only when the device has finished it (the device idles between
#: calls while the host prepares the next), so the full blocks of a long prompt go four to a
#: call. The plan and the
#: last-row logits it sizes stay small; a model that accepts embeddings keeps a zero
#: ``[S, W, D]`` "nothing injected" block per program width.
PREFILL_CALL_ROWS = 8192

class BlockProducer(ChunkedPrefillRunner[BlockState], BlockVerifying, BlockBursts):
    """A :class:`BlockModel` served through the one block program.

    Args:
      model: the model family instance (hashable, static under jit).
      params: its parameters pytree.
      capacity: positions a state can hold (the preallocated context).
      width: ``W``, rows per block. Decode pays for ``W`` rows of compute and a verify runs
        in blocks of ``W``; on a GPU a decode step costs about the same for small ``W``
        because the weights are read once either way.
      steps_per_call: ``S``, blocks per program call (the longest decode burst).
      prefill_width: the most rows one block of the exact prefill holds (:meth:`prefill_chunk`
        and what routes through it); ``None``: ``width``, the one program. A wider value
        needs a model whose programs of different widths agree bitwise
        (:attr:`~turbospark_jax.models.base.BlockModel.widths_agree`: a dense model under a
        row-invariant kernel plan): a chunk then runs in blocks of ``prefill_width`` rows and its
        rest in one block of a power of two between ``width`` and ``prefill_width``
        (:func:`~turbospark_jax.engine.sizing.prefill_block_widths`), so a few programs serve
        every prompt, each block reading the weights once for all its rows, and every row
        keeps the bits of token-by-token decoding. A prefill program of ``w > W`` rows runs
        ``S * W // w`` blocks a call (at least one), so a call holds about as many rows as a
        decode burst; the ``prefill_width`` program, which feeds the full blocks of long
        prompts, at least :data:`PREFILL_CALL_ROWS` rows' worth (at most ``S`` blocks).
      short_decode_keys: decode bursts whose rows all sit below this many positions run a
        program bounded by it, on a model that declares
        :attr:`~turbospark_jax.models.base.BlockModel.bounds_keys` (:data:`SHORT_DECODE_KEYS`;
        ``None`` or 0: one decode program for every context). Speed only.
      donate: let the program consume the state's buffers (no KV copy per call). When True,
        the append-only buffers of a state passed to any method are invalid afterwards (its
        by-value leaves, and so every :meth:`checkpoint`, stay valid); keep a
        :func:`~turbospark_jax.core.state.copy_state` copy to keep a whole old value.

    Raises:
      BadInputError: an argument of the wrong type or below 1; a ``prefill_width`` below
        ``width``, or other than ``width`` for a model whose widths do not agree (with XLA's
        kernels programs of two widths round differently, so the chunked prefill would no
        longer equal token-by-token decoding).
      ContextOverflowError: a state of ``capacity`` positions needs more memory than the
        device has free (:attr:`state_bytes` against what JAX reports for the device, or the
        host's available memory on a CPU); nothing is allocated or compiled before this.

    Every method checks its arguments and the state it is given (:meth:`check_state`) before
    any work: a wrong type, an id outside the vocabulary, a position that does not continue
    the state, a state of another producer or one whose buffers were donated raise
    :class:`~turbospark_jax.errors.BadInputError` and leave the state untouched.
    """

    def __init__(
        self,
        model: BlockModel,
        params: Any,
        *,
        capacity: int,
        width: int = 8,
        steps_per_call: int = STEPS_PER_CALL,
        donate: bool = True,
        prefill_width: int | None = None,
        short_decode_keys: int | None = SHORT_DECODE_KEYS,
    ) -> None:
        if not isinstance(model, BlockModel):
            raise BadInputError(f"model must be a BlockModel, got {type(model).__name__}")
        capacity = as_int("capacity", capacity, low=1)
        width = as_int("width", width, low=1)
        steps_per_call = as_int("steps_per_call", steps_per_call, low=1)
        donate = as_bool("donate", donate)
        prefill_width = width if prefill_width is None else as_int(
            "prefill_width", prefill_width, low=1)
        short_decode_keys = None if short_decode_keys is None else as_int(
            "short_decode_keys", short_decode_keys, low=0) or None
        check_prefill_width(prefill_width, width, model.widths_agree)
        # The state's layout, from shapes alone: what check_state compares against, and the
        # bytes a state takes, checked against the device before anything is allocated.
        layout = jax.eval_shape(
            lambda: BlockState(cache=model.init_cache(capacity), fed=FedRecord.empty(capacity))
        )
        leaves, self._state_def = jax.tree.flatten(layout)
        self._state_leaves = [(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]
        #: Bytes one state of this producer takes (its cache and fed record).
        self.state_bytes = sum(int(np.prod(shape)) * dtype.itemsize
                               for shape, dtype in self._state_leaves)
        require_memory(self.state_bytes, f"a state of {capacity} positions")
        if capacity > MAX_CAPACITY:
            raise ContextOverflowError(
                f"capacity {capacity} is past the int32 positions the programs use "
                f"(at most {MAX_CAPACITY})"
            )
        self.model = model
        self.params = params
        self.capacity = capacity
        self.width = width
        self.steps_per_call = steps_per_call
        self.prefill_width = prefill_width
        self.short_decode_keys = short_decode_keys if model.bounds_keys else None
        self.donate = donate
        # Stamped into every state this producer makes, so a state or checkpoint from another
        # producer (even one of the same structure) is refused.
        self.identity = int.from_bytes(os.urandom(4), "little") | 1
        self._program = compiled_program(model, donate)
        self._idle = self._idle_control()
        self._nothing_by_width: dict[int, tuple[jax.Array, jax.Array | None]] = {}
        no_injected, no_embeds = self._nothing(width)
        #: One block's "nothing injected" ``(identities [W], embeddings [W, D] or None)``, as
        #: data: what a program that feeds blocks outside the block program (the device
        #: speculative rounds) passes to ``feed_block`` so its step compiles like this one's.
        self.nothing_injected = (no_injected[0], None if no_embeds is None else no_embeds[0])

    # -- basic protocol -----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def accepts_embeddings(self) -> bool:
        """Whether prompts may carry injected embeddings (images): the model declares it."""
        return self.model.accepts_embeddings

    @property
    def can_rewind(self) -> bool:
        """Whether a state can be moved back to any position (the model's KV rows behind a
        cursor); a recurrent model's cannot."""
        return self.model.rewindable

    def rewind_floor(self, state: BlockState) -> int:
        if not self.can_rewind:
            return super().rewind_floor(state)
        return self.model.rewind_floor(state.cache)

    def rewind(self, state: BlockState, count: int) -> BlockState:
        fed = self._require_state(state)
        if not self.can_rewind:
            return super().rewind(state, count)
        if not is_int(count) or not 0 <= int(count) <= fed:
            raise BadInputError(
                f"cannot rewind to {count!r}: the state has consumed {fed} positions"
            )
        count = int(count)
        floor = self.rewind_floor(state)
        if count < floor:
            raise BadInputError(
                f"cannot rewind to {count}: the sliding-window cache keeps rows from position "
                f"{floor} on; rewind no further back than that"
            )
        return self._with_count(state, int(count))

    def fed_record(self, state: BlockState) -> FedRecord:
        self._require_state(state)
        return state.fed

    def check_state(self, state: BlockState) -> None:
        self._require_state(state)

    @property
    def max_positions(self) -> int:
        return self.capacity

    def init_state(self) -> BlockState:
        return compiled_init(self.model, self.capacity)(jnp.uint32(self.identity))

    def try_reuse_prefix(
        self,
        state: BlockState,
        prompt_ids: Sequence[int],
        *,
        injected: Mapping[int, int] | None = None,
    ) -> tuple[int, BlockState]:
        self._require_state(state)
        prompt_ids = require_prompt(prompt_ids, self.vocab_size)
        record = state.fed.to_host()
        n = reusable_prefix(record.ids, record.injected, prompt_ids, injected,
                            rewindable=self.can_rewind)
        if n == 0 and not self.can_rewind:
            return self._reuse_snapshot(state, record, prompt_ids, injected)
        if n == 0 or (n < record.count and n < self.rewind_floor(state)):
            # nothing shared, or a ring that no longer holds the rows a move back needs
            return 0, self.init_state()
        return n, self._with_count(state, n)

    def prefill_chunk_with_status(
        self, state: BlockState, tokens: Sequence[int], start_position: int,
        is_final_prompt_chunk: bool, *, injection: Injection | None = None,
    ) -> tuple[jax.Array, BlockState]:
        """:meth:`prefill_chunk`; a model that cannot rewind also keeps a snapshot at the end
        of the prompt, so the next turn (whose prompt repeats this one) can restore it."""
        logits, state = self.prefill_chunk(state, tokens, start_position, injection=injection)
        if is_final_prompt_chunk and not self.can_rewind:
            state = self._snapshot(state)
        return logits, state

    def produce(
        self, state: BlockState, token: int, position: int, *,
        injection: Injection | None = None,
    ) -> tuple[jax.Array, BlockState]:
        """:meth:`~turbospark_jax.core.protocols.LogitProducer.produce`; ``injection`` (a model
        that accepts embeddings) replaces the token's embedding when it covers ``position``."""
        token = as_token("token", token, self.vocab_size)
        self._check_injection(injection)
        self._check_tokens([token], position, state)
        plan = self._single_plan(token, need_head=True, injection=injection, position=position)
        out, state = self._call(state, plan, self._idle, 1)
        return out.logits[0], state

    def produce_prefill(
        self, state: BlockState, token: int, position: int, *,
        injection: Injection | None = None,
    ) -> BlockState:
        token = as_token("token", token, self.vocab_size)
        self._check_injection(injection)
        self._check_tokens([token], position, state)
        plan = self._single_plan(token, need_head=False, injection=injection, position=position)
        return self._call(state, plan, self._idle, 1)[1]

    def prefill_chunk(
        self, state: BlockState, tokens: Sequence[int], start_position: int, *,
        injection: Injection | None = None,
    ) -> tuple[jax.Array, BlockState]:
        """:meth:`~turbospark_jax.core.protocols.ChunkedPrefillRunner.prefill_chunk`, in blocks of
        :func:`~turbospark_jax.engine.sizing.prefill_block_widths` (blocks of ``width`` rows
        unless ``prefill_width`` is wider); the rows of ``injection`` that fall inside the
        chunk replace their tokens' embeddings (bitwise the same as feeding the chunk token by
        token with the same injection)."""
        self._check_injection(injection)
        tokens = self._check_tokens(tokens, start_position, state, what="prefill chunk")
        blocks, at = [], 0
        for rows in prefill_block_widths(len(tokens), self.width, self.prefill_width):
            blocks.append((rows, tokens[at : at + rows]))
            at += rows
        # One call per run of blocks of one width, at most that width's steps each; the
        # output head runs on the chunk's last block only.
        calls = []
        for rows, run in itertools.groupby(blocks, key=lambda b: b[0]):
            fed = [block for _, block in run]
            steps = self._steps_for(rows)
            calls += [(rows, fed[i : i + steps]) for i in range(0, len(fed), steps)]
        # Where widths agree, the head runs on the chunk's last row alone (its bits are the
        # same as in a head over the whole block): a wide block skips W - 1 rows of the
        # vocabulary product and the [W, V] logits it would write.
        last_row = self.model.widths_agree
        position, logits = start_position, None
        for i, (rows, group) in enumerate(calls):
            final = i == len(calls) - 1
            plan = self._plan(group, width=rows, head_on_last=final, injection=injection,
                              position=position)
            out, state = self._call(state, plan, self._idle, len(group), last_row_head=last_row)
            position += sum(len(block) for block in group)
            if final:
                logits = out.logits[len(group) - 1 if last_row else len(group[-1]) - 1]
        assert logits is not None
        return logits, state

    def supports_parallel_prefill(self) -> bool:
        return self.model.parallel_prefill

    def prefill_parallel(
        self, state: BlockState, tokens: Sequence[int], start_position: int, *,
        chunk: int = 2048,
    ) -> tuple[jax.Array, BlockState]:
        """The fast path: the prompt in wide batched passes, the last of which also gives the
        last token's logits (a model that declares ``parallel_head``; otherwise all but the
        last token go in passes and the last one through the exact program).

        A prompt fed into an empty state goes in one pass over its own rows (width: the next
        power of two, so prompt lengths share a few programs; cuDNN flash attention on a GPU).
        Otherwise passes of ``chunk`` rows attend over the cache up to the last row they can
        see (a static bound rounded up to a multiple of ``chunk``, so at most
        ``capacity / chunk`` programs). These are different executables from the exact
        program, so the cache rows they write differ from the exact path's by rounding (the
        tolerance is stated in the tests). Not part of any bitwise guarantee.
        """
        if not self.supports_parallel_prefill():
            return super().prefill_parallel(state, tokens, start_position, chunk=chunk)
        chunk = as_int("chunk", chunk, low=1)
        tokens = self._check_tokens(tokens, start_position, state, what="prefill chunk")
        program = compiled_parallel(self.model, self.donate)
        # With ``parallel_head`` the last pass also feeds the last token and returns its
        # logits; otherwise that token goes through the exact program (:meth:`produce`).
        head = self.model.parallel_head
        body = tokens if head else tokens[:-1]
        fed = int(start_position)  # the state's count: _check_tokens has held them equal
        if body and fed == 0:
            # The body fits the capacity (checked above), so this one pass always holds it.
            width = min(max(256, 1 << (len(body) - 1).bit_length()), self.capacity)
            pieces = [(body, width, True)]
        else:
            pieces = [(body[a : a + chunk], chunk, False) for a in range(0, len(body), chunk)]
        logits = None
        for i, (piece, width, fresh) in enumerate(pieces):
            padded = np.zeros((width,), np.int32)
            padded[: len(piece)] = piece
            limit = None if fresh else min(self.capacity, -(-(fed + width) // chunk) * chunk)
            bare, held = without_auxiliary(state)
            last = head and i == len(pieces) - 1
            buffers, values, *out = program(
                self.params, buffers_only(bare), by_value(bare), padded,
                np.int32(len(piece)), key_limit=limit, fresh=fresh,
                **({"head": True} if last else {}),
            )
            state = with_auxiliary(merge_parts(buffers, values), held)
            fed += len(piece)
            if last:
                logits = out[0]
        if head:
            return logits, state
        return self.produce(state, tokens[-1], start_position + len(body))

    # -- internals ------------------------------------------------------------------------

    def _snapshot(self, state: BlockState) -> BlockState:
        """``state`` keeping a :class:`Snapshot` at its cursor (the newest ``MAX_SNAPSHOTS``)."""
        count = state.fed.count
        keep = [s for s in state.snapshots if int(s.count) != int(count)]
        snap = Snapshot(count=count, digest=state.fed.digest,
                        values=durable_values(state.cache))
        return state.replace(snapshots=(*keep, snap)[-MAX_SNAPSHOTS:])

    def _reuse_snapshot(
        self, state: BlockState, record: Any, prompt_ids: Sequence[int],
        injected: Mapping[int, int] | None,
    ) -> tuple[int, BlockState]:
        """The longest prefix a snapshot of ``state``'s own lineage restores exactly: at most
        the common prefix of the record and the prompt; ``(0, fresh state)`` when none does."""
        common = common_prefix(record.ids, record.injected, prompt_ids, injected)
        best = None
        for snap in state.snapshots:
            at = int(snap.count)
            if 0 < at <= common and int(state.fed.prefix[at - 1]) == int(snap.digest) and (
                best is None or at > int(best.count)
            ):
                best = snap
        if best is None:
            return 0, self.init_state()
        restored = state.replace(cache=restore_durable(state.cache, best.values))
        return int(best.count), self._with_count(restored, int(best.count))

    def _with_count(self, state: BlockState, n: int) -> BlockState:
        return state.replace(fed=state.fed.moved_to(n))

    def _require_state(self, state: Any) -> int:
        """Refuse anything but a live state of this producer; return its cursor."""
        if not isinstance(state, BlockState):
            raise BadInputError(
                f"expected a state of this producer (a BlockState from init_state()), got "
                f"{type(state).__name__}"
            )
        leaves, treedef = jax.tree.flatten(without_auxiliary(state)[0])  # snapshots vary
        if treedef != self._state_def or len(leaves) != len(self._state_leaves) or any(
            not hasattr(x, "shape") or (tuple(x.shape), np.dtype(x.dtype)) != want
            for x, want in zip(leaves, self._state_leaves, strict=False)
        ):
            raise BadInputError(
                "this state does not have the layout of this producer's states (another "
                f"model, or another capacity than {self.capacity}); use a state from this "
                "producer's init_state()"
            )
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
            raise BadInputError(
                "this state's buffers were consumed by an earlier call (the producer donates "
                "them); continue from the state that call returned, or keep a "
                "turbospark_jax.core.state.copy_state copy"
            )
        owner, count = (int(v) for v in jax.device_get((state.fed.owner, state.fed.count)))
        if owner != self.identity:
            raise BadInputError(
                "this state was made by another producer; continue a state only with the "
                "producer whose init_state() made it"
            )
        return count

    def _check_tokens(
        self,
        tokens: Sequence[int],
        position: int,
        state: BlockState,
        what: str = "token",
    ) -> list[int]:
        return self._check_feed(tokens, position, self._require_state(state), what)

    def _check_feed(self, tokens: Sequence[int], position: int, count: int, what: str) -> list[int]:
        """Refuse a feed that is not ids of this vocabulary continuing ``count`` positions."""
        tokens = as_token_ids(what, tokens, self.vocab_size)
        if not is_int(position) or int(position) != count:
            raise BadInputError(
                f"position {position!r} does not continue the state, which has consumed "
                f"{count} positions; pass position={count}"
            )
        if count + len(tokens) > self.capacity:
            raise ContextOverflowError(
                f"{what} of {len(tokens)} tokens at position {count} overflows the context "
                f"of {self.capacity} positions"
            )
        return tokens

    def _check_injection(self, injection: Injection | None) -> None:
        """Refuse an injection that is not one, or that this model cannot take."""
        if injection is None:
            return
        if not isinstance(injection, Injection):
            raise BadInputError(f"injection must be an Injection or None, got "
                                f"{type(injection).__name__}")
        if not self.model.accepts_embeddings:
            raise BadInputError(
                f"this {type(self.model).__name__} takes token ids only, not images or other "
                "embeddings (a text-only model, or one whose image tokens attend "
                "bidirectionally, which the causal block program does not run)"
            )
        if injection.width != self.model.embedding_size:
            raise BadInputError(
                f"the injected embeddings are {injection.width} wide but this model embeds "
                f"tokens in {self.model.embedding_size}"
            )

    def _single_plan(self, token: int, need_head: bool, injection: Injection | None = None,
                     position: int = 0) -> Plan:
        return self._plan([[token]], head_on_last=need_head, injection=injection,
                          position=position)

    def _plan(
        self,
        blocks: Sequence[Sequence[int]],
        *,
        head_on_last: bool,
        head_all: bool = False,
        offsets: np.ndarray | None = None,
        injection: Injection | None = None,
        position: int = 0,
        width: int | None = None,
    ) -> Plan:
        """The plan for ``blocks`` fed from ``position`` on (consecutive positions) in a
        program of ``width`` rows (default: :attr:`width`); the rows of ``injection`` that
        fall among them go into the plan's embeddings."""
        width = self.width if width is None else width
        steps_cap = self._steps_for(width)
        tokens = np.zeros((steps_cap, width), np.int32)
        live = np.ones((steps_cap,), np.int32)
        need = np.zeros((steps_cap,), bool)
        for i, block in enumerate(blocks):
            tokens[i, : len(block)] = block
            live[i] = len(block)
        if head_all:
            need[: len(blocks)] = True
        elif head_on_last:
            need[len(blocks) - 1] = True
        if offsets is None:
            offsets = np.zeros((steps_cap,), np.int32)
        injected, embeds = self._nothing(width)
        fed = sum(len(b) for b in blocks)
        rows, identities = (None, None) if injection is None else injection.rows_for(
            position, fed)
        if rows is not None and np.any(rows >= 0):
            ids = np.zeros((steps_cap, width), np.int32)
            host = np.zeros((steps_cap, width, self.model.embedding_size),
                            self.model.embedding_dtype)
            at = 0
            for i, block in enumerate(blocks):
                part = slice(at, at + len(block))
                ids[i, : len(block)] = identities[part]
                hit = rows[part] >= 0
                host[i, : len(block)][hit] = np.asarray(injection.embeds)[rows[part][hit]]
                at += len(block)
            injected, embeds = ids, host
        # Host arrays: the program call transfers them with its other arguments.
        return Plan(
            tokens=tokens,
            live=live,
            need_head=need,
            out_offset=np.asarray(offsets, np.int32),
            injected=injected,
            embeds=embeds,
        )

    def _steps_for(self, width: int) -> int:
        """Blocks one call of the ``width``-row program holds: :attr:`steps_per_call` at the
        producer's own width; a wider program about as many rows (at least one block), so
        its plan, embeddings and output stay the size of a decode burst's; the
        ``prefill_width`` program at least :data:`PREFILL_CALL_ROWS` rows (a long prompt's
        full blocks, fewer calls each waited for), in at most :attr:`steps_per_call` blocks
        (its per-block logits rows stay within a decode burst's)."""
        if width == self.width:
            return self.steps_per_call
        rows = self.steps_per_call * self.width
        if width == self.prefill_width:  # never more blocks than a decode burst's steps
            return max(1, min(max(rows, PREFILL_CALL_ROWS) // width, self.steps_per_call))
        return max(1, rows // width)

    def _nothing(self, width: int) -> tuple[jax.Array, jax.Array | None]:
        """The ``width``-row program's "nothing injected" ``(identities [S, W], embeddings
        [S, W, D] or None)``, made once per width and kept on the device: a text-only call
        of a model that accepts embeddings passes these, so it runs the same program as a
        call with images, without a transfer."""
        if width not in self._nothing_by_width:
            steps = self._steps_for(width)
            embeds = jnp.zeros(
                (steps, width, self.model.embedding_size), self.model.embedding_dtype
            ) if self.model.accepts_embeddings else None
            self._nothing_by_width[width] = (jnp.zeros((steps, width), jnp.int32), embeds)
        return self._nothing_by_width[width]

    def _idle_control(self) -> Control:
        return Control(
            feedback=jnp.bool_(False),
            params=sampling.SamplingParams.greedy(),
            history=sampling.History.empty(self.vocab_size),
            key=sampling.request_key(0),
            gen_index=jnp.int32(0),
            stop_ids=jnp.full((MAX_STOP_IDS,), -1, jnp.int32),
        )

    def key_bound(self, end: int) -> int | None:
        """The ``max_keys`` hint for a call whose rows all sit below position ``end``: the
        short-context bound when they fit under it, else ``None`` (the unbounded program)."""
        short = self.short_decode_keys
        return short if short is not None and end <= short else None

    def _call(
        self, state: BlockState, plan: Plan, control: Control, n_steps: int,
        last_row_head: bool = False, draw: str = "any", max_keys: int | None = None,
    ) -> tuple[StepOutput, BlockState]:
        bare, held = without_auxiliary(state)
        buffers, values, out = self._program(
            self.params, buffers_only(bare), by_value(bare), plan, control, program_steps(n_steps),
            **program_statics(last_row_head, draw, max_keys),
        )
        return out, with_auxiliary(merge_parts(buffers, values), held)


def program_steps(n_steps: Any) -> Any:
    """A call's step count as the program takes it: an int32 scalar, left on the device when
    it is there (a chained burst's count is computed there)."""
    return n_steps if isinstance(n_steps, jax.Array) else np.int32(n_steps)


def program_statics(last_row_head: bool, draw: str, max_keys: int | None) -> dict[str, Any]:
    """The block program's static arguments for a call, those at their defaults left out: the
    call then matches the program's cache entry of the calls that never name them."""
    extra: dict[str, Any] = {"last_row_head": True} if last_row_head else {}
    if draw != "any":
        extra["draw"] = draw
    if max_keys is not None:
        extra["max_keys"] = max_keys
    return extra
