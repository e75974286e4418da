"""Attention of a block of rows over a KV cache as one fused GPU kernel (Pallas, Triton).

XLA runs the block program's attention as about ten kernels per layer (scores, mask, max,
exp, sum, normalise, the value product, transposes); at decode widths their launches cost
more than their work. This kernel does the whole of it in one launch per layer: for every KV
head and tile of query rows it streams the cache a key tile at a time with an online softmax
(FlashAttention style), and for long caches it splits the keys over several programs whose
partial results XLA combines.

Exactness: the block program's guarantees need a row's result to be independent of how many
rows the block holds and of how far the keys are scanned. Both hold here:

* rows never mix (the reductions run along each row; the matrix products give each output
  element its own dot product);
* the loop over key tiles stops after the tile holding the last row's position, so a row
  early in a block may scan tiles that are wholly masked for it. Such a tile changes
  nothing: its scores are :data:`MASK_VALUE`, so the running maximum stays, the correction
  factor is ``exp(0) == 1`` and the added probabilities are exactly zero. A split whose
  keys are all masked ends with a maximum of ``MASK_VALUE`` and is weighted by exactly zero
  in the combination. (Dead cache rows must hold finite values, which they do: they are
  zeros or rows of earlier tokens.)

The tile boundaries and splits depend only on the cache capacity, never on the data. In the
row-invariant form, which tiles run without the mask does depend on the rows' positions, but
only tiles that every live row of the query tile sees whole do, where the mask would keep
every score: the same bits (:func:`_split_partial`); the other form masks every tile.

Across block widths (``row_invariant=True``, under a row-invariant kernel plan) a row must
also keep its bits when the number of rows changes, which changes the query tile. So the
probabilities' row sums go through the tensor cores (their order is the matrix product's, as
the values' is) instead of a reduction laid out by the tile, and the splits are folded in
order by one piece of arithmetic (:func:`_fold`) in either of two forms: for few rows (decode,
verify) a program per split and a second kernel that folds the partial results; for many rows
(a prefill) one program per query tile that runs the splits one after another and folds as
it goes, so the partial results never leave the chip (for the 1B shape's 2,048-row block over
an 8k cache they would be 436 MB a layer).

A quantized cache (:mod:`~turbospark_jax.quant.kv`: int8 or float8 values with a float32
scale a row and KV head) is read through :class:`DequantizedRef`: each key and value tile is
dequantized in registers as it is loaded, elementwise as :func:`~turbospark_jax.quant.kv.
dequantize` does it, so every kernel runs the same arithmetic over the same tiles as over an
unquantized cache holding the dequantized rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.layers import MASK_VALUE
from turbospark_jax.quant import kv as kv_quant

#: log2(e): score differences are scaled by ``scale * LOG2_E`` so the softmax's
#: exponentials are ``exp2`` (one hardware instruction on a GPU, where ``exp`` is several).
LOG2_E = math.log2(math.e)
#: Keys per tile of the inner loop.
KEY_TILE = 64
#: Most query rows (rows x query heads of one KV head) one program holds.
MAX_ROW_TILE = 64
#: Keys one split aims at. A program walks its keys one tile after another, so long
#: caches are split to keep that walk short and the GPU's multiprocessors busy.
KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
#: Under ``row_invariant``, blocks of more query rows than this (per KV head) run the
#: folding kernel (every split in one program, the partials kept on chip); fewer, the split
#: kernel and the fold kernel (the splits spread over programs). Speed only: both give a row
#: the same bits.
FOLD_ON_CHIP_ROWS = 256
#: Under ``row_invariant``, a call whose rows see at most this many splits by its
#: ``max_keys`` bound runs the folding kernel whatever its row count: one launch over the
#: splits a row sees, where the split kernel would launch a program for every split of the
#: cache (most of them empty at a short context) and the fold kernel after it. Speed only.
ON_CHIP_SPLITS = 2
#: The fold kernel loads this many splits' partial results at once, then folds them one
#: after another: one round trip to memory for each group instead of each split. The split
#: kernel of the row-invariant form writes a whole number of such groups (the splits past
#: the cache are empty: they fold in as exact identities). Speed only.
FOLD_LOADS = 4
#: Columns of the ones matrix whose product with the probabilities gives their row sums
#: (``row_invariant=True``): every column holds the same sum; the smallest tile a GPU
#: matrix product takes.
SUM_COLUMNS = 16
#: Query rows a tile product of the row-invariant form takes at once in the Pallas
#: interpreter. A CPU's matrix product may round a row differently beside another number of
#: rows, and the query tile's rows follow the call's width, so there the
#: tile's products run 16 rows at a time, a shape no width changes; on a GPU the tensor
#: cores already keep a row's bits, and the whole tile is one product.
INTERPRET_DOT_ROWS = 16
#: Contractions of the attention's tile products: scores (a query row with a key row) and
#: the products with the probabilities (their columns with a value's or a ones matrix' rows).
_SCORES = (((1,), (1,)), ((), ()))
_PRODUCT = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class AttentionTiles:
    """Speed settings of the attention kernels, none of which changes a row's bits: a row's
    scores, maximum, row sum (a product with a ones matrix) and value product are its own, so
    the number of rows a program holds and Triton's warps and pipeline stages only decide
    how the work is spread. (The key tile and the splits, which fix the order of a row's
    additions, are module constants: :data:`KEY_TILE`, :data:`KEYS_PER_SPLIT`.)

    Attributes:
      max_row_tile: most query rows (rows x query heads of one KV head) one program holds
        (a power of two from 16).
      warps, stages: Triton's ``num_warps`` and ``num_stages`` for every attention kernel.
    """

    max_row_tile: int = MAX_ROW_TILE
    warps: int = 4
    stages: int = 2

    def __post_init__(self) -> None:
        tile = self.max_row_tile
        if not (isinstance(tile, int) and tile >= 16 and tile & (tile - 1) == 0):
            raise BadInputError(f"max_row_tile must be a power of two >= 16, got {tile!r}")
        for name in ("warps", "stages"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise BadInputError(f"{name} must be an integer >= 1, got {value!r}")


DEFAULT_TILES = AttentionTiles()
#: The prefill-sized blocks' settings for heads of 128 or more dimensions: twice the rows a
#: program, 8 warps, 3 stages. A modest choice: faster for wide heads at a short prefix,
#: about even at a long one. 64-dimensional heads keep the defaults, which no setting tried
#: beat at both.
WIDE_HEAD_PREFILL_TILES = AttentionTiles(max_row_tile=128, warps=8, stages=3)


def compiler_kwargs(tiles: AttentionTiles, interpret: bool) -> dict:
    """The ``pallas_call`` keyword giving an attention kernel ``tiles``' Triton settings (none
    in the interpreter)."""
    if interpret:
        return {}
    return {"compiler_params": plgpu.CompilerParams(num_warps=tiles.warps,
                                                    num_stages=tiles.stages)}


def tiles_for(rows: int, head_dim: int) -> AttentionTiles:
    """The settings the kernels run under when a caller names none: a function of the query
    rows per KV head (``W x H / KV``) and the head width alone, so the query layout
    (:func:`query_rows`) and the kernels always agree on it. Decode and verify sizes, which
    run the split kernel, keep :data:`DEFAULT_TILES`."""
    if head_dim >= 128 and rows > FOLD_ON_CHIP_ROWS:
        if KEY_TILE * head_dim > 64 * 128:
            # three stages of key and value tiles this large, beside 128 query rows, pass
            # the shared memory a block may have
            return dataclasses.replace(WIDE_HEAD_PREFILL_TILES, stages=2)
        return WIDE_HEAD_PREFILL_TILES
    return DEFAULT_TILES


def supported(head_dim: int, capacity: int) -> bool:
    """Whether the kernel handles these shapes on a GPU (Triton wants power-of-two tiles)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and capacity >= KEY_TILE


