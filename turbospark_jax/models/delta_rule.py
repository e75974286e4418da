"""The gated delta rule over many rows at once: the chunked form, for parallel prefill and
training.

The recurrence (per value head, float32, state ``S [dk, dv]``)::

    S_t   = exp(g_t) * S_{t-1} + k_t d_t^T,   d_t = beta_t * (v_t - (exp(g_t) * S_{t-1})^T k_t)
    o_t   = S_t^T q_t

is what the block program runs row by row (a ``lax.scan``: exact, and what makes chunked ==
token by token bitwise). Over thousands of rows that scan is a long chain of small products.
The chunked form does the same algebra ``C`` rows at a time with matrix products. Within a
chunk starting from ``S_0``, with ``G_i = exp(g_1 + ... + g_i)`` (cumulative decay from the
chunk's start) and ``D`` the rows ``d_i``:

* the corrections solve a unit lower-triangular system,
  ``(I + A) D = beta * V - diag(beta * G) K S_0`` with
  ``A_ij = beta_i (G_i / G_j) k_i . k_j`` for ``j < i``;
* the outputs are ``O = diag(G) Q S_0 + (M * Q K^T) D`` with ``M_ij = G_i / G_j`` for
  ``j <= i`` (zero above the diagonal);
* the state carried to the next chunk is ``S_C = G_C S_0 + K^T diag(G_C / G) D``.

Ratios ``G_i / G_j`` are formed as ``exp`` of a difference of cumulative sums, masked before
the ``exp`` so no entry above the diagonal can overflow. Rows past the end are padded with
``beta = 0`` and ``g = 0``: they change neither the state nor any other row.

This is a different order of floating-point operations from the row-by-row scan, so results
agree within a tolerance (float32; measured in ``tests/test_delta_rule.py``), not bitwise: it
serves the parallel prefill, which is outside the bitwise guarantees, and training.
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


def delta_rule_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                       beta: jax.Array, state: jax.Array, chunk: int = 64
                       ) -> tuple[jax.Array, jax.Array]:
    """The same as :func:`delta_rule_scan`, ``chunk`` rows at a time (see the module doc)."""
    t, h, dk = k.shape
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
    eye = jnp.eye(chunk, dtype=q.dtype)

    def one_chunk(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        qc, kc, vc, gc, bc = xs  # [H, C, dk], [H, C, dk], [H, C, dv], [H, C], [H, C]
        cum = jnp.cumsum(gc, axis=-1)  # log G_i
        diff = cum[:, :, None] - cum[:, None, :]  # log(G_i / G_j)
        ratio_lower = jnp.exp(jnp.where(lower, diff, -jnp.inf))
        ratio_causal = jnp.exp(jnp.where(causal, diff, -jnp.inf))
        decay = jnp.exp(cum)  # G_i
        kk = jnp.einsum("hik,hjk->hij", kc, kc)
        a = bc[:, :, None] * ratio_lower * kk
        rhs = bc[:, :, None] * (vc - decay[:, :, None] * jnp.einsum("hik,hkv->hiv", kc, s))
        d = jax.vmap(lambda m, r: jax.scipy.linalg.solve_triangular(
            eye + m, r, lower=True, unit_diagonal=True))(a, rhs)
        qk = jnp.einsum("hik,hjk->hij", qc, kc) * ratio_causal
        o = decay[:, :, None] * jnp.einsum("hik,hkv->hiv", qc, s) + jnp.einsum(
            "hij,hjv->hiv", qk, d)
        tail = jnp.exp(cum[:, -1:] - cum)  # G_C / G_j
        s = decay[:, -1, None, None] * s + jnp.einsum("hjk,hjv->hkv", kc * tail[:, :, None], d)
        return s, o

    state, o = jax.lax.scan(one_chunk, state, (qs, ks, vs, gs, bs))  # o: [n, H, C, dv]
    o = jnp.moveaxis(o, 2, 1).reshape(n * chunk, h, dv)[:t]
    del dk
    return o, state
