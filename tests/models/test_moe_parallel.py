"""Mixture-of-experts models split over a tensor-parallel mesh of simulated CPU devices: the
expert stacks split on each expert's width (``parallel.tp_specs``), the guarantees hold
bitwise on the mesh (chunked == token by token, verify == decode, reuse == fresh, speculative
== plain, with controls), and the logits stay near one device's.

The suite's process has one device, so the checks run in a subprocess with eight (as
``tests/parallel/test_sharding.py`` does) and print JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.parallel.tp_specs import check_divisible

SCRIPT = textwrap.dedent('''
    import json
    from turbospark_jax.testing import mesh_checks as M  # asks for 8 devices first
    import jax
    import jax.numpy as jnp
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel, unstack_layers
    from turbospark_jax.models.qwen3_5.config import Qwen35Config
    from turbospark_jax.models.qwen3_5.model import Qwen35Model
    from turbospark_jax.parallel.sharding import ShardedProducer, tp_mesh

    def run(name, model, params, tp, leaf):
        producer = ShardedProducer(model, params, mesh=tp_mesh(jax.devices()[:tp]),
                                   capacity=64, width=4, steps_per_call=4)
        result = M.conformance(producer, full=True)
        result.update(M.against_one_device(model, params, result))
        del result["logits"]
        result["expert_spec"] = str(leaf(producer.params).sharding.spec)
        result["name"] = name
        return result

    dense = DenseConfig(model_type="qwen3_moe", vocab_size=M.VOCAB, hidden_size=64,
                        intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=16, num_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    model = DenseModel(dense, jnp.float32, scan_layers=False)
    params = unstack_layers(model.init_params(jax.random.PRNGKey(7)))
    cases = [run("qwen3_moe", model, params, 4,
                 lambda p: p["layers"][0]["expert_down"])]
    qwen = Qwen35Config(model_type="qwen3_5_moe_text", vocab_size=M.VOCAB, hidden_size=64,
                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_num_key_heads=4, linear_num_value_heads=8,
                        layer_types=("linear_attention", "full_attention"),
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32)
    qmodel = Qwen35Model(qwen, jnp.float32).for_mesh()
    cases.append(run("qwen3_5_moe", qmodel, qmodel.init_params(jax.random.PRNGKey(8)), 2,
                     lambda p: p["layers"][1]["expert_gate"]))
    print(json.dumps({"devices": len(jax.devices()), "cases": cases}))
''')


@pytest.fixture(scope="module")
def report():
    flags = os.environ.get("XLA_FLAGS", "")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=8".strip()}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", [0, 1])
def test_guarantees_hold_bitwise_on_a_mesh(report, index):
    case = report["cases"][index]
    assert report["devices"] == 8
    assert case["passed"] and case["spec_equals_plain"]
    # (a recurrent model reuses a record only when the prompt extends it, which this one does
    # not: reuse == fresh still held, over nothing reused)
    assert case["reused"] > 0 or case["name"] == "qwen3_5_moe"
    assert all(case["controls_fire"].values()), case["controls_fire"]  # the controls fail


@pytest.mark.parametrize("index", [0, 1])
def test_experts_split_and_logits_stay_near_one_device(report, index):
    case = report["cases"][index]
    assert "'tp'" in case["expert_spec"], case["expert_spec"]
    assert case["max_abs_logit_diff"] < 1e-4 * max(1.0, case["max_logit"])
    assert case["same_tokens"]


def test_a_mesh_that_cuts_an_experts_width_is_refused():
    config = DenseConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=64,
                         intermediate_size=96, num_hidden_layers=1, num_attention_heads=8,
                         num_key_value_heads=8, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=12)
    check_divisible(config, 4)  # 12 columns split 4 ways (the dense width 96 does not count)
    with pytest.raises(BadInputError, match="moe_intermediate_size=12"):
        check_divisible(config, 8)


def test_loading_shard_by_shard_is_refused_before_reading(tmp_path):
    import jax

    from turbospark_jax.errors import UnsupportedCapabilityError
    from turbospark_jax.io.saving import save_folder
    from turbospark_jax.models.dense.model import init_params
    from turbospark_jax.parallel.loading import load_sharded
    from turbospark_jax.parallel.sharding import tp_mesh

    config = DenseConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=16,
                         intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=8)
    save_folder(tmp_path, config, init_params(config, jax.random.PRNGKey(0)))
    with pytest.raises(UnsupportedCapabilityError, match="shard_params"):
        load_sharded(tmp_path, tp_mesh(jax.devices()[:1]))
