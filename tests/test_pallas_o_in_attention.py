"""The output projection inside the short-context attention kernel
(``rope_store_attention(o_weight=...)``, ``DenseModel.o_in_attention``): bitwise the
attention's rows followed by the row-invariant matvec kernel on the KV-group schedule, for
one-head and two-head K tiles, decode and verify widths, finished or partial q/k/v sums;
the kernel that ran is the fused one where it folds on chip and the matvec elsewhere; bad
weights are refused; the model's widths agree with it.

On a CPU the kernels run in the Pallas interpreter; on a GPU these tests run the compiled
Triton kernels (``JAX_PLATFORMS=cuda python -m pytest tests/test_pallas_o_in_attention.py``).
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.models.layers import rope_cos_sin, rope_inv_freq
from turbospark_jax.models.pallas_rope_store import (
    o_group_schedule,
    rope_store_attention,
)
from turbospark_jax.models.rowinv import Schedule, rowinv_matmul, sum_parts

INTERPRET = jax.default_backend() != "gpu"
N = 128  # the projection's output columns: two blocks of 64


def _inputs(seed, dtype, heads, kv_heads, head_dim, width, first, capacity, parts):
    rng = np.random.default_rng(seed)
    normal = lambda shape, s=1.0: jnp.asarray(rng.standard_normal(shape) * s, dtype)  # noqa: E731
    shape = (width, (heads + 2 * kv_heads) * head_dim)
    qkv = (jnp.asarray(rng.standard_normal((parts, *shape)), jnp.float32) if parts
           else normal(shape))
    pos = first + jnp.arange(width, dtype=jnp.int32)
    inv, scale = rope_inv_freq(head_dim, 10000.0, None, 4096)
    cos, sin = rope_cos_sin(pos, inv, scale, dtype)
    caches = (normal((capacity, kv_heads, head_dim)), normal((capacity, kv_heads, head_dim)))
    norms = {"q_norm": normal(head_dim), "k_norm": normal(head_dim)}
    w_o = normal((heads * head_dim, N), 1 / 16)
    return qkv, cos, sin, pos, caches, norms, w_o


def _pallas_calls(fn, *args) -> set[str]:
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                name = eqn.params.get("name_and_src_info", eqn.params.get("name"))
                names.add(getattr(name, "name", name))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def test_group_schedule():
    """A KV group's rows as the o product's K segments: two or more whole 128-wide tiles."""
    assert o_group_schedule(16, 8, 128) == Schedule(segment_tiles=2)   # Qwen3-0.6B
    assert o_group_schedule(32, 8, 64) == Schedule(segment_tiles=2)    # Llama-3.2-1B
    assert o_group_schedule(32, 8, 128) == Schedule(segment_tiles=4)   # Llama-3.1-8B
    assert o_group_schedule(8, 2, 32) is None     # a group of one tile
    assert o_group_schedule(8, 8, 128) is None    # no grouping: one-tile segments
    assert o_group_schedule(12, 8, 128) is None   # heads not in whole groups
    # the plan gives segments of exactly one group each
    _, tiles, per = o_group_schedule(32, 8, 64).plan(32 * 64)
    assert (tiles, per) == (16, 2)


SHAPES = [(8, 2, 64), (4, 2, 128)]  # two heads a K tile (the 1B's), one head a tile (0.6B's)


@pytest.mark.parametrize(("width", "first", "parts", "capacity", "max_keys", "fused"), [
    (1, 10, 0, 256, None, True),      # a cache of one split
    (1, 300, 3, 2048, 512, True),     # a short decode's bound
    (5, 40, 2, 2048, 512, True),      # a verify's rows
    (16, 7, 0, 256, None, True),      # FUSED_ROWS rows
    (1, 1000, 3, 2048, None, False),  # eight splits: the split kernel, then the matvec
    (17, 30, 0, 256, None, False),    # past FUSED_ROWS: two launches, then the matvec
])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_o_inside_the_attention_gives_the_matvec_kernels_bits(
        width, first, parts, capacity, max_keys, fused, shape, dtype):
    heads, kv_heads, head_dim = shape
    qkv, cos, sin, pos, caches, norms, w_o = _inputs(
        1, dtype, heads, kv_heads, head_dim, width, first, capacity, parts)
    args = (qkv, cos, sin, pos, *caches, pos)

    def run(*a, o=True):
        return rope_store_attention(*a, heads, **norms, interpret=INTERPRET, max_keys=max_keys,
                                    o_weight=w_o if o else None)

    got = run(*args)
    out, k_cache, v_cache = run(*args, o=False)
    want = rowinv_matmul(out.reshape(width, -1), w_o, parts=True,
                         schedule=o_group_schedule(heads, kv_heads, head_dim),
                         impl="interpret" if INTERPRET else "auto")
    # a segment a KV group (past 16 rows the matrix kernel finishes its sums: one part)
    assert got[0].shape == (kv_heads if width <= 16 else 1, width, N)
    assert got[0].dtype == jnp.float32
    for g, w in zip(got, (want, k_cache, v_cache), strict=True):
        assert np.array_equal(_bits(g), _bits(w))
    kernels = _pallas_calls(run, *args)
    assert ("rope_store_attention_o" in kernels) == fused
    assert any(k.startswith("rowinv_") for k in kernels) != fused
    # control: one weight in the last group's rows moved; that group's sums see it
    moved = rope_store_attention(*args, heads, **norms, interpret=INTERPRET,
                                 max_keys=max_keys, o_weight=w_o.at[-1, 3].multiply(2))
    assert not np.array_equal(_bits(moved[0][-1]), _bits(want[-1]))
    if width <= 16:  # the other groups' sums do not
        assert np.array_equal(_bits(moved[0][0]), _bits(want[0]))


@pytest.mark.parametrize("columns", [64, 128])
def test_o_columns_change_no_bit(columns):
    """The column blocks a program takes are a speed setting."""
    heads, kv_heads, head_dim = SHAPES[0]
    qkv, cos, sin, pos, caches, norms, w_o = _inputs(
        2, jnp.bfloat16, heads, kv_heads, head_dim, 3, 50, 256, 2)
    args = (qkv, cos, sin, pos, *caches, pos, heads)
    got = rope_store_attention(*args, **norms, interpret=INTERPRET, o_weight=w_o,
                               o_columns=columns)
    want = rope_store_attention(*args, **norms, interpret=INTERPRET, o_weight=w_o,
                                fuse=False)
    assert all(np.array_equal(_bits(g), _bits(w)) for g, w in zip(got, want, strict=True))


def test_finished_sums_are_the_product_on_the_group_schedule():
    """The parts finished in order are the o product of the attention's rows to float32
    rounding (a check that the wiring, not only the order, is the product's)."""
    heads, kv_heads, head_dim = SHAPES[1]
    qkv, cos, sin, pos, caches, norms, w_o = _inputs(
        3, jnp.float32, heads, kv_heads, head_dim, 2, 20, 256, 0)
    args = (qkv, cos, sin, pos, *caches, pos, heads)
    parts, _, _ = rope_store_attention(*args, **norms, interpret=INTERPRET, o_weight=w_o)
    out, _, _ = rope_store_attention(*args, **norms, interpret=INTERPRET)
    with jax.default_matmul_precision("highest"):
        want = out.reshape(2, -1) @ w_o
    np.testing.assert_allclose(sum_parts(parts, jnp.float32), want, rtol=1e-5, atol=1e-5)


def test_bad_weights_are_refused():
    heads, kv_heads, head_dim = SHAPES[0]
    qkv, cos, sin, pos, caches, _, w_o = _inputs(
        4, jnp.bfloat16, heads, kv_heads, head_dim, 1, 5, 256, 0)
    args = (qkv, cos, sin, pos, *caches, pos, heads)
    with pytest.raises(BadInputError, match="o_weight must be"):
        rope_store_attention(*args, interpret=INTERPRET, o_weight=w_o[:-64])
    small = _inputs(4, jnp.bfloat16, 8, 2, 32, 1, 5, 256, 0)  # a group of one K tile
    with pytest.raises(BadInputError, match="whole K tiles"):
        rope_store_attention(*small[:4], *small[4], small[3], 8, interpret=INTERPRET,
                             o_weight=small[6])
