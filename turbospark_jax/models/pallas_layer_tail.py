"""A decode step's layer tail in one persistent kernel: the output projection, the residual
add and post-attention RMSNorm, the gated product and the down product.

At decode widths each of those is a kernel of its own today (four launches a layer), and on
an H100 or H200 every launch costs a fixed 2.4-2.6 us of ramp and tail on top of its bytes
(``benchmarks/decode_bound.py``'s line; NOTES.md, thirteenth session). Here one launch of
one program per multiprocessor runs them as phases that meet at grid-wide barriers:

1. **o**: the o product's work items (column block, K segment), the matvec kernel's float32
   partial sums, into a scratch buffer;
2. barrier; **norm and gate**: every program finishes the rows itself (the residual plus the
   partial sums in order, :mod:`~turbospark_jax.models.pallas_row_norm`'s functions with the
   halving-tree sum of squares), keeps its normed rows in a scratch row of its own, and runs
   its share of the gated product's column blocks (one K segment, gated in the epilogue);
   program 0 writes the finished residual rows out (with ``shared_norm``, program 0 norms
   the rows alone and the others wait for it at one more barrier);
3. barrier; **down**: the down product's work items over the gated rows, as the matvec
   kernel's partial sums, which the next norm (the next layer's, or the head's) adds itself.

With ``ahead``, each program loads its first gated and first down item's first weight
tiles before the barrier in front of that phase (the weights do not depend on the rows), so
their latency overlaps the wait.

On an H200 the kernel keeps every bit (the kernel tests compiled) but a decode step with it
was 1-3% slower than with the four kernels (NOTES.md, fourteenth session): the phase
boundary, not the launch, is what a kernel's fixed cost pays for, and a barrier keeps it.

A barrier is a counter bumped atomically by each program after a CTA barrier (so its
threads' stores precede the release), then polled until every program has arrived; after the
last phase each program bumps it once more and the last to do so sets it back to zero, so one
counter serves every layer of a step. Every scratch row is written once a call before any
program reads it, so no multiprocessor holds a stale L1 line of it.

**Bits.** Each work item is the matvec kernels' arithmetic on the same tiles in the same
order (:mod:`~turbospark_jax.models.rowinv`: the same K tiles, the same ``acc + dot``
steps, the same segments from the weight's :func:`~turbospark_jax.models.rowinv.
schedule_for`), and the norm is the norm kernel's code with ``tree=True``, so a row comes
out bitwise as the four kernels give it at any width, provided the model's post-attention
norm runs with the tree at every width (``DenseModel(persistent_tail=True)`` sees to that).
The column blocks a program takes change no bit (a column's sum over K is the same sequence
in any block). ``tests/test_pallas_layer_tail.py`` checks that in the Pallas interpreter,
where one program runs every phase (its barriers pass at once), and compiled on a GPU over
several program counts (28 passed on an H200); ``benchmarks/probe_layer_tail.py`` checks
the three model shapes' tails there and times them.

Only up to :data:`~turbospark_jax.models.rowinv.ROW_TILE` rows (a decode step, a verify
block) of a 16-bit dtype, a power-of-two width and K and F in whole tiles take this path;
:func:`refusal` says why another does not.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from turbospark_jax.checks import as_bool
from turbospark_jax.errors import BadInputError
from turbospark_jax.models import rowinv
from turbospark_jax.models.pallas_row_norm import (
    finished_rows,
    inverse_rms,
    parts_total,
    scaled_rows,
)

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ROWS = rowinv.ROW_TILE
K_TILE = rowinv.Schedule.k_tile
#: Column blocks of a phase's work items: the narrowest of these that gives no more items
#: than programs (one round a phase), else the widest.
BLOCK_WIDTHS = (16, 32, 64, 128)
#: Weight tiles a program loads before a barrier for the phase after it (``layer_tail``'s
#: ``ahead``); 0 until a GPU times the forms (``benchmarks/probe_layer_tail.py``).
AHEAD = 0
#: How a program polls the barrier's counter (:func:`layer_tail`'s ``spin``), and the ways.
SPIN = "atomic"
SPINS = ("atomic", "load")
#: Triton settings of the kernel (the matvec kernels' warps, their gated kernel's stages).
WARPS, STAGES = 4, 4


@dataclasses.dataclass(frozen=True)
class _Product:
    """A product phase's work: ``[*, k] @ [k, n]`` in ``segments`` K segments of ``per`` tiles,
    its columns in blocks of ``bn``; item ``i`` is segment ``i // blocks``, block
    ``i % blocks``."""

    k: int
    n: int
    per: int
    segments: int
    bn: int

    @property
    def blocks(self) -> int:
        return self.n // self.bn

    @property
    def items(self) -> int:
        return self.blocks * self.segments


def _product(k: int, n: int, schedule: rowinv.Schedule, programs: int) -> _Product:
    _, tiles, per = schedule.plan(k)
    segments = tiles // per
    fits = [bn for bn in BLOCK_WIDTHS if n % bn == 0 and n // bn * segments <= programs]
    bn = fits[0] if fits else max(bn for bn in BLOCK_WIDTHS if n % bn == 0)
    return _Product(k, n, per, segments, bn)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The three products' work items, each phase's column blocks fitted to the programs
    that share them (static)."""

    o: _Product
    gated: _Product
    down: _Product


