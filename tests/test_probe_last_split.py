"""The last-split fold probe (``benchmarks/probe_last_split.py``) on the CPU: in the Pallas
interpreter the split kernel that folds in each tile's last program gives the rows of the
split and fold kernels bitwise and leaves its counters at zero, a changed key shows (the
control), and both forms lower for CUDA. Whether the partials are visible to the last
program on the hardware is the probe's own question on a GPU."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from jax import export

from benchmarks.probe_last_split import chain, main, slots

S = jax.ShapeDtypeStruct
CHECKS = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def test_the_interpreted_probe_keeps_the_bits_and_resets_its_counters(tmp_path):
    out = tmp_path / "probe.json"
    assert main(["--interpret", "--seeds", "1", "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())["records"]
    assert record["bits_equal"] and record["counter_reset"] and record["control_differs"]


@pytest.mark.parametrize("form", ["last split", "last split, fresh counters", "two launches"])
def test_each_form_lowers_for_cuda(form):
    heads, kv_heads, head_dim, capacity = 8, 2, 64, 2048

    def run(qs, k, v, positions, count):
        return chain(qs, k, v, positions, count, form=form, interpret=False)

    bf16 = jnp.bfloat16
    exported = export.export(jax.jit(run), platforms=["cuda"], disabled_checks=CHECKS)(
        S((2, 1, heads, head_dim), bf16), S((capacity, kv_heads, head_dim), bf16),
        S((capacity, kv_heads, head_dim), bf16), S((2, 1), jnp.int32),
        S((slots(heads, kv_heads, head_dim, capacity),), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
