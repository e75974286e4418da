"""The chunked gated delta rule against the row-by-row recurrence (float32, tolerance)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.models.delta_rule import delta_rule_chunked, delta_rule_scan

#: Outputs and states agree to this (measured at most 5e-7 on these inputs).
ATOL = 2e-5


def _inputs(t: int, h: int = 3, dk: int = 8, dv: int = 6, seed: int = 0, decay: float = 1.0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (t, h, dk))) * dk**-0.5
    k = unit(jax.random.normal(ks[1], (t, h, dk)))
    v = jax.random.normal(ks[2], (t, h, dv))
    g = -decay * jax.nn.softplus(jax.random.normal(ks[3], (t, h)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (t, h)))
    state = 0.3 * jax.random.normal(ks[5], (h, dk, dv))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t,chunk,decay", [(1, 4, 1.0), (70, 16, 8.0), (33, 64, 0.01)])
def test_chunked_equals_the_recurrence(t: int, chunk: int, decay: float) -> None:
    args = _inputs(t, decay=decay)
    o_ref, s_ref = delta_rule_scan(*args)
    o, s = jax.jit(delta_rule_chunked, static_argnames="chunk")(*args, chunk=chunk)
    err = max(float(jnp.abs(o - o_ref).max()), float(jnp.abs(s - s_ref).max()))
    print(f"T={t} chunk={chunk} decay={decay}: max abs diff {err:.2e}")
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert err < ATOL


def test_padding_rows_change_nothing() -> None:
    """Rows with beta = 0 and g = 0 leave the state and the earlier rows as they were."""
    q, k, v, g, beta, state = _inputs(10)
    o, s = delta_rule_chunked(q, k, v, g, beta, state, chunk=4)
    tail = jnp.zeros((5, *beta.shape[1:]))
    o2, s2 = delta_rule_chunked(
        jnp.concatenate([q, q[:5]]), jnp.concatenate([k, k[:5]]), jnp.concatenate([v, v[:5]]),
        jnp.concatenate([g, tail]), jnp.concatenate([beta, tail]), state, chunk=4)
    assert np.allclose(o2[:10], o, atol=ATOL) and np.allclose(s2, s, atol=ATOL)


def test_control_a_missing_correction_is_caught() -> None:
    """Control: dropping the triangular solve (D = rhs) must fail the tolerance."""
    q, k, v, g, beta, state = _inputs(24)
    o_ref, _ = delta_rule_scan(q, k, v, g, beta, state)
    solve = jax.scipy.linalg.solve_triangular
    try:
        jax.scipy.linalg.solve_triangular = lambda a, b, **kw: b
        o, _ = delta_rule_chunked(q, k, v, g, beta, state, chunk=8)
    finally:
        jax.scipy.linalg.solve_triangular = solve
    assert float(jnp.abs(o - o_ref).max()) > ATOL
