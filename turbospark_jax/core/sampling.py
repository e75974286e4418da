"""Pure, jittable next-token samplers with every setting a traced value.

Each sampling setting is a traced ``jnp`` scalar inside :class:`SamplingParams`, so one compiled
program serves greedy decoding, nucleus sampling and everything between: the decode loop runs
sampling inside one jitted ``while_loop``, and a program per setting would both cost compiles
and break the "same program, different data" rule our bitwise guarantees rest on.

Composition order (what :func:`process_logits` does to a ``f32[V]`` logits vector):

1. **Penalties**, always, even when greedy:

   * repetition penalty ``r`` (Hugging Face semantics) on every id in ``History.seen`` (the
     prompt and everything generated): a positive logit is divided by ``r``, a negative one
     multiplied by ``r``;
   * presence penalty (OpenAI semantics): subtracted once from every id generated at least once;
   * frequency penalty: ``penalty * count`` subtracted, ``count`` = times the id was generated.

2. **Greedy stop.** At ``temperature == 0`` the penalized logits are returned as they are: no
   scaling, no filtering. The greedy token is their argmax, the lowest id among equal maxima.

3. **Temperature.** ``(logits - max(logits)) / temperature``. The shift changes nothing that a
   softmax sees, but keeps a tiny temperature from overflowing every logit to ``inf``.

4. **Top-k**, then **top-p** (on the distribution renormalized over the top-k survivors), then
   **min-p** (keep ids whose probability is at least ``min_p`` times the top one's). Filtered ids
   become ``-inf``. ``top_k == 0`` or ``top_k >= V`` is off; ``top_p == 1`` is off; ``min_p == 0``
   is off.

Ties: top-k and top-p rank ids by a stable sort on descending logit, so among equal logits the
lower id ranks first. Top-k therefore keeps exactly ``min(k, V)`` ids (``top_k=1`` is greedy,
ties included), and top-p keeps the shortest rank prefix whose probability mass reaches ``top_p``
(never less than the top-ranked id). Min-p compares values, so equal logits are kept or dropped
together.

Cost: :func:`sample` and :func:`probabilities` branch with ``lax.cond``, so a greedy step never
ranks the vocabulary, and a sampled step ranks only with top-k or top-p on: its best
:data:`CANDIDATES` ids (:func:`_top`), sorting the whole vocabulary only when they cannot
decide the cut (top-p alone, its mass not reached among them), and with the cut among them
its noise is drawn for those ids alone. (Under ``vmap``
with a batched setting ``lax.cond`` turns into a select that runs both branches; a batched
program compiles :func:`draw` with ``truncate=False`` for steps where no row needs the sort.)
A program that knows on the host which kind of draw a request needs compiles
:func:`draw_as` with that plan (:func:`draw_plan`) instead: the same token, with no branch
(on a GPU each ``lax.cond`` waits on the host for its predicate, a stall per drawn token).

The three public entry points check their arguments (:func:`check_sampling_args`) and call a
``jax.jit``-wrapped core: called eagerly they run one cached program instead of re-tracing both
``lax.cond`` branches per call; inside an outer ``jit`` they simply inline.

Keys: :func:`request_key` turns a request's seed into a key and :func:`token_key` folds in the
index of the generated token, so a token's randomness never depends on how the decode loop was
split into bursts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from numbers import Integral, Real

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from turbospark_jax.core.checks import as_int
from turbospark_jax.errors import BadInputError

__all__ = [
    "DRAW_PLANS",
    "History",
    "SamplingConfig",
    "SamplingParams",
    "categorical",
    "check_sampling_args",
    "distribution",
    "draw",
    "draw_as",
    "draw_plan",
    "draw_processed",
    "greedy_token",
    "is_greedy",
    "needs_truncation",
    "probabilities",
    "process_logits",
    "request_key",
    "sample",
    "token_key",
    "unpack_mask",
]


def _real(name: str, value: object) -> float:
    """``value`` as a Python float, or BadInputError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real | np.ndarray | jax.Array):
        raise BadInputError(f"{name} must be a real number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise BadInputError(f"{name} must be a real scalar, got {value!r}") from exc


def checked_settings(temperature: object = 0.0, top_k: object = 0, top_p: object = 1.0,
                     min_p: object = 0.0, repetition_penalty: object = 1.0,
                     presence_penalty: object = 0.0,
                     frequency_penalty: object = 0.0) -> dict[str, float | int]:
    """The sampling settings checked and normalised on the host, touching no JAX backend (a
    request is checked when it is made, which may be before a backend may start): ranges as
    :meth:`SamplingParams.make` documents them, ``top_k`` capped to int32.

    Raises:
      BadInputError: a setting is outside its range; the message names it.
    """
    t = _real("temperature", temperature)
    if not (math.isfinite(t) and t >= 0.0):
        raise BadInputError(f"temperature must be finite and >= 0 (0 = greedy), got {t}")
    if isinstance(top_k, bool) or not isinstance(top_k, Integral | np.integer):
        raise BadInputError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    k = int(top_k)
    if k < 0:
        raise BadInputError(f"top_k must be >= 0 (0 = off), got {k}")
    # Values past int32 cannot be stored; they exceed any vocabulary, i.e. mean "off".
    k = min(k, int(np.iinfo(np.int32).max))
    p = _real("top_p", top_p)
    if not 0.0 < p <= 1.0:  # NaN fails this comparison too
        raise BadInputError(f"top_p must be in (0, 1] (1 = off), got {p}")
    m = _real("min_p", min_p)
    if not 0.0 <= m <= 1.0:
        raise BadInputError(f"min_p must be in [0, 1] (0 = off), got {m}")
    r = _real("repetition_penalty", repetition_penalty)
    if not (math.isfinite(r) and r > 0.0):
        raise BadInputError(f"repetition_penalty must be finite and > 0 (1 = off), got {r}")
    pres = _real("presence_penalty", presence_penalty)
    if not math.isfinite(pres):
        raise BadInputError(f"presence_penalty must be finite (0 = off), got {pres}")
    freq = _real("frequency_penalty", frequency_penalty)
    if not math.isfinite(freq):
        raise BadInputError(f"frequency_penalty must be finite (0 = off), got {freq}")
    return dict(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r,
                presence_penalty=pres, frequency_penalty=freq)


@struct.dataclass(kw_only=True)
class SamplingParams:
    """Sampling settings, every one a traced scalar so one program serves them all.

    Build with :meth:`make` (validates on the host) or :meth:`greedy`.

    Fields (all 0-d arrays):
      temperature:        f32[]  0 means greedy (argmax of the penalized logits).
      top_k:              i32[]  keep the k best ids; 0 (or >= vocab size) means off.
      top_p:              f32[]  nucleus mass in (0, 1]; 1 means off.
      min_p:              f32[]  in [0, 1]; keep ids with p >= min_p * p_max; 0 means off.
      repetition_penalty: f32[]  > 0; 1 means off. Over prompt and generated ids (``seen``).
      presence_penalty:   f32[]  0 means off. Subtracted once per generated id.
      frequency_penalty:  f32[]  0 means off. Subtracted ``count`` times per generated id.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array

    @classmethod
    def make(
        cls,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
    ) -> SamplingParams:
        """Validate the settings on the host and build the params.

        Args:
          temperature: >= 0 and finite; 0 selects greedy decoding.
          top_k: integer >= 0; 0 (or any value >= the vocabulary size) turns it off.
          top_p: in (0, 1]; 1 turns it off.
          min_p: in [0, 1]; 0 turns it off.
          repetition_penalty: finite and > 0; 1 turns it off.
          presence_penalty: finite; 0 turns it off.
          frequency_penalty: finite; 0 turns it off.

        Returns:
          The params, each field a 0-d float32 (``top_k``: int32) array. The dtypes are fixed so
          that params built from different values never cause a recompile.

        Raises:
          BadInputError: a setting is outside the range above; the message names it.
        """
        c = checked_settings(temperature, top_k, top_p, min_p, repetition_penalty,
                             presence_penalty, frequency_penalty)

        def f32(name: str) -> jax.Array:
            return jnp.asarray(np.float32(c[name]))

        return cls(
            temperature=f32("temperature"),
            top_k=jnp.asarray(np.int32(c["top_k"])),
            top_p=f32("top_p"),
            min_p=f32("min_p"),
            repetition_penalty=f32("repetition_penalty"),
            presence_penalty=f32("presence_penalty"),
            frequency_penalty=f32("frequency_penalty"),
        )

    @classmethod
    def greedy(cls) -> SamplingParams:
        """Params for plain greedy decoding: temperature 0, no penalties."""
        return cls.make()

    @property
    def is_greedy(self) -> bool:
        """Whether these params decode greedily (temperature 0). Host-side: not under ``jit``."""
        return bool(self.temperature <= 0)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """A request's sampling settings as plain host values (see the module docstring for the
    order they apply in); :meth:`to_params` validates them into :class:`SamplingParams`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def check(self) -> None:
        """Raise BadInputError naming a bad setting; touches no JAX backend."""
        checked_settings(**dataclasses.asdict(self))

    def to_params(self) -> SamplingParams:
        """Validated device params; raises BadInputError naming a bad setting."""
        return SamplingParams.make(**dataclasses.asdict(self))


