"""The fused cached-attention kernel: same function as ``attend``, and the properties the
block program's bitwise guarantees need (rows never mix; scanning further changes nothing).

On a CPU the kernel runs in the Pallas interpreter; on a GPU these tests run the compiled
Triton kernel (``JAX_PLATFORMS=cuda python -m pytest tests/kernels/test_attention.py``).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.attention import KEY_TILE, cached_attention
from turbospark_jax.kernels.layers import attend

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


def _inputs(seed, width, heads, kv_heads, head_dim, capacity, dtype):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((width, heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((capacity, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((capacity, kv_heads, head_dim)), dtype)
    return q, k, v


# (W, H, KV, hd, capacity, first position, window): one key tile, an overlapping last tile,
# several splits (capacity >= 2 * 1024), a sliding window, MQA, W*G above one row tile.
CASES = [
    (1, 8, 2, 32, 80, 37, None),
    (4, 8, 2, 32, 80, 70, None),
    (16, 4, 4, 32, 3000, 2500, None),
    (3, 4, 2, 16, 200, 150, 32),
    (2, 4, 1, 16, 64, 0, None),
    (32, 8, 2, 16, 300, 100, None),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_reference(case, dtype):
    width, heads, kv_heads, head_dim, capacity, first, window = case
    q, k, v = _inputs(0, width, heads, kv_heads, head_dim, capacity, dtype)
    pos = first + jnp.arange(width, dtype=jnp.int32)
    got = cached_attention(q, k, v, pos, window=window, interpret=INTERPRET)
    want = attend(q, k, v, pos, jnp.arange(capacity, dtype=jnp.int32), window)
    assert got.shape == want.shape and got.dtype == v.dtype
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max()
    # float32 on a GPU multiplies in TF32 (both here and in XLA's attend).
    tol = 2e-2 if dtype == jnp.bfloat16 or ON_GPU else 1e-5
    assert err < tol, err


def _row(q, k, v, first, row, window=None):
    pos = first + jnp.arange(q.shape[0], dtype=jnp.int32)
    return np.asarray(cached_attention(q, k, v, pos, window=window, interpret=INTERPRET))[row]


@settings(max_examples=25, deadline=None)
@given(first=st.integers(0, 2200), row=st.integers(0, 3), seed=st.integers(0, 3))
def test_row_independent_of_block_and_scan_length(first, row, seed):
    """Row ``row`` of a block starting at ``first`` equals row 0 of the block that starts at
    the row's own position (a shorter scan, other neighbours), bitwise; and other rows'
    queries do not touch it."""
    width, capacity = 4, 2304  # two splits; tiles of 64 keys
    q, k, v = _inputs(seed, width, 8, 2, 16, capacity, jnp.bfloat16)
    here = _row(q, k, v, first, row)
    alone = jnp.zeros_like(q).at[0].set(q[row])
    moved = _row(alone, k, v, first + row, 0)
    assert np.array_equal(here.view(np.uint16), moved.view(np.uint16))
    noisy = q.at[jnp.arange(width) != row].set(7.0)
    assert np.array_equal(here.view(np.uint16), _row(noisy, k, v, first, row).view(np.uint16))


@settings(max_examples=10, deadline=None)
@given(first=st.integers(KEY_TILE, 250), seed=st.integers(0, 3))
def test_windowed_row_independent_of_scan_length(first, seed):
    q, k, v = _inputs(seed, 4, 4, 2, 16, 320, jnp.float32)
    here = _row(q, k, v, first, 3, window=40)
    moved = _row(jnp.zeros_like(q).at[0].set(q[3]), k, v, first + 3, 0, window=40)
    assert np.array_equal(here, moved)


def test_control_one_ulp_in_a_visible_key_changes_the_row():
    """The bitwise checks above can fail: one ulp in one visible key shows in the result."""
    q, k, v = _inputs(1, 4, 8, 2, 16, 2304, jnp.bfloat16)
    base = _row(q, k, v, 1500, 2)
    bits = np.asarray(k).view(np.uint16).copy()
    bits[700, 0, :] += 1
    nudged = jnp.asarray(bits.view(jnp.bfloat16))
    assert not np.array_equal(base.view(np.uint16), _row(q, nudged, v, 1500, 2).view(np.uint16))


# -- the row-invariant form (a row-invariant kernel plan) -------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_row_invariant_form_matches_reference(case):
    """Row sums by the tensor cores and splits combined in sequence: the same function."""
    width, heads, kv_heads, head_dim, capacity, first, window = case
    q, k, v = _inputs(1, width, heads, kv_heads, head_dim, capacity, jnp.bfloat16)
    pos = first + jnp.arange(width, dtype=jnp.int32)
    got = cached_attention(q, k, v, pos, window=window, interpret=INTERPRET, row_invariant=True)
    want = attend(q, k, v, pos, jnp.arange(capacity, dtype=jnp.int32), window)
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max()
    assert err < 2e-2, err


@pytest.mark.parametrize("capacity", [2304, 320])
def test_row_invariant_form_rows_agree_across_widths(capacity):
    """Blocks of 1 and 5 rows (the split kernel, then the fold kernel over its partials) give
    each row the bits it has in a block of 140 (280 query rows: the folding kernel, every
    split in one program), over nine key splits and over one. In the interpreter the tile
    products are XLA dots, so this checks the schedule (splits, key tiles, the fold); the
    GPU's own products are checked by this file and ``tests/models/test_dense_widths_agree.py``
    run with ``JAX_PLATFORMS=cuda``."""
    from turbospark_jax.kernels.attention import FOLD_ON_CHIP_ROWS

    width = 140
    assert 2 * width > FOLD_ON_CHIP_ROWS
    # float32 outputs: a bfloat16 result's rounding would hide a fold in another order
    q, k, v = _inputs(2, width, 4, 2, 16, capacity, jnp.float32)
    first = capacity - width - 20
    pos = first + jnp.arange(width, dtype=jnp.int32)
    run = lambda a, p: np.asarray(cached_attention(  # noqa: E731
        a, k, v, p, interpret=INTERPRET, row_invariant=True)).view(np.uint32)
    full = run(q, pos)
    for m in (1, 5):
        for start in (0, 77, 135):
            part = run(q[start : start + m], pos[start : start + m])
            assert np.array_equal(part, full[start : start + m]), (m, start)
    # control: the comparison sees a change of one row, and only of that row
    moved = run(q.at[3].set(q[3] * 2), pos)
    assert not np.array_equal(moved[3], full[3]) and np.array_equal(moved[4], full[4])


def test_row_invariant_form_a_short_context_folds_only_the_splits_it_sees():
    """Rows spread over a nine-split cache: a one-row block at position 5 folds one split, the
    same row inside a block that reaches the end folds all nine (eight of them empty for it),
    and the folding kernel of 140 rows does too; every row's bits agree."""
    width, capacity = 140, 2304
    q, k, v = _inputs(3, width, 4, 2, 16, capacity, jnp.float32)
    pos = jnp.asarray(np.linspace(5, capacity - 1, width).astype(np.int32))
    run = lambda a, p: np.asarray(cached_attention(  # noqa: E731
        a, k, v, p, interpret=INTERPRET, row_invariant=True)).view(np.uint32)
    full = run(q, pos)
    for rows in ([0], [1], [0, 139], [0, 1, 2, 70, 139], [60, 61]):
        idx = np.asarray(rows)
        assert np.array_equal(run(q[idx], pos[idx]), full[idx]), rows
    # control: the same rows seen to another position differ
    shifted = run(q[:1], pos[:1] + 1)
    assert not np.array_equal(shifted, full[:1])


