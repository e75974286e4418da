"""Grouped expert products (kernels/grouped.py): the tile layout, the products against a plain
float64 reference, and a selection's bits independent of the selections grouped beside it,
for the XLA form and the Pallas form (in the interpreter on a CPU; lowered for CUDA too).

The row-invariance checks compare one row alone with the same row inside a 37-row block
whose other rows are random (so they route elsewhere and fill its tiles differently),
``np.array_equal``; their controls show the check sees a row-count dependent product and a
change to the row itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import grouped
from turbospark_jax.kernels.grouped import GroupedTiles, expert_mlp, group, tile_bound
from turbospark_jax.quant.weights import Quantization, quantize_leaf

ON_GPU = jax.default_backend() == "gpu"
KERNEL_IMPL = "pallas" if ON_GPU else "interpret"
E, D, F, K, ROWS = 8, 32, 16, 2, 37
TILES = GroupedTiles(bn=16, bk=16)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _silu(x):
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def _gelu(x):
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


@functools.cache
def _operands(dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, D))
    experts = np.stack([rng.choice(E, K, replace=False) for _ in range(ROWS)])
    gate = rng.standard_normal((E, D, F)) / np.sqrt(D)
    up = rng.standard_normal((E, D, F)) / np.sqrt(D)
    down = rng.standard_normal((E, F, D)) / np.sqrt(F)
    cast = functools.partial(jnp.asarray, dtype=DTYPES[dtype])
    return cast(x), jnp.asarray(experts, jnp.int32), cast(gate), cast(up), cast(down)


_run = jax.jit(expert_mlp, static_argnames=("act", "nk", "impl", "tiles"))


def _reference(x, experts, gate, up, down) -> np.ndarray:
    """The math in float64, selection by selection."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    out = np.zeros((*experts.shape, x.shape[1]))
    for t, row in enumerate(np.asarray(experts)):
        for j, e in enumerate(row):
            g = x[t] @ gate[e]
            out[t, j] = (g / (1 + np.exp(-g)) * (x[t] @ up[e])) @ down[e]
    return out


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("impl", ["xla", KERNEL_IMPL])
def test_products_match_a_plain_reference(dtype, tol, impl):
    x, experts, gate, up, down = _operands(dtype)
    got = np.asarray(_run(x, experts, gate, up, down, act=_silu, impl=impl, tiles=TILES),
                     np.float64)
    want = _reference(x, experts, gate, up, down)
    assert got.shape == (ROWS, K, D)
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", ["xla", KERNEL_IMPL])
def test_fused_out_in_stacks_match_the_split_ones(impl):
    """Gemma 4's layout: ``gate_up [E, 2F, D]`` and ``down [E, D, F]``, ``[out, in]``."""
    x, experts, gate, up, down = _operands("float32")
    gate_up = jnp.concatenate([gate, up], axis=2).transpose(0, 2, 1)
    got = _run(x, experts, gate_up, None, down.transpose(0, 2, 1), act=_gelu, nk=True,
               impl=impl, tiles=TILES)
    want = _run(x, experts, gate, up, down, act=_gelu, impl=impl, tiles=TILES)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def _row_alone_and_in_blocks(impl: str, dtype: str, row: int) -> list[bool]:
    """Whether selection ``row``'s outputs alone equal its outputs inside blocks of 37 rows
    (the row at two positions, the others random, two seeds)."""
    x, experts, gate, up, down = _operands(dtype)
    run = functools.partial(_run, gate=gate, up=up, down=down, act=_silu, impl=impl,
                            tiles=TILES)
    alone = np.asarray(run(x[row:row + 1], experts[row:row + 1])[0].astype(jnp.float32))
    same = []
    for seed, at in ((1, 0), (2, 20)):
        others, chosen = _operands(dtype, seed)[:2]
        block = run(others.at[at].set(x[row]), chosen.at[at].set(experts[row]))
        same.append(np.array_equal(np.asarray(block[at].astype(jnp.float32)), alone))
    return same


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["xla", KERNEL_IMPL])
def test_a_rows_bits_do_not_depend_on_its_tile_mates(dtype, impl):
    assert _row_alone_and_in_blocks(impl, dtype, 5) == [True, True]


def test_xla_form_many_block_sizes():
    """The XLA form (the CPU's path) over more row counts: every prefix of the block gives
    its rows the block's bits."""
    x, experts, gate, up, down = _operands("bfloat16")
    full = np.asarray(_run(x, experts, gate, up, down, act=_silu).astype(jnp.float32))
    for m in (1, 2, 3, 4, 9, 16, 17, 30):
        part = _run(x[:m], experts[:m], gate, up, down, act=_silu)
        assert np.array_equal(np.asarray(part.astype(jnp.float32)), full[:m]), m


def test_control_the_check_sees_a_row_count_dependent_product():
    """The same comparison fails for XLA's own product over all rows: one row alone takes a
    path that sums otherwise than the same row among 37 (float32, on the CPU)."""
    if ON_GPU:
        pytest.skip("the CPU's matrix-vector path is what this control shows")
    x, _, gate, _, _ = _operands("float32")
    w = gate[0]
    dot = jax.jit(lambda a: jnp.dot(a, w, precision=jax.lax.Precision.HIGHEST))
    full = np.asarray(dot(x))
    assert any(not np.array_equal(np.asarray(dot(x[r:r + 1]))[0], full[r])
               for r in range(ROWS))


