"""The chunked gated delta rule against the row-by-row recurrence (float32, tolerance)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.models.qwen3_5 import delta_rule
from turbospark_jax.models.qwen3_5.delta_rule import (
    delta_rule_chunked,
    delta_rule_scan,
    unit_lower_inverse,
)

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


CHUNKED = jax.jit(delta_rule_chunked, static_argnames=("chunk", "unroll"))


@pytest.mark.parametrize("t,chunk,decay,unroll", [(1, 4, 1.0, 16), (70, 16, 8.0, 2),
                                                  (33, 64, 0.01, 16), (150, 32, 1.0, 1)])
def test_chunked_equals_the_recurrence(t: int, chunk: int, decay: float, unroll: int) -> None:
    args = _inputs(t, decay=decay)
    o_ref, s_ref = delta_rule_scan(*args)
    o, s = CHUNKED(*args, chunk=chunk, unroll=unroll)
    err = max(float(jnp.abs(o - o_ref).max()), float(jnp.abs(s - s_ref).max()))
    print(f"T={t} chunk={chunk} decay={decay}: max abs diff {err:.2e}")
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert err < ATOL


def test_repeated_keys_without_decay() -> None:
    """The hardest case for the series inverse: one key repeated, no decay, beta near 1
    (every entry of A near 1; its powers grow like binomial coefficients)."""
    q, k, v, g, beta, state = _inputs(64)
    k = jnp.broadcast_to(k[:1], k.shape)
    g, beta = jnp.zeros_like(g), jnp.full_like(beta, 0.999)
    o_ref, s_ref = delta_rule_scan(q, k, v, g, beta, state)
    o, s = CHUNKED(q, k, v, g, beta, state, chunk=64)
    err = max(float(jnp.abs(o - o_ref).max()), float(jnp.abs(s - s_ref).max()))
    print(f"repeated keys: max abs diff {err:.2e}")
    assert err < ATOL


@pytest.mark.parametrize("c", [1, 2, 5, 16, 18, 24, 37, 64])
def test_unit_lower_inverse(c: int) -> None:
    a = jnp.tril(jax.random.uniform(jax.random.PRNGKey(c), (3, c, c), minval=-1, maxval=1), -1)
    eye = np.eye(c, dtype=np.float32)
    got = np.asarray(unit_lower_inverse(a))
    want = np.linalg.inv(eye + np.asarray(a, np.float64))
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    assert np.array_equal(np.triu(got, 1), np.zeros_like(got))


def test_padding_rows_change_nothing() -> None:
    """Rows with beta = 0 and g = 0 leave the state and the earlier rows as they were."""
    q, k, v, g, beta, state = _inputs(10)
    o, s = delta_rule_chunked(q, k, v, g, beta, state, chunk=4)
    tail = jnp.zeros((5, *beta.shape[1:]))
    o2, s2 = delta_rule_chunked(
        jnp.concatenate([q, q[:5]]), jnp.concatenate([k, k[:5]]), jnp.concatenate([v, v[:5]]),
        jnp.concatenate([g, tail]), jnp.concatenate([beta, tail]), state, chunk=4)
    assert np.allclose(o2[:10], o, atol=ATOL) and np.allclose(s2, s, atol=ATOL)


def test_control_a_missing_correction_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: dropping the chunk systems' inverse (D = rhs) must fail the tolerance."""
    q, k, v, g, beta, state = _inputs(24)
    o_ref, _ = delta_rule_scan(q, k, v, g, beta, state)
    monkeypatch.setattr(delta_rule, "unit_lower_inverse",
                        lambda a: jnp.broadcast_to(jnp.eye(a.shape[-1]), a.shape))
    o, _ = delta_rule_chunked(q, k, v, g, beta, state, chunk=8)
    assert float(jnp.abs(o - o_ref).max()) > ATOL