class DequantizedRef:
    """A KV head's quantized cache rows read as a ref of rows in the compute dtype: indexing
    it loads the values and their rows' scales and dequantizes them
    (:func:`~turbospark_jax.quant.kv.dequantize`; in a kernel, in registers).

    Attributes:
      values: the head's stored rows, ``[C, hd]`` (a kernel ref or an array).
      scales: their float32 scales, ``[C]``.
      dtype: the compute dtype.
    """

    def __init__(self, values, scales, dtype) -> None:
        self.values, self.scales, self.dtype = values, scales, dtype

    def __getitem__(self, index) -> jax.Array:
        rows = index[0] if isinstance(index, tuple) else index
        return kv_quant.dequantize(self.values[index], self.scales[rows], self.dtype)


def cache_refs(k_ref, v_ref, k_scale_ref, v_scale_ref, dtype) -> tuple:
    """The key and value refs a kernel body reads: as they are, or (with scale refs)
    :class:`DequantizedRef` views of a quantized cache."""
    if k_scale_ref is None:
        return k_ref, v_ref
    return (DequantizedRef(k_ref, k_scale_ref, dtype), DequantizedRef(v_ref, v_scale_ref, dtype))


def _with_scales(kernel, dtype):
    """``kernel(bound, q, pos, k, v, *outs)`` as a kernel over a quantized cache, whose refs
    are ``(bound, q, pos, k, v, k_scale, v_scale, *outs)``."""
    def quantized(bound_ref, q_ref, pos_ref, k_ref, v_ref, ks_ref, vs_ref, *outs):
        return kernel(bound_ref, q_ref, pos_ref,
                      *cache_refs(k_ref, v_ref, ks_ref, vs_ref, dtype), *outs)
    return quantized


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def plan_keys(rows: int, capacity: int,
              max_row_tile: int = MAX_ROW_TILE) -> tuple[int, int, int, int]:
    """Row tile, row tiles, key splits and keys per split of ``rows`` query rows per KV head
    over a cache of ``capacity``: functions of the shapes only."""
    tile = min(max_row_tile, max(16, 1 << max(0, rows - 1).bit_length()))
    splits = max(1, min(MAX_SPLITS, capacity // KEYS_PER_SPLIT))
    split_len = _ceil_div(_ceil_div(capacity, splits), KEY_TILE) * KEY_TILE
    return tile, _ceil_div(rows, tile), _ceil_div(capacity, split_len), split_len


def interpret_dot_rows(interpret: bool) -> int | None:
    """The row-invariant form's ``dot_rows`` (see :data:`INTERPRET_DOT_ROWS`)."""
    return INTERPRET_DOT_ROWS if interpret else None


def _tile_product(a: jax.Array, b: jax.Array, dims: tuple, dot_rows: int | None) -> jax.Array:
    """``dot_general(a, b, dims)`` in float32 for a query tile ``a [tile, ...]``: one product,
    or with ``dot_rows`` (:data:`INTERPRET_DOT_ROWS`) one of that many rows after another
    (query tiles are powers of two from 16 up: :func:`plan_keys`)."""
    def one(rows: jax.Array) -> jax.Array:
        return jax.lax.dot_general(rows, b, dims, preferred_element_type=jnp.float32)
    if dot_rows is None:
        return one(a)
    return jnp.concatenate([one(a[i : i + dot_rows]) for i in range(0, a.shape[0], dot_rows)])


def _split_partial(q: jax.Array, pos: jax.Array, k_ref, v_ref, first, end, *, scale: float,
                   capacity: int, window: int | None, mma_sums: bool,
                   dot_rows: int | None = None) -> tuple:
    """One split's unnormalised attention of the query tile ``q [tile, hd]`` (positions
    ``pos [tile]``, ``-1`` on padding rows) over keys ``first..end-1`` in tiles of
    :data:`KEY_TILE`, from zero: ``(acc [tile, hd], m [tile], l [tile])``, the maximum that
    of the unscaled scores ``q . k``. The exponentials are ``exp2((score - m) * c)`` with
    ``c = scale * log2(e)``: one hardware instruction on a GPU (``exp`` is several), and a
    subtraction before the product, which no compiler can fuse into a multiply-add
    (``score * c - m`` could be, on one path and not on another).

    With the row sums through the tensor cores (``mma_sums``, the row-invariant form) the
    tiles every live row sees whole (keys at or before the tile's smallest live position,
    none past the cache) run a loop without the mask; the rest (the diagonal, an overlapping
    last tile, any tile under a sliding window) a loop with it. On a tile a row sees whole
    the mask selects every score as it is, so a row's bits do not depend on which loop ran a
    tile, and so not on its neighbours in the query tile; the attention tests, compiled on
    the GPU, hold that against the compiler too. The other form's row sum is a reduction
    the compiler lays out per loop, and on a GPU the two loops gave a row different bits
    (that test's ``row_invariant=False`` case, compiled), so that form runs every tile
    through the masked loop: the same code for a row whatever its neighbours. ``dot_rows``:
    the tile products' rows at a time (:data:`INTERPRET_DOT_ROWS` in the interpreter)."""
    trips = jnp.maximum(0, (end - first + KEY_TILE - 1) // KEY_TILE)
    tile, head_dim = q.shape
    lanes = jnp.arange(KEY_TILE, dtype=jnp.int32)
    c = scale * LOG2_E

    def step(i, carry, masked: bool):
        acc, m, l = carry
        nominal = first + i * KEY_TILE
        start = jnp.minimum(nominal, capacity - KEY_TILE)  # the last tile may overlap
        k = k_ref[pl.ds(start, KEY_TILE), :]  # [KT, hd]
        v = v_ref[pl.ds(start, KEY_TILE), :]
        s = _tile_product(q, k, _SCORES, dot_rows)  # [tile, KT], unscaled
        if masked:
            keys = start + lanes  # [KT]
            visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] >= nominal)
            if window is not None:
                visible &= keys[None, :] > pos[:, None] - window
            s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp2((m - m_new) * c)
        p = jnp.exp2((s - m_new[:, None]) * c)
        p_low = p.astype(v.dtype)
        if mma_sums:  # the row sum as a matrix product: its order is the tensor cores'
            ones = jnp.ones((KEY_TILE, SUM_COLUMNS), v.dtype)
            row_sum = jnp.max(_tile_product(p_low, ones, _PRODUCT, dot_rows), axis=1)
        else:
            row_sum = jnp.sum(p, axis=1)
        l = l * correction + row_sum
        acc = acc * correction[:, None] + _tile_product(p_low, v, _PRODUCT, dot_rows)
        return acc, m_new, l

    if window is None and mma_sums:  # tiles 0..whole-1 are seen whole by every live row
        lowest = jnp.min(jnp.where(pos >= 0, pos, capacity))
        whole = jnp.clip((jnp.minimum(lowest + 1, capacity) - first) // KEY_TILE, 0, trips)
    else:
        whole = jnp.zeros_like(trips)
    carry = (jnp.zeros((tile, head_dim), jnp.float32), jnp.full((tile,), MASK_VALUE, jnp.float32),
             jnp.zeros((tile,), jnp.float32))
    carry = jax.lax.fori_loop(0, whole, functools.partial(step, masked=False), carry)
    return jax.lax.fori_loop(whole, trips, functools.partial(step, masked=True), carry)


def split_of(q: jax.Array, pos: jax.Array, bound: jax.Array, k_ref, v_ref, *, scale: float,
             capacity: int, split_len: int, window: int | None, mma_sums: bool,
             split: jax.Array | None = None,
             dot_rows: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The split kernel's body: split ``split``'s partial ``(acc, m, l)`` for the query tile
    ``q`` (``bound``: the call's last key + 1; ``split``: by default the program's index on
    grid axis 2, which a caller under a branch reads at its top level and passes). Shared
    by every kernel that writes split partials."""
    first = (pl.program_id(2) if split is None else split) * split_len
    end = jnp.minimum(jnp.minimum(first + split_len, capacity), bound)
    return _split_partial(q, pos, k_ref, v_ref, first, end, scale=scale, capacity=capacity,
                          window=window, mma_sums=mma_sums, dot_rows=dot_rows)


def _kernel(bound_ref, q_ref, pos_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, scale: float,
            capacity: int, split_len: int, window: int | None, normalise: bool,
            mma_sums: bool, dot_rows: int | None = None) -> None:
    """One program per (KV head, query tile, split): that split's partial result."""
    acc, m, l = split_of(q_ref[...], pos_ref[...], bound_ref[()], k_ref, v_ref, scale=scale,
                         capacity=capacity, split_len=split_len, window=window,
                         mma_sums=mma_sums, dot_rows=dot_rows)
    if normalise:  # one split: the kernel writes the finished rows
        acc_ref[...] = (acc / l[:, None]).astype(acc_ref.dtype)
    else:
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def _fold(carry: tuple, part: tuple, c: float) -> tuple:
    """Fold one split's partial ``(acc, m, l)`` into the running ``(acc, m, l)`` of the
    splits before it: the arithmetic both row-invariant paths share, split after split in
    order. A split that saw no key of a row (its maximum ``MASK_VALUE``) is weighted by
    exactly zero once any split has; the first split that did is taken exactly. The maxima
    are unscaled scores, ``c`` the scale times log2(e) (see :func:`_split_partial`)."""
    acc, m, l = carry
    part_acc, part_m, part_l = part
    top = jnp.maximum(m, part_m)
    old, new = jnp.exp2((m - top) * c), jnp.exp2((part_m - top) * c)
    return acc * old[:, None] + part_acc * new[:, None], top, l * old + part_l * new


def _splits_seen(bound: jax.Array, split_len: int) -> jax.Array:
    """How many key splits hold a key some row sees, the rows' last key being ``bound - 1``;
    the later splits see none."""
    return (bound + split_len - 1) // split_len


def store_rows(o_ref, value: jax.Array, rows: int | None, tile: jax.Array | None = None) -> None:
    """Write a query tile's finished rows: all of them, or (``rows``, the output's row count,
    which the tiles overhang) those of the output, the tile being ``tile`` (by default the
    program's index on grid axis 1)."""
    if rows is None:
        o_ref[...] = value
        return
    tile = pl.program_id(1) if tile is None else tile
    row = tile * value.shape[0] + jax.lax.broadcasted_iota(
        jnp.int32, value.shape, 0)
    plgpu.store(o_ref, value, mask=row < rows)


def _folding_kernel(bound_ref, q_ref, pos_ref, k_ref, v_ref, o_ref, *, scale: float,
                    capacity: int, split_len: int, window: int | None, mma_sums: bool,
                    rows: int | None = None, dot_rows: int | None = None) -> None:
    """One program per (KV head, query tile) that runs the splits one after another, each
    from zero as :func:`_kernel` runs it, folding each into the running result
    (:func:`_fold`): the bits of :func:`_kernel` followed by :func:`_fold_kernel`, without
    the partial results ever leaving the chip. For many rows (a prefill), where the query
    tiles alone fill the GPU, and for few rows at a short context (``max_keys``), where the
    splits a row sees are one or two.

    A tile walks the keys up to its own last row's position, not the block's: in a causal
    prefill block the early tiles would otherwise scan every later key wholly masked (half
    the work of a block that starts a prompt). Keys past a row's position change none of its
    bits (see the module docstring), so a row's result is the same for any such bound, as a
    one-row decode, which walks exactly its own keys, shows."""
    acc, l = fold_splits(q_ref[...], pos_ref[...], bound_ref[()], k_ref, v_ref, scale=scale,
                         capacity=capacity, split_len=split_len, window=window,
                         mma_sums=mma_sums, dot_rows=dot_rows)
    store_rows(o_ref, (acc / l[:, None]).astype(o_ref.dtype), rows)


def fold_splits(q: jax.Array, pos: jax.Array, bound: jax.Array, k_ref, v_ref, *, scale: float,
                capacity: int, split_len: int, window: int | None,
                mma_sums: bool, dot_rows: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The folding kernel's body (inside a kernel): the query tile ``q [tile, hd]`` at
    positions ``pos`` over the key splits its rows see (``bound``: the call's last key + 1),
    each split from zero, folded in order; ``(acc, l)``, the result ``acc / l``. Shared by
    every kernel that folds on chip, so their rows agree bit for bit."""
    bound = jnp.minimum(jnp.minimum(bound, jnp.max(pos) + 1), capacity)
    needed = _splits_seen(bound, split_len)

    def one(s, carry):
        first = s * split_len
        end = jnp.minimum(first + split_len, bound)
        part = _split_partial(q, pos, k_ref, v_ref, first, end, scale=scale,
                              capacity=capacity, window=window, mma_sums=mma_sums,
                              dot_rows=dot_rows)
        return _fold(carry, part, scale * LOG2_E)

    tile, head_dim = q.shape
    start = (jnp.zeros((tile, head_dim), jnp.float32), jnp.full((tile,), MASK_VALUE, jnp.float32),
             jnp.zeros((tile,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(0, needed, one, start)
    return acc, l


def fold_in_last_split(bound: jax.Array, part: tuple, s: jax.Array, acc_ref, m_ref, l_ref,
                       o_ref, count_ref, slot: jax.Array, tile: jax.Array, *, splits: int,
                       scale: float, capacity: int, split_len: int, rows: int | None,
                       barrier: bool) -> None:
    """A split program's end when the query tile's fold runs in its last split program, not
    in the fold kernel: store this split's ``part`` at ``[s]`` of the tile's whole-split
    refs (``acc_ref [S, tile, hd]``, ``m_ref``, ``l_ref [S, tile]``), bump the tile's
    counter ``count_ref[slot]`` with an atomic add (after a CTA barrier, with ``barrier``,
    so every thread's stores precede the add's release), and in the program that finds the
    other ``splits - 1`` there already, fold them all with the fold kernel's body
    (:func:`fold_partial_refs`, the same bits), store the tile's finished rows (``tile``:
    the query tile's index) and put the counter back to zero for the next call."""
    acc_ref[s], m_ref[s], l_ref[s] = part
    if barrier:
        plgpu.debug_barrier()
    before = plgpu.atomic_add(count_ref, (slot,), jnp.int32(1))

    @pl.when(before == splits - 1)
    def _():
        acc, l = fold_partial_refs(bound, acc_ref, m_ref, l_ref, scale=scale,
                                   capacity=capacity, split_len=split_len)
        store_rows(o_ref, (acc / l[:, None]).astype(o_ref.dtype), rows, tile=tile)
        count_ref[slot] = jnp.int32(0)


def partial_splits(splits: int) -> int:
    """The splits the row-invariant split kernel writes partials for: ``splits`` rounded up to
    whole groups of :data:`FOLD_LOADS` (those past the cache see no key)."""
    return _ceil_div(splits, FOLD_LOADS) * FOLD_LOADS


def _fold_kernel(bound_ref, acc_ref, m_ref, l_ref, o_ref, *, scale: float, capacity: int,
                 split_len: int, rows: int | None = None) -> None:
    """One program per (KV head, query tile): fold the splits' partial results in order
    (:func:`_fold`) and normalise, loading them :data:`FOLD_LOADS` splits at a time (the
    loads of a group go out together; the folds stay one after another). A split past a
    row's last key folds in as an exact identity (its maximum ``MASK_VALUE`` weighs it by
    zero, the running result by one), so the walk stops at the group holding the last split
    any row of the call sees: the splits of a long cache past a short context cost no
    loads."""
    acc, l = fold_partial_refs(bound_ref[()], acc_ref, m_ref, l_ref, scale=scale,
                               capacity=capacity, split_len=split_len)
    store_rows(o_ref, (acc / l[:, None]).astype(o_ref.dtype), rows)


def fold_partial_refs(bound: jax.Array, acc_ref, m_ref, l_ref, *, scale: float, capacity: int,
                      split_len: int) -> tuple[jax.Array, jax.Array]:
    """The fold kernel's body (inside a kernel): one query tile's split partials, ``acc_ref
    [S, tile, hd]``, ``m_ref`` and ``l_ref [S, tile]``, folded in order up to the last split
    a row sees, :data:`FOLD_LOADS` splits' loads at a time; ``(acc, l)``, the result
    ``acc / l``. Shared by every kernel that folds written partials."""
    _, tile, head_dim = acc_ref.shape
    needed = _splits_seen(jnp.minimum(bound, capacity), split_len)
    start = (jnp.zeros((tile, head_dim), jnp.float32), jnp.full((tile,), MASK_VALUE, jnp.float32),
             jnp.zeros((tile,), jnp.float32))
    c = scale * LOG2_E

    def group(g, carry):
        first = g * FOLD_LOADS
        parts = [(acc_ref[first + j], m_ref[first + j], l_ref[first + j])
                 for j in range(FOLD_LOADS)]
        for part in parts:
            carry = _fold(carry, part, c)
        return carry

    acc, _, l = jax.lax.fori_loop(0, _ceil_div(needed, FOLD_LOADS), group, start)
    return acc, l


def folds_on_chip(rows: int, capacity: int, tiles: AttentionTiles,
                  max_keys: int | None = None) -> bool:
    """Whether a row-invariant call of ``rows`` query rows per KV head runs the folding
    kernel (one program per query tile over the splits its rows see) rather than the split
    kernel and the fold kernel: a cache of one split, a prefill-sized block, or a short
    bound (``max_keys`` within :data:`ON_CHIP_SPLITS` splits). Speed only: both forms give
    a row the same bits."""
    _, _, splits, split_len = plan_keys(rows, capacity, tiles.max_row_tile)
    short = max_keys is not None and _splits_seen(min(max_keys, capacity),
                                                  split_len) <= ON_CHIP_SPLITS
    return splits == 1 or rows > FOLD_ON_CHIP_ROWS or short


def fold_partials(bound: jax.Array, acc: jax.Array, m: jax.Array, l: jax.Array, *, rows: int,
                  capacity: int, split_len: int, dtype, tiles: AttentionTiles,
                  interpret: bool) -> jax.Array:
    """The fold kernel over the split kernel's partials ``acc [S, KV, R, hd]``, ``m``,
    ``l [S, KV, R]``: the finished rows ``[KV, rows, hd]`` in ``dtype`` (the first
    ``rows`` of each KV head's ``R``)."""
    splits, kv_heads, padded, head_dim = acc.shape
    tile = min(padded, tiles.max_row_tile)
    return pl.pallas_call(
        functools.partial(_fold_kernel, scale=1.0 / math.sqrt(head_dim), capacity=capacity,
                          split_len=split_len, rows=None if rows == padded else rows),
        grid=(kv_heads, padded // tile),
        in_specs=[
            pl.BlockSpec((), lambda h, t: ()),
            pl.BlockSpec((splits, None, tile, head_dim), lambda h, t: (0, h, t, 0)),
            pl.BlockSpec((splits, None, tile), lambda h, t: (0, h, t)),
            pl.BlockSpec((splits, None, tile), lambda h, t: (0, h, t)),
        ],
        out_specs=pl.BlockSpec((None, tile, head_dim), lambda h, t: (h, t, 0)),
        out_shape=jax.ShapeDtypeStruct((kv_heads, rows, head_dim), dtype),
        interpret=interpret, name="cached_attention_fold", **compiler_kwargs(tiles, interpret),
    )(bound, acc, m, l)


def query_rows(width: int, heads: int, kv_heads: int, capacity: int,
               tiles: AttentionTiles | None = None, *, head_dim: int) -> int:
    """Rows per KV head of the kernel's query layout (see :func:`arrange_queries`);
    ``tiles=None``: :func:`tiles_for`'s."""
    rows = width * (heads // kv_heads)
    tiles = tiles_for(rows, head_dim) if tiles is None else tiles
    tile, count, _, _ = plan_keys(rows, capacity, tiles.max_row_tile)
    return tile * count


def arrange_queries(q: jax.Array, kv_heads: int, capacity: int,
                    tiles: AttentionTiles | None = None) -> jax.Array:
    """``q [W, H, hd]`` in the kernel's layout ``[KV, R, hd]``: row ``w * G + g`` of KV head
    ``h`` is query row ``w``, head ``h * G + g``; rows past ``W * G`` are padding (the
    layout's row tiles are ``tiles``' as the kernel is to run them; ``None``:
    :func:`tiles_for`'s)."""
    width, heads, head_dim = q.shape
    groups = heads // kv_heads
    rows = width * groups
    qr = q.reshape(width, kv_heads, groups, head_dim).transpose(1, 0, 2, 3)
    qr = qr.reshape(kv_heads, rows, head_dim)
    padded = query_rows(width, heads, kv_heads, capacity, tiles, head_dim=head_dim)
    return jnp.pad(qr, ((0, 0), (0, padded - rows), (0, 0)))


@functools.partial(jax.jit, static_argnames=("window", "interpret", "row_invariant", "tiles",
                                             "max_keys"))
def cached_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    q_positions: jax.Array,
    window: int | None = None,
    interpret: bool = False,
    row_invariant: bool = False,
    tiles: AttentionTiles | None = None,
    max_keys: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Causal grouped-query attention of ``W`` rows over a cache, as one fused kernel.

    Same contract as :func:`~turbospark_jax.kernels.layers.attend` with the keys at positions
    ``0..C-1``: row ``w`` sees cache row ``s`` iff ``s <= q_positions[w]`` (and
    ``s > q_positions[w] - window``). Rows of the cache past the largest position are never
    read.

    Args:
      q: ``[W, H, hd]`` rotated queries.
      k_cache, v_cache: ``[C, KV, hd]``, the block's own rows already written.
      q_positions: int32 ``[W]``.
      window: static sliding window, or ``None``.
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      row_invariant: make every reduction's order independent of the row count, so a row's
        bits do not depend on ``W`` (a row-invariant kernel plan): the probabilities' row sums are
        taken by the tensor cores (a product with a ones matrix) instead of a reduction
        whose thread layout follows the row tile, and the key splits are folded one after
        another in order (:func:`_fold`), either by a second kernel over the partial
        results (few rows) or inside one program per query tile (many rows, or one split).
      tiles: speed settings (:class:`AttentionTiles`; ``None``: :func:`tiles_for`'s); a
        row's bits do not depend on them.
      max_keys: static; the caller's bound on the keys any row sees (its position + 1), or
        ``None``. With ``row_invariant`` and a bound within :data:`ON_CHIP_SPLITS` splits,
        the folding kernel runs for any row count (a decode step at a short context: one
        launch instead of two). Speed only: the two forms give a row the same bits, and the
        folding kernel walks the splits the rows actually see, so a row past the bound is
        still right, only slower.
      k_scale, v_scale: float32 ``[C, KV]``, each cache row's scale where the cache is
        quantized (:mod:`~turbospark_jax.quant.kv`; the kernel dequantizes each tile it
        loads), else ``None``.

    Returns:
      ``[W, H, hd]`` in ``q.dtype``.
    """
    heads = q.shape[1]
    qr = arrange_queries(q, k_cache.shape[1], k_cache.shape[0], tiles)
    return cached_attention_arranged(qr, k_cache, v_cache, q_positions, heads=heads,
                                     window=window, interpret=interpret,
                                     row_invariant=row_invariant, tiles=tiles,
                                     max_keys=max_keys, k_scale=k_scale, v_scale=v_scale)


@functools.partial(jax.jit, static_argnames=("heads", "window", "interpret", "row_invariant",
                                             "tiles", "max_keys"))
def cached_attention_arranged(
    qr: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    q_positions: jax.Array,
    heads: int,
    window: int | None = None,
    interpret: bool = False,
    row_invariant: bool = False,
    tiles: AttentionTiles | None = None,
    max_keys: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """:func:`cached_attention` with the queries already in the kernel's layout (as
    :func:`arrange_queries` puts them, or a kernel writes them), saving that transpose.

    Args:
      qr: ``[KV, R, hd]``, ``R = query_rows(W, heads, KV, C, tiles)``; padding rows may hold
        anything (they are computed, never read back).
      heads: ``H``, the number of query heads.
      the rest: as for :func:`cached_attention`.
    """
    if max_keys is not None and (not isinstance(max_keys, int) or isinstance(max_keys, bool)
                                 or max_keys < 1):
        raise BadInputError(f"max_keys must be a positive int or None, got {max_keys!r}")
    width = q_positions.shape[0]
    capacity, kv_heads, head_dim = k_cache.shape
    groups = heads // kv_heads
    rows = width * groups
    tiles = tiles_for(rows, head_dim) if tiles is None else tiles
    tile, count, splits, split_len = plan_keys(rows, capacity, tiles.max_row_tile)
    padded = count * tile
    if qr.shape != (kv_heads, padded, head_dim):
        raise BadInputError(
            f"arranged queries must be [KV, R, hd] = {(kv_heads, padded, head_dim)} for "
            f"{width} rows of {heads} heads over this cache; got {tuple(qr.shape)}"
        )
    pos = jnp.repeat(q_positions.astype(jnp.int32), groups)
    pos = jnp.pad(pos, (0, padded - rows), constant_values=-1)  # padding rows see nothing
    bound = jnp.max(q_positions).astype(jnp.int32) + 1
    scale = 1.0 / math.sqrt(head_dim)
    kwargs = compiler_kwargs(tiles, interpret)
    dtype = qr.dtype  # the cache's own, or the compute dtype a quantized cache reads in
    queries = [
        pl.BlockSpec((), lambda h, t, *_: ()),
        pl.BlockSpec((None, tile, head_dim), lambda h, t, *_: (h, t, 0)),
        pl.BlockSpec((tile,), lambda h, t, *_: (t,)),
        pl.BlockSpec((capacity, None, head_dim), lambda h, t, *_: (0, h, 0)),
        pl.BlockSpec((capacity, None, head_dim), lambda h, t, *_: (0, h, 0)),
    ]
    operands = [bound, qr, pos, k_cache, v_cache]
    if k_scale is not None:  # each head's row scales beside its rows
        queries += [pl.BlockSpec((capacity, None), lambda h, t, *_: (0, h))] * 2
        operands += [k_scale, v_scale]

    def body(kernel):
        return kernel if k_scale is None else _with_scales(kernel, dtype)

    rows_out = pl.BlockSpec((None, tile, head_dim), lambda h, t: (h, t, 0))
    # The row-invariant kernels write the live rows alone: no XLA copy then cuts them out
    # of the padded tiles (at one row of a decode step, the reshape after is free too).
    live = jax.ShapeDtypeStruct((kv_heads, rows, head_dim), dtype)
    overhang = None if rows == padded else rows
    if row_invariant and folds_on_chip(rows, capacity, tiles, max_keys):
        out = pl.pallas_call(
            body(functools.partial(_folding_kernel, scale=scale, capacity=capacity,
                                   split_len=split_len, window=window, mma_sums=True,
                                   rows=overhang, dot_rows=interpret_dot_rows(interpret))),
            grid=(kv_heads, count), in_specs=queries, out_specs=rows_out,
            out_shape=live, interpret=interpret, name="cached_attention_folding",
            **kwargs,
        )(*operands)
    else:
        normalise = splits == 1
        acc_dtype = dtype if normalise else jnp.float32
        if row_invariant:  # whole groups for the fold kernel's loads
            splits = partial_splits(splits)
        acc, m, l = pl.pallas_call(
            body(functools.partial(
                _kernel, scale=scale, capacity=capacity, split_len=split_len, window=window,
                normalise=normalise, mma_sums=row_invariant,
                dot_rows=interpret_dot_rows(interpret) if row_invariant else None)),
            grid=(kv_heads, count, splits),
            in_specs=queries,
            out_specs=[
                pl.BlockSpec((None, None, tile, head_dim), lambda h, t, s: (s, h, t, 0)),
                pl.BlockSpec((None, None, tile), lambda h, t, s: (s, h, t)),
                pl.BlockSpec((None, None, tile), lambda h, t, s: (s, h, t)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((splits, kv_heads, padded, head_dim), acc_dtype),
                jax.ShapeDtypeStruct((splits, kv_heads, padded), jnp.float32),
                jax.ShapeDtypeStruct((splits, kv_heads, padded), jnp.float32),
            ],
            interpret=interpret,
            name="cached_attention",
            **kwargs,
        )(*operands)
        if normalise:
            out = acc[0]
        elif row_invariant:  # the folding kernel's arithmetic, over the written partials
            out = fold_partials(bound, acc, m, l, rows=rows, capacity=capacity,
                                split_len=split_len, dtype=dtype, tiles=tiles,
                                interpret=interpret)
        else:
            # Splits combine in a fixed order; a split that saw no visible key has maximum
            # MASK_VALUE and weight exactly zero.
            top = jnp.max(m, axis=0)  # [KV, R]
            weight = jnp.exp2((m - top[None]) * (scale * LOG2_E))  # [S, KV, R]
            total = jnp.sum(l * weight, axis=0)
            out = jnp.sum(acc * weight[..., None], axis=0) / total[..., None]
            out = out.astype(dtype)
    out = out[:, :rows].reshape(kv_heads, width, groups, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(width, heads, head_dim)