def plan(k_o: int, d: int, f: int, programs: int) -> Plan:
    """The work of a layer tail with an o product ``[k_o, d]``, gate and up ``[d, f]`` and
    a down product ``[f, d]``, over ``programs`` programs."""
    return Plan(o=_product(k_o, d, rowinv.schedule_for(k_o, d), programs),
                gated=_product(d, f, rowinv.gated_schedule(d), programs),
                down=_product(f, d, rowinv.schedule_for(f, d), programs))


def refusal(rows: int, dtype: Any, k_o: int, d: int, f: int) -> str | None:
    """Why a layer tail of these shapes cannot run as the persistent kernel (None when it can):
    at most :data:`ROWS` rows, a 16-bit dtype (its squares are exact in float32, so a fused
    multiply-add in the tree changes no bit), a power-of-two width of at least one K tile
    (one halving tree, no padding) and the o product's K and the hidden width ``f`` in whole
    K tiles (no padded weights)."""
    if not 1 <= rows <= ROWS:
        return f"the layer tail kernel takes 1 to {ROWS} rows; got {rows}"
    if jnp.dtype(dtype) not in _DTYPES:
        return f"the layer tail kernel takes bfloat16 or float16 rows; got {jnp.dtype(dtype)}"
    if d < K_TILE or d & (d - 1):
        return f"the layer tail kernel needs a power-of-two width >= {K_TILE}; got {d}"
    for name, n in (("the o product's K", k_o), ("the hidden width", f)):
        if n % K_TILE:
            return f"the layer tail kernel needs {name} in whole {K_TILE}-column tiles; got {n}"
    return None


def _live(rows: int, width: int) -> jax.Array:
    """bool ``[ROWS, width]``: the call's rows of a row tile."""
    return jax.lax.broadcasted_iota(jnp.int32, (ROWS, width), 0) < rows


def _segment_sum(x_tile: Any, w_ref: Any, p: _Product, s: Any, c: Any, tile_dot: Any,
                 first: tuple = ()) -> jax.Array:
    """Item ``(s, c)``'s float32 sum over segment ``s``'s tiles, from zero: the matvec
    kernel's steps (``acc + dot``, tile by tile), with ``x_tile(t)`` the rows' K tile ``t``
    (absolute) and the weight's block read from the whole weight. ``first``: the segment's
    first weight tiles of this block, already loaded (:func:`_first_tiles`); the same steps
    in the same order either way."""
    cols = pl.ds(pl.multiple_of(c * p.bn, p.bn), p.bn)
    acc = jnp.zeros((ROWS, p.bn), jnp.float32)
    for i, w_tile in enumerate(first):
        acc = acc + tile_dot(x_tile(s * p.per + i), w_tile, False)

    def step(i: Any, acc: jax.Array) -> jax.Array:
        t = s * p.per + i
        rows = pl.ds(pl.multiple_of(t * K_TILE, K_TILE), K_TILE)
        return acc + tile_dot(x_tile(t), w_ref[rows, cols], False)

    return jax.lax.fori_loop(len(first), p.per, step, acc)


