"""Row-invariant matrix products (kernels/rowinv.py): a row's result is bitwise the same for any
number of rows in the call, any position of the row, either Pallas kernel and any tile sizes;
the result is within the float32 summation bound of a float64 product; and the invariance check
fails for a kernel whose K split depends on the row count.

On a CPU the kernels run in the Pallas interpreter (small K and N: it is slow); on a GPU these
tests run the compiled Triton kernels (``JAX_PLATFORMS=cuda python -m pytest
tests/kernels/test_rowinv.py``), where the XLA form is not the default.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.rowinv import Schedule, Tiles, rowinv_matmul

ON_GPU = jax.default_backend() == "gpu"
KERNEL_IMPL = "pallas" if ON_GPU else "interpret"
#: Four K tiles of 32 in two segments of two; N not a multiple of the column tiles below.
K, N, ROWS = 128, 48, 40
SCHEDULE = Schedule(k_tile=32, segment_tiles=2)
TILES = {"small": Tiles(bm=16, bn=32, matvec_bn=16),
         "large": Tiles(bm=32, bn=64, matvec_bn=32, flat_loop=False),
         "one loop": Tiles(bm=32, bn=32, matvec_bn=16, flat_loop=True)}
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@functools.cache
def _operands(dtype: str, k: int = K, n: int = N, rows: int = ROWS):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((rows, k)), DTYPES[dtype])
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), DTYPES[dtype])
    return x, w


@functools.cache
def _product(dtype: str, impl: str, kernel: str, tiles: str, rows: tuple[int, int],
             out: str = "float32") -> np.ndarray:
    """The product of rows ``rows[0]:rows[1]`` of the operands."""
    x, w = _operands(dtype)
    got = rowinv_matmul(x[rows[0] : rows[1]], w, out_dtype=DTYPES[out], impl=impl, kernel=kernel,
                        schedule=SCHEDULE, tiles=TILES[tiles])
    return np.asarray(got)


def _failures(product, ms, singles) -> list:
    """Row counts ``m`` whose rows differ from the same rows of the widest call, and rows ``r``
    whose one-row call differs from row ``r`` of the widest call."""
    full = product((0, ROWS))
    bad = [m for m in ms if not np.array_equal(product((0, m)), full[:m])]
    return bad + [("row", r) for r in singles
                  if not np.array_equal(product((r, r + 1))[0], full[r])]


CASES = [("xla", "auto"), (KERNEL_IMPL, "matvec"), (KERNEL_IMPL, "matmul")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("impl", "kernel"), CASES)
def test_rows_do_not_depend_on_the_row_count(dtype, impl, kernel):
    product = functools.partial(_product, dtype, impl, kernel, "small")
    assert _failures(product, ms=(1, 5, 16, 17), singles=(23,)) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_and_tile_sizes_agree(dtype):
    """matvec == matmul, for three sets of tile sizes and both matmul loop forms."""
    rows = (0, ROWS)
    want = _product(dtype, KERNEL_IMPL, "matmul", "small", rows)
    for kernel in ("matvec", "matmul"):
        for tiles in TILES:
            assert np.array_equal(_product(dtype, KERNEL_IMPL, kernel, tiles, rows), want)


def test_xla_form_rows_many_row_counts():
    """The XLA form (the CPU's path) over a wider range of row counts and a larger shape."""
    rng = np.random.default_rng(3)
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.asarray(rng.standard_normal((300, 256)), dtype)
        w = jnp.asarray(rng.standard_normal((256, 96)) / 16, dtype)
        full = np.asarray(rowinv_matmul(x, w, impl="xla"))
        for m in (1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 100):
            assert np.array_equal(np.asarray(rowinv_matmul(x[:m], w, impl="xla")), full[:m]), m
        one = np.asarray(rowinv_matmul(x[250:251], w, impl="xla"))
        assert np.array_equal(one[0], full[250])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
@pytest.mark.parametrize(("impl", "kernel"), CASES)
def test_close_to_a_float64_product(dtype, out, impl, kernel):
    """Within the bound of K float32 roundings of the summed magnitudes (plus, for float32
    operands, their products' rounding), and half a bfloat16 ulp for a bfloat16 result."""
    x, w = _operands(dtype)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want = x64 @ w64
    got = np.asarray(_product(dtype, impl, kernel, "small", (0, ROWS), out), np.float64)
    bound = (K + 1) * 2.0**-24 * (np.abs(x64) @ np.abs(w64))
    if out == "bfloat16":
        bound = bound + 2.0**-8 * np.abs(want)
    assert np.all(np.abs(got - want) <= bound)


def _m_dependent(rows: tuple[int, int]) -> np.ndarray:
    """A kernel that is NOT row-invariant: its segments (partial sums from zero, added in
    order) change with the row count: two segments of two tiles for up to 16 rows, one of
    four above. On a GPU only the segments change a row's order (the tensor cores add each
    tile's products into the running sum in place, so a K tile's length does not: on an H100
    a control that changed the K tile alone, and segments of one tile, which Triton folds
    into that in-place sum too, left every bit as it was); in the interpreter they change it
    as well."""
    x, w = _operands("float32")
    small = rows[1] - rows[0] <= 16
    schedule = Schedule(k_tile=32, segment_tiles=2 if small else 4)
    return np.asarray(rowinv_matmul(x[rows[0] : rows[1]], w, impl=KERNEL_IMPL, kernel="matmul",
                                    schedule=schedule, tiles=TILES["small"]))


def test_control_a_row_count_dependent_k_split_fails_the_check():
    assert _failures(_m_dependent, ms=(5, 17), singles=(23,)) != []


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prime_tile_count_runs_one_segment_and_both_kernels_agree(dtype):
    """Seven K tiles (no divisor from 2 to 4): one segment of seven, not seven of one, which
    the two kernels would add in different orders on a GPU (see ``Schedule``); matvec ==
    matmul row for row, whatever the row count."""
    assert Schedule(k_tile=32).plan(224) == (224, 7, 7)
    x, w = _operands(dtype, k=224)
    schedule = Schedule(k_tile=32, segment_tiles=4)

    def product(kernel: str, rows: tuple[int, int]) -> np.ndarray:
        return np.asarray(rowinv_matmul(x[rows[0] : rows[1]], w, impl=KERNEL_IMPL,
                                        kernel=kernel, schedule=schedule,
                                        tiles=TILES["small"]))

    full = product("matmul", (0, ROWS))
    for kernel in ("matvec", "matmul"):
        for rows in ((0, 1), (3, 8), (0, ROWS)):
            assert np.array_equal(product(kernel, rows), full[rows[0] : rows[1]]), (kernel, rows)


def test_bad_input_is_refused():
    x, w = _operands("float32")
    cases = [
        (x[0], w), (x, w[None]), (x[:, :0], w[:0]), (x[:, :64], w),
        (x.astype(jnp.bfloat16), w), (x.astype(jnp.int32), w.astype(jnp.int32)),
    ]
    for a, b in cases:
        with pytest.raises(BadInputError):
            rowinv_matmul(a, b)
    for kwargs in ({"impl": "cuda"}, {"kernel": "gemm"}, {"out_dtype": jnp.int8}):
        with pytest.raises(BadInputError):
            rowinv_matmul(x, w, **kwargs)
    if not ON_GPU:
        with pytest.raises(BadInputError, match="needs a GPU"):
            rowinv_matmul(x, w, impl="pallas")
    for bad in ({"k_tile": 24}, {"k_tile": 8}, {"segment_tiles": 0}):
        with pytest.raises(BadInputError):
            Schedule(**bad)
    with pytest.raises(BadInputError):
        Tiles(bn=48)


def test_schedule_plan_depends_on_k_alone():
    assert Schedule().plan(2048) == (2048, 16, 4)
    assert Schedule().plan(896) == (896, 7, 7)  # 7 tiles: one segment, never seven of one
    assert Schedule(segment_tiles=1).plan(512) == (512, 4, 4)
    assert Schedule().plan(128) == (128, 1, 1)
    assert Schedule().plan(4864) == (4864, 38, 2)
    assert Schedule(k_tile=32).plan(40) == (64, 2, 2)  # padded to whole tiles


# -- several weights in one launch, and weights stored transposed ------------------------------

@functools.cache
def _split_product(impl: str, kernel: str, layout: str, rows: tuple[int, int]) -> np.ndarray:
    """The product with the weight cut into three column groups (one not a multiple of the
    column tiles), stored as ``layout``, in one call."""
    x, w = _operands("bfloat16")
    parts = (w[:, :16], w[:, 16:40], w[:, 40:])
    if layout == "nk":
        parts = tuple(p.T for p in parts)
    return np.asarray(rowinv_matmul(x[rows[0] : rows[1]], parts, w_layout=layout, impl=impl,
                                    kernel=kernel, schedule=SCHEDULE, tiles=TILES["small"]))


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize(("impl", "kernel"), CASES)
def test_weights_side_by_side_and_transposed(layout, impl, kernel):
    """A tuple of weights (either layout) gives rows that do not depend on the row count,
    equal to the product with the one concatenated weight."""
    product = functools.partial(_split_product, impl, kernel, layout)
    assert _failures(product, ms=(1, 5, 17), singles=(23,)) == []
    whole = _product("bfloat16", impl, kernel, "small", (0, ROWS), "bfloat16")
    np.testing.assert_array_equal(product((0, ROWS)).view(np.uint16), whole.view(np.uint16))


def test_weight_tuple_and_layout_refusals():
    x, w = _operands("float32")
    with pytest.raises(BadInputError, match="w_layout"):
        rowinv_matmul(x, w, w_layout="tn")
    with pytest.raises(BadInputError, match="non-empty"):
        rowinv_matmul(x, ())
    with pytest.raises(BadInputError, match=r"w\[1\]"):
        rowinv_matmul(x, (w, w[0]))
    with pytest.raises(BadInputError, match="equal K"):
        rowinv_matmul(x, w, w_layout="nk")
    with pytest.raises(BadInputError, match="dtype"):
        rowinv_matmul(x, (w, w.astype(jnp.bfloat16)))


@pytest.mark.parametrize(("impl", "kernel"), CASES)
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_parts_summed_in_order_are_the_product(impl, kernel, out):
    """``parts=True`` hands the product over unfinished; ``sum_parts`` finishes it into the
    same bits the finished call returns (the matvec kernel's two segments here, one part
    from the others)."""
    from turbospark_jax.kernels.rowinv import sum_parts

    x, w = _operands("bfloat16")
    common = dict(impl=impl, kernel=kernel, schedule=SCHEDULE, tiles=TILES["small"])
    parts = rowinv_matmul(x, (w[:, :40], w[:, 40:]), parts=True, **common)
    assert parts.dtype == jnp.float32
    assert parts.shape == ((2 if kernel == "matvec" else 1), ROWS, N)
    done = rowinv_matmul(x, (w[:, :40], w[:, 40:]), out_dtype=DTYPES[out], **common)
    bits = np.uint16 if out == "bfloat16" else np.uint32
    np.testing.assert_array_equal(np.asarray(sum_parts(parts, DTYPES[out])).view(bits),
                                  np.asarray(done).view(bits))


def test_a_vocabulary_wide_product_walks_k_in_one_segment():
    """``schedule_for`` reads the weight's shape only: one segment from WIDE_N columns on
    (no partial sums for the head), the default segments below up to 16 tiles."""
    from turbospark_jax.kernels.rowinv import WIDE_N, schedule_for

    for k in (512, 2048, 3000):
        _, tiles, per = schedule_for(k, WIDE_N).plan(k)
        assert per == tiles
    for k in (512, 1024, 2048):
        assert schedule_for(k, WIDE_N - 1) == Schedule()


def test_a_long_k_has_few_segments():
    """Past 16 tiles the segments lengthen to about MAX_SEGMENTS of them (the partial sums the
    next kernel adds one by one): the shapes' down products and the 8B's q/k/v and o."""
    from turbospark_jax.kernels.rowinv import MAX_SEGMENTS, schedule_for

    def segments(k: int) -> int:
        _, tiles, per = schedule_for(k, 4096).plan(k)
        return tiles // per

    assert MAX_SEGMENTS == 4
    assert [segments(k) for k in (2048, 3072, 4096, 8192, 14336)] == [4, 4, 4, 4, 4]
    assert segments(1024) == 2  # short K: the default segment length
    assert segments(4864) == 19  # 38 tiles: the largest divisor under 10 is 2
    assert segments(17 * 128) == 1  # a prime count: one segment (see Schedule)
    assert schedule_for(8192, 2048) == schedule_for(8192, 512)  # below WIDE_N, k alone
    assert schedule_for(8192, 2048).plan(8192) == (8192, 64, 16)


# -- the gated product (SwiGLU's hidden rows) ----------------------------------------------------

@functools.cache
def _gated_operands(dtype: str, k: int = 256, f: int = 80):
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((ROWS, k)), DTYPES[dtype])
    gate, up = (jnp.asarray(rng.standard_normal((k, f)) / np.sqrt(k), DTYPES[dtype])
                for _ in range(2))
    return x, gate, up


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_gated_product_is_the_gating_of_its_products(dtype):
    """One launch that gates in its epilogue gives the bits of the two products (on the
    gated schedule, one segment) gated afterwards, in the interpreter (on a GPU the
    epilogue's SiLU is Triton's and the reference's XLA's: close, not bitwise); the rows
    agree for every row count in both kernels and in the XLA form."""
    from turbospark_jax.kernels.rowinv import gated_schedule, rowinv_swiglu, swiglu_gating

    x, gate, up = _gated_operands(dtype)
    f = gate.shape[1]
    both = rowinv_matmul(x, (gate, up), out_dtype=jnp.float32, impl=KERNEL_IMPL,
                         schedule=gated_schedule(x.shape[1]), tiles=TILES["small"])
    want = np.asarray(swiglu_gating(both[:, :f], both[:, f:], x.dtype))
    for impl, kernel in CASES:
        def gated(rows, impl=impl, kernel=kernel):
            return np.asarray(rowinv_swiglu(x[rows[0]:rows[1]], gate, up, impl=impl,
                                            kernel=kernel, tiles=TILES["small"]))
        full = gated((0, ROWS if kernel != "matvec" else 16))
        if impl == "interpret":
            assert np.array_equal(full.view(np.uint8), want[: len(full)].view(np.uint8))
        elif impl == "pallas":
            np.testing.assert_allclose(full.astype(np.float32),
                                       want[: len(full)].astype(np.float32), rtol=2e-2,
                                       atol=2e-2)
        for m in (1, 5, len(full)):
            assert np.array_equal(gated((0, m)), full[:m]), (impl, kernel, m)
        assert np.array_equal(gated((7, 8))[0], full[7]), (impl, kernel)


