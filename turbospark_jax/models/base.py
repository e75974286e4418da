"""The contract between a model family and the block program.

A family is pure functions over explicit params and cache: :meth:`BlockModel.init_cache` and
:meth:`BlockModel.block_forward` over a block of ``W`` rows with a live count. What else it can
do is declared here as class attributes, never probed: the engine reads these declarations to
decide how a state rolls back, how a prefix is reused and which fast paths exist.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import jax

from turbospark_jax.errors import BadInputError, UnsupportedCapabilityError


def check_tap_layers(tap_layers: Any, num_layers: int) -> None:
    """Refuse a ``tap_layers`` setting that is not increasing, distinct layer indices of a
    model of ``num_layers`` layers.

    Raises:
      BadInputError: the setting, named, with what it must be.
    """
    if not isinstance(tap_layers, tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in tap_layers
    ):
        raise BadInputError(f"tap_layers must be a tuple of layer indices, got {tap_layers!r}")
    if any(not 0 <= i < num_layers for i in tap_layers) or \
            list(tap_layers) != sorted(set(tap_layers)):
        raise BadInputError(
            f"tap_layers must be increasing, distinct layer indices in 0..{num_layers - 1} "
            f"(the model has {num_layers} layers), got {tap_layers!r}"
        )


class BlockModel(abc.ABC):
    """What a model family gives the block program.

    Instances are frozen and hashable: they are static arguments under ``jit``.

    Declarations (class attributes, with the defaults of a plain KV-cache decoder):
      rewindable: the cache can be moved back to any earlier position by the cursor alone
        (append-only KV rows). A recurrent model, whose leaves summarise every fed token,
        declares ``False``: it rolls back by value only.
      records_tape: ``block_forward`` keeps the per-row recurrent state of its last block in
        the cache (a scratch leaf), so :meth:`retain_rows` can restore any row of a verify
        without replaying it.
      parallel_prefill: ``block_forward`` accepts blocks much wider than the exact program's
        ``W`` (a batched prefill pass) and uses the ``key_limit`` / ``fresh`` hints.
      parallel_head: such a pass (``key_limit`` or ``fresh`` given) also takes
        ``last_row_head=True`` whatever the kernels: the logits of the last live row alone,
        ``[1, V]``, outside any bitwise claim. The parallel prefill then feeds the prompt's
        last token in its last pass instead of an exact step of its own (a second program
        call, a sizeable share of a short prompt's prefill). The dense family does.
      can_tap: the family can record tap rows: its instances take a ``tap_layers`` setting
        (checked by :func:`check_tap_layers`; ``dataclasses.replace(model, tap_layers=...)``
        sets it), have ``config.hidden_size``, ``config.num_hidden_layers``,
        ``config.vocab_size`` and ``config.tie_word_embeddings``, params with
        ``embed_tokens`` (and ``lm_head`` when untied), and a ``forward_taps`` for
        training. The dense and Qwen3.5 families do.
      tap_layers: the layers whose output rows the cache records for every fed position
        (``cache.taps``, ``[C, len(tap_layers), D]``), which a block drafter reads; a family
        that declares ``can_tap`` makes this a setting of the instance. Empty: nothing is
        recorded.
      accepts_embeddings: ``block_forward`` takes ``embeds`` / ``embed_rows``: rows whose
        input is a given embedding (an image's soft token) instead of their token's. Such a
        model also answers :attr:`embedding_size` and :attr:`embedding_dtype`.
      row_invariant_kernels: the family has row-invariant kernels: its instances take a
        ``plan`` (:class:`~turbospark_jax.kernels.plan.KernelPlan`;
        ``dataclasses.replace(model, plan=...)`` sets it), and under a row-invariant plan a
        row's result does not depend on how many rows the call has, so block programs of
        different widths agree bit for bit. The dense family does.
      backend_kernels: the family has kernels of its own per backend without row-invariant
        forms: its instances take a ``plan`` whose
        :attr:`~turbospark_jax.kernels.plan.KernelPlan.pallas` picks them (loading sets it,
        :func:`~turbospark_jax.kernels.plan.kernel_plan`'s ``backend_kernels``), and it runs
        at one program width. The Qwen3.5 family (its delta-rule walk, its grouped experts)
        and the Gemma 4 family (its grouped experts) do.

    Declared per instance (a property, since it follows the instance's settings):
      widths_agree: block programs of different widths give this instance's rows bitwise
        the same results, so the exact prefill may run in blocks wider than decode's
        (:class:`~turbospark_jax.engine.producer.BlockProducer`'s ``prefill_width``). False
        by default; a family with :attr:`row_invariant_kernels` answers True under a
        row-invariant plan.
        Such an instance's :meth:`block_forward` also takes ``last_row_head=True`` (static):
        the output head then runs on the last live row only and the logits are ``[1, V]``,
        that row's bits whatever the block's width (a prefill needs no other row's).
      bounds_keys: :meth:`block_forward` takes ``max_keys`` (static): the caller's bound on
        every row's position + 1, which this instance can turn into speed (the dense family's
        row-invariant attention folds a short context's key splits in one launch). A speed
        hint only: no bit of any result depends on it, and a row past it is still computed
        exactly. False by default (the hint is then never passed).
    """

    rewindable: ClassVar[bool] = True
    records_tape: ClassVar[bool] = False
    parallel_prefill: ClassVar[bool] = False
    parallel_head: ClassVar[bool] = False
    can_tap: ClassVar[bool] = False
    tap_layers: tuple[int, ...] = ()
    accepts_embeddings: ClassVar[bool] = False
    row_invariant_kernels: ClassVar[bool] = False
    backend_kernels: ClassVar[bool] = False

    @property
    def widths_agree(self) -> bool:
        """Whether block programs of different widths agree bit for bit, row for row, for
        this instance (declared, never probed; see the class docstring)."""
        return False

    @property
    def bounds_keys(self) -> bool:
        """Whether :meth:`block_forward` takes a ``max_keys`` speed hint (see the class
        docstring)."""
        return False

    @property
    def embedding_size(self) -> int:
        """``D`` of the rows ``embeds`` carries (models that accept embeddings)."""
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} takes token ids only; it cannot be given embeddings"
        )

    @property
    def embedding_dtype(self) -> Any:
        """The dtype of the rows ``embeds`` carries (models that accept embeddings)."""
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} takes token ids only; it cannot be given embeddings"
        )

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Length of every logits row."""

    @abc.abstractmethod
    def init_cache(self, capacity: int) -> Any:
        """A fresh cache pytree holding ``capacity`` positions (append-only buffers marked)."""

    @abc.abstractmethod
    def block_forward(
        self,
        params: Any,
        cache: Any,
        tokens: jax.Array,
        positions: jax.Array,
        live: jax.Array,
        need_head: jax.Array,
        *,
        key_limit: int | None = None,
        fresh: bool = False,
        embeds: jax.Array | None = None,
        embed_rows: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """Run ``W`` rows against the cache and return float32 ``[W, V]`` logits.

        Args:
          params: the params tree.
          cache: the cache pytree.
          tokens: int32 ``[W]``.
          positions: int32 ``[W]``, the position of each row (the engine passes start + i).
          live: int32 ``[]``; rows ``>= live`` are padding and write nothing.
          need_head: bool ``[]`` (traced); when false the output head may be skipped. The
            Python constant ``True`` (a decode program, whose every step needs its logits)
            asks for the head without a branch on the flag.
          key_limit: static hint: no row attends past this position (parallel prefill only).
          fresh: static hint: the block starts at position 0 of an empty cache (parallel
            prefill only). A model that does not declare ``parallel_prefill`` ignores both.
          embeds: ``[W, D]`` rows to feed instead of the token embeddings where
            ``embed_rows`` (bool ``[W]``) is true; only passed to a model that declares
            ``accepts_embeddings`` (``None``: every row embeds its token).

        Row ``i``'s result must depend only on row ``i`` and the cache, so the same compiled
        program gives it bitwise the same result whether 1 or ``W`` rows are live.
        """

    def rewind_reach(self) -> int | None:
        """How far back from the furthest position its cache was written to a cursor may be
        moved (rollback, rewind), or ``None`` for any distance: a cache that keeps every row.
        A ring that keeps only a sliding window's last rows answers its margin."""
        return None

    def rewind_floor(self, cache: Any) -> int:
        """The earliest position a cursor over ``cache`` may be moved back to (rollback,
        prefix reuse, rewind): 0 for caches that keep every row; a ring that keeps only the
        last rows of a sliding window answers where its oldest still-needed row lies."""
        del cache
        return 0

    def retain_rows(self, restored: Any, current: Any, keep_rows: int) -> Any:
        """The cache ``restored`` (rolled back by value) advanced over the first ``keep_rows``
        rows of the last block, read from the tape ``current`` holds. Only for models that
        declare ``records_tape``. ``keep_rows`` may be traced (the device speculative loop
        commits inside one compiled program), so select with array operations."""
        del restored, current, keep_rows
        raise UnsupportedCapabilityError(
            f"{type(self).__name__} records no per-row tape; roll back and re-verify instead"
        )