def _first_tiles(w_ref: Any, p: _Product, ahead: int) -> tuple:
    """The first ``ahead`` weight tiles (at most the segment's) of this program's first item
    of ``p`` (item ``j``, or the last item where the program has none: loaded, never used).
    They do not depend on the rows, so a program loads them before a barrier and their
    latency overlaps the wait."""
    item = jnp.minimum(pl.program_id(0), p.items - 1)
    s, c = jax.lax.div(item, p.blocks), jax.lax.rem(item, p.blocks)
    cols = pl.ds(pl.multiple_of(c * p.bn, p.bn), p.bn)
    return tuple(w_ref[pl.ds(pl.multiple_of((s * p.per + t) * K_TILE, K_TILE), K_TILE), cols]
                 for t in range(min(ahead, p.per)))


def _each_item(p: _Product, body: Any, first: tuple = ()) -> None:
    """``body(segment, block, first)`` for this program's items ``j, j + P, ...``, the
    first of them with ``first`` (its loaded tiles), the rest with none."""
    j, programs = pl.program_id(0), pl.num_programs(0)
    split = lambda item: (jax.lax.div(item, p.blocks), jax.lax.rem(item, p.blocks))  # noqa: E731
    start = 0
    if first:
        pl.when(j < p.items)(lambda: body(*split(j), first))
        start = 1

    def one(i: Any, carry: Any) -> Any:
        body(*split(j + i * programs), ())
        return carry

    jax.lax.fori_loop(start, (p.items - j + programs - 1) // programs, one, 0)


def _cta_barrier(interpret: bool) -> None:
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        plgpu.debug_barrier()


def _bump(count_ref: Any, by: Any) -> jax.Array:
    """Add ``by`` to the counter atomically; the value before."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.atomic_add(count_ref, (jnp.int32(0),), jnp.int32(by))


def _peek(count_ref: Any) -> jax.Array:
    """The counter read past the L1 cache (a volatile load: served by L2, where the atomics
    land), without the read-modify-write an atomic poll makes every arriving program's add
    queue behind."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.load(count_ref.at[0], volatile=True)


def _grid_barrier(count_ref: Any, arrival: int, interpret: bool, spin: str) -> None:
    """Wait until every program has arrived here (the ``arrival``-th barrier of the call).
    ``spin``: poll with atomic adds of zero (``"atomic"``), or with volatile loads and one
    atomic add of zero once they see everyone (``"load"``: its acquire orders this
    program's later loads after the other programs' released stores)."""
    target = arrival * pl.num_programs(0)
    _cta_barrier(interpret)  # every thread's stores issued before the release
    seen = _bump(count_ref, 1) + 1
    if not interpret:  # (the interpreter's one program has arrived: seen == target)
        if spin == "load":
            jax.lax.while_loop(lambda n: n < target, lambda n: _peek(count_ref), seen)
            # the acquiring add: its value is used (a loop that never turns), since an atomic
            # whose value is dropped compiles to a reduction, which releases but does not
            # acquire (on an H100 the rows read after it were then stale: the tests caught it)
            jax.lax.while_loop(lambda n: n < target, lambda n: _bump(count_ref, 0),
                               _bump(count_ref, 0))
        else:
            jax.lax.while_loop(lambda n: n < target, lambda n: _bump(count_ref, 0), seen)
    _cta_barrier(interpret)


def _tail_kernel(attn_ref: Any, res_ref: Any, wo_ref: Any, nw_ref: Any, gate_ref: Any,
                 up_ref: Any, down_ref: Any, count_in: Any, h_ref: Any, parts_ref: Any,
                 count_ref: Any, o_parts: Any, normed_ref: Any, hidden_ref: Any, *, rows: int,
                 eps: float, plan: Plan, interpret: bool, shared_norm: bool,
                 ahead: int, spin: str) -> None:
    del count_in  # read and written through its aliased output
    j = pl.program_id(0)
    dtype = h_ref.dtype
    d = h_ref.shape[1]
    tile_dot = rowinv.tile_dot_for(interpret)
    live = _live(rows, K_TILE)

    def x_tile(ref: Any, *lead: Any) -> Any:
        def load(t: Any) -> jax.Array:
            from jax.experimental.pallas import triton as plgpu

            at = pl.ds(pl.multiple_of(t * K_TILE, K_TILE), K_TILE)
            return plgpu.load(ref.at[(*lead, slice(None), at)], mask=live, other=0)
        return load

    # 1. the o product's partial sums
    def o_item(s: Any, c: Any, first: tuple) -> None:
        acc = _segment_sum(x_tile(attn_ref), wo_ref, plan.o, s, c, tile_dot, first)
        o_parts[s, :, pl.ds(pl.multiple_of(c * plan.o.bn, plan.o.bn), plan.o.bn)] = acc

    _each_item(plan.o, o_item)
    gate_first = _first_tiles(gate_ref, plan.gated, ahead)  # the next phase's, before waiting
    _grid_barrier(count_ref, 1, interpret, spin)

    # 2. the rows normed (by every program into a scratch row of its own, or by program 0
    # alone behind one more barrier), then the gated product's blocks
    def norm_rows(into: Any) -> None:
        for r in range(rows):
            delta = parts_total(lambda i, r=r: o_parts[i, r, :], plan.o.segments, dtype)
            h = finished_rows(res_ref[r, :], delta, dtype=dtype)
            normed_ref[into, r, :] = scaled_rows(h, inverse_rms(h, d, eps, tree=True),
                                                 nw_ref[...], dtype)

            @pl.when(j == 0)
            def _(r: int = r, h: jax.Array = h) -> None:
                h_ref[r, :] = h

    barriers = 1
    if shared_norm:
        pl.when(j == 0)(lambda: norm_rows(0))
        barriers += 1
        _grid_barrier(count_ref, barriers, interpret, spin)
        normed_row = jnp.int32(0)
    else:
        norm_rows(j)
        _cta_barrier(interpret)  # the scratch row's stores before this program's loads
        normed_row = j

    def gated_item(s: Any, c: Any, first: tuple) -> None:
        total = functools.partial(_segment_sum, x_tile(normed_ref, normed_row), p=plan.gated,
                                  s=s, c=c, tile_dot=tile_dot)
        cols = pl.ds(pl.multiple_of(c * plan.gated.bn, plan.gated.bn), plan.gated.bn)
        hidden_ref[:, cols] = rowinv.swiglu_gating(total(w_ref=gate_ref, first=first),
                                                   total(w_ref=up_ref), dtype)

    _each_item(plan.gated, gated_item, gate_first)
    down_first = _first_tiles(down_ref, plan.down, ahead)
    barriers += 1
    _grid_barrier(count_ref, barriers, interpret, spin)

    # 3. the down product's partial sums, the call's rows only
    def down_item(s: Any, c: Any, first: tuple) -> None:
        from jax.experimental.pallas import triton as plgpu

        acc = _segment_sum(x_tile(hidden_ref), down_ref, plan.down, s, c, tile_dot, first)
        cols = pl.ds(pl.multiple_of(c * plan.down.bn, plan.down.bn), plan.down.bn)
        plgpu.store(parts_ref.at[s, :, cols], acc, mask=_live(rows, plan.down.bn))

    _each_item(plan.down, down_item, down_first)
    # the exit: the last program to leave sets the counter back to zero for the next call
    arrivals = (barriers + 1) * pl.num_programs(0)
    last = _bump(count_ref, 1) == arrivals - 1

    @pl.when(last)
    def _() -> None:
        _bump(count_ref, -arrivals)


def multiprocessors() -> int:
    """The device's multiprocessor count (132, an H100's or H200's, when it does not say)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "programs", "shared_norm",
                                             "ahead", "triton", "spin"))
def _layer_tail(attn: jax.Array, residual: jax.Array, w_o: jax.Array, norm_weight: jax.Array,
                gate: jax.Array, up: jax.Array, down: jax.Array, count: jax.Array, eps: float,
                interpret: bool, programs: int, shared_norm: bool = False, ahead: int = 0,
                triton: tuple[int, int] = (WARPS, STAGES), spin: str = "atomic",
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    m, k_o = attn.shape
    d, f = gate.shape
    work = plan(k_o, d, f, programs)
    dtype = residual.dtype
    whole = lambda shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_tail_kernel, rows=m, eps=eps, plan=work, interpret=interpret,
                               shared_norm=shared_norm, ahead=ahead, spin=spin)
    norm_rows = 1 if shared_norm else programs
    h, parts, count, *_ = pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[whole((ROWS, k_o)), whole((ROWS, d)), whole(w_o.shape), whole((d,)),
                  whole(gate.shape), whole(up.shape), whole(down.shape), whole((1,))],
        out_specs=[whole((ROWS, d)), whole((work.down.segments, ROWS, d)), whole((1,)),
                   whole((work.o.segments, ROWS, d)), whole((norm_rows, ROWS, d)),
                   whole((ROWS, f))],
        out_shape=[jax.ShapeDtypeStruct((m, d), dtype),
                   jax.ShapeDtypeStruct((work.down.segments, m, d), jnp.float32),
                   jax.ShapeDtypeStruct((1,), jnp.int32),
                   jax.ShapeDtypeStruct((work.o.segments, ROWS, d), jnp.float32),
                   jax.ShapeDtypeStruct((norm_rows, ROWS, d), dtype),
                   jax.ShapeDtypeStruct((ROWS, f), dtype)],
        input_output_aliases={7: 2},
        interpret=interpret,
        name="rowinv_layer_tail",
        **rowinv.compiler_params(interpret, *triton),
    )(attn, residual, w_o, norm_weight, gate, up, down, count)
    return h, parts, count


def layer_tail(
    attn: jax.Array,
    residual: jax.Array,
    w_o: jax.Array,
    norm_weight: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    eps: float,
    *,
    count: jax.Array | None = None,
    impl: str = "auto",
    programs: int | None = None,
    shared_norm: bool = False,
    ahead: int | None = None,
    triton: tuple[int, int] = (WARPS, STAGES),
    spin: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A pre-norm layer's work after its attention, for a few rows, in one launch.

    ``h = residual + attn @ w_o`` and ``mlp = swiglu(rms_norm(h)) @ down``, as the
    row-invariant kernels give them one after another: bitwise ``add_parts_rms_norm(residual,
    matvec_parts(attn, w_o), norm_weight, eps, tree=True)`` then the gated product, then the
    down product's partial sums (see the module docstring).

    Args:
      attn: ``[M, K_o]`` attention rows (heads flattened), ``M`` up to :data:`ROWS`.
      residual: ``[M, D]`` the rows before the attention.
      w_o: ``[K_o, D]``; norm_weight: ``[D]``; gate, up: ``[D, F]``; down: ``[F, D]``; all
        of ``attn``'s dtype (bfloat16 or float16).
      eps: the norm's epsilon (static).
      count: the barrier counter, int32 ``[1]`` holding zero (as a call leaves it: thread it
        from one layer's call to the next); None makes one.
      impl: ``"pallas"`` (a GPU), ``"interpret"`` (the Pallas interpreter, one program) or
        ``"auto"`` (``"pallas"`` on a GPU; refused elsewhere).
      programs: the kernel's programs (static; they all wait for each other, so no more than
        the GPU runs at once: at most its multiprocessor count). None: that count on a GPU,
        1 in the interpreter (which runs programs one after another, so only one).
      shared_norm: program 0 norms the rows alone and the others wait for it at a third
        barrier, instead of every program norming them itself (the same bits; speed only).
      ahead: weight tiles of its first item of the gated and down phases that each program
        loads before the barrier in front of them (0 to 8; at most a segment's tiles are
        used), so their latency overlaps the wait (the same bits; speed only). None:
        :data:`AHEAD`.
      triton: the kernel's Triton ``(num_warps, num_stages)`` (speed only: a tile's steps
        are the same; a power of two from 1 to 16 warps, 1 to 8 stages).
      spin: how a program waits at a barrier (speed only): ``"atomic"`` polls with atomic
        adds of zero, ``"load"`` with volatile loads, then one atomic add. None:
        :data:`SPIN`.

    Returns:
      ``(h, parts, count)``: ``h [M, D]`` in the rows' dtype, ``parts`` float32 ``[S, M,
      D]`` (the down product's partial sums over its K segments) and the counter.

    Raises:
      BadInputError: shapes or dtypes :func:`refusal` turns down or that do not fit
        together; an ``impl`` other than the three; ``"pallas"`` or ``"auto"`` off a GPU;
        ``programs`` not 1 in the interpreter or above the multiprocessors on a GPU;
        ``ahead``, ``triton``, ``spin`` or ``count`` out of their ranges.
    """
    shapes = {name: tuple(getattr(a, "shape", ())) for name, a in (
        ("attn", attn), ("residual", residual), ("w_o", w_o), ("norm_weight", norm_weight),
        ("gate", gate), ("up", up), ("down", down))}
    if any(len(shapes[n]) != 2 for n in ("attn", "residual", "w_o", "gate", "up", "down")):
        raise BadInputError(f"layer_tail takes 2-D rows and weights; got shapes {shapes}")
    (m, k_o), (_, d), (_, f) = attn.shape, residual.shape, gate.shape
    want = {"attn": (m, k_o), "residual": (m, d), "w_o": (k_o, d), "norm_weight": (d,),
            "gate": (d, f), "up": (d, f), "down": (f, d)}
    if shapes != want:
        raise BadInputError(f"layer_tail's operands do not fit together: expected {want} "
                            f"from attn {attn.shape}, residual {residual.shape} and gate "
                            f"{gate.shape}; got {shapes}")
    arrays = (attn, residual, w_o, norm_weight, gate, up, down)
    if len({a.dtype for a in arrays}) != 1:
        raise BadInputError(f"layer_tail's operands must share one dtype; got "
                            f"{[str(a.dtype) for a in arrays]}")
    why = refusal(m, attn.dtype, k_o, d, f)
    if why:
        raise BadInputError(why)
    if impl not in ("auto", "pallas", "interpret"):
        raise BadInputError(f"impl must be 'auto', 'pallas' or 'interpret'; got {impl!r}")
    impl = rowinv.resolve_impl(impl)
    if impl == "xla":  # "auto" off a GPU: the kernel has no XLA form
        raise BadInputError(
            f"layer_tail is a GPU kernel (the backend is {jax.default_backend()!r}); use "
            "impl='interpret' for the Pallas interpreter, or the four row-invariant kernels")
    interpret = impl == "interpret"
    limit = 1 if interpret else multiprocessors()
    programs = limit if programs is None else programs
    if not isinstance(programs, int) or not 1 <= programs <= limit:
        raise BadInputError(
            f"programs must be 1 to {limit} (they wait for each other at barriers, so all "
            f"must run at once{'; the interpreter runs one' if interpret else ''}); got "
            f"{programs!r}")
    if count is None:
        count = jnp.zeros((1,), jnp.int32)
    elif getattr(count, "shape", None) != (1,) or count.dtype != jnp.int32:
        raise BadInputError(f"count must be int32 [1] (a layer tail's counter); got "
                            f"{getattr(count, 'shape', None)}, {getattr(count, 'dtype', None)}")
    ahead = AHEAD if ahead is None else ahead
    if isinstance(ahead, bool) or not isinstance(ahead, int) or not 0 <= ahead <= 8:
        raise BadInputError(f"ahead must be 0 to 8 weight tiles; got {ahead!r}")
    warps, stages = triton if isinstance(triton, tuple) and len(triton) == 2 else (0, 0)
    if (not all(isinstance(v, int) and not isinstance(v, bool) for v in (warps, stages))
            or warps not in (1, 2, 4, 8, 16) or not 1 <= stages <= 8):
        raise BadInputError(f"triton must be (num_warps, num_stages): a power of two from 1 "
                            f"to 16 and 1 to 8; got {triton!r}")
    spin = SPIN if spin is None else spin
    if spin not in SPINS:
        raise BadInputError(f"spin must be one of {SPINS}; got {spin!r}")
    return _layer_tail(attn, residual, w_o, norm_weight, gate, up, down, count, float(eps),
                       interpret, programs, as_bool("shared_norm", shared_norm), ahead,
                       (warps, stages), spin)
