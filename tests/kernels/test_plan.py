"""The kernel plan (``kernels/plan.py``): what :func:`kernel_plan` resolves for each backend,
``exact`` and family, and the refusals of a bad plan or a bad choice."""

from __future__ import annotations

import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.plan import XLA_PLAN, KernelPlan, kernel_plan

ROWINV_GPU = KernelPlan(row_invariant=True, pallas="compiled")
ROWINV_TILED = KernelPlan(row_invariant=True, pallas="off")


@pytest.mark.parametrize(("backend", "exact", "family", "want"), [
    ("gpu", True, True, ROWINV_GPU),        # the exact plan is also the fastest on a GPU
    ("gpu", False, True, ROWINV_GPU),
    ("cpu", True, True, ROWINV_TILED),      # the fixed-shape tiled forms
    ("cpu", False, True, XLA_PLAN),         # XLA's own kernels decode faster there
    ("tpu", True, True, ROWINV_TILED),
    ("gpu", True, False, XLA_PLAN),         # a family without row-invariant kernels
    ("cpu", False, False, XLA_PLAN),
])
def test_kernel_plan_by_backend_exactness_and_family(backend, exact, family, want):
    got = kernel_plan(backend, exact, family)
    assert got == want
    assert got.widths_agree == (family and (exact or backend == "gpu"))


def test_the_plan_of_a_parallel_pass_and_the_interpreted_fixture():
    assert ROWINV_GPU.parallel() == KernelPlan(pallas="compiled")
    assert not ROWINV_GPU.parallel().widths_agree
    assert KernelPlan.interpreted() == KernelPlan(row_invariant=True, pallas="interpret")
    assert KernelPlan.interpreted().impl == "interpret" and ROWINV_GPU.impl == "pallas"
    assert ROWINV_TILED.impl == "xla" and not ROWINV_TILED.uses_pallas
    assert hash(ROWINV_GPU) == hash(KernelPlan(row_invariant=True, pallas="compiled"))


def test_bad_plans_and_choices_are_refused():
    with pytest.raises(BadInputError, match="pallas must be one of off, compiled, interpret"):
        KernelPlan(pallas="triton")
    with pytest.raises(BadInputError, match="row_invariant must be True or False"):
        KernelPlan(row_invariant="yes")
    with pytest.raises(BadInputError, match="exact must be True or False"):
        kernel_plan("cpu", 1, True)
    with pytest.raises(BadInputError, match="backend must be a JAX backend name"):
        kernel_plan(None, True, True)
