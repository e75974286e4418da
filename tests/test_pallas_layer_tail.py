"""The persistent layer tail (``models/pallas_layer_tail.py``): bitwise the four row-invariant
kernels it replaces (the o product's partial sums, the norm kernel with the tree sum, the
gated product, the down product's partial sums), for 1 to 16 rows and shapes of one and of
several K segments; its barrier counter back at zero after a call; its refusals; and its
CUDA lowering. In the Pallas interpreter one program runs every phase (its barriers pass at
once); on a GPU the same checks run the compiled kernel with the multiprocessors' count of
programs and fewer (``benchmarks/probe_layer_tail.py`` times it)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from turbospark_jax.errors import BadInputError
from turbospark_jax.models import pallas_layer_tail, rowinv
from turbospark_jax.models.pallas_layer_tail import layer_tail, plan, refusal
from turbospark_jax.models.pallas_row_norm import add_parts_rms_norm

BF16 = jnp.bfloat16
EPS = 1e-6
ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas" if ON_GPU else "interpret"


def _operands(rows: int, k_o: int, d: int, f: int, seed: int = 0, dtype=BF16) -> tuple:
    rng = np.random.default_rng(seed)

    def a(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    return (a(rows, k_o), a(rows, d), a(k_o, d, scale=k_o**-0.5), 1 + a(d, scale=0.1),
            a(d, f, scale=d**-0.5), a(d, f, scale=d**-0.5), a(f, d, scale=f**-0.5))


def _four_kernels(attn, residual, w_o, norm_weight, gate, up, down):
    (k_o, d), f = w_o.shape, gate.shape[1]
    o = rowinv.rowinv_matmul(attn, w_o, parts=True, schedule=rowinv.schedule_for(k_o, d),
                             impl=IMPL)
    h, normed = add_parts_rms_norm(residual, o, norm_weight, EPS, impl=IMPL, tree=True)
    hidden = rowinv.rowinv_swiglu(normed, gate, up, impl=IMPL)
    return h, rowinv.rowinv_matmul(hidden, down, parts=True,
                                   schedule=rowinv.schedule_for(f, d), impl=IMPL)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _programs() -> list:
    if not ON_GPU:
        return [None]
    sms = pallas_layer_tail.multiprocessors()
    return [None, sms // 2 + 1, 7]


# (rows, K_o, D, F): one K segment each; two o segments and two down segments (K 1,024)
SHAPES = [(1, 256, 128, 384), (3, 1024, 256, 1024), (16, 1024, 128, 512)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("programs", _programs())
@pytest.mark.parametrize(("shared_norm", "ahead", "spin"),
                         [(False, 0, "atomic"), (True, 0, "atomic"), (False, 2, "atomic"),
                          (True, 3, "atomic"), (False, 0, "load"), (True, 4, "load")],
                         ids=["norm_each", "norm_shared", "norm_each_ahead2",
                              "norm_shared_ahead3", "norm_each_load_spin",
                              "norm_shared_ahead4_load_spin"])
def test_the_tail_is_bitwise_the_four_kernels(shape, programs, shared_norm, ahead, spin):
    """``ahead``: the gated and down phases' first weight tiles loaded before their barriers
    (3 is more than some segments have: those load all of theirs). ``spin``: how programs
    poll the barrier (on a GPU, a program that left a barrier early would read rows not
    yet written and differ; the interpreter's one program never polls)."""
    ops = _operands(*shape)
    want = _four_kernels(*ops)
    h, parts, count = layer_tail(*ops, EPS, impl=IMPL, programs=programs,
                                 shared_norm=shared_norm, ahead=ahead, spin=spin)
    assert parts.shape == want[1].shape and h.shape == want[0].shape
    assert np.array_equal(_bits(h), _bits(want[0]))
    assert np.array_equal(_bits(parts), _bits(want[1]))
    assert int(count[0]) == 0  # ready for the next layer's call


@pytest.mark.parametrize("triton", [(8, 4), (4, 6)], ids=["8_warps", "6_stages"])
def test_triton_settings_change_no_bit(triton):
    """More warps or a deeper pipeline (speed only; on a GPU, different compiled kernels)."""
    ops = _operands(*SHAPES[1])
    want = _four_kernels(*ops)
    h, parts, _ = layer_tail(*ops, EPS, impl=IMPL, triton=triton)
    assert np.array_equal(_bits(h), _bits(want[0]))
    assert np.array_equal(_bits(parts), _bits(want[1]))


def test_control_a_changed_weight_changes_the_bits():
    ops = list(_operands(*SHAPES[1]))
    want = _four_kernels(*ops)
    ops[6] = ops[6].at[5, 0].multiply(3)  # the down product's first column
    _, parts, _ = layer_tail(*ops, EPS, impl=IMPL)
    assert not np.array_equal(_bits(parts), _bits(want[1]))


def test_a_threaded_counter_serves_the_next_call():
    ops = _operands(*SHAPES[0])
    _, _, count = layer_tail(*ops, EPS, impl=IMPL)
    again = layer_tail(*ops, EPS, impl=IMPL, count=count)
    first = layer_tail(*ops, EPS, impl=IMPL)
    assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(again, first, strict=True))


