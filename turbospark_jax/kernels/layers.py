"""Layers shared by the decoder families: RMSNorm, rotary embeddings, attention, SwiGLU.

Every function here is pure and works on one sequence of rows (``W`` rows at explicit
positions); batching is the caller's business (``jax.vmap``). Dtype handling follows the
Hugging Face reference implementations: norms compute in float32 and cast back, rotary tables
are built in float32 and cast to the activation dtype, attention scores and their softmax are
float32, and everything else runs in the model dtype.

Row independence is a contract: no function here reduces across rows except :func:`attend`
and :func:`wide_attend`, which reduce over *keys*. Row ``i`` of any output therefore depends
only on row ``i`` of the inputs (and on the keys), which is what lets one compiled block
program serve 1 live row or W.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.errors import BadInputError
from turbospark_jax.quant.weights import as_array

#: Added to masked attention scores. Finite, so a fully masked (padding) row gives a uniform
#: softmax instead of NaN; far below any real score, so it never carries weight otherwise.
MASK_VALUE = -1e30

#: Query rows per attention slice. A block wider than this (and a multiple of it) attends in
#: slices so the float32 score tensor stays ``[heads, ATTENTION_QUERY_BLOCK, keys]``.
ATTENTION_QUERY_BLOCK = 256

#: RoPE variants :func:`rope_inv_freq` implements (Hugging Face ``rope_type`` names).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling, as Hugging Face's ``rope_parameters`` / ``rope_scaling`` hold it.

    Field names are the Hugging Face keys; fields a variant does not read stay ``None``.

    Attributes:
      rope_type: one of :data:`SUPPORTED_ROPE_TYPES` other than ``"default"``.
      factor: frequency divisor (linear, llama3) or interpolation factor (yarn).
      low_freq_factor, high_freq_factor: llama3 band edges, as fractions of the context.
      original_max_position_embeddings: the pretraining context (llama3, yarn).
      beta_fast, beta_slow: yarn ramp bounds in rotations (HF defaults 32 and 1).
      attention_factor: yarn cos/sin scale; derived from ``factor`` and mscale when ``None``.
      mscale, mscale_all_dim: yarn (DeepSeek style) inputs to the derived attention factor.
      truncate: yarn: round the correction range outward to whole dimensions (HF default).
    """

    rope_type: str
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def to_hf_dict(self) -> dict[str, object]:
        """The Hugging Face dict form (``rope_type`` plus every field that is set)."""
        out: dict[str, object] = {"rope_type": self.rope_type}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "rope_type" or value is None:
                continue
            if f.name == "truncate" and value:
                continue
            out[f.name] = value
        return out


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    max_position_embeddings: int,
) -> tuple[np.ndarray, float]:
    """Inverse rotary frequencies and the cos/sin scale, computed in float32 like the reference.

    Args:
      head_dim: the (even) per-head width; ``head_dim // 2`` frequencies are returned.
      theta: the RoPE base (``rope_theta``).
      scaling: a frequency scaling, or ``None`` for plain RoPE.
      max_position_embeddings: used by yarn when ``factor`` is unset.

    Returns:
      ``(inv_freq, attention_scaling)``: float32 ``[head_dim // 2]`` and a python float that
      multiplies cos and sin (1.0 except for yarn).

    Raises:
      ValueError: an odd ``head_dim`` or a ``rope_type`` outside :data:`SUPPORTED_ROPE_TYPES`.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    f32 = np.float32
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim)
    base_freq = f32(theta) ** exponents  # [head_dim // 2]
    inv_freq = (f32(1.0) / base_freq).astype(f32)
    if scaling is None or scaling.rope_type == "default":
        return inv_freq, 1.0
    kind = scaling.rope_type
    if kind == "linear":
        return (inv_freq / f32(scaling.factor)).astype(f32), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, base_freq, scaling, max_position_embeddings)
    raise ValueError(
        f"unsupported rope_type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    # Llama 3.1: long wavelengths slow down by `factor`, short ones stay, the band between the
    # two edges blends linearly in 1/wavelength.
    f32 = np.float32
    factor, low, high = f32(s.factor), f32(s.low_freq_factor), f32(s.high_freq_factor)
    old_ctx = f32(s.original_max_position_embeddings)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(f32)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (f32(1.0) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, blended, scaled).astype(f32)


def _yarn_inv_freq(
    head_dim: int,
    theta: float,
    base_freq: np.ndarray,
    s: RopeScaling,
    max_position_embeddings: int,
) -> tuple[np.ndarray, float]:
    # YaRN: interpolate (divide by factor) the low-frequency dimensions, keep the high ones,
    # ramp linearly between two correction dimensions found from beta_fast / beta_slow.
    f32 = np.float32
    original = s.original_max_position_embeddings or max_position_embeddings
    factor = s.factor if s.factor is not None else max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = float(mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim))
        else:
            attention = mscale(factor)
    beta_fast = s.beta_fast or 32
    beta_slow = s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    keep = (f32(1.0) - ramp).astype(f32)  # 1 where the frequency is extrapolated (kept)
    extrapolated = f32(1.0) / base_freq
    interpolated = f32(1.0) / (f32(factor) * base_freq)
    inv_freq = interpolated * (f32(1.0) - keep) + extrapolated * keep
    return inv_freq.astype(f32), float(attention)


def rope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, attention_scaling: float, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """Rotary tables for the given positions.

    Args:
      positions: int32 ``[W]`` absolute positions.
      inv_freq: float32 ``[head_dim // 2]`` from :func:`rope_inv_freq`.
      attention_scaling: multiplies cos and sin (yarn), 1.0 otherwise.
      dtype: the activation dtype the tables are cast to (as the reference does).

    Returns:
      ``(cos, sin)``, each ``[W, head_dim]`` in ``dtype``; the two halves repeat the frequencies.
    """
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [W, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [W, hd]
    cos = jnp.cos(angles) * attention_scaling
    sin = jnp.sin(angles) * attention_scaling
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` [W, N, hd] by the tables ``cos``/``sin`` [W, hd] (HF ``rotate_half`` layout).

    The first and second halves of the head dimension form the rotated pairs, not interleaved
    neighbours: that is the layout Hugging Face checkpoints are trained with.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [W, N, hd]
    out = x * cos[:, None, :] + rotated * sin[:, None, :]
    if jax.default_backend() == "cpu":
        # Rounded as written, in a kernel of its own. Fused into its consumer (the attention's
        # score product), the CPU compiler gave a row other bits at other slots of
        # one block (the products and the sum contracted differently lane by lane), which
        # broke chunked == sequential on an 8-way tensor-parallel mesh; materialised, every
        # row is the same arithmetic (docs/decisions/0008-cpu-row-tiles.md).
        out = jax.lax.optimization_barrier(out)
    return out


def rms_norm(
    x: jax.Array, weight: jax.Array | None, eps: float, *, weight_in_float32: bool = False
) -> jax.Array:
    """RMSNorm over the last axis: normalise in float32, cast back, then scale by ``weight``.

    Args:
      x: ``[..., D]`` activations in the model dtype.
      weight: ``[D]`` scale, or ``None`` for a scale-free norm.
      eps: added to the mean square before the reciprocal square root.
      weight_in_float32: scale in float32 and round once (Gemma's norms do this); by default
        the normalised rows are rounded to ``x.dtype`` first and scaled in that dtype (Llama's).

    Returns:
      ``[..., D]`` in ``x.dtype``.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is None:
        return normed.astype(x.dtype)
    if weight_in_float32:
        return (normed * weight.astype(jnp.float32)).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def swiglu_mlp(
    x: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    gate_bias: jax.Array | None = None,
    up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    *,
    matmul: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """``down(silu(gate(x)) * up(x))`` with weights in ``[in, out]`` orientation.

    Args:
      x: ``[W, D]``.
      gate, up: ``[D, F]``.
      down: ``[F, D]``.
      gate_bias, up_bias: optional ``[F]``; down_bias: optional ``[D]``.
      matmul: ``(x [W, K], w [K, N]) -> [W, N]`` in ``x.dtype`` for the three products
        (a model's kernel mode); XLA's own when None.

    Returns:
      ``[W, D]`` in ``x.dtype``. SiLU runs in float32 and is rounded once, like torch does for
      half-precision inputs.
    """
    if matmul is None:
        def matmul(a: jax.Array, w: Any) -> jax.Array:
            return jnp.einsum("wd,df->wf", a, as_array(w, a.dtype))
    g = matmul(x, gate)
    u = matmul(x, up)
    if gate_bias is not None:
        g = g + gate_bias
    if up_bias is not None:
        u = u + up_bias
    h = jax.nn.silu(g.astype(jnp.float32)).astype(x.dtype) * u
    out = matmul(h, down)
    if down_bias is not None:
        out = out + down_bias
    return out


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    window: jax.Array | int | None = None,
    query_block: int = ATTENTION_QUERY_BLOCK,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Causal (optionally sliding-window) grouped-query attention of W query rows over S keys.

    Query row ``w`` sees key ``s`` iff ``k_positions[s] <= q_positions[w]`` and, with a window,
    ``k_positions[s] > q_positions[w] - window`` (Hugging Face's sliding-window rule: the row
    itself plus ``window - 1`` earlier positions). Scores and softmax are float32; the
    probabilities are cast to the value dtype before the value product (as the reference's
    eager path does), which accumulates in float32.

    Queries wider than ``query_block`` (and a multiple of it) are processed in slices of
    ``query_block`` rows, so the float32 score tensor is at most
    ``[KV, G, query_block, S]``. Every slice has the same shape, so each row runs the same
    computation whichever slice it sits in.

    Args:
      q: ``[W, H, hd]`` queries (already rotated), ``H = KV * G``.
      k, v: ``[S, KV, hd]`` keys (rotated) and values.
      q_positions: int32 ``[W]``; k_positions: int32 ``[S]``.
      window: sliding-window size (python int, traced int32 scalar, or ``None`` for none).
      query_block: slice width for wide query blocks.
      scale: multiplies the scores; ``head_dim ** -0.5`` when ``None`` (Gemma 4, whose q/k
        norms fix the scale, passes 1.0).

    Returns:
      ``[W, H, hd]`` in ``v.dtype``.
    """
    w_rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    groups = heads // kv_heads
    qg = q.reshape(w_rows, kv_heads, groups, head_dim)  # [W, KV, G, hd]
    if w_rows > query_block and w_rows % query_block == 0:
        outs = [
            _attend_rows(
                qg[i : i + query_block], k, v, q_positions[i : i + query_block], k_positions,
                window, scale,
            )
            for i in range(0, w_rows, query_block)
        ]
        out = jnp.concatenate(outs, axis=0)
    else:
        out = _attend_rows(qg, k, v, q_positions, k_positions, window, scale)
    return out.reshape(w_rows, heads, head_dim)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     implementation: str = "xla") -> jax.Array:
    """Causal grouped-query self-attention over whole sequences, for training passes.

    Row ``t`` of each sequence attends to rows ``0 .. t`` of the same sequence. This is
    ``jax.nn.dot_product_attention``: ``"cudnn"`` is its fused kernel (GPU, bfloat16 or
    float16; scores never written out, forward or backward), ``"xla"`` the plain products.
    Neither is the block program's :func:`attend`, so results agree with it within a
    tolerance only.

    Args:
      q: ``[B, T, H, hd]`` rotated queries; k, v: ``[B, T, KV, hd]``, ``H = KV * G``.
      implementation: ``"xla"`` or ``"cudnn"``.

    Returns:
      ``[B, T, H, hd]`` in ``q.dtype``.
    """
    t = q.shape[1]
    # cuDNN takes sequence lengths in whole tiles (it refused the MTP head's 1023 rows); rows
    # appended at the end change no earlier row of a causal attention.
    pad = -t % CUDNN_ROWS if implementation == "cudnn" else 0
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    return out[:, :t]


#: The sequence lengths cuDNN's fused attention takes are multiples of this.
CUDNN_ROWS = 64


def _attend_rows(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    window: jax.Array | int | None,
    scale: float,
) -> jax.Array:
    scores = jnp.einsum(
        "wkgd,skd->kgws", q, k, preferred_element_type=jnp.float32
    ) * scale  # [KV, G, W, S] float32
    visible = k_positions[None, :] <= q_positions[:, None]  # [W, S]
    if window is not None:
        visible = visible & (k_positions[None, :] > q_positions[:, None] - window)
    scores = jnp.where(visible[None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [KV, G, W, S]
    out = jnp.einsum("kgws,skd->wkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(v.dtype)  # [W, KV, G, hd]


#: A key position no query sees: after every row, so the causal rule hides it (padding keys
#: of :func:`wide_attend`, and cached rows a pass replaces).
NO_KEY = 2**31 - 1


def wide_attend(
    q: jax.Array,
    q_positions: jax.Array,
    fixed: tuple[jax.Array, jax.Array, jax.Array] | None,
    band: tuple[jax.Array, jax.Array, jax.Array] | None,
    window: int | None,
    *,
    block: int = ATTENTION_QUERY_BLOCK,
    scale: float | None = None,
) -> jax.Array:
    """:func:`attend` for a wide pass (parallel prefill): query blocks of ``block`` rows in a
    loop, each over the ``fixed`` keys and, with a window, only the band of the pass's own
    rows that its window can reach.

    Every block has the same shapes, so the loop is one compiled body however wide the pass;
    a sliding layer's scores are ``[heads, block, S + block + window - 1]`` rather than
    ``[heads, W, W]``. Masking is :func:`attend`'s, by position.

    Args:
      q: ``[W, H, hd]`` queries (rotated); row ``i`` sits at ``q_positions[i]`` (int32 ``[W]``).
      fixed: ``(k [S, KV, hd], v, positions [S])`` every block reads (cached rows, or all the
        pass's own rows), or ``None``.
      band: the pass's own rows ``(k [W, KV, hd], v, positions [W])`` in query order, of which
        a block reads the ``window - 1`` rows before its first and its own; needs ``window``.
      window: sliding-window size, or ``None``.
      block: query rows per block (``W`` is padded up to a multiple of it).
      scale: as :func:`attend`'s.

    Returns:
      ``[W, H, hd]`` in the values' dtype.

    Raises:
      BadInputError: a band without a window.
    """
    width = q.shape[0]
    block = min(block, width)
    count = -(-width // block)
    pad = count * block - width
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    q_positions = jnp.pad(q_positions, (0, pad), mode="edge")
    if band is not None:
        if window is None:
            raise BadInputError("wide_attend: a band of own rows needs a window")
        # Own rows before a block that its rows may see; the padding in front holds no key.
        reach = min(window - 1, count * block - block)
        rows = ((reach, pad), (0, 0), (0, 0))
        band = (jnp.pad(band[0], rows), jnp.pad(band[1], rows),
                jnp.pad(band[2], (reach, pad), constant_values=NO_KEY))

    def one(first: jax.Array) -> jax.Array:
        keys = [] if fixed is None else [fixed]
        if band is not None:
            keys.append(tuple(jax.lax.dynamic_slice_in_dim(a, first, block + reach)
                              for a in band))
        k, v, positions = (jnp.concatenate(parts) for parts in zip(*keys, strict=True))
        return attend(jax.lax.dynamic_slice_in_dim(q, first, block), k, v,
                      jax.lax.dynamic_slice_in_dim(q_positions, first, block), positions,
                      window, block, scale=scale)

    out = jax.lax.map(one, jnp.arange(count, dtype=jnp.int32) * block)  # [count, block, H, hd]
    return out.reshape(count * block, *out.shape[2:])[:width]


def random_leaves(shapes: Any, key: jax.Array, std: float, dtype: Any,
                  constant: Callable[[str], float | None]) -> Any:
    """Params with the tree of ``shapes`` (shape tuples as leaves): a leaf whose name ``n``
    gives ``constant(n)`` not None is filled with that value, every other one drawn
    ~ N(0, ``std``) with its own key from one split of ``key``. Drawn flat and reshaped: XLA
    compiles 1-D threefry sampling much faster. Meant to run inside one jitted init (one
    program instead of one dispatch per leaf)."""
    paths, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    leaves = []
    for (path, shape), k in zip(paths, jax.random.split(key, len(paths)), strict=True):
        value = constant(path[-1].key)
        if value is None:
            w = jax.random.normal(k, (math.prod(shape),), jnp.float32).reshape(shape)
            leaves.append((w * std).astype(dtype))
        else:
            leaves.append(jnp.full(shape, value, dtype))
    return jax.tree.unflatten(treedef, leaves)
