"""The grid-barrier probe (``benchmarks/probe_grid_barrier.py``) on the CPU: its chain of
one-kernel-a-product launches computes the chained products (the Pallas interpreter against
XLA's, to bfloat16 rounding), and both it and the persistent kernel, whose programs wait for
each other at barriers and so cannot run in the interpreter, lower for CUDA. Their bits
against each other, and the time a barrier costs, are the probe's to measure on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from benchmarks.probe_grid_barrier import ROWS, inputs, launches, main, persistent, stepped

S = jax.ShapeDtypeStruct
CHECKS = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def test_the_launched_chain_computes_the_chained_products():
    x, w = inputs(0, 256, 3)
    got = np.asarray(launches(x, w, interpret=True), np.float32)
    row = x[0].astype(jnp.float32)
    for p in range(3):
        row = (row @ w[p].astype(jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32)
        np.testing.assert_allclose(got[p, 0], np.asarray(row), rtol=0.02, atol=0.02)
        assert not got[p, 1:].any()  # the padding rows stay zero
    assert got.shape == (3, ROWS, 256)


@pytest.mark.parametrize("form", ["launches", "persistent", "persistent, 2 tiles ahead"])
def test_each_form_lowers_for_cuda(form):
    ahead = 2 if "ahead" in form else 0
    fn = launches if form == "launches" else (
        lambda x, w: persistent(x, w, programs=8, ahead=ahead))
    exported = export.export(stepped(fn, 2), platforms=["cuda"], disabled_checks=CHECKS)(
        S((ROWS, 256), jnp.bfloat16), S((3, 256, 256), jnp.bfloat16))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_the_probe_refuses_a_machine_without_a_gpu():
    with pytest.raises(SystemExit):
        main([])


def test_the_persistent_kernel_refuses_more_tiles_ahead_than_k_has():
    x, w = inputs(0, 256, 2)
    with pytest.raises(ValueError, match=r"ahead must be 0\.\.2"):
        persistent(x, w, programs=8, ahead=3)