def test_each_phase_takes_one_round_where_it_can():
    """The column blocks: the narrowest that gives a phase no more items than programs."""
    work = plan(2048, 2048, 8192, 132)  # the 1B shape on 132 multiprocessors
    assert (work.o.items, work.gated.items, work.down.items) == (128, 128, 128)
    assert (work.o.segments, work.down.segments, work.gated.segments) == (4, 4, 1)
    big = plan(4096, 4096, 14336, 132)  # the 8B shape: 128-column blocks
    assert (big.o.bn, big.gated.bn, big.down.bn) == (128, 128, 128)
    assert plan(2048, 1024, 3072, 132).gated.items == 96  # the 0.6B shape


@pytest.mark.parametrize(("args", "match"), [
    ((17, BF16, 256, 128, 384), "1 to 16 rows"),
    ((1, jnp.float32, 256, 128, 384), "bfloat16 or float16"),
    ((1, BF16, 256, 96, 384), "power-of-two width"),
    ((1, BF16, 200, 128, 384), "o product's K"),
    ((1, BF16, 256, 128, 300), "hidden width"),
])
def test_refusals_name_the_shape(args, match):
    assert match in refusal(*args)


def test_bad_calls_are_refused_with_our_error():
    ops = _operands(*SHAPES[0])
    with pytest.raises(BadInputError, match="do not fit together"):
        layer_tail(ops[0], ops[1], ops[2][:128], *ops[3:], EPS, impl=IMPL)
    with pytest.raises(BadInputError, match="one dtype"):
        layer_tail(ops[0].astype(jnp.float16), *ops[1:], EPS, impl=IMPL)
    with pytest.raises(BadInputError, match="1 to 16 rows"):
        layer_tail(*_operands(17, 256, 128, 384), EPS, impl=IMPL)
    with pytest.raises(BadInputError, match="impl must be"):
        layer_tail(*ops, EPS, impl="xla")
    with pytest.raises(BadInputError, match="count must be int32"):
        layer_tail(*ops, EPS, impl=IMPL, count=jnp.zeros((2,), jnp.int32))
    with pytest.raises(BadInputError, match="programs must be"):
        layer_tail(*ops, EPS, impl=IMPL, programs=10_000)
    with pytest.raises(BadInputError, match="ahead must be 0 to 8"):
        layer_tail(*ops, EPS, impl=IMPL, ahead=9)
    with pytest.raises(BadInputError, match="triton must be"):
        layer_tail(*ops, EPS, impl=IMPL, triton=(3, 4))
    with pytest.raises(BadInputError, match="spin must be one of"):
        layer_tail(*ops, EPS, impl=IMPL, spin="sleep")


@pytest.mark.skipif(ON_GPU, reason="the CPU's refusal of the GPU kernel")
def test_pallas_off_a_gpu_is_refused():
    with pytest.raises(BadInputError, match="needs a GPU"):
        layer_tail(*_operands(*SHAPES[0]), EPS, impl="pallas")
    with pytest.raises(BadInputError, match="is a GPU kernel"):
        layer_tail(*_operands(*SHAPES[0]), EPS)  # "auto"


@pytest.mark.parametrize("spin", pallas_layer_tail.SPINS)
def test_the_tail_lowers_for_cuda(spin):
    s = jax.ShapeDtypeStruct
    fn = functools.partial(pallas_layer_tail._layer_tail, eps=EPS, interpret=False, programs=8,
                           ahead=2, spin=spin)
    shapes = [s((2, 1024), BF16), s((2, 256), BF16), s((1024, 256), BF16), s((256,), BF16),
              s((256, 1024), BF16), s((256, 1024), BF16), s((1024, 256), BF16),
              s((1,), jnp.int32)]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
        *shapes).mlir_module()
    assert "rowinv_layer_tail" in text
