"""The layer-tail probe (``benchmarks/probe_layer_tail.py``) on the CPU: it refuses a machine
without a GPU (the tail kernel's programs wait for each other), its reference form is the
four kernels' arithmetic (checked in the interpreter against the tail kernel in
``tests/test_pallas_layer_tail.py``), and every form it times names settings the kernel
takes. Its bits and times are the GPU's to give."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import probe_layer_tail
from turbospark_jax.models import pallas_layer_tail


def test_the_probe_refuses_a_machine_without_a_gpu():
    with pytest.raises(SystemExit):
        probe_layer_tail.main([])


def test_every_form_names_settings_the_kernel_takes():
    taken = set(inspect.signature(pallas_layer_tail.layer_tail).parameters)
    assert probe_layer_tail.FORMS["four kernels"] is None
    for form, settings in probe_layer_tail.FORMS.items():
        if settings is not None:
            assert set(settings) <= taken, form


def test_the_reference_form_computes_the_layer_tail():
    """The four kernels (XLA's forms on the CPU) against the tail's arithmetic in float32:
    ``h = residual + attn @ w_o``, then ``swiglu(rms_norm(h)) @ down``, to bfloat16 rounding."""
    lw = probe_layer_tail.layer_weights(jax.random.PRNGKey(1), 128, 256, 256)
    rng = np.random.default_rng(0)
    attn = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    h0 = jnp.asarray(rng.standard_normal((2, 128)), jnp.bfloat16)
    h, parts = probe_layer_tail.four_kernels(attn, h0, lw)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    want_h = f32(h0) + f32(attn) @ f32(lw["w_o"])
    np.testing.assert_allclose(f32(h), want_h, rtol=0.02, atol=0.05)
    x = f32(h)
    normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + probe_layer_tail.EPS) * f32(lw["post"])
    gate, up = normed @ f32(lw["gate"]), normed @ f32(lw["up"])
    want = (gate / (1 + np.exp(-gate)) * up) @ f32(lw["down"])
    np.testing.assert_allclose(f32(parts).sum(0), want, rtol=0.05, atol=0.1)
