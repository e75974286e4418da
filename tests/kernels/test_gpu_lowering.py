"""The GPU kernels lowered for CUDA on the CPU, and what the row-invariant program is made of.

A CPU machine cannot run a Triton kernel, but it can lower one: ``jax.export`` for the
``cuda`` platform runs Pallas' Triton lowering, which is where a kernel that the GPU would
refuse usually fails (the matmul kernel's single-loop form did, on the H200, with an
``('i32', 'i1')`` assertion; the control below keeps that failure reproducible). And it shows
what a row-invariant block program (a row-invariant kernel plan) is made of on a GPU: no XLA matrix
product, no floating-point reduction outside our kernels (XLA's reductions and products choose
their order by shape, ours by ``K`` and the cache's capacity alone), only exact integer and
boolean reductions; the same program with XLA's kernels is full of products (the control).
What lowering cannot show, that the compiled kernels keep every row's bits on the hardware,
the kernel and model tests check when run with ``JAX_PLATFORMS=cuda``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from turbospark_jax.kernels import attention as pallas_attention
from turbospark_jax.kernels import rope_store as pallas_rope_store
from turbospark_jax.kernels import row_norm as pallas_row_norm
from turbospark_jax.kernels import rowinv
from turbospark_jax.kernels.mosaic_matmul import MosaicTiles
from turbospark_jax.kernels.plan import KernelPlan
from turbospark_jax.kernels.rowinv import Schedule, Tiles
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, unstack_layers
from turbospark_jax.testing.cuda_export import cuda_text

BF16 = jnp.bfloat16
S = jax.ShapeDtypeStruct


def _matmul(x, ws, nk=False, out=BF16, kernel="auto", tiles=None):
    # the jitted core, past the check that refuses impl="pallas" on a machine without a GPU
    return rowinv._rowinv_matmul(x, ws, nk, jnp.dtype(out), "pallas", kernel, Schedule(),
                                 tiles or Tiles())


ROW, ROWS = S((1, 256), BF16), S((300, 256), BF16)
W_KN, W_KN2, W_NK = S((256, 384), BF16), S((256, 64), BF16), S((1000, 256), BF16)
Q1, Q2 = S((1, 8, 64), BF16), S((300, 8, 64), BF16)
CACHE = S((2048, 2, 64), BF16)

KERNELS = {
    "matvec, three weights": (lambda x, a, b: _matmul(x, (a, b, b)), ROW, W_KN, W_KN2),
    "matmul, three weights": (lambda x, a, b: _matmul(x, (a, b, b)), ROWS, W_KN, W_KN2),
    "matvec, [N, K] weight": (lambda x, w: _matmul(x, (w,), True, jnp.float32), ROW, W_NK),
    "matmul, [N, K] weight": (lambda x, w: _matmul(x, (w,), True, jnp.float32), ROWS, W_NK),
    "matmul, one loop": (lambda x, w: _matmul(x, (w,), tiles=Tiles(flat_loop=True)), ROWS, W_KN),
    "matmul, 128 x 256 tiles": (
        lambda x, w: _matmul(x, (w,), tiles=Tiles(bm=128, bn=256, warps=8)), ROWS, W_KN),
    "gated matvec, one row": (
        lambda x, g, u: rowinv._rowinv_swiglu(x, g, u, "pallas", "auto", Tiles(), "gate_up"),
        ROW, W_KN, W_KN),
    "gated matmul": (
        lambda x, g, u: rowinv._rowinv_swiglu(x, g, u, "pallas", "auto", Tiles(), "gate_up"),
        ROWS, W_KN, W_KN),
    "attention, row-invariant, 1 row": (
        lambda q, k, v, p: pallas_attention.cached_attention(q, k, v, p, row_invariant=True),
        Q1, CACHE, CACHE, S((1,), jnp.int32)),
    "attention, row-invariant, 300 rows": (
        lambda q, k, v, p: pallas_attention.cached_attention(q, k, v, p, row_invariant=True),
        Q2, CACHE, CACHE, S((300,), jnp.int32)),
    "attention, row-invariant, 300 rows, 128-row tiles and 8 warps": (
        lambda q, k, v, p: pallas_attention.cached_attention(
            q, k, v, p, row_invariant=True,
            tiles=pallas_attention.AttentionTiles(max_row_tile=128, warps=8, stages=3)),
        Q2, CACHE, CACHE, S((300,), jnp.int32)),
    "matvec, a prime tile count (one segment)": (
        lambda x, w: _matmul(x, (w,)), S((1, 896), BF16), S((896, 384), BF16)),
    "norm": (lambda x, w: pallas_row_norm._row_rms_norm(x, w, None, 1e-5, "pallas"),
             ROWS, S((256,), BF16)),
    "norm after partial sums": (
        lambda r, p, w: pallas_row_norm._add_parts_rms_norm(r, p, w, 1e-5, "pallas"),
        S((1, 256), BF16), S((4, 1, 256), jnp.float32), S((256,), BF16)),
    "norm after a residual add, D not a power of two": (
        lambda x, w, r: pallas_row_norm._row_rms_norm(x, w, r, 1e-5, "pallas"),
        S((5, 96), BF16), S((96,), BF16), S((5, 96), BF16)),
    "rope and cache write": (
        lambda qkv, c, s, at, k, v: pallas_rope_store.rope_store(qkv, c, s, at, k, v, 8),
        S((3, 12 * 64), BF16), S((3, 64), BF16), S((3, 64), BF16), S((3,), jnp.int32),
        CACHE, CACHE),
    "rope and cache write inside the attention, partial sums, q/k norm": (
        lambda qkv, c, s, at, k, v, n: pallas_rope_store.rope_store_attention(
            qkv, c, s, at, k, v, at, 8, n, n, max_keys=512)[0],
        S((4, 3, 12 * 64), jnp.float32), S((3, 64), BF16), S((3, 64), BF16),
        S((3,), jnp.int32), CACHE, CACHE, S((64,), BF16)),
    "rope and cache write inside the split attention kernel, folding in its last split": (
        lambda qkv, c, s, at, k, v: pallas_rope_store.rope_store_attention(
            qkv, c, s, at, k, v, at, 8)[0],
        S((3, 12 * 64), BF16), S((3, 64), BF16), S((3, 64), BF16), S((3,), jnp.int32),
        CACHE, CACHE),
}


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_lowers_for_cuda(name):
    fn, *args = KERNELS[name]
    assert "xla.gpu.triton" in cuda_text(fn, *args)


MOSAIC = {
    "mosaic, two weights, segments": (
        lambda x, a, b: _matmul(x, (a, b), kernel="mosaic"), S((300, 512), BF16),
        S((512, 384), BF16),
        S((512, 128), BF16)),
    "mosaic, float32 out, 64 x 128 warpgroup tiles": (
        lambda x, w: _matmul(x, (w,), out=jnp.float32, kernel="mosaic", tiles=Tiles(
            mosaic=MosaicTiles(wg_rows=64, wg_cols=128, split="rows"))),
        ROWS, S((256, 256), BF16)),
    "mosaic, gated in the epilogue": (
        lambda x, g, u: rowinv._rowinv_swiglu(x, g, u, "pallas", "mosaic", Tiles(), "gate_up"),
        ROWS, S((256, 256), BF16), S((256, 256), BF16)),
}


@pytest.mark.parametrize("name", MOSAIC)
def test_mosaic_kernel_lowers_for_cuda(name):
    """The Mosaic kernel lowers (Pallas runs its Mosaic GPU passes, layout inference
    included, while lowering); the gated product gates in the Mosaic kernel's epilogue, with
    no Triton gating kernel after it."""
    fn, *args = MOSAIC[name]
    text = cuda_text(fn, *args)
    assert "mosaic_gpu" in text and "rowinv_mosaic" in text
    assert "rowinv_gate_gate_up" not in text
    assert "stablehlo.dot_general" not in text


def test_control_jnp_remainder_in_a_kernel_loop_fails_to_lower():
    """The form the matmul kernel's single loop had when the H200 refused it: ``jnp``'s
    remainder of the loop index lowers to boolean arithmetic Triton's lowering rejects. (The
    kernel now uses ``lax.rem``.) If this ever lowers, the check above has lost its witness,
    not its point: drop this test then."""

    def kernel(x_ref, o_ref):
        def body(i, acc):
            return jnp.where((i + 1) % 4 == 0, acc + x_ref[...], acc)

        o_ref[...] = jax.lax.fori_loop(0, 8, body, jnp.zeros(o_ref.shape, jnp.float32))

    def call(x):
        from jax.experimental.pallas import triton as plgpu

        return pl.pallas_call(kernel, out_shape=S((16, 16), jnp.float32),
                              compiler_params=plgpu.CompilerParams(num_warps=4))(x)

    with pytest.raises(Exception, match="i1"):
        cuda_text(call, S((16, 16), jnp.float32))


# -- what a block program is made of --------------------------------------------------------

CONFIG = DenseConfig(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)


#: Three query heads a KV head and an untied head: the RoPE-and-cache-write kernel does not
#: take these shapes, so attention runs the projections, RoPE and cache writes unfused.
ODD = DenseConfig(model_type="qwen3", vocab_size=500, hidden_size=96, intermediate_size=200,
                  num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                  head_dim=32, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)


def _gpu_plan(kernels: str) -> KernelPlan:
    """The GPU's plan: the compiled Pallas kernels, row-invariant for ``"rowinv"``."""
    return KernelPlan(row_invariant=kernels == "rowinv", pallas="compiled")


