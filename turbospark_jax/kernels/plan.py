"""The kernel plan: which implementation runs each piece of a dense layer's per-row work
(matrix products, RMSNorm, RoPE, attention), fixed once when a model is built.

A :class:`KernelPlan` has two facts, and every choice below follows from them:

* ``row_invariant``: every piece gives a row the same bits whatever the number of rows
  beside it, so programs of different widths (decode at one row, verify at ``k + 1``,
  prefill in wide chunks) agree row for row. Without it XLA's own kernels run: fast, but a
  row's bits may change with the number of rows in the call, so exactness needs one program
  width for every path.
* ``pallas``: where the Pallas kernels run. ``"compiled"`` on a GPU: row-invariant products
  through :func:`~turbospark_jax.kernels.rowinv.rowinv_matmul`, the norm as one program per
  row (:mod:`~turbospark_jax.kernels.row_norm`), attention over a per-layer cache as the
  fused kernel (:mod:`~turbospark_jax.kernels.attention`) fed by the RoPE-and-cache-write
  kernel (:mod:`~turbospark_jax.kernels.rope_store`), which in the row-invariant form runs
  inside the attention's first kernel for a decode or verify block and folds a long
  context's splits in the last split program. ``"tpu"`` on a TPU: the row-invariant
  products and attention in Pallas' TPU dialect (:mod:`~turbospark_jax.kernels.tpu_products`,
  :mod:`~turbospark_jax.kernels.tpu_attention` where it takes the shapes), the norm and RoPE
  in XLA's row-invariant tiled forms. ``"off"`` elsewhere: XLA's operations, and
  under ``row_invariant`` their fixed-shape tiled forms of
  :data:`~turbospark_jax.kernels.rowinv.XLA_ROW_TILE` rows
  (:func:`~turbospark_jax.kernels.rowinv.row_tiled`), since XLA's own CPU reductions and
  products change with the row count. ``"interpret"`` and ``"tpu_interpret"`` run the
  GPU's or the TPU's kernels in the Pallas interpreter: test fixtures
  (:meth:`KernelPlan.interpreted`) that check a graph's wiring on a CPU, never a serving
  choice.

One more field gives up the bits for speed, where no bits are promised:
``quant_matvec``, the few-row products of quantized weights on the CUDA cores
(:mod:`~turbospark_jax.kernels.quant_matvec`), which the GPU's non-exact plan takes.

:func:`kernel_plan` resolves the plan a loaded model serves with from the backend and the
user's one choice, ``exact``: the backend picks the kernel set once, when the model is
built, and a backend without kernels of ours gets XLA's with a notice
(:class:`UnknownBackendWarning`).

Families without row-invariant kernels (Qwen3.5, Gemma 4) take a plan too, never
row-invariant: its ``pallas`` names the backend's kernel set, from which they run what they
have at their one program width. Qwen3.5's delta rule walks its rows as
:func:`delta_rule_walk` says (the GPU's fused kernel, the TPU's, or an XLA loop), and the
grouped experts of any family take :func:`grouped_impl`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from turbospark_jax.core.checks import as_bool
from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels import (
    delta_rule,
    layers,
    quant_matvec,
    tpu_attention,
    tpu_delta_rule,
)
from turbospark_jax.kernels.rowinv import (
    dense,
    row_tiled,
    rowinv_matmul,
    rowinv_swiglu,
    schedule_for,
    sum_parts,
)
from turbospark_jax.kernels.tpu_products import TPU_IMPLS

#: Values of :attr:`KernelPlan.pallas`.
PALLAS = ("off", "compiled", "interpret", "tpu", "tpu_interpret")
#: The ``impl`` of the row-invariant products under each :attr:`KernelPlan.pallas`.
_IMPL = {"off": "xla", "compiled": "pallas", "interpret": "interpret", "tpu": "tpu",
         "tpu_interpret": "tpu_interpret"}
#: The backends with kernels of ours; any other runs XLA's (:func:`kernel_plan`).
BACKENDS = ("cpu", "gpu", "tpu")
#: The :attr:`KernelPlan.pallas` of each backend's kernel set.
_BACKEND_PALLAS = {"cpu": "off", "gpu": "compiled", "tpu": "tpu"}
#: The CPU's tiled attention runs at least one tile, like the product
#: (:data:`~turbospark_jax.kernels.rowinv.DOT_MIN_TILES`), not the norms' two: a one-row
#: decode step then attends with one tile of query rows, not two, and every width still
#: agrees (checked by the row-invariant model tests under the CPU's default XLA flags and
#: the tests' own).
ATTEND_MIN_TILES = 1


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """Which kernels a model's per-row work runs on (see the module docstring). Frozen and
    hashable: a static part of the model under ``jit``.

    Attributes:
      row_invariant: a row's bits do not depend on the number of rows in the call, so block
        programs of different widths agree bitwise (:attr:`widths_agree`).
      pallas: one of :data:`PALLAS`: ``"compiled"`` (the Pallas kernels on a GPU),
        ``"tpu"`` (the TPU's Pallas products and attention, XLA's tiled forms for the
        rest), ``"off"``
        (XLA's operations only), ``"interpret"`` or ``"tpu_interpret"`` (the GPU's or the
        TPU's kernels in the Pallas interpreter; tests only).
      quant_matvec: products of quantized weights at up to
        :data:`~turbospark_jax.kernels.quant_matvec.MAX_ROWS` rows (decode, a short verify)
        run on the CUDA cores (:mod:`~turbospark_jax.kernels.quant_matvec`), where the GPU's
        kernels run under ``row_invariant`` (elsewhere it changes nothing). That kernel sums
        in its own order, so such a product agrees bitwise across those row counts but not
        with a wider block's, which runs the tensor-core kernels: the plan of
        ``exact=False``, which promises no bits. Programs of different widths then still
        serve together (:attr:`widths_agree` picks the widths they run at) and agree to
        rounding.
    """

    row_invariant: bool = False
    pallas: str = "off"
    quant_matvec: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_invariant", as_bool("row_invariant", self.row_invariant))
        object.__setattr__(self, "quant_matvec", as_bool("quant_matvec", self.quant_matvec))
        if self.pallas not in PALLAS:
            raise BadInputError(
                f"pallas must be one of {', '.join(PALLAS)}; got {self.pallas!r}")

    @classmethod
    def interpreted(cls, row_invariant: bool = True, target: str = "gpu") -> KernelPlan:
        """The GPU's (or with ``target="tpu"`` the TPU's) plan with every Pallas kernel in
        the interpreter, for tests on a CPU (slow: tiny models only)."""
        if target not in ("gpu", "tpu"):
            raise BadInputError(f"target must be 'gpu' or 'tpu'; got {target!r}")
        return cls(row_invariant=row_invariant,
                   pallas="interpret" if target == "gpu" else "tpu_interpret")

    @property
    def widths_agree(self) -> bool:
        """Whether block programs of different widths agree row for row, so a model may
        serve at several widths: bitwise, except in the products of quantized weights under
        :attr:`quant_matvec` (equal to rounding there)."""
        return self.row_invariant

    @property
    def uses_pallas(self) -> bool:
        """Whether the GPU's Pallas kernels run (compiled or interpreted): the norm, the
        RoPE-and-cache-write and the fused attention kernels with the products. The TPU's
        plan runs its products and attention in Pallas (:attr:`impl`); its norm and RoPE
        take the forms of a plan without Pallas."""
        return self.pallas in ("compiled", "interpret")

    def quant_rows(self, x: jax.Array, ws: tuple[Any, ...]) -> bool:
        """Whether ``x @ ws`` runs on the CUDA-core kernel (:attr:`quant_matvec`): few
        enough rows, every weight quantized and taken by the kernel."""
        if not (self.quant_matvec and self.row_invariant and self.uses_pallas):
            return False
        return x.shape[0] <= quant_matvec.MAX_ROWS and all(
            quant_matvec.refusal(w) is None for w in ws)

    @property
    def impl(self) -> str:
        """The ``impl`` the row-invariant products and norm take under this plan."""
        return _IMPL[self.pallas]

    def parallel(self) -> KernelPlan:
        """The plan of a parallel prefill pass: it stands outside every bitwise guarantee,
        so XLA's kernels (and the faster, non-invariant forms of the Pallas ones)."""
        return dataclasses.replace(self, row_invariant=False, quant_matvec=False)