@pytest.mark.parametrize("width", [1, 3])
def test_a_short_key_bound_runs_the_folding_kernel_and_keeps_the_bits(width):
    """``max_keys`` within two splits: a decode-sized call runs the folding kernel (one
    launch) instead of the split and fold kernels, with every row's bits unchanged; rows past
    the bound (a broken promise) still get theirs, the folding kernel walking the splits
    they see."""
    from turbospark_jax.kernels.attention import ON_CHIP_SPLITS, plan_keys

    capacity = 2304  # nine splits of 256
    split_len = plan_keys(width * 2, capacity)[3]
    q, k, v = _inputs(7, width, 4, 2, 16, capacity, jnp.float32)

    def run(pos, **kw):
        return np.asarray(cached_attention(q, k, v, jnp.asarray(pos, jnp.int32),
                                           interpret=INTERPRET, row_invariant=True,
                                           **kw)).view(np.uint32)

    def folds(**kw):  # the kernels that fold the call's splits: folding, or fold
        text = str(jax.make_jaxpr(lambda q: cached_attention(
            q, k, v, jnp.zeros((width,), jnp.int32), interpret=INTERPRET,
            row_invariant=True, **kw))(q))
        return set(re.findall(r"cached_attention_fold\w*", text))

    bound = ON_CHIP_SPLITS * split_len
    short = [bound - width - 40 + i for i in range(width)]
    assert np.array_equal(run(short, max_keys=bound), run(short))
    far = [capacity - 1 - i for i in range(width)]
    assert np.array_equal(run(far, max_keys=bound), run(far))
    assert folds(max_keys=bound) == {"cached_attention_folding"}
    assert folds(max_keys=bound + split_len) == folds() == {"cached_attention_fold"}
    # control: the comparison sees a key the rows see, changed
    assert not np.array_equal(np.asarray(cached_attention(
        q, k.at[bound - 60].multiply(2.0), v, jnp.asarray(short, jnp.int32),
        interpret=INTERPRET, row_invariant=True, max_keys=bound)).view(np.uint32), run(short))
    with pytest.raises(BadInputError, match="max_keys"):
        cached_attention(q, k, v, jnp.asarray(short, jnp.int32), interpret=INTERPRET,
                         row_invariant=True, max_keys=0)