@struct.dataclass(kw_only=True)
class History:
    """What the penalties look at, kept as fixed-size vectors so updates stay jittable.

    Fields:
      counts: i32[V]  times each id was generated (presence and frequency penalties).
      seen:   bool[V] the id appears in the prompt or was generated (repetition penalty).
    """

    counts: jax.Array
    seen: jax.Array

    @classmethod
    def empty(cls, vocab_size: int) -> History:
        """A history with nothing seen, for a vocabulary of ``vocab_size`` ids.

        Raises:
          BadInputError: ``vocab_size`` is not a positive integer.
        """
        _check_vocab_size(vocab_size)
        return cls(
            counts=jnp.zeros((vocab_size,), jnp.int32),
            seen=jnp.zeros((vocab_size,), jnp.bool_),
        )

    @classmethod
    def from_prompt(
        cls, prompt_ids: Sequence[int] | np.ndarray | jax.Array, vocab_size: int
    ) -> History:
        """A history whose ``seen`` marks the prompt ids; nothing counts as generated yet.

        Args:
          prompt_ids: the prompt's token ids (any 1-d integer sequence, possibly empty).
          vocab_size: length of the logits vectors the history will be applied to.

        Returns:
          The history. Under ``jit`` (traced ids) ids outside ``[0, vocab_size)`` are dropped.

        Raises:
          BadInputError: ``vocab_size`` is not positive, or a concrete id is out of range.
        """
        _check_vocab_size(vocab_size)
        if not isinstance(prompt_ids, jax.core.Tracer):
            host = np.asarray(prompt_ids)
            if host.size and (host.ndim != 1 or not np.issubdtype(host.dtype, np.integer)):
                raise BadInputError(
                    f"prompt_ids must be a 1-d sequence of integer ids, got shape {host.shape} "
                    f"dtype {host.dtype}"
                )
            bad = host[(host < 0) | (host >= vocab_size)] if host.size else host
            if bad.size:
                raise BadInputError(
                    f"prompt id {int(bad[0])} is outside the vocabulary [0, {vocab_size})"
                )
            # Built on the host: a device scatter would compile anew for every prompt length.
            seen = np.zeros((vocab_size,), np.bool_)
            seen[host.astype(np.int64).reshape(-1)] = True
            return cls(counts=jnp.zeros((vocab_size,), jnp.int32), seen=jnp.asarray(seen))
        ids = jnp.asarray(prompt_ids, jnp.int32)
        empty = cls.empty(vocab_size)
        return empty.replace(seen=empty.seen.at[_droppable(ids, vocab_size)].set(True, mode="drop"))

    def add(self, token: jax.Array) -> History:
        """Record one generated ``token`` (jittable; an id outside the vocabulary is dropped)."""
        vocab_size = self.counts.shape[0]
        index = _droppable(jnp.asarray(token, jnp.int32), vocab_size)
        return self.replace(
            counts=self.counts.at[index].add(1, mode="drop"),
            seen=self.seen.at[index].set(True, mode="drop"),
        )


