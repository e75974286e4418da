"""The last-program norm probe (``benchmarks/probe_last_program.py``) on the CPU: in the
Pallas interpreter its fused kernel gives the two launches' bits with either sum and leaves
its counter at zero, a changed norm weight shows (the control), and every form lowers for
CUDA (where an atomic or a slice Triton cannot lower would fail). Whether the tiles are
visible to the last program on the hardware is the probe's own question on a GPU."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks.probe_last_program import chain, main
from turbospark_jax.testing.cuda_export import cuda_text

S = jax.ShapeDtypeStruct


def test_the_interpreted_probe_keeps_the_bits_and_resets_its_counter(tmp_path):
    out = tmp_path / "probe.json"
    assert main(["--interpret", "--seeds", "2", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert len(records) == 2
    for r in records:
        assert r["bits_equal_jnp.sum"] and r["bits_equal_tree"] and r["control_differs"]
        assert r["counter_reset_jnp.sum"] and r["counter_reset_tree"]


@pytest.mark.parametrize("form,tree", [("last program", False), ("last program", True),
                                       ("last program, fresh counter", True),
                                       ("two launches", True), ("matvec", False)])
def test_each_form_lowers_for_cuda(form, tree):
    def run(x, w, r, wn, c):
        return chain(x, w, r, wn, c, form=form, tree=tree, steps=2, interpret=False)

    bf16 = jnp.bfloat16
    text = cuda_text(run, S((16, 512), bf16), S((512, 256), bf16), S((256,), bf16),
                     S((256,), bf16), S((1,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in text