#: XLA's own kernels, no Pallas: a model's plan until loading resolves another (training and
#: tools want it: every piece differentiates and shards).
XLA_PLAN = KernelPlan()


class UnknownBackendWarning(UserWarning):
    """A model loads on a backend without kernels of ours (not one of :data:`BACKENDS`): it
    runs XLA's own kernels, at one program width."""


def kernel_plan(backend: str, exact: bool, row_invariant_family: bool, *,
                backend_kernels: bool = False) -> KernelPlan:
    """The plan a loaded model serves with: the backend picks its kernel set here, once.

    Args:
      backend: the JAX backend (``jax.default_backend()``). ``"gpu"``: the Pallas (Triton
        and Mosaic GPU) kernels; ``"tpu"``: the row-invariant products and attention in
        Pallas' TPU dialect beside XLA's tiled forms for the other pieces; ``"cpu"``: XLA's
        tiled forms. Any other backend runs XLA's own kernels, with an
        :class:`UnknownBackendWarning`.
      exact: whether the exact prefill should run in wide blocks that agree bitwise with
        token-by-token decoding (the row-invariant plan). On a GPU the row-invariant kernels
        are also the fastest, so both choices take them there, and ``exact=False`` adds
        :attr:`KernelPlan.quant_matvec` (a quantized weight's decode product on the CUDA
        cores, which no wide block sums alike); on another backend the row-invariant forms
        are fixed-shape tiles (and on a TPU, products of fixed blocks) that decode slower
        than XLA's own kernels, which ``exact=False`` takes instead.
      row_invariant_family: the family has row-invariant kernels
        (:attr:`~turbospark_jax.models.base.BlockModel.row_invariant_kernels`); one without
        them runs at one program width.
      backend_kernels: the family, without row-invariant kernels, has kernels of its own
        per backend (:attr:`~turbospark_jax.models.base.BlockModel.backend_kernels`: Qwen3.5's
        delta-rule walk, the grouped experts of Qwen3.5 and Gemma 4): it gets the backend's
        kernel set (``pallas``) without ``row_invariant``, whatever ``exact`` says, since
        each of those kernels is the one program of every path. Otherwise such a family
        runs XLA's kernels.

    Raises:
      BadInputError: ``exact``, ``row_invariant_family`` or ``backend_kernels`` not a bool,
        ``backend`` not a str.
    """
    exact = as_bool("exact", exact)
    if not isinstance(backend, str):
        raise BadInputError(f"backend must be a JAX backend name; got {backend!r}")
    family = as_bool("row_invariant_family", row_invariant_family)
    own = as_bool("backend_kernels", backend_kernels)
    if backend not in BACKENDS:
        warnings.warn(f"turbospark_jax has no kernels for the {backend!r} backend; XLA's own "
                      "kernels run (no row-invariant plan, one program width)",
                      UnknownBackendWarning, stacklevel=2)
        return XLA_PLAN
    if not family:
        return KernelPlan(pallas=_BACKEND_PALLAS[backend]) if own else XLA_PLAN
    if backend == "gpu":
        return KernelPlan(row_invariant=True, pallas="compiled", quant_matvec=not exact)
    if exact:
        return KernelPlan(row_invariant=True, pallas=_BACKEND_PALLAS[backend])
    return XLA_PLAN