def _check_vocab_size(vocab_size: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, Integral) or vocab_size <= 0:
        raise BadInputError(f"vocab_size must be a positive integer, got {vocab_size!r}")


def _droppable(ids: jax.Array, vocab_size: int) -> jax.Array:
    """Map negative ids past the end so ``mode="drop"`` drops them instead of wrapping."""
    return jnp.where(ids < 0, vocab_size, ids)


def check_sampling_args(
    params: object, history: object, key: object | None = None, vocab_size: int | None = None
) -> None:
    """Refuse arguments the samplers cannot take, before anything is traced or run.

    Args:
      params: must be :class:`SamplingParams`.
      history: must be a :class:`History` (of ``vocab_size`` ids when that is given).
      key: when given, a PRNG key: a typed key array of shape ``[]`` (:func:`request_key`,
        :func:`token_key`) or a raw ``uint32[2]`` key.
      vocab_size: the logits length the history must match.

    Raises:
      BadInputError: naming the argument that is wrong.
    """
    if not isinstance(params, SamplingParams):
        raise BadInputError(
            f"params must be SamplingParams (SamplingParams.make(...) or "
            f"SamplingConfig(...).to_params()), got {type(params).__name__}"
        )
    if not isinstance(history, History):
        raise BadInputError(
            f"history must be a sampling.History (History.from_prompt or History.empty), got "
            f"{type(history).__name__}"
        )
    if vocab_size is not None and (
        np.shape(history.counts) != (vocab_size,) or np.shape(history.seen) != (vocab_size,)
    ):
        raise BadInputError(
            f"history is for a vocabulary of shape {np.shape(history.counts)}, the logits have "
            f"{vocab_size} ids"
        )
    if key is not None:
        _check_key(key)


def _check_key(key: object) -> None:
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if isinstance(key, jax.Array | np.ndarray) and dtype is not None:
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ():
            return
        if dtype == np.uint32 and shape == (2,):
            return
    raise BadInputError(
        f"key must be a PRNG key (sampling.request_key(seed), or token_key of one), got "
        f"{type(key).__name__}{'' if shape is None else f' of shape {shape} and dtype {dtype}'}"
    )


