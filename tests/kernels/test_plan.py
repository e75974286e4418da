"""The kernel plan (``kernels/plan.py``): what :func:`kernel_plan` resolves for each backend,
``exact`` and family (one with row-invariant kernels, one with kernels per backend, one with
neither), the delta-rule walk a plan picks, and the refusals of a bad plan or a bad
choice."""

from __future__ import annotations

import warnings

import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.kernels.plan import (
    DELTA_RULE_WALKS,
    XLA_PLAN,
    KernelPlan,
    UnknownBackendWarning,
    delta_rule_walk,
    kernel_plan,
)

ROWINV_GPU = KernelPlan(row_invariant=True, pallas="compiled")
ROWINV_TPU = KernelPlan(row_invariant=True, pallas="tpu")
ROWINV_TILED = KernelPlan(row_invariant=True, pallas="off")


@pytest.mark.parametrize(("backend", "exact", "family", "want"), [
    ("gpu", True, True, ROWINV_GPU),        # the exact plan is also the fastest on a GPU
    ("gpu", False, True, KernelPlan(row_invariant=True, pallas="compiled",
                                    quant_matvec=True)),  # quantized decode on CUDA cores
    ("cpu", True, True, ROWINV_TILED),      # the fixed-shape tiled forms
    ("cpu", False, True, XLA_PLAN),         # XLA's own kernels decode faster there
    ("tpu", True, True, ROWINV_TPU),        # the TPU's products, XLA's tiles for the rest
    ("tpu", False, True, XLA_PLAN),
    ("tpu", True, False, XLA_PLAN),
    ("gpu", True, False, XLA_PLAN),         # a family without row-invariant kernels
    ("cpu", False, False, XLA_PLAN),
])
def test_kernel_plan_by_backend_exactness_and_family(backend, exact, family, want):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known backend gives no notice
        got = kernel_plan(backend, exact, family)
    assert got == want
    assert got.widths_agree == (family and (exact or backend == "gpu"))


@pytest.mark.parametrize(("backend", "want"), [
    ("gpu", KernelPlan(pallas="compiled")), ("tpu", KernelPlan(pallas="tpu")),
    ("cpu", XLA_PLAN)])
@pytest.mark.parametrize("exact", [True, False])
def test_a_family_with_backend_kernels_gets_the_backends_set_whatever_exact(backend, want,
                                                                            exact):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = kernel_plan(backend, exact, False, backend_kernels=True)
    assert got == want and not got.widths_agree
    # a row-invariant family's plan does not follow the flag
    assert kernel_plan(backend, exact, True, backend_kernels=True) == kernel_plan(
        backend, exact, True)


@pytest.mark.parametrize(("pallas", "heads", "want"), [
    ("compiled", (128, 128), "pallas"), ("compiled", (16, 24), "xla"),  # Triton's tiles
    ("tpu", (128, 128), "tpu"), ("tpu", (16, 32), "xla"),  # whole lane blocks of dv
    ("interpret", (16, 24), "interpret"), ("tpu_interpret", (16, 32), "tpu_interpret"),
    ("off", (128, 128), "xla")])
def test_the_delta_rule_walk_follows_the_plan_and_the_heads(pallas, heads, want):
    assert delta_rule_walk(KernelPlan(pallas=pallas), *heads) == want
    assert want in DELTA_RULE_WALKS


@pytest.mark.parametrize("backend", ["METAL", "rocm", "neuron", ""])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("own", [True, False])
def test_an_unknown_backend_gets_xla_and_one_notice(backend, exact, own):
    with pytest.warns(UnknownBackendWarning) as caught:
        got = kernel_plan(backend, exact, not own, backend_kernels=own)
    assert got == XLA_PLAN
    assert len(caught) == 1
    message = str(caught[0].message)
    assert repr(backend) in message and "XLA's own kernels run" in message
    assert "\n" not in message


def test_the_tpu_plan_runs_only_its_products_in_pallas():
    assert ROWINV_TPU.impl == "tpu" and ROWINV_TPU.widths_agree
    # the norm, RoPE and attention take the forms of a plan without the GPU's kernels
    assert not ROWINV_TPU.uses_pallas and not KernelPlan.interpreted(target="tpu").uses_pallas
    assert KernelPlan.interpreted(target="tpu") == KernelPlan(row_invariant=True,
                                                              pallas="tpu_interpret")
    assert KernelPlan.interpreted(target="tpu").impl == "tpu_interpret"
    assert ROWINV_TPU.parallel() == KernelPlan(pallas="tpu")
    with pytest.raises(BadInputError, match="target must be 'gpu' or 'tpu'"):
        KernelPlan.interpreted(target="metal")


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
    with pytest.raises(BadInputError, match="pallas must be one of off, compiled, interpret, "
                                            "tpu, tpu_interpret"):
        KernelPlan(pallas="mosaic_tpu")
    with pytest.raises(BadInputError, match="row_invariant must be True or False"):
        KernelPlan(row_invariant="yes")
    with pytest.raises(BadInputError, match="exact must be True or False"):
        kernel_plan("cpu", 1, True)
    with pytest.raises(BadInputError, match="backend must be a JAX backend name"):
        kernel_plan(None, True, True)
    with pytest.raises(BadInputError, match="backend_kernels must be True or False"):
        kernel_plan("cpu", True, False, backend_kernels="yes")