def test_control_the_gated_schedule_is_not_the_products_default():
    """The check above can fail: gating the products of the default schedule (two segments
    over K here) gives other bits than the one-segment gated kernel."""
    from turbospark_jax.kernels.rowinv import rowinv_swiglu, schedule_for, swiglu_gating

    x, gate, up = _gated_operands("float32", k=1024)
    f = gate.shape[1]
    both = rowinv_matmul(x, (gate, up), out_dtype=jnp.float32, impl=KERNEL_IMPL,
                         schedule=schedule_for(1024, 2 * f), tiles=TILES["small"])
    other = np.asarray(swiglu_gating(both[:, :f], both[:, f:], x.dtype))
    gated = np.asarray(rowinv_swiglu(x, gate, up, impl=KERNEL_IMPL, tiles=TILES["small"]))
    assert np.allclose(other, gated, rtol=1e-4, atol=1e-5)
    assert not np.array_equal(other, gated)


def test_gated_column_tiles_change_no_bit():
    """The gated matvec kernel's columns per program and pipeline depth are speed only: a
    decode row and a 16-row verify block come out bitwise the same under every setting
    (each column's sum runs over K in one order, whatever the tile)."""
    from turbospark_jax.kernels.rowinv import rowinv_swiglu

    x, gate, up = _gated_operands("bfloat16", f=160)

    def gated(tiles, m):
        return np.asarray(rowinv_swiglu(x[:m], gate, up, impl=KERNEL_IMPL, kernel="matvec",
                                        tiles=tiles)).view(np.uint16)

    for m in (1, 16):
        want = gated(Tiles(), m)
        for tiles in (Tiles(gated_bn=16), Tiles(gated_bn=64), Tiles(gated_bn=64,
                                                                     gated_stages=3)):
            assert np.array_equal(gated(tiles, m), want), (tiles, m)