def _check_logits(logits: jax.Array, history: History) -> jax.Array:
    """``logits`` as float32 ``[V]`` matching the history; BadInputError otherwise."""
    if not isinstance(logits, jax.Array | np.ndarray) or not (
        jnp.issubdtype(logits.dtype, jnp.floating)
    ):
        raise BadInputError(
            f"logits must be a float array, got {type(logits).__name__}"
            f"{' of dtype ' + str(logits.dtype) if hasattr(logits, 'dtype') else ''}"
        )
    if logits.ndim != 1:
        raise BadInputError(
            f"logits must be a 1-d [vocab_size] vector (vmap for batches), got shape {logits.shape}"
        )
    if history.counts.shape != logits.shape or history.seen.shape != logits.shape:
        raise BadInputError(
            f"history is for a vocabulary of {history.counts.shape[0]} ids but logits have "
            f"{logits.shape[0]}"
        )
    return logits


def _penalize(logits: jax.Array, params: SamplingParams, history: History) -> jax.Array:
    """Repetition, then presence, then frequency penalty. Neutral values change no bit."""
    r = params.repetition_penalty
    repeated = jnp.where(logits > 0, logits / r, logits * r)
    logits = jnp.where(history.seen, repeated, logits)
    generated = (history.counts > 0).astype(jnp.float32)
    logits = logits - params.presence_penalty * generated
    return logits - params.frequency_penalty * history.counts.astype(jnp.float32)


def _kept_by_top_k(params: SamplingParams, vocab_size: int) -> jax.Array:
    """How many of the best ids top-k keeps: all of them when it is off."""
    k = params.top_k
    return jnp.where((k <= 0) | (k >= vocab_size), vocab_size, k)


def _kept_by_top_p(probs: jax.Array, params: SamplingParams) -> jax.Array:
    """Top-p's keep mask over ``probs``, ranked best first."""
    # Mass strictly before each rank: rank 0 sees 0 < top_p, so the top id always survives.
    mass_before = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(probs)[:-1]])
    # At top_p == 1 rounding could push the running sum to 1 early; "off" must mean off.
    return (mass_before < params.top_p) | (params.top_p >= 1.0)


