"""The last-split fold probe (``benchmarks/probe_last_split.py``) on the CPU: in the Pallas
interpreter the model's fused split kernel with ``fold_in_split`` (each tile's partials
folded by its last split program) gives the rows and caches of the split and fold kernels
bitwise over decode steps, a changed key shows (the control), and both forms lower for
CUDA. Whether the partials are visible to the last program on the hardware is the probe's
own question on a GPU."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks.probe_last_split import chain, main
from turbospark_jax.testing.cuda_export import cuda_text

S = jax.ShapeDtypeStruct


def test_the_interpreted_probe_keeps_the_bits(tmp_path):
    out = tmp_path / "probe.json"
    assert main(["--interpret", "--seeds", "1", "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())["records"]
    assert record["bits_equal"] and record["control_differs"]


@pytest.mark.parametrize("form", ["last split", "two launches"])
def test_each_form_lowers_for_cuda(form):
    heads, kv_heads, head_dim, capacity, steps = 8, 2, 64, 2048, 2

    def run(qkv, cos, sin, positions, k, v):
        return chain(qkv, cos, sin, positions, k, v, heads=heads, form=form, interpret=False)

    bf16 = jnp.bfloat16
    text = cuda_text(
        run, S((steps, 1, (heads + 2 * kv_heads) * head_dim), bf16),
        S((steps, 1, head_dim), bf16), S((steps, 1, head_dim), bf16),
        S((steps, 1), jnp.int32), S((capacity, kv_heads, head_dim), bf16),
        S((capacity, kv_heads, head_dim), bf16))
    assert "__gpu$xla.gpu.triton" in text
    folding = "rope_store_attention_split_folding" in text
    assert folding == (form == "last split")