@pytest.mark.parametrize("impl", ["xla", KERNEL_IMPL])
def test_control_a_change_to_the_row_itself_is_seen(impl):
    x, experts, gate, up, down = _operands("float32")
    run = functools.partial(_run, gate=gate, up=up, down=down, act=_silu, impl=impl,
                            tiles=TILES)
    alone = np.asarray(run(x[5:6], experts[5:6]))
    nudged = np.asarray(run(x[5:6].at[0, 0].add(2.0**-10), experts[5:6]))
    assert not np.array_equal(nudged, alone)


def test_layout_tiles_hold_one_expert_and_skipped_selections_take_none():
    experts = jnp.asarray([[3, 1], [3, 0], [-1, -1], [1, 3], [8, 2]], jnp.int32)
    g = group(experts, E, 2)
    slot, source, tile_expert = (np.asarray(a) for a in g[:3])
    used = int(g.used)
    assert source.shape == (2 * tile_bound(10, E, 2),)
    # expert 0: one selection, 1: two, 2: one, 3: three; -1 and 8 (out of range) take none
    assert used == 1 + 1 + 1 + 2
    assert list(tile_expert[:used]) == [0, 1, 2, 3, 3]
    empty = 2 * len(tile_expert)
    assert slot[4] == slot[5] == slot[8] == empty
    for s, e in enumerate(np.asarray(experts).reshape(-1)):
        if 0 <= e < E:
            assert tile_expert[slot[s] // 2] == e and source[slot[s]] == s // 2
    # a tile's empty slots read the zero row (index T), each taken slot once
    taken = sorted(int(slot[s]) for s in range(10) if slot[s] < empty)
    assert len(set(taken)) == 7 and all(source[i] == 5 for i in range(empty) if i not in taken)


def test_the_tile_bound_holds_where_every_expert_pads():
    """Every expert with one selection past whole tiles (each pads a tile): the used count
    stays within the static bound, which sizes the layout."""
    tm, experts = 4, np.repeat(np.arange(E), 5)[:, None]  # 5 selections an expert
    g = group(jnp.asarray(experts, jnp.int32), E, tm)
    assert int(g.used) == 2 * E <= tile_bound(5 * E, E, tm)
    assert len(np.asarray(g.tile_expert)) == tile_bound(5 * E, E, tm)


def test_padding_rows_create_no_tiles():
    """Selections marked skipped (a padding row's) take no tile: the used count is the live
    rows' alone, and their outputs are zeros."""
    x, experts, gate, up, down = _operands("float32")
    live = 4
    marked = experts.at[live:].set(-1)
    assert int(group(marked, E, grouped.XLA_TILE_ROWS).used) == int(
        group(experts[:live], E, grouped.XLA_TILE_ROWS).used)
    assert int(group(marked, E, grouped.XLA_TILE_ROWS).used) < int(
        group(experts, E, grouped.XLA_TILE_ROWS).used)  # control: the padding rows would
    got = np.asarray(_run(x, marked, gate, up, down, act=_silu))
    assert not got[live:].any()
    assert np.array_equal(got[:live], np.asarray(_run(x[:live], experts[:live], gate, up,
                                                      down, act=_silu)))


def test_quantized_stacks_multiply_as_their_dequantized_weights():
    """Each tile dequantizes its expert alone, as the whole stack would dequantize; the
    Pallas form takes quantized stacks in the XLA form."""
    x, experts, gate, up, down = _operands("float32")
    spec = Quantization.parse("int8")
    q = [quantize_leaf(np.asarray(w), w.shape[1], 1, spec, jnp.float32)
         for w in (gate, up, down)]
    plain = [w.dequantize(jnp.float32) for w in q]
    got = np.asarray(_run(x, experts, *q, act=_silu))
    assert np.array_equal(got, np.asarray(_run(x, experts, *plain, act=_silu)))
    assert np.array_equal(np.asarray(_run(x, experts, *q, act=_silu, impl=KERNEL_IMPL,
                                          tiles=TILES)), got)
    # Control: the quantized experts are not the float ones.
    assert not np.array_equal(got, np.asarray(_run(x, experts, gate, up, down, act=_silu)))


def test_bad_input_is_refused():
    x, experts, gate, up, down = _operands("float32")
    with pytest.raises(BadInputError, match="impl"):
        expert_mlp(x, experts, gate, up, down, _silu, impl="triton")
    with pytest.raises(BadInputError, match="bn"):
        GroupedTiles(bn=24)


def test_kernels_lower_for_cuda():
    """The Pallas form passes Triton's lowering (on a machine without a GPU: ``jax.export``
    for CUDA), at a decode's and a prefill's width of the Qwen3-30B-A3B layer and for a
    fused ``[out, in]`` stack: two kernels, no XLA product left."""
    from turbospark_jax.testing.cuda_export import cuda_text

    s, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    e, d, f = 128, 2048, 768
    for rows in (1, 2048):
        text = cuda_text(lambda x, ex, g, u, w: expert_mlp(x, ex, g, u, w, _silu,
                                                           impl="pallas"),
                         s((rows, d), bf16), s((rows, 8), jnp.int32), s((e, d, f), bf16),
                         s((e, d, f), bf16), s((e, f, d), bf16))
        assert text.count("__gpu$xla.gpu.triton") == 2 and "stablehlo.dot_general" not in text
    text = cuda_text(lambda x, ex, gu, w: expert_mlp(x, ex, gu, None, w, _gelu, nk=True,
                                                     impl="pallas"),
                     s((5, d), bf16), s((5, 8), jnp.int32), s((e, 2 * f, d), bf16),
                     s((e, d, f), bf16))
    assert text.count("__gpu$xla.gpu.triton") == 2
