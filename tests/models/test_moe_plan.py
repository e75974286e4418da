"""The grouped experts of Qwen3.5 and Gemma 4 under their kernel plan: the plan picks the
grouped form (:func:`~turbospark_jax.kernels.plan.grouped_impl`), and a block's padding rows
take no expert tile (their selections reach the grouped products as ``-1``), on the block
program's path and the MTP head's."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.kernels.plan import XLA_PLAN, KernelPlan, grouped_impl
from turbospark_jax.models import moe
from turbospark_jax.models.gemma4 import config as GC
from turbospark_jax.models.gemma4.model import Gemma4Model
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5.model import Qwen35Model

WIDTH, LIVE = 4, 2
QWEN = QC.Qwen35Config.from_hf_dict(dict(
    model_type="qwen3_5_moe_text", vocab_size=32, hidden_size=32, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, layer_types=[QC.LINEAR, QC.FULL], bos_token_id=0,
    eos_token_id=1, pad_token_id=2, max_position_embeddings=64, mtp_num_hidden_layers=1))
GEMMA = GC.Gemma4Config.from_hf_dict(dict(
    model_type="gemma4_text", vocab_size=32, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    global_head_dim=16, layer_types=[GC.SLIDING, GC.FULL], sliding_window=4,
    hidden_size_per_layer_input=4, vocab_size_per_layer_input=32, enable_moe_block=True,
    num_experts=6, top_k_experts=2, moe_intermediate_size=16,
    bos_token_id=0, eos_token_id=1, pad_token_id=2, max_position_embeddings=64))
MODELS = [Qwen35Model(QWEN, max_width=WIDTH), Gemma4Model(GEMMA, ring_margin=WIDTH)]
PLANS = [XLA_PLAN, KernelPlan(pallas="interpret"), KernelPlan(pallas="tpu_interpret")]


@pytest.fixture
def calls(monkeypatch) -> dict[str, list[Any]]:
    """What reaches the grouped products: each call's form (at trace time) and selections
    (as the program runs), in the XLA form (the forms' own tests check them)."""
    seen: dict[str, list[Any]] = {"impl": [], "experts": []}
    real = moe.expert_mlp

    def record(x: jax.Array, experts: jax.Array, *args: Any, impl: str, **kwargs: Any) -> Any:
        seen["impl"].append(impl)
        jax.debug.callback(lambda e: seen["experts"].append(np.asarray(e)), experts)
        return real(x, experts, *args, impl="xla", **kwargs)

    monkeypatch.setattr(moe, "expert_mlp", record)
    return seen


def _random(shapes: Any) -> Any:
    """Random leaves of these shapes (quicker than a family's own init)."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape) * 0.3, a.dtype),
                        shapes)


def _block(model: Any, run: bool) -> None:
    """One block of ``WIDTH`` rows, ``LIVE`` of them live: run, or only traced."""
    params = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    if run:
        params = _random(params)
    rows = jnp.arange(WIDTH, dtype=jnp.int32)
    step = jax.jit(lambda p: model.block_forward(p, model.init_cache(16), rows + 3, rows,
                                                 jnp.int32(LIVE), jnp.bool_(True)))
    if run:
        jax.block_until_ready(step(params))
    else:
        jax.eval_shape(step, params)


def _check_rows(calls: dict[str, list[Any]], layers: int) -> None:
    assert len(calls["experts"]) == layers
    for experts in calls["experts"]:
        assert np.all(experts[:LIVE] >= 0) and np.all(experts[LIVE:] == -1), experts


@pytest.mark.parametrize("model", MODELS, ids=["qwen3_5", "gemma4"])
def test_the_plan_picks_the_grouped_form(calls, model) -> None:
    for plan in PLANS:
        calls["impl"].clear()
        _block(dataclasses.replace(model, plan=plan), run=False)
        assert calls["impl"] == [grouped_impl(plan)] * model.config.num_hidden_layers


@pytest.mark.parametrize("model", MODELS, ids=["qwen3_5", "gemma4"])
def test_padding_rows_take_no_expert_tile(calls, model) -> None:
    _block(model, run=True)
    _check_rows(calls, model.config.num_hidden_layers)


def test_the_mtp_heads_padding_rows_take_no_expert_tile(calls) -> None:
    model = Qwen35Model(QWEN, max_width=WIDTH)
    params = _random(jax.eval_shape(model.init_params, jax.random.PRNGKey(0)))
    rows = jnp.arange(WIDTH, dtype=jnp.int32)
    step = jax.jit(lambda p: model.mtp_block_forward(
        p, model.mtp_init_cache(16), jnp.ones((WIDTH, QWEN.hidden_size)), rows + 3, rows,
        jnp.int32(LIVE)))
    jax.block_until_ready(step(params))
    _check_rows(calls, 1)


def test_the_mesh_plan_turns_the_pallas_forms_off() -> None:
    for model in (Qwen35Model(QWEN, plan=KernelPlan(pallas="compiled")),
                  Gemma4Model(GEMMA, plan=KernelPlan(pallas="compiled"))):
        assert model.for_mesh().plan == XLA_PLAN
        assert grouped_impl(model.plan) == "pallas"