def _sort_filters(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    """Top-k then top-p on temperature-scaled logits; returns the bool[V] keep mask."""
    vocab_size = scaled.shape[0]
    ids = lax.iota(jnp.int32, vocab_size)
    # Stable ascending sort of the negated logits: descending logits, lower id first on ties.
    neg_sorted, order = lax.sort((-scaled, ids), num_keys=1, is_stable=True)
    sorted_logits = -neg_sorted
    keep_sorted = ids < _kept_by_top_k(params, vocab_size)
    probs = jax.nn.softmax(jnp.where(keep_sorted, sorted_logits, -jnp.inf))
    keep_sorted &= _kept_by_top_p(probs, params)
    # ``order`` is a permutation: every index is in range and written once.
    return (
        jnp.zeros((vocab_size,), jnp.bool_)
        .at[order]
        .set(keep_sorted, mode="promise_in_bounds", unique_indices=True)
    )


#: How many of the best ids the top-k / top-p filter ranks before it would sort the whole
#: vocabulary (:func:`_candidate_filters`).
CANDIDATES = 64
#: Ids a block of the GPU's candidate search holds (:func:`_blocked_top`): a top-k of that
#: many is one sort of a row in a GPU's shared memory, one kernel for all the rows.
TOP_BLOCK = 1024


def candidates() -> int:
    """The candidate count (static under jit): :data:`CANDIDATES`."""
    return CANDIDATES


def _blocked_top(x: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, count)`` over a long ``x`` as top-k of blocks, level by level: each
    block of :data:`TOP_BLOCK` keeps its best ``count``, and their concatenation is searched
    the same way until one block remains. Same values and ids as one top-k (descending, the
    lower id first on ties): every id of the whole best ``count`` is among its block's best,
    and equal values keep id order from level to level (blocks are runs of consecutive
    positions, a block's equal values come out in position order). On a GPU, where XLA's
    top-k above k = 16 sorts its input, this sorts rows of 1,024 (one kernel a level) instead
    of the whole vocabulary (about thirty kernels for 128k ids)."""
    values, ids = x, lax.iota(jnp.int32, x.shape[0])
    while values.shape[0] > TOP_BLOCK:
        n = values.shape[0]
        blocks = -(-n // TOP_BLOCK)
        pad = blocks * TOP_BLOCK - n
        # Padding loses every tie to a real id (it sits after them) and never reaches the
        # last level's best ``count``: ``x`` has more than ``count`` real ids.
        v = jnp.pad(values, (0, pad), constant_values=-jnp.inf).reshape(blocks, TOP_BLOCK)
        i = jnp.pad(ids, (0, pad), constant_values=x.shape[0]).reshape(blocks, TOP_BLOCK)
        best, at = lax.top_k(v, count)
        values, ids = best.reshape(-1), jnp.take_along_axis(i, at, axis=1).reshape(-1)
    best, at = lax.top_k(values, count)
    return best, ids[at]


def _top(x: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, count)``: on a CPU XLA's own (each output behind its own barrier: an
    expression that relates the candidates to the whole of ``x``, a normaliser, makes XLA's
    CPU compiler turn the top-k back into a full sort; one barrier over both outputs crashes
    XLA's SPMD partitioner on a mesh), elsewhere :func:`_blocked_top`."""
    if jax.default_backend() != "cpu":
        return _blocked_top(x, count)
    values, ids = lax.top_k(x, count)
    return lax.optimization_barrier(values), lax.optimization_barrier(ids)


def _candidate_filters(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    """:func:`_sort_filters`' keep mask from the :func:`candidates` best ids alone, when they
    decide it, else from the whole sorted vocabulary.

    :func:`_top` ranks the candidates as the stable sort ranks them (descending, the lower id
    first on ties). They decide the mask when top-k keeps at most that many ids (the
    same ids in the same order; top-p then normalises over them as the sort does), or when
    top-k is off and top-p's cut falls among them (the last candidate is cut, so every later
    id is too; the normaliser is the whole vocabulary's, one sum). The masks are the same ids
    but for a cut within float32 rounding of ``top_p`` (the sums associate differently). On a
    CPU this spares a sort of the whole vocabulary on most sampled steps (the figures:
    docs/decisions/0016-top-64-sampling.md)."""
    vocab_size, count = scaled.shape[0], candidates()
    if vocab_size <= count:
        return _sort_filters(scaled, params)
    values, ids = _top(scaled, count)
    k = _kept_by_top_k(params, vocab_size)
    top_k_small = k <= count
    keep, in_top_k = _kept_among(values, params, k)
    in_vocabulary = jnp.exp(values - values[0]) / jnp.sum(jnp.exp(scaled - values[0]))
    keep &= _kept_by_top_p(jnp.where(top_k_small, in_top_k, in_vocabulary), params)
    return lax.cond(
        top_k_small | ((k == vocab_size) & ~keep[-1]),
        lambda: jnp.zeros((vocab_size,), jnp.bool_).at[ids].set(
            keep, mode="drop", unique_indices=True),
        lambda: _sort_filters(scaled, params),
    )


def _kept_among(values: jax.Array, params: SamplingParams,
                k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Top-k's keep mask over ranked candidates ``values`` (``k`` of them kept, from
    :func:`_kept_by_top_k`) and the distribution top-p then reads when top-k keeps no more
    than the candidates: their softmax over the kept."""
    keep = lax.iota(jnp.int32, values.shape[0]) < k
    return keep, jax.nn.softmax(jnp.where(keep, values, -jnp.inf))


def _scaled(penalized: jax.Array, params: SamplingParams) -> jax.Array:
    """The penalized logits shifted to a maximum of 0 and divided by the temperature."""
    # Safe divisor: under vmap both cond branches run, and this one must not divide by 0.
    t = jnp.where(params.temperature > 0, params.temperature, 1.0)
    return (penalized - jnp.max(penalized)) / t


def _sampling_logits(
    penalized: jax.Array, params: SamplingParams, truncate: bool | str = True
) -> jax.Array:
    """Temperature, top-k, top-p, min-p on penalized logits (the temperature > 0 path).

    ``truncate`` (static) False leaves out the top-k/top-p branch: for settings with both off
    the branch keeps every id, so leaving it out changes no bit. ``"always"`` runs the
    branch's filters without the branch: bitwise the branch for settings that turn either on.
    """
    scaled = _scaled(penalized, params)
    filtered = scaled
    if truncate == "always":
        filtered = jnp.where(_candidate_filters(scaled, params), scaled, -jnp.inf)
    elif truncate:
        keep = lax.cond(
            _needs_sort(params, scaled.shape[0]),
            _candidate_filters,
            lambda x, _: jnp.ones(x.shape, jnp.bool_),
            scaled,
            params,
        )
        filtered = jnp.where(keep, scaled, -jnp.inf)
    # p_i / p_max = exp(l_i - l_max); renormalizing after top-k/top-p leaves the ratio alone.
    ratio = jnp.exp(filtered - jnp.max(filtered))
    return jnp.where(ratio >= params.min_p, filtered, -jnp.inf)


def _is_sampled(params: SamplingParams) -> jax.Array:
    return params.temperature > 0


def _needs_sort(params: SamplingParams, vocab_size: int) -> jax.Array:
    return ((params.top_k > 0) & (params.top_k < vocab_size)) | (params.top_p < 1.0)


def needs_truncation(params: SamplingParams, vocab_size: int) -> bool:
    """Whether :func:`sample` would sort the vocabulary for ``params`` (sampled, with top-k or
    top-p on); host-side, for choosing :func:`draw`'s ``truncate``.

    Raises:
      BadInputError: ``params`` is not :class:`SamplingParams`.
    """
    if not isinstance(params, SamplingParams):
        raise BadInputError(f"params must be SamplingParams, got {type(params).__name__}")
    _check_vocab_size(vocab_size)
    sampled, sort = jax.device_get((_is_sampled(params), _needs_sort(params, vocab_size)))
    return bool(sampled and sort)


def is_greedy(params: SamplingParams) -> bool:
    """Whether ``params`` decode greedily (temperature 0); host-side, for compiling a
    program's greedy variant (:func:`greedy_token`), which draws the same tokens.

    Raises:
      BadInputError: ``params`` is not :class:`SamplingParams`.
    """
    if not isinstance(params, SamplingParams):
        raise BadInputError(f"params must be SamplingParams, got {type(params).__name__}")
    return not bool(np.asarray(jax.device_get(params.temperature)) > 0)


def greedy_token(logits: jax.Array, params: SamplingParams, history: History) -> jax.Array:
    """:func:`draw`'s token at temperature 0, for use inside a compiled program (traced
    arguments, no checks): the argmax of the penalized logits, lowest id on ties, with no
    branch on the temperature (a conditional can return its predicate to the host on a GPU).
    Bitwise :func:`draw`'s greedy branch; only for requests that :func:`is_greedy`."""
    return jnp.argmax(_penalize(logits.astype(jnp.float32), params, history)).astype(jnp.int32)


def process_logits(logits: jax.Array, params: SamplingParams, history: History) -> jax.Array:
    """The logits that :func:`sample` draws from, after every step in the module docstring.

    Args:
      logits: ``[V]`` next-token logits (any float dtype; computed in float32).
      params: the sampling settings.
      history: what was seen and generated so far, for the penalties.

    Returns:
      float32 ``[V]``. At temperature 0: the penalized logits. Otherwise the penalized logits
      shifted so their maximum is 0, divided by the temperature, with filtered ids at ``-inf``.

    Raises:
      BadInputError: ``logits`` is not a 1-d float array, its length differs from the
        history's, or ``params`` / ``history`` are not what :func:`check_sampling_args` asks.
    """
    check_sampling_args(params, history)
    return _process_logits(_check_logits(logits, history), params, history)


@jax.jit
def _process_logits(logits: jax.Array, params: SamplingParams, history: History) -> jax.Array:
    penalized = _penalize(logits.astype(jnp.float32), params, history)
    return lax.cond(_is_sampled(params), _sampling_logits, lambda x, _: x, penalized, params)


def probabilities(logits: jax.Array, params: SamplingParams, history: History) -> jax.Array:
    """The exact distribution :func:`sample` draws from.

    Args:
      logits, params, history: as for :func:`process_logits`.

    Returns:
      float32 ``[V]`` summing to 1: the softmax of :func:`process_logits`, or at temperature 0
      a one-hot at the greedy token. Zero exactly where :func:`sample` can never land.

    Raises:
      BadInputError: as for :func:`process_logits`.
    """
    check_sampling_args(params, history)
    return _probabilities(_check_logits(logits, history), params, history)


@jax.jit
def _probabilities(logits: jax.Array, params: SamplingParams, history: History) -> jax.Array:
    penalized = _penalize(logits.astype(jnp.float32), params, history)
    return lax.cond(
        _is_sampled(params),
        lambda x, p: jax.nn.softmax(_sampling_logits(x, p)),
        lambda x, _: jax.nn.one_hot(jnp.argmax(x), x.shape[0], dtype=jnp.float32),
        penalized,
        params,
    )


def sample(
    logits: jax.Array, params: SamplingParams, history: History, key: jax.Array
) -> jax.Array:
    """Draw the next token.

    Args:
      logits: ``[V]`` next-token logits.
      params: the sampling settings; temperature 0 means greedy and ignores ``key``.
      history: what was seen and generated so far, for the penalties.
      key: a PRNG key, normally ``token_key(request_key(seed), index)``.

    Returns:
      int32 scalar token id. Greedy: argmax of the penalized logits, lowest id on ties.

    Raises:
      BadInputError: as for :func:`process_logits`, or ``key`` is not a PRNG key.
    """
    check_sampling_args(params, history, key)
    return _sample(_check_logits(logits, history), params, history, key)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """A draw from ``softmax(logits)`` (float32 ``[V]``, ``-inf`` for impossible ids), as
    ``jax.random.categorical``: the Gumbel-max trick. When at most :func:`candidates` ids
    are possible (top-k or top-p left no more), the noise is drawn for those candidates alone
    instead of for the whole vocabulary: the same distribution, in a tenth of the time for
    32,000 ids on 2 cores. Returns int32 ``[]``; a function of ``key`` and ``logits`` only.
    (:func:`sample` draws this way when top-k or top-p is on, and over the whole vocabulary
    otherwise.)"""
    vocab_size, count = logits.shape[0], candidates()
    if vocab_size <= count:
        return jax.random.categorical(key, logits).astype(jnp.int32)
    values, ids = _top(logits, count)
    return lax.cond(
        jnp.sum(jnp.isfinite(logits)) <= count,
        lambda: ids[jax.random.categorical(key, values)],
        lambda: jax.random.categorical(key, logits),
    ).astype(jnp.int32)


def draw(
    logits: jax.Array, params: SamplingParams, history: History, key: jax.Array, *,
    truncate: bool = True,
) -> jax.Array:
    """:func:`sample`'s computation for use inside a compiled program (traced arguments, no
    checks): one row's draw.

    ``truncate`` (static) False compiles without the top-k/top-p sort. Under ``vmap`` the
    sort's ``lax.cond`` runs for every row, greedy ones included, so a batched program may
    compile a variant without it for steps where no row has top-k or top-p on
    (:func:`needs_truncation`); such a row's draw is bitwise the same in either variant.
    A row that needs the sort must be drawn with ``truncate=True``.
    """
    penalized = _penalize(logits.astype(jnp.float32), params, history)

    def sampled(x: jax.Array, p: SamplingParams) -> jax.Array:
        whole = lambda: jax.random.categorical(  # noqa: E731
            key, _sampling_logits(x, p, False)).astype(jnp.int32)
        if not truncate:
            return whole()
        # One branch for the filters and the draw: top-k / top-p on, the candidates'.
        return lax.cond(_needs_sort(p, x.shape[0]),
                        lambda: categorical(key, _sampling_logits(x, p, "always")), whole)

    return lax.cond(
        _is_sampled(params),
        sampled,
        lambda x, _: jnp.argmax(x).astype(jnp.int32),
        penalized,
        params,
    )


_sample = jax.jit(draw)


#: Values of :func:`draw_as`'s ``plan``: what the host knows of a request's settings before
#: it compiles a decode loop. ``"any"``: nothing (:func:`draw`, branching on the settings in
#: the program); ``"greedy"``: temperature 0; ``"sampled"``: temperature > 0 with top-k and
#: top-p off; ``"top_k"``: temperature > 0 with a top-k that keeps at most
#: :data:`CANDIDATES` ids (top-p and min-p as they are); ``"truncated"``: temperature > 0
#: with top-k or top-p on otherwise.
DRAW_PLANS = ("any", "greedy", "sampled", "top_k", "truncated")


def draw_plan(params: SamplingParams, vocab_size: int) -> str:
    """The :data:`DRAW_PLANS` entry that ``params`` fall under (host-side: one transfer of
    their scalars), for compiling :func:`draw_as` without the branches :func:`draw` takes.

    Raises:
      BadInputError: ``params`` is not :class:`SamplingParams`, or ``vocab_size`` is not a
        positive integer.
    """
    if not isinstance(params, SamplingParams):
        raise BadInputError(f"params must be SamplingParams, got {type(params).__name__}")
    _check_vocab_size(vocab_size)
    sampled, sort, k = jax.device_get(
        (_is_sampled(params), _needs_sort(params, vocab_size), params.top_k))
    if not sampled:
        return "greedy"
    if not sort:
        return "sampled"
    return "top_k" if 0 < int(k) <= CANDIDATES and int(k) < vocab_size else "truncated"


def draw_as(
    plan: str, logits: jax.Array, params: SamplingParams, history: History, key: jax.Array
) -> jax.Array:
    """:func:`draw` for settings the host has classified (:func:`draw_plan`), for use inside a
    compiled program (traced arguments, no checks; ``plan`` static).

    Each plan but ``"any"`` runs one branch of :func:`draw` with no ``lax.cond`` around it (on
    a GPU a conditional copies its predicate to the host and waits for it, once per drawn
    token), so for settings of that plan the token is bitwise :func:`draw`'s. Settings of
    another plan get a token from the wrong branch: the caller picks the plan from the very
    settings it passes.

    Raises:
      BadInputError: ``plan`` is not one of :data:`DRAW_PLANS`.
    """
    if plan not in DRAW_PLANS:
        raise BadInputError(f"plan must be one of {', '.join(DRAW_PLANS)}; got {plan!r}")
    if plan == "any":
        return draw(logits, params, history, key)
    if plan == "greedy":
        return greedy_token(logits, params, history)
    penalized = _penalize(logits.astype(jnp.float32), params, history)
    if plan == "sampled":
        return jax.random.categorical(
            key, _sampling_logits(penalized, params, False)).astype(jnp.int32)
    if plan == "top_k" and penalized.shape[0] > candidates():
        return _draw_among_candidates(penalized, params, key)
    return categorical(key, _sampling_logits(penalized, params, "always"))


def _draw_among_candidates(penalized: jax.Array, params: SamplingParams,
                           key: jax.Array) -> jax.Array:
    """:func:`draw`'s token for settings whose top-k keeps at most the :func:`candidates`,
    computed on the candidates alone: one ranking of the vocabulary, then top-k, top-p,
    min-p and the noise over 64 values. Bitwise :func:`draw`'s: the ids it keeps are the
    candidates' leading run in either (each filter cuts the ranking), with the same values
    in the same places, so the noise of each place and the winning place are the same; the
    vocabulary-wide mask, min-p ratio and second ranking :func:`draw` goes through add no
    bit (``tests/core/test_draw_plans.py``)."""
    scaled = _scaled(penalized, params)
    values, ids = _top(scaled, candidates())
    keep, in_top_k = _kept_among(values, params, _kept_by_top_k(params, scaled.shape[0]))
    keep &= _kept_by_top_p(in_top_k, params)
    filtered = jnp.where(keep, values, -jnp.inf)
    ratio = jnp.exp(filtered - jnp.max(filtered))
    filtered = jnp.where(ratio >= params.min_p, filtered, -jnp.inf)
    return ids[jax.random.categorical(key, filtered)].astype(jnp.int32)


def distribution(processed: jax.Array, params: SamplingParams) -> jax.Array:
    """:func:`probabilities` from :func:`process_logits`'s output, for use inside a compiled
    program (traced arguments, no checks).

    A program that needs both a row's distribution and a draw from it (the speculative
    rounds) processes the row once, sorting the vocabulary at most once, and takes both
    from the result: bitwise what :func:`probabilities` and :func:`sample` return.

    Args:
      processed: float32 ``[V]`` from :func:`process_logits`.
      params: the settings it was processed with.

    Returns:
      float32 ``[V]``: the softmax, or at temperature 0 a one-hot at the greedy token.
    """
    return lax.cond(
        _is_sampled(params),
        jax.nn.softmax,
        lambda x: jax.nn.one_hot(jnp.argmax(x), x.shape[0], dtype=jnp.float32),
        processed,
    )


def draw_processed(processed: jax.Array, params: SamplingParams, key: jax.Array) -> jax.Array:
    """:func:`sample`'s token from :func:`process_logits`'s output (traced arguments, no
    checks; see :func:`distribution`): int32 ``[]``, bitwise the same for the same key."""
    def sampled(x: jax.Array) -> jax.Array:
        return lax.cond(_needs_sort(params, x.shape[0]), lambda: categorical(key, x),
                        lambda: jax.random.categorical(key, x).astype(jnp.int32))

    return lax.cond(
        _is_sampled(params),
        sampled,
        lambda x: jnp.argmax(x).astype(jnp.int32),
        processed,
    )


def unpack_mask(words: jax.Array, vocab_size: int) -> jax.Array:
    """``bool[vocab_size]`` from a mask packed 32 ids a word (id ``i`` at bit ``i % 32`` of
    ``words[i // 32]``, as ``Constraint.allowed_words`` packs it), for use inside a compiled
    program (traced ``words``, static ``vocab_size``): a host sends the words, a
    thirty-second of the boolean mask, and the device spreads them with shifts alone."""
    shifts = lax.iota(jnp.uint32, 32)
    bits = (words.astype(jnp.uint32)[:, None] >> shifts[None, :]) & jnp.uint32(1)
    return bits.reshape(-1)[:vocab_size].astype(jnp.bool_)


def token_key(base_key: jax.Array, index: jax.Array | int) -> jax.Array:
    """The key for the ``index``-th generated token of a request (jittable).

    Folding the index in, rather than splitting a carried key, makes a token's randomness a
    function of its index alone, however the decode loop is cut into bursts.

    Raises:
      BadInputError: ``base_key`` is not a PRNG key, or ``index`` is not an integer (a
        concrete one >= 0, or a traced integer).
    """
    _check_key(base_key)
    if isinstance(index, jax.core.Tracer):
        if not jnp.issubdtype(index.dtype, jnp.integer):
            raise BadInputError(f"index must be an integer, got dtype {index.dtype}")
    else:
        as_int("index", index, low=0)
    return jax.random.fold_in(base_key, index)


def request_key(seed: int) -> jax.Array:
    """A typed PRNG key for a request's ``seed``, an integer in ``[0, 2**64)``.

    Without 64-bit mode JAX keeps only the low 32 bits of a seed, so distinct large seeds would
    collide; the high 32 bits are folded in instead, which gives the same key either way.

    Raises:
      BadInputError: ``seed`` is not an integer in ``[0, 2**64)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, Integral | np.integer):
        raise BadInputError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise BadInputError(f"seed must be an integer in [0, 2**64), got {seed}")
    key = jax.random.key(seed & 0xFFFFFFFF)
    high = seed >> 32
    return jax.random.fold_in(key, high) if high else key