def matmul(plan: KernelPlan, x: jax.Array, w: jax.Array | tuple[jax.Array, ...],
           out_dtype: Any = None, w_layout: str = "kn", label: str = "") -> jax.Array:
    """``x [W, K] @ w [K, N]`` in ``out_dtype`` (``x.dtype`` when None), float32 accumulation.

    ``w`` may be a tuple of weights whose products come out side by side (one launch under
    a row-invariant plan), and ``w_layout="nk"`` takes weights stored ``[N, K]`` (a tied
    head); ``label`` names the row-invariant kernel in a profile. A weight may be a
    :class:`~turbospark_jax.quant.weights.QuantizedWeight` (``[K, N]``): the row-invariant
    kernels read it at its stored width where they can (a decode step's), XLA's multiply by
    it dequantized, and under :attr:`KernelPlan.quant_matvec` a few rows' product of
    quantized weights runs on the CUDA cores."""
    ws = w if isinstance(w, tuple) else (w,)
    if w_layout == "kn" and plan.quant_rows(x, ws):
        return quant_matvec.quant_matmul(x, ws, out_dtype=out_dtype, impl=plan.impl,
                                         label=label)
    if plan.row_invariant:
        return rowinv_matmul(x, w, w_layout=w_layout, out_dtype=out_dtype, impl=plan.impl,
                             schedule=_schedule(x, w, w_layout), label=label)
    ws = dense(w if isinstance(w, tuple) else (w,), x.dtype)
    if w_layout == "nk":
        ws = tuple(a.T for a in ws)
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=1)
    if out_dtype is None:
        return x @ w
    return jnp.matmul(x, w, preferred_element_type=out_dtype)