@pytest.mark.parametrize("row_invariant", [False, True])
def test_a_row_keeps_its_bits_whether_its_key_tiles_ran_masked_or_not(row_invariant):
    """A row next to a row at position 0 has every key tile of its query tile masked (the
    tile's lowest position bounds the tiles the row-invariant form runs unmasked); next to
    a padding row (position -1, as a decode's), all but its last. Its bits must not change,
    at any slot of the block: XLA mode's one width relies on it (a prompt's row chunked
    beside others, then the same row decoded alone), and the row-invariant form must also
    keep them from one width to another (below). (The first form of the base-2 softmax,
    ``exp2(score * c - max)``, failed here in the interpreter: its LLVM fused the multiply
    into the subtraction on one loop only.)"""
    capacity, position = 2304, 2000
    q, k, v = _inputs(6, 2, 4, 2, 16, capacity, jnp.float32)
    run = lambda a, p: np.asarray(cached_attention(  # noqa: E731
        a, k, v, jnp.asarray(p, jnp.int32), interpret=INTERPRET,
        row_invariant=row_invariant)).view(np.uint32)
    beside_zero = run(q, [0, position])[1]
    first_slot = run(q[::-1], [position, -1])[0]
    assert np.array_equal(beside_zero, first_slot)
    if row_invariant:  # a call of another width: another program, the same bits
        assert np.array_equal(beside_zero, run(q[1:], [position])[0])
    # control: a key the row sees, doubled, shows in its result
    nudged = np.asarray(cached_attention(
        q[::-1], k.at[1000].multiply(2.0), v, jnp.asarray([position, -1], jnp.int32),
        interpret=INTERPRET, row_invariant=row_invariant)).view(np.uint32)
    assert not np.array_equal(nudged[0], first_slot)


@pytest.mark.parametrize("width", [3, 140])
def test_row_invariant_form_keeps_its_bits_under_any_attention_tiles(width):
    """Row tiles of 16, 64 (the default) and 128, warps and stages: speed settings only. At 3
    rows (the split and fold kernels) and at 140 (the folding kernel), over nine splits."""
    from turbospark_jax.kernels.attention import AttentionTiles

    capacity = 2304
    q, k, v = _inputs(4, width, 4, 2, 16, capacity, jnp.float32)
    pos = capacity - width - 7 + jnp.arange(width, dtype=jnp.int32)

    def run(tiles):
        return np.asarray(cached_attention(q, k, v, pos, interpret=INTERPRET, row_invariant=True,
                                           tiles=tiles)).view(np.uint32)

    base = run(AttentionTiles())
    for tiles in (AttentionTiles(max_row_tile=16), AttentionTiles(max_row_tile=128, warps=8),
                  AttentionTiles(stages=3)):
        assert np.array_equal(run(tiles), base), tiles
    # control: the comparison sees a one-row change
    assert not np.array_equal(np.asarray(cached_attention(
        q.at[1].set(-q[1]), k, v, pos, interpret=INTERPRET, row_invariant=True)).view(np.uint32),
        base)


