"""The gated delta rule over many rows at once: the chunked form, for parallel prefill and
training.

The recurrence (per value head, float32, state ``S [dk, dv]``)::

    S_t   = exp(g_t) * S_{t-1} + k_t d_t^T,   d_t = beta_t * (v_t - (exp(g_t) * S_{t-1})^T k_t)
    o_t   = S_t^T q_t

is what the block program runs row by row (exact, and what makes chunked == token by token
bitwise). Over thousands of rows that walk is a long chain of small products.
The chunked form does the same algebra ``C`` rows at a time with matrix products. Within a
chunk starting from ``S_0``, with ``G_i = exp(g_1 + ... + g_i)`` (cumulative decay from the
chunk's start) and ``D`` the rows ``d_i``:

* the corrections solve a unit lower-triangular system,
  ``(I + A) D = beta * V - diag(beta * G) K S_0`` with
  ``A_ij = beta_i (G_i / G_j) k_i . k_j`` for ``j < i``;
* the outputs are ``O = diag(G) Q S_0 + (M * Q K^T) D`` with ``M_ij = G_i / G_j`` for
  ``j <= i`` (zero above the diagonal);
* the state carried to the next chunk is ``S_C = G_C S_0 + K^T diag(G_C / G) D``.

With ``T = (I + A)^-1``, ``D = U - W S_0`` where ``U = T (beta V)`` and
``W = T diag(beta G) K`` depend on the chunk alone, so they are computed for every chunk at
once; only the walk of ``S`` from chunk to chunk is sequential.

Ratios ``G_i / G_j`` are formed as ``exp`` of a difference of cumulative sums, masked before
the ``exp`` so no entry above the diagonal can overflow. Rows past the end are padded with
``beta = 0`` and ``g = 0``: they change neither the state nor any other row.

This is a different order of floating-point operations from the row-by-row scan, so results
agree within a float32 tolerance, not bitwise: it serves the parallel prefill, which is outside
the bitwise guarantees, and training.

The chunk systems are inverted by matrix products (:func:`unit_lower_inverse`) rather than a
triangular solve: a solve is a chain of small dependent steps per chunk, where the products
batch over every chunk and head at once, forward and backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def delta_rule_scan(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                    state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The reference: the recurrence row by row.

    Args:
      q, k: ``[T, H, dk]``; v: ``[T, H, dv]``; g, beta: ``[T, H]``; state: ``[H, dk, dv]``.
      All float32.

    Returns:
      ``(o [T, H, dv], final state [H, dk, dv])``.
    """

    def row(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t = xs
        decayed = s * jnp.exp(g_t)[:, None, None]
        d = (v_t - jnp.einsum("hkv,hk->hv", decayed, k_t)) * b_t[:, None]
        s = decayed + k_t[:, :, None] * d[:, None, :]
        return s, jnp.einsum("hkv,hk->hv", s, q_t)

    state, o = jax.lax.scan(row, state, (q, k, v, g, beta))
    return o, state


#: Unit lower-triangular blocks this wide or narrower are inverted by their Neumann series;
#: wider ones split in halves (see :func:`unit_lower_inverse`).
NEUMANN_BLOCK = 8


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + a)^-1`` for strictly lower-triangular ``a [..., C, C]``, by matrix products.

    Up to :data:`NEUMANN_BLOCK` rows the inverse is the finite Neumann series
    ``sum_k (-a)^k`` (``a`` is nilpotent), taken as ``(I - a)(I + a^2)(I + a^4)``. Its terms
    stay small there: with unit keys, ``beta <= 1`` and decays ``<= 1`` every entry of ``a``
    is at most 1 in size, so ``a^m``'s entries are at most ``C(6, 3) = 20`` for 8 rows, and
    the series loses little to cancellation (over 16 rows the terms reach ``C(14, 7) = 3432``
    and cancellation shows with a repeated key and no decay; over a whole 64-row chunk they
    could overflow). Wider
    matrices split into halves: ``[[T1, 0], [-T2 a21 T1, T2]]`` with ``T1``, ``T2`` the halves'
    inverses (both computed in one batched recursion).
    """
    c = a.shape[-1]
    return _unit_lower_inverse(a.reshape(-1, c, c)).reshape(a.shape)


def _unit_lower_inverse(a: jax.Array) -> jax.Array:
    # a [N, C, C]: one batch axis however deep the recursion goes (XLA's CPU backend refuses
    # tensors of rank 8 and more in some fusions).
    n, c = a.shape[0], a.shape[-1]
    eye = jnp.eye(c, dtype=a.dtype)
    if c <= NEUMANN_BLOCK:
        inverse, power, covered = eye - a, a, 1
        while covered < c - 1:  # inverse holds the series up to a^covered
            power = power @ power
            inverse = inverse @ (eye + power)
            covered = 2 * covered + 1
        return inverse
    h = c // 2
    if c == 2 * h:  # both halves in one batched recursion
        halves = _unit_lower_inverse(jnp.concatenate([a[:, :h, :h], a[:, h:, h:]], axis=0))
        t11, t22 = halves[:n], halves[n:]
    else:
        t11, t22 = _unit_lower_inverse(a[:, :h, :h]), _unit_lower_inverse(a[:, h:, h:])
    t21 = -(t22 @ a[:, h:, :h] @ t11)
    top = jnp.concatenate([t11, jnp.zeros_like(a[:, :h, h:])], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([t21, t22], axis=-1)], axis=-2)


def delta_rule_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                       beta: jax.Array, state: jax.Array, chunk: int = 64,
                       unroll: int = 16) -> tuple[jax.Array, jax.Array]:
    """The same as :func:`delta_rule_scan`, ``chunk`` rows at a time (see the module doc).

    Everything that does not depend on the carried state is computed for all chunks at once
    (wide batched products): the decay ratios, the chunk systems' inverses ``T = (I + A)^-1``
    and with them ``W = T diag(beta G) K`` and ``U = T (beta V)``, so that a chunk's
    corrections are ``D = U - W S_0``. Only the state's walk from chunk to chunk stays
    sequential: three small products a chunk, in a loop ``unroll`` chunks to a pass (a GPU
    pays a host round trip per loop pass; a training sequence of 16 chunks has none).

    Args:
      q, k, v, g, beta, state: as :func:`delta_rule_scan`.
      chunk: rows per chunk.
      unroll: chunks per pass of the state's loop.
    """
    t, h, _ = k.shape
    dv = v.shape[-1]
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(x: jax.Array) -> jax.Array:  # [T, H, ...] -> [n, H, C, ...]
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        x = x.reshape(n, chunk, *x.shape[1:])
        return jnp.moveaxis(x, 1, 2)

    qs, ks, vs, gs, bs = (split(x) for x in (q, k, v, g, beta))
    lower = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    cum = jnp.cumsum(gs, axis=-1)  # [n, H, C]: log G_i
    diff = cum[..., :, None] - cum[..., None, :]  # log(G_i / G_j)
    decay = jnp.exp(cum)  # G_i
    a = bs[..., :, None] * jnp.exp(jnp.where(lower, diff, -jnp.inf)) * jnp.einsum(
        "nhik,nhjk->nhij", ks, ks)
    tri = unit_lower_inverse(a)
    w = tri @ (ks * (bs * decay)[..., None])  # [n, H, C, dk]
    u = tri @ (vs * bs[..., None])  # [n, H, C, dv]
    qk = jnp.einsum("nhik,nhjk->nhij", qs, ks) * jnp.exp(jnp.where(causal, diff, -jnp.inf))
    q_decayed = qs * decay[..., None]  # [n, H, C, dk]
    k_tail = ks * jnp.exp(cum[..., -1:] - cum)[..., None]  # K scaled by G_C / G_j
    chunk_decay = decay[..., -1]  # [n, H]

    def one_chunk(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        w_c, u_c, qd_c, qk_c, kt_c, cd_c = xs
        d = u_c - jnp.einsum("hik,hkv->hiv", w_c, s)  # [H, C, dv]
        o = jnp.einsum("hik,hkv->hiv", qd_c, s) + jnp.einsum("hij,hjv->hiv", qk_c, d)
        s = cd_c[:, None, None] * s + jnp.einsum("hjk,hjv->hkv", kt_c, d)
        return s, o

    state, o = jax.lax.scan(one_chunk, state, (w, u, q_decayed, qk, k_tail, chunk_decay),
                            unroll=max(1, min(unroll, n)))  # o: [n, H, C, dv]
    o = jnp.moveaxis(o, 2, 1).reshape(n * chunk, h, dv)[:t]
    return o, state