def test_gated_column_tile_keeps_the_multiprocessors_busy():
    """The default column tile: the widest of 16, 32, 64 with at least GATED_PROGRAMS
    programs (the 0.6B, 1B and 8B shapes' gate/up widths), unless one is asked for."""
    assert [Tiles().gated_columns(f) for f in (3072, 8192, 14336)] == [32, 64, 64]
    assert Tiles().gated_columns(1024) == 16  # (64 programs at 16: as few as it goes)
    assert Tiles(gated_bn=16).gated_columns(14336) == 16


def test_gated_product_refusals():
    from turbospark_jax.kernels.rowinv import rowinv_swiglu

    x, gate, up = _gated_operands("float32")
    with pytest.raises(BadInputError, match="one shape"):
        rowinv_swiglu(x, gate, up[:, :40])
    with pytest.raises(BadInputError, match="one shape"):
        rowinv_swiglu(x[:, :100], gate, up)
    with pytest.raises(BadInputError, match="share one dtype"):
        rowinv_swiglu(x, gate.astype(jnp.bfloat16), up)
    with pytest.raises(BadInputError, match="2-D"):
        rowinv_swiglu(x[0], gate, up)
    with pytest.raises(BadInputError, match="kernel must be"):
        rowinv_swiglu(x, gate, up, kernel="gemv")
    with pytest.raises(BadInputError, match="label"):
        rowinv_swiglu(x, gate, up, label="gate-up")