def grouped_impl(plan: KernelPlan) -> str:
    """The form the grouped expert products take under ``plan``
    (:func:`~turbospark_jax.kernels.grouped.expert_mlp`): the Pallas kernels where the
    GPU's kernels run (compiled or interpreted), the XLA loop over tiles elsewhere. Every
    plan groups, so a decode step and a prefill compute a token's experts alike."""
    return plan.impl if plan.uses_pallas else "xla"


def check_backend_plan(plan: Any, family: str) -> None:
    """Refuse what a family without row-invariant kernels cannot run as its plan: anything
    but a :class:`KernelPlan`, or one with ``row_invariant``.

    Raises:
      BadInputError: naming ``family`` and the plan.
    """
    if not isinstance(plan, KernelPlan):
        raise BadInputError(f"plan must be a KernelPlan (turbospark_jax.kernels.plan); "
                            f"got {plan!r}")
    if plan.row_invariant:
        raise BadInputError(f"the {family} family has no row-invariant kernels; its plan "
                            f"must not be row_invariant, got {plan}")


#: Values of :func:`delta_rule_walk`.
DELTA_RULE_WALKS = ("xla", "pallas", "interpret", "tpu", "tpu_interpret")


def delta_rule_walk(plan: KernelPlan, key_dim: int, value_dim: int) -> str:
    """How a gated DeltaNet layer's exact path walks its rows under ``plan``, for heads of
    ``key_dim`` and ``value_dim``: ``"pallas"``, the GPU's kernel with the layer's preamble
    fused in (:mod:`~turbospark_jax.kernels.delta_rule`), where its tiles fit the heads;
    ``"tpu"``, the TPU's (:mod:`~turbospark_jax.kernels.tpu_delta_rule`), likewise; either
    one's interpreted form (``"interpret"``, ``"tpu_interpret"``: tests, any heads); else
    ``"xla"``, a loop of XLA's operations. Every walk runs one loop body per row whatever
    the live count; two walks agree within float32 rounding, not bitwise."""
    if plan.pallas in ("interpret", "tpu_interpret"):
        return plan.pallas
    if plan.pallas == "compiled" and delta_rule.supported(key_dim, value_dim):
        return "pallas"
    if plan.pallas == "tpu" and tpu_delta_rule.supported(key_dim, value_dim):
        return "tpu"
    return "xla"


def _require_row_invariant(plan: KernelPlan, what: str) -> None:
    if not plan.row_invariant:
        raise BadInputError(f"{what} is a row-invariant kernel; the plan {plan} is not")


