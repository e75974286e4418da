"""The TPU's kernels lowered for a TPU on the CPU: ``jax.export`` for ``platforms=["tpu"]``
runs Pallas' Mosaic TPU lowering (block shapes, the kernel body's operations), so a kernel a
TPU would refuse at that stage fails here. What lowering cannot show, that Mosaic's compiler
and the hardware keep every row's bits, needs a TPU; nothing here ran on one.

Also lowered: a dense model's one-row decode step under the TPU plan (every product a Mosaic
kernel), and a tensor-parallel decode step on a 2x2 TPU mesh of abstract devices (the mesh
plan's XLA forms, as :meth:`~turbospark_jax.models.dense.model.DenseModel.for_mesh` makes it),
with the TPU product itself on that mesh under ``shard_map``.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from turbospark_jax.kernels import tpu_attention, tpu_products
from turbospark_jax.kernels.plan import KernelPlan
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, unstack_layers
from turbospark_jax.parallel.tp_specs import TP, cache_specs, param_specs

BF16, F32 = jnp.bfloat16, jnp.float32
S = jax.ShapeDtypeStruct
MOSAIC = "tpu_custom_call"


def _tpu_text(fn, *args) -> tuple[str, export.Exported]:
    program = fn if hasattr(fn, "lower") else jax.jit(fn)
    exported = export.export(program, platforms=["tpu"])(*args)
    return exported.mlir_module(), exported


def _product(nk: bool, out, label: str = "o"):
    # the jitted core, past the check that refuses impl="tpu" on a machine without a TPU
    return lambda x, w: tpu_products._tpu_matmul(x, w, nk, jnp.dtype(out), "tpu", label)


PRODUCTS = {
    "one row, bfloat16": (_product(False, BF16), S((1, 700), BF16), S((700, 300), BF16)),
    "one row, float32": (_product(False, F32), S((1, 700), F32), S((700, 300), F32)),
    "one row, [N, K] weight, float32 out": (
        _product(True, F32), S((1, 256), BF16), S((1000, 256), BF16)),
    "16 rows": (_product(False, BF16), S((16, 512), BF16), S((512, 384), BF16)),
    "300 rows, tall row tiles": (_product(False, BF16), S((300, 2048), BF16),
                                 S((2048, 256), BF16)),
}


@pytest.mark.parametrize("name", PRODUCTS)
def test_the_tpu_product_lowers_for_a_tpu(name):
    fn, *args = PRODUCTS[name]
    text, _ = _tpu_text(fn, *args)
    assert MOSAIC in text and "tpu_rowinv_matmul_o" in text
    assert "stablehlo.dot_general" not in text  # the product is the kernel's, none left to XLA


def _attention(window):
    # the jitted core, past the check that refuses impl="tpu" on a machine without a TPU
    return lambda q, k, v, qp, kp: tpu_attention._tpu_attention(q, k, v, qp, kp, window, "tpu")


CACHE = S((2048, 2, 128), BF16)
ATTENTION = {
    "one row": (_attention(None), S((1, 8, 128), BF16), CACHE, CACHE, S((1,), jnp.int32),
                S((2048,), jnp.int32)),
    "40 rows, a window, float32": (
        _attention(512), S((40, 8, 128), F32), S((2048, 2, 128), F32), S((2048, 2, 128), F32),
        S((40,), jnp.int32), S((2048,), jnp.int32)),
    "a capacity of one block": (_attention(None), S((3, 2, 256), BF16), S((200, 1, 256), BF16),
                                S((200, 1, 256), BF16), S((3,), jnp.int32),
                                S((200,), jnp.int32)),
}


@pytest.mark.parametrize("name", ATTENTION)
def test_the_tpu_attention_lowers_for_a_tpu(name):
    fn, *args = ATTENTION[name]
    text, _ = _tpu_text(fn, *args)
    assert MOSAIC in text and 'kernel_name = "tpu_attention"' in text
    assert "stablehlo.dot_general" not in text


CONFIG = DenseConfig(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)


def _decode(model: DenseModel, shardings=None) -> tuple[str, export.Exported]:
    params = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0)))
    if not model.scan_layers:
        params = jax.eval_shape(unstack_layers, params)
    cache = jax.eval_shape(lambda: model.init_cache(256))
    row = S((1,), jnp.int32)

    def step(p, c, t, pos, live, head):
        return model.block_forward(p, c, t, pos, live, head)

    program = jax.jit(step) if shardings is None else jax.jit(
        step, in_shardings=shardings(params, cache))
    return _tpu_text(program, params, cache, row, row, S((), jnp.int32), S((), jnp.bool_))


def _kernel_names(text: str) -> set[str]:
    return set(re.findall(r'kernel_name = "(\w+)"', text))


def test_a_one_row_decode_step_under_the_tpu_plan_lowers_with_mosaic_products(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    tpu = DenseModel(CONFIG, BF16, scan_layers=False,
                     plan=KernelPlan(row_invariant=True, pallas="tpu"))
    text, _ = _decode(tpu)
    names = _kernel_names(text)
    assert MOSAIC in text
    assert {"tpu_rowinv_matmul_o", "tpu_rowinv_matmul_gate_up", "tpu_rowinv_matmul_down",
            "tpu_rowinv_matmul_head"} <= names, names
    # control: the CPU's row-invariant plan lowers the same step without a Mosaic kernel
    assert "tpu_attention" not in names  # heads of 32: XLA's tiled attention
    tiled = DenseModel(CONFIG, BF16, scan_layers=False,
                       plan=KernelPlan(row_invariant=True, pallas="off"))
    assert MOSAIC not in _decode(tiled)[0]


def test_a_decode_step_with_heads_of_128_runs_the_tpu_attention(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    config = dataclasses.replace(CONFIG, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=128)
    model = DenseModel(config, BF16, scan_layers=False,
                       plan=KernelPlan(row_invariant=True, pallas="tpu"))
    text, _ = _decode(model)
    assert "tpu_attention" in _kernel_names(text)
    assert "stablehlo.dot_general" not in text  # every product and attention in a kernel


MESH = AbstractMesh((2, 2), ("dp", TP))


def _named(specs):
    return jax.tree.map(lambda s: NamedSharding(MESH, s), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def test_a_sharded_decode_step_lowers_on_a_2x2_tpu_mesh(monkeypatch):
    """The mesh plan of the TPU plan (Pallas off: a kernel is a single-device custom call
    the partitioner cannot split) lowers for four TPU devices, the weights and the cache
    split over the tensor-parallel axis."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    model = DenseModel(CONFIG, BF16, plan=KernelPlan(row_invariant=True, pallas="tpu"))
    meshed = model.for_mesh()
    assert meshed.plan == KernelPlan(row_invariant=True, pallas="off")
    replicated = NamedSharding(MESH, PartitionSpec())

    def shardings(params, cache):
        return (_named(param_specs(CONFIG, params, 2)), _named(cache_specs(CONFIG, cache, 2)),
                *(replicated,) * 4)

    text, exported = _decode(meshed, shardings)
    assert exported.nr_devices == 4
    assert re.search(r'sdy\.mesh @\w+ = <\["dp"=2, "tp"=2\]>', text)
    assert '{"tp"}' in text  # split operands, not a replicated program
    assert MOSAIC not in text


def test_the_tpu_product_lowers_per_shard_on_a_2x2_tpu_mesh():
    """The product under ``shard_map``, the weight's columns split over ``tp``: each device
    runs the Mosaic kernel on its own columns (a column's bits follow ``K`` alone, so the
    split changes none)."""
    local = _product(False, BF16)
    split = PartitionSpec(None, TP)
    program = jax.jit(
        jax.shard_map(local, mesh=MESH, in_specs=(PartitionSpec(), split), out_specs=split,
                      check_vma=False),
        in_shardings=(NamedSharding(MESH, PartitionSpec()), NamedSharding(MESH, split)))
    text, exported = _tpu_text(program, S((1, 256), BF16), S((256, 512), BF16))
    assert exported.nr_devices == 4
    assert MOSAIC in text
    assert "tensor<256x256xbf16>" in text  # each shard's half of the columns