def _program(kernels: str, width: int, monkeypatch, last_row_head: bool = False,
             config: DenseConfig = CONFIG, capacity: int = 256, **hints) -> str:
    """The block program of ``width`` rows as it lowers for a GPU (the products check that
    the backend is one, so the test says it is)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    model = DenseModel(config, BF16, scan_layers=False, plan=_gpu_plan(kernels))
    params = jax.eval_shape(lambda: unstack_layers(model.init_params(jax.random.PRNGKey(0))))
    cache = jax.eval_shape(lambda: model.init_cache(capacity))
    rows = S((width,), jnp.int32)
    return cuda_text(lambda p, c, t, pos, live, head: model.block_forward(
        p, c, t, pos, live, head, last_row_head=last_row_head, **hints),
        params, cache, rows, rows, S((), jnp.int32), S((), jnp.bool_))


def test_a_short_decode_bound_folds_the_attention_in_one_launch(monkeypatch):
    """A decode step over a cache of eight key splits runs the RoPE-store's work inside the
    split kernel, whose last program folds each query tile: one launch a layer; bounded by
    ``max_keys`` to two splits (a short context's decode program,
    ``block_producer.SHORT_DECODE_KEYS``), inside the folding kernel: one launch too."""
    def kernels(**hints):
        text = _program("rowinv", 1, monkeypatch, capacity=2048, **hints)
        return set(re.findall(r'name = "(cached_attention\w*|rope_store\w*)"', text))

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert DenseModel(CONFIG, BF16, scan_layers=False, plan=_gpu_plan("rowinv")).bounds_keys
    assert not DenseModel(CONFIG, BF16, scan_layers=False).bounds_keys  # XLA's kernels
    assert kernels() == {"rope_store_attention_split_folding"}
    assert kernels(max_keys=512) == {"rope_store_attention"}
    assert kernels(max_keys=1024) == {"rope_store_attention_split_folding"}


def _float_reductions(text: str) -> list[str]:
    reductions = re.findall(r"stablehlo\.reduce\(.*", text)
    return [r for r in reductions if not re.search(r"tensor<[0-9x]*(i1|i32|i64)>", r)]


@pytest.mark.parametrize(("width", "last_row_head"), [(1, False), (5, False), (64, False),
                                                      (64, True)])
def test_rowinv_program_leaves_xla_no_product_and_no_float_reduction(width, last_row_head,
                                                                     monkeypatch):
    text = _program("rowinv", width, monkeypatch, last_row_head)
    kernel_names = set(re.findall(r'name = "(row_rms_norm|rowinv_mat\w+|rope_store\w*|'
                                  r'cached_attention\w*)"', text))
    assert "row_rms_norm" in kernel_names
    # a decode or verify block runs the RoPE-store inside the attention's first kernel
    fused = {"rope_store_attention", "rope_store_attention_split_folding"}
    if width <= pallas_rope_store.FUSED_ROWS:
        assert kernel_names & fused and "rope_store" not in kernel_names
    else:
        assert "rope_store" in kernel_names and not kernel_names & fused
        assert kernel_names & {"cached_attention", "cached_attention_folding"}
    products = {n.split("_", 2)[2] for n in kernel_names if n.startswith("rowinv_mat")}
    assert products == {"qkv", "o", "gate_up", "down", "head"}  # each labelled, for profiles
    kernel = "matvec" if width <= 16 else "matmul"
    assert f"rowinv_{kernel}_down" in kernel_names
    head = "matvec" if width <= 16 or last_row_head else "matmul"
    assert f"rowinv_{head}_head" in kernel_names
    assert "stablehlo.dot_general" not in text and "stablehlo.dot " not in text
    assert _float_reductions(text) == []
    # SwiGLU's gating runs in the gate/up product's epilogue: no SiLU left to XLA
    assert not re.search(r"stablehlo\.(exponential|logistic)\b", text)


def test_rowinv_prefill_program_on_hopper_takes_the_mosaic_kernel(monkeypatch):
    """A prefill-wide program on a Hopper GPU runs the products the Mosaic kernel fits on it
    (o, gate/up gated in its epilogue, down) and the rest on the Triton kernels (this
    config's 64-column K and V weights, the tied head stored [N, K]); still no XLA product
    and no float reduction."""
    monkeypatch.setattr(rowinv, "_hopper", lambda: True)
    text = _program("rowinv", rowinv.MOSAIC_MIN_ROWS, monkeypatch)
    names = set(re.findall(r"rowinv_(?:mosaic|matmul|gate)_[a-z_]+?(?=_mosaic_gpu|\b|\")",
                           text))
    assert {"rowinv_mosaic_o", "rowinv_mosaic_gate_up", "rowinv_mosaic_down",
            "rowinv_matmul_qkv", "rowinv_matmul_head"} <= names, names
    assert "rowinv_gate_gate_up" not in names
    assert "stablehlo.dot_general" not in text and "stablehlo.dot " not in text
    assert _float_reductions(text) == []


def _float_pads(text: str) -> list[str]:
    return re.findall(r"stablehlo\.pad .*-> tensor<[0-9x]*(?:f32|bf16|f16)>", text)


@pytest.mark.parametrize("width", [1, 5])
def test_rowinv_program_pads_no_activation_for_a_kernel(width, monkeypatch):
    """The matvec kernel and the attention's fold read and write the call's own rows: no XLA
    pad copies a decode row into a 16-row tile before a kernel (nor a slice copies it out
    after), a launch each on a GPU, both ends of every product."""
    text = _program("rowinv", width, monkeypatch)
    assert _float_pads(text) == []
    # the attention's rows come out live: no slice of its padded tiles before the reshape
    assert not re.search(r"stablehlo\.slice .*tensor<2x16x32xbf16>", text)


def test_control_a_row_padded_into_the_matmul_tile_shows_as_a_pad():
    text = cuda_text(lambda x, w: _matmul(x, (w,), kernel="matmul"), ROW, W_KN)
    assert len(_float_pads(text)) == 1


def test_control_xla_kernels_program_has_products_and_reductions(monkeypatch):
    text = _program("xla", 5, monkeypatch)
    assert "stablehlo.dot_general" in text
    assert _float_reductions(text) != []
    assert re.search(r"stablehlo\.(exponential|logistic)\b", text)


@pytest.mark.parametrize("width", [1, 64])
def test_rowinv_program_of_an_odd_shape_lowers_the_same_way(width, monkeypatch):
    text = _program("rowinv", width, monkeypatch, config=ODD)
    assert "rope_store" not in text and "cached_attention" in text
    assert "stablehlo.dot_general" not in text
    assert _float_reductions(text) == []


# -- the decode loop's branches ----------------------------------------------------------------

class _Lowered(Exception):
    """Raised in place of running a program, with its CUDA lowering."""

    def __init__(self, text: str) -> None:
        super().__init__("lowered")
        self.text = text


def _decode_program(kernels: str, settings: dict, monkeypatch) -> str:
    """The program ``BlockProducer.decode`` would run for ``settings``, lowered for a GPU."""
    import functools

    from turbospark_jax.core import sampling
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.engine.program import _run_blocks

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    model = DenseModel(CONFIG, BF16, scan_layers=False, plan=_gpu_plan(kernels))
    params = unstack_layers(model.init_params(jax.random.PRNGKey(0)))
    producer = BlockProducer(model, params, capacity=64, width=1 if kernels == "rowinv" else 4,
                             steps_per_call=4, donate=False)

    def lower(*args, **static):
        program = jax.jit(functools.partial(_run_blocks, model), static_argnames=tuple(static))
        raise _Lowered(cuda_text(program, *args, **static))

    producer._program = lower
    with pytest.raises(_Lowered) as lowered:
        producer.decode(producer.init_state(), 3, 4, params=sampling.SamplingParams.make(
            **settings), history=sampling.History.empty(CONFIG.vocab_size),
            key=sampling.request_key(0), gen_index=1)
    return lowered.value.text


def _branches(text: str) -> int:
    return len(re.findall(r"stablehlo\.(case|if)\b", text))


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.8},
                                      {"temperature": 0.8, "top_k": 50, "top_p": 0.95}],
                         ids=["greedy", "sampled", "truncated"])
def test_rowinv_decode_loop_has_no_branch_but_its_loop(settings, monkeypatch):
    """A conditional on a GPU copies its predicate to the host and waits, every token; so
    does a loop's condition, unless the loop has a known trip count. The decode program's
    steps run in chunks of DECODE_CHUNK, a loop whose condition compares its counter with
    that constant, inside the loop over chunks: one host check per chunk. This shape (no
    conditional, the inner loop's trip count fixed) is also why these programs alone compile
    with their loops as CUDA graphs (``device_flags.decode_program_options``): the programs
    that broke under the graphs on an H100 nest conditionals or data-dependent loops in
    their loop (docs/decisions/0004-loop-graphs.md)."""
    from turbospark_jax.engine.program import DECODE_CHUNK

    text = _decode_program("rowinv", settings, monkeypatch)
    assert _branches(text) == 0
    # the function that holds the loops (constants are named per function)
    text = next(f for f in text.split("\n  func.func ") if "stablehlo.while" in f)
    loops = re.findall(r"stablehlo\.while\(.*\n\s*cond \{\n\s*%\S+ = stablehlo\.compare\s+"
                       r"(\w+), (%[\w#]+), (%[\w#]+)", text)
    assert len(loops) == 2  # the chunks' loop, and the steps' loop inside it
    constants = dict(re.findall(r"(%c[_\d]*) = stablehlo\.constant dense<(-?\d+)> : "
                                r"tensor<i32>", text))
    direction, _, bound = loops[1]
    assert direction == "LT" and constants.get(bound) == str(DECODE_CHUNK)


def test_control_the_one_program_branches_on_the_settings(monkeypatch):
    text = _decode_program("xla", {"temperature": 0.8, "top_k": 50}, monkeypatch)
    assert _branches(text) >= 2  # greedy or sampled; top-k/top-p or not
    assert _whiles(text) == 1  # a look at the host a step


def _rounds_program(kernels: str, monkeypatch, settings=None, bounded=None) -> str:
    """The greedy speculative rounds program (an n-gram drafter, the target verifying 4 rows)
    that ``SpeculativePair.device_rounds`` would run, lowered for a GPU (``bounded``: as
    ``rounds.compiled_rounds`` takes it)."""
    from turbospark_jax.core import sampling
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.speculative import pair as pair_module
    from turbospark_jax.speculative.drafters import NGramDrafter
    from turbospark_jax.speculative.pair import SpeculativePair
    from turbospark_jax.speculative.rounds import RoundsSpec, rounds_function

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    model = DenseModel(CONFIG, BF16, scan_layers=False, plan=_gpu_plan(kernels))
    params = unstack_layers(model.init_params(jax.random.PRNGKey(0)))
    target = BlockProducer(model, params, capacity=64, width=4, steps_per_call=4, donate=False)
    pair = SpeculativePair(target, NGramDrafter(CONFIG.vocab_size, max_n=3), device_rounds=True)

    def compiled(spec, donate):
        if bounded is not None:
            spec = RoundsSpec.choose(spec.target, spec.drafter, spec.width, greedy=spec.greedy,
                                     record_logits=spec.record_logits, max_keys=spec.max_keys,
                                     bounded=bounded)

        def lower(*args):
            raise _Lowered(cuda_text(rounds_function(spec), *args))
        return lower

    monkeypatch.setattr(pair_module, "compiled_rounds", compiled)
    with pytest.raises(_Lowered) as lowered:
        pair.device_rounds(pair.init_state(), 3, draft_len=3, budget=8,
                           params=settings or sampling.SamplingParams.greedy(),
                           history=sampling.History.empty(CONFIG.vocab_size),
                           key=sampling.request_key(0), gen_index=1, remaining=20, stop_ids=[],
                           record_logits=False)
    return lowered.value.text


def _fixed_round_loops(text: str) -> list[str]:
    """The trip-count bounds of the program's loops whose condition compares the counter
    with a constant (a loop of known trip count)."""
    text = next(f for f in text.split("\n  func.func ") if "stablehlo.while" in f)
    loops = re.findall(r"stablehlo\.while\(.*\n\s*cond \{\n\s*%\S+ = stablehlo\.compare\s+"
                       r"LT, (%[\w#]+), (%[\w#]+)", text)
    constants = dict(re.findall(r"(%c[_\d]*) = stablehlo\.constant dense<(-?\d+)> : "
                                r"tensor<i32>", text))
    return [constants.get(bound, "?") for _, bound in loops]


def test_rowinv_greedy_rounds_verify_with_no_branch(monkeypatch):
    """A row-invariant target verifies with its head unbranched (its rows do not depend on
    how XLA compiles the program around them), and a greedy burst with the n-gram drafter
    runs as one loop of FIXED_ROUNDS iterations whose one branch is the round itself (run
    while the burst's condition holds): no loop whose trip count is data. With XLA's kernels
    the head's branch stays (control), so that the verify compiles like the decode step
    whose rows it must equal."""
    from turbospark_jax.speculative.rounds import FIXED_ROUNDS

    text = _rounds_program("rowinv", monkeypatch)
    assert _branches(text) == 1
    assert _whiles(text) == 1
    assert _fixed_round_loops(text) == [str(FIXED_ROUNDS)]


#: An integer constant's name and value in StableHLO text.
_INTEGER_CONSTANT = r"(%\w+) = stablehlo\.constant dense<(-?\d+)> : tensor<i(?:32|64)>"


def loop_trip_counts(text: str, skip_scans: bool = False) -> list[int | None]:
    """Every loop's trip count in a lowered program (every function): the constant its
    counter is compared with, where that comparison is the whole condition, else ``None``.
    A constant is an integer literal or the size of a static dimension (jax 0.11 lowers a
    cumulative sum as a loop to ``get_dimension_size`` of its operand, in a function of its
    own: ``skip_scans`` leaves those out)."""
    counts: list[int | None] = []
    for function in text.split("func.func ")[1:]:
        if skip_scans and re.match(r"\w+ @chlo\.scan", function):
            continue
        constants = dict(re.findall(_INTEGER_CONSTANT, function))
        for name, dim, shape in re.findall(r"(%\w+) = stablehlo\.get_dimension_size %\w+, "
                                           r"dim = (\d+) : \(tensor<([^>]+)>\)", function):
            constants[name] = shape.split("x")[int(dim)]
        for name, source in re.findall(r"(%\w+) = stablehlo\.convert (%\w+) : "
                                       r"\(tensor<i\d+>\) -> tensor<i\d+>", function):
            if source in constants:
                constants[name] = constants[source]
        for block in re.findall(r"cond \{(.*?)\} do \{", function, re.S):
            ops = [op for op in re.findall(r"= (stablehlo\.\w+)", block)
                   if op != "stablehlo.constant"]
            # a region may define its own constants under names the function uses elsewhere
            known = {**constants, **dict(re.findall(_INTEGER_CONSTANT, block))}
            bound = re.search(r"stablehlo\.compare\s+LT, %iterArg\w*, (%\w+)", block)
            fixed = ops == ["stablehlo.compare"] and bound and bound.group(1) in known
            counts.append(int(known[bound.group(1)]) if fixed else None)
    return counts


def _constant_trip_loops(text: str, skip_scans: bool = False) -> tuple[int, int]:
    """(loops, loops of a constant trip count: :func:`loop_trip_counts`)."""
    counts = loop_trip_counts(text, skip_scans)
    assert len(counts) == _whiles(text, skip_scans)
    return len(counts), sum(c is not None for c in counts)


def _whiles(text: str, skip_scans: bool = True) -> int:
    """The program's loops, those of jax 0.11's cumulative sums left out unless asked for
    (``chlo.scan``'s functions: a loop over a static dimension, none in jax 0.10)."""
    functions = text.split("func.func ")
    if skip_scans:
        functions = [f for f in functions if not re.match(r"\w+ @chlo\.scan", f)]
    return sum(len(re.findall(r"stablehlo\.while\b", f)) for f in functions)


def test_loop_trip_counts_reads_literals_and_static_sizes():
    """The parser on the forms jax 0.10 and 0.11 lower loops to: a counter against an
    integer literal, against a static dimension's size, and (control) against a value."""
    literal = jax.jit(lambda x: jax.lax.fori_loop(0, 7, lambda i, a: a + i, x)).lower(
        S((), jnp.int32)).as_text()
    assert loop_trip_counts(literal) == [7]
    data = jax.jit(lambda n, x: jax.lax.fori_loop(0, n, lambda i, a: a + i, x)).lower(
        S((), jnp.int32), S((), jnp.int32)).as_text()
    assert loop_trip_counts(data) == [None]
    scan = """func.func private @f(%arg0: tensor<9x32xf32>) {
    %c_0 = stablehlo.constant dense<0> : tensor<i64>
    %0 = stablehlo.get_dimension_size %arg0, dim = 1 : (tensor<9x32xf32>) -> tensor<i32>
    %1 = stablehlo.convert %0 : (tensor<i32>) -> tensor<i64>
    %3:3 = stablehlo.while(%iterArg = %c_0) : tensor<i64>
    cond {
      %4 = stablehlo.compare LT, %iterArg, %1 : (tensor<i64>, tensor<i64>) -> tensor<i1>
      stablehlo.return %4 : tensor<i1>
    } do {
"""
    assert loop_trip_counts(scan) == [32]
    assert loop_trip_counts(scan.replace("@f(", "@chlo.scan.impl(")) == [32]
    assert loop_trip_counts(scan.replace("@f(", "@chlo.scan.impl("), skip_scans=True) == []


def test_greedy_rounds_hold_no_loop_that_stops_on_data(monkeypatch):
    """Greedy rounds with the n-gram drafter: every loop of the program has a constant trip
    count, so no predicate goes back to the host. Sampled rounds with the judge's loop
    (``bounded=False``), which stops at the first rejection, are the control."""
    from turbospark_jax.core import sampling

    loops, fixed = _constant_trip_loops(_rounds_program("rowinv", monkeypatch))
    assert loops >= 1 and fixed == loops
    params = sampling.SamplingParams.make(temperature=0.8, top_k=50, top_p=0.95)
    loops, fixed = _constant_trip_loops(_rounds_program("rowinv", monkeypatch, params,
                                                        bounded=False))
    assert fixed < loops


def test_sampled_ngram_rounds_hold_no_loop_that_stops_on_data(monkeypatch):
    """By default (n-gram lookup's sampled rounds hold no loop) the judge shapes its rows
    side by side, so sampled n-gram rounds hold one loop: the burst's, of
    ``rounds.FIXED_ROUNDS`` iterations (the unbounded control is the test above)."""
    from turbospark_jax.core import sampling
    from turbospark_jax.speculative import rounds

    params = sampling.SamplingParams.make(temperature=0.8, top_k=50, top_p=0.95)
    text = _rounds_program("rowinv", monkeypatch, params)
    assert _constant_trip_loops(text, skip_scans=True) == (1, 1)
    assert _fixed_round_loops(text) == [str(rounds.FIXED_ROUNDS)]


def test_control_a_loop_to_a_traced_count_is_not_counted_as_fixed():
    def count_to(n):
        return jax.lax.while_loop(lambda c: c[0] < c[1], lambda c: (c[0] + 1, c[1]),
                                  (jnp.int32(0), n))

    assert _constant_trip_loops(jax.jit(count_to).lower(jnp.int32(9)).as_text()) == (1, 0)
    fixed = jax.jit(lambda x: jax.lax.fori_loop(0, 8, lambda i, c: c + i, x)).lower(
        jnp.int32(0)).as_text()
    assert _constant_trip_loops(fixed) == (1, 1)


def test_control_xla_kernels_rounds_keep_the_heads_branch(monkeypatch):
    text = _rounds_program("xla", monkeypatch)
    assert _branches(text) == 2 and "head/cond" in text
