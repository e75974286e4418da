"""Lowering a function for an NVIDIA GPU on a machine that has none, for tests that read the
program a GPU would run (its Pallas kernels, what is left to XLA).

``jax.export`` for ``platforms=["cuda"]`` does that on the CPU. jax 0.10 lowers a Pallas
Triton kernel there without asking which GPU; jax 0.11 asks the device for its compute
capability and, on a machine without a GPU, takes it from an abstract device named by the
abstract mesh in use (``jax.sharding.use_abstract_mesh``). :func:`export_for_cuda` names an
H100 that way where the jax in use has abstract devices, so the same tests run on both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax
from jax import export

#: The custom calls a GPU program may hold that ``jax.export`` would otherwise refuse: the
#: Triton kernels Pallas lowers to, and the GPU's own random-bits kernel.
GPU_CALLS = ("__gpu$xla.gpu.triton", "cu_threefry2x32", "cu_threefry2x32_ffi")
#: The GPU a program is lowered for where jax asks (its compute capability: 9.0).
TARGET_KIND = "NVIDIA H100 80GB HBM3"


def _target_gpu() -> contextlib.AbstractContextManager:
    """Names :data:`TARGET_KIND` as the device to lower for, where this jax has abstract
    devices and the machine has no GPU; otherwise changes nothing."""
    device_type = getattr(jax.sharding, "AbstractDevice", None)
    # (the devices themselves: tests may say the default backend is a GPU)
    if device_type is None or any(d.platform == "gpu" for d in jax.devices()):
        return contextlib.nullcontext()
    device = device_type(device_kind=TARGET_KIND, num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def export_for_cuda(fn: Any, *args: Any, calls: Sequence[str] = GPU_CALLS,
                    **kwargs: Any) -> export.Exported:
    """``jax.export`` of ``fn`` (jitted here unless it is already) for a CUDA GPU, at
    ``args`` and ``kwargs`` (arrays or ``jax.ShapeDtypeStruct``; a jitted ``fn``'s static
    arguments), the custom calls ``calls`` allowed."""
    program = fn if hasattr(fn, "lower") else jax.jit(fn)
    checks = [export.DisabledSafetyCheck.custom_call(name) for name in calls]
    with _target_gpu():
        return export.export(program, platforms=["cuda"], disabled_checks=checks)(
            *args, **kwargs)


def cuda_text(fn: Any, *args: Any, calls: Sequence[str] = GPU_CALLS, **kwargs: Any) -> str:
    """The StableHLO text of :func:`export_for_cuda`'s program."""
    return export_for_cuda(fn, *args, calls=calls, **kwargs).mlir_module()