@pytest.mark.parametrize("loads", [1, 8, 16])
def test_the_fold_keeps_its_bits_whatever_it_loads_at_once(loads, monkeypatch):
    """``FOLD_LOADS`` (splits' partials loaded at once; speed only): the split kernel writes
    whole groups (empty splits fold in as exact identities) and the folds stay in split
    order, so 3 rows over nine splits give the bits of four at once."""
    from turbospark_jax.kernels import attention as pallas_attention

    capacity = 2304
    q, k, v = _inputs(5, 3, 4, 2, 16, capacity, jnp.float32)
    pos = capacity - 3 - 7 + jnp.arange(3, dtype=jnp.int32)

    def run():
        jax.clear_caches()  # the kernels are traced for the setting they meet
        return np.asarray(cached_attention(q, k, v, pos, interpret=INTERPRET,
                                           row_invariant=True)).view(np.uint32)

    base = run()
    monkeypatch.setattr(pallas_attention, "FOLD_LOADS", loads)
    assert np.array_equal(run(), base)
    assert pallas_attention.partial_splits(9) == -(-9 // loads) * loads


def test_wide_head_prefill_blocks_choose_their_tiles_and_keep_the_bits():
    """Without ``tiles`` the kernels take :func:`tiles_for`'s: 128-row tiles, 8 warps and 3
    stages for prefill-sized blocks of 128-wide heads, the defaults elsewhere. The query
    layout follows the same choice, and the bits are those of the default settings."""
    from turbospark_jax.errors import BadInputError
    from turbospark_jax.kernels.attention import (
        DEFAULT_TILES,
        FOLD_ON_CHIP_ROWS,
        WIDE_HEAD_PREFILL_TILES,
        arrange_queries,
        cached_attention_arranged,
        query_rows,
        tiles_for,
    )

    assert tiles_for(FOLD_ON_CHIP_ROWS, 128) == DEFAULT_TILES  # decode and verify sizes
    assert tiles_for(FOLD_ON_CHIP_ROWS + 1, 128) == WIDE_HEAD_PREFILL_TILES
    assert tiles_for(8192, 64) == DEFAULT_TILES
    width, heads, kv_heads, head_dim, capacity = 130, 4, 2, 128, 640
    q, k, v = _inputs(5, width, heads, kv_heads, head_dim, capacity, jnp.float32)
    pos = capacity - width - 3 + jnp.arange(width, dtype=jnp.int32)
    # 260 rows a KV head: three tiles of 128 (five of 64 under the defaults)
    assert query_rows(width, heads, kv_heads, capacity, head_dim=head_dim) == 384
    qr = arrange_queries(q, kv_heads, capacity)
    assert qr.shape == (kv_heads, 384, head_dim)
    common = dict(interpret=INTERPRET, row_invariant=True)
    chosen = np.asarray(cached_attention(q, k, v, pos, **common)).view(np.uint32)
    arranged = cached_attention_arranged(qr, k, v, pos, heads=heads, **common)
    assert np.array_equal(np.asarray(arranged).view(np.uint32), chosen)
    default = cached_attention(q, k, v, pos, tiles=DEFAULT_TILES, **common)
    assert np.array_equal(np.asarray(default).view(np.uint32), chosen)
    # the default settings' layout does not fit the chosen kernel: refused, not misread
    with pytest.raises(BadInputError, match="arranged queries"):
        cached_attention_arranged(arrange_queries(q, kv_heads, capacity, DEFAULT_TILES), k, v,
                                  pos, heads=heads, **common)


def test_wide_head_prefill_tiles_fit_shared_memory_under_a_longer_key_tile(monkeypatch):
    """At 128 keys a tile, three stages of
    128-wide key and value tiles beside 128 query rows asked an H100 for 228 KiB of shared
    memory, 1 KiB past the limit: the chosen prefill tiles drop to two stages there; at the
    default 64 keys they keep three."""
    from turbospark_jax.kernels import attention as pa

    assert pa.tiles_for(pa.FOLD_ON_CHIP_ROWS + 1, 128).stages == 3
    monkeypatch.setattr(pa, "KEY_TILE", 128)
    chosen = pa.tiles_for(pa.FOLD_ON_CHIP_ROWS + 1, 128)
    assert chosen.stages == 2 and chosen.max_row_tile == pa.WIDE_HEAD_PREFILL_TILES.max_row_tile
    assert pa.tiles_for(pa.FOLD_ON_CHIP_ROWS + 1, 64) == pa.DEFAULT_TILES


def test_attention_tiles_refuse_bad_settings():
    from turbospark_jax.errors import BadInputError
    from turbospark_jax.kernels.attention import AttentionTiles

    for bad in ({"max_row_tile": 48}, {"max_row_tile": 8}, {"warps": 0}, {"stages": 1.5}):
        with pytest.raises(BadInputError):
            AttentionTiles(**bad)