def swiglu(plan: KernelPlan, x: jax.Array, gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU's hidden rows ``silu(x @ gate) * (x @ up)`` under a row-invariant plan: one
    launch on a GPU that gates in its epilogue
    (:func:`~turbospark_jax.kernels.rowinv.rowinv_swiglu`), labelled ``gate_up``."""
    _require_row_invariant(plan, "the gated product")
    if plan.quant_rows(x, (gate, up)):
        return quant_matvec.quant_swiglu(x, gate, up, impl=plan.impl, label="gate_up")
    return rowinv_swiglu(x, gate, up, impl=plan.impl, label="gate_up")


def matmul_parts(plan: KernelPlan, x: jax.Array, w: jax.Array | tuple[jax.Array, ...],
                 label: str = "") -> jax.Array:
    """``x @ w`` under a row-invariant plan, unfinished: float32 partial sums over K
    ``[S, W, N]`` (:func:`~turbospark_jax.kernels.rowinv.sum_parts` finishes them; so do
    :func:`add_norm` and the RoPE-and-cache-write kernel, without a launch of their own)."""
    _require_row_invariant(plan, "a product's partial sums")
    if plan.quant_rows(x, w if isinstance(w, tuple) else (w,)):
        return quant_matvec.quant_matmul(x, w, parts=True, impl=plan.impl, label=label)
    return rowinv_matmul(x, w, parts=True, impl=plan.impl, schedule=_schedule(x, w, "kn"),
                         label=label)


def _schedule(x: jax.Array, w: Any, w_layout: str) -> Any:
    ws = w if isinstance(w, tuple) else (w,)
    return schedule_for(x.shape[-1], sum(a.shape[0 if w_layout == "nk" else 1] for a in ws))


def add_norm(plan: KernelPlan, residual: jax.Array, parts: jax.Array,
             weight: jax.Array | None, eps: float) -> tuple[jax.Array, jax.Array]:
    """``h = residual + sum_parts(parts)`` and its RMSNorm, ``(h, normed)``, under a
    row-invariant plan: one kernel where the Pallas kernels run
    (:func:`~turbospark_jax.kernels.row_norm.add_parts_rms_norm`), the sum (elementwise) and
    the tiled norm elsewhere. Both round ``h`` exactly as finishing the product and adding
    it would."""
    _require_row_invariant(plan, "the norm after partial sums")
    if plan.uses_pallas:
        from turbospark_jax.kernels.row_norm import add_parts_rms_norm

        return add_parts_rms_norm(residual, parts, weight, eps, impl=plan.impl)
    h = residual + sum_parts(parts, residual.dtype)
    return h, rms_norm(plan, h, weight, eps)


def rms_norm(plan: KernelPlan, x: jax.Array, weight: jax.Array | None,
             eps: float) -> jax.Array:
    """:func:`~turbospark_jax.kernels.layers.rms_norm` over the last axis of ``x [..., D]``;
    under a row-invariant plan every leading index is a row of the norm kernel or of the
    fixed-shape tiles."""
    if not plan.row_invariant:
        return layers.rms_norm(x, weight, eps)
    if plan.uses_pallas:
        from turbospark_jax.kernels.row_norm import row_rms_norm

        return row_rms_norm(x, weight, eps, impl=plan.impl)
    rows = x.reshape(-1, x.shape[-1])
    if weight is None:
        return row_tiled(lambda t: layers.rms_norm(t, None, eps), rows).reshape(x.shape)
    return row_tiled(lambda t, w: layers.rms_norm(t, w, eps), rows,
                     shared=(weight,)).reshape(x.shape)


def _tiles_elementwise(plan: KernelPlan) -> bool:
    """Whether RoPE's tables and rotation run in fixed-shape tiles: under a row-invariant
    plan without the Pallas kernels (XLA's vectorised sine and cosine, and its fusions on
    the CPU, need not round a row alike at every row count). Beside the Pallas kernels that
    elementwise arithmetic runs as XLA writes it (no reduction, so nothing whose order could
    follow the shape)."""
    return plan.row_invariant and not plan.uses_pallas


def rope_cos_sin(plan: KernelPlan, positions: jax.Array, inv_freq: Any, scale: float,
                 dtype: Any) -> tuple[jax.Array, jax.Array]:
    """:func:`~turbospark_jax.kernels.layers.rope_cos_sin` of ``positions [W]``."""
    if not _tiles_elementwise(plan):
        return layers.rope_cos_sin(positions, inv_freq, scale, dtype)
    return row_tiled(lambda p: layers.rope_cos_sin(p, inv_freq, scale, dtype), positions)


def apply_rope(plan: KernelPlan, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """:func:`~turbospark_jax.kernels.layers.apply_rope` of ``x [W, N, hd]``."""
    if not _tiles_elementwise(plan):
        return layers.apply_rope(x, cos, sin)
    return row_tiled(layers.apply_rope, x, cos, sin)


def attend(plan: KernelPlan, q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
           k_positions: jax.Array, window: Any) -> jax.Array:
    """:func:`~turbospark_jax.kernels.layers.attend` of queries ``[W, H, hd]`` over keys and
    values ``[S, KV, hd]``; under a row-invariant plan the queries go in fixed-shape tiles,
    so a query row's score and value products have one shape whatever ``W`` is. Under the
    TPU's plan the TPU kernel runs where it takes the shapes
    (:func:`~turbospark_jax.kernels.tpu_attention.supported`): it walks the keys in blocks at
    fixed offsets with query tiles of one height, the same structure. Without the
    Pallas kernels each tile walks the keys in blocks up to the last one its rows see
    (:func:`_attend_blocks`); beside them (where this is the fallback for shapes the fused
    kernel does not take) it takes the whole softmax, since on a GPU a loop whose trip count
    is data waits on the host, per block."""
    if not plan.row_invariant:
        return layers.attend(q, k, v, q_positions, k_positions, window)
    if plan.impl in TPU_IMPLS and tpu_attention.supported(q.shape[-1], window):
        return tpu_attention.tpu_attention(q, k, v, q_positions, k_positions, window,
                                           impl=plan.impl)
    attend_tile = layers.attend if plan.uses_pallas else _attend_blocks
    return row_tiled(
        lambda qt, pt, k, v, kp: attend_tile(qt, k, v, pt, kp, window), q, q_positions,
        shared=(k, v, k_positions), min_tiles=ATTEND_MIN_TILES,
    )


#: Keys per block of the row-invariant XLA form's attention (:func:`_attend_blocks`).
KEY_BLOCK = 256


def _attend_blocks(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                   k_positions: jax.Array, window: Any) -> jax.Array:
    """Causal grouped-query attention of a tile of query rows ``[T, H, hd]`` over ``[S, KV,
    hd]`` keys and values (the contract of :func:`~turbospark_jax.kernels.layers.attend`),
    walking the keys in blocks of :data:`KEY_BLOCK` rows at fixed offsets, up to the block of
    the last key a row of the tile sees, with an online softmax (as the GPU kernel does).

    A decode step then reads its context's blocks, not the whole cache. A row's bits do not
    depend on how many blocks its tile walks: a block with no key the row sees leaves its
    maximum, multiplies its sums by ``exp(0) == 1`` and adds exact zeros (the maximum starts
    at the finite ``MASK_VALUE``: blocks before the first key a row sees add only what the
    first such block then multiplies by ``exp(MASK_VALUE - m) == 0``). The last block may
    overlap the one before it (it ends at ``S``); keys before its nominal start are masked.
    """
    rows, heads, head_dim = q.shape
    length, kv_heads, _ = k.shape
    block = min(KEY_BLOCK, length)
    groups = heads // kv_heads
    qg = q.reshape(rows, kv_heads, groups, head_dim)
    scale = head_dim**-0.5
    # The last cache row any row of the tile sees: an exact integer reduction.
    index = jnp.arange(length, dtype=jnp.int32)
    last = jnp.max(jnp.where(k_positions <= jnp.max(q_positions), index, -1))
    blocks = (last + block) // block

    def one(b: jax.Array, carry: tuple) -> tuple:
        acc, m, l = carry
        nominal = b * block
        start = jnp.minimum(nominal, length - block)
        kb, vb, pb = (jax.lax.dynamic_slice_in_dim(a, start, block, 0)
                      for a in (k, v, k_positions))
        scores = jnp.einsum("wkgd,skd->kgws", qg, kb,
                            preferred_element_type=jnp.float32) * scale
        visible = (pb[None, :] <= q_positions[:, None]) & (
            (start + jnp.arange(block))[None, :] >= nominal)
        if window is not None:
            visible &= pb[None, :] > q_positions[:, None] - window
        scores = jnp.where(visible[None, None], scores, layers.MASK_VALUE)
        top = jnp.maximum(m, jnp.max(scores, axis=-1))
        fade = jnp.exp(m - top)
        probs = jnp.exp(scores - top[..., None])
        acc = acc * fade[..., None] + jnp.einsum(
            "kgws,skd->kgwd", probs.astype(v.dtype), vb, preferred_element_type=jnp.float32)
        return acc, top, l * fade + jnp.sum(probs, axis=-1)

    shape = (kv_heads, groups, rows)
    acc, _, l = jax.lax.fori_loop(0, blocks, one, (
        jnp.zeros((*shape, head_dim), jnp.float32),
        jnp.full(shape, layers.MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32)))
    l = jnp.where(l > 0, l, 1.0)  # a tile of padding rows that sees no key: zeros, not NaN
    out = (acc / l[..., None]).astype(v.dtype)  # [KV, G, T, hd]
    return out.transpose(2, 0, 1, 3).reshape(rows, heads, head_dim)
