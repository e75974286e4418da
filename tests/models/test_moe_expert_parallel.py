"""Expert parallelism on eight simulated CPU devices: a mesh with an ``ep`` axis
(``tp_mesh(devices, ep=n)``) splits the expert stacks on their expert axis, each device
computes the selections of the experts it holds, and one all-reduce of activations brings
them together (``models.moe.expert_outputs``).

* On a mesh whose ``tp`` axis has one device, a ``qwen3_moe`` (listed layers, and stacked
  layers in a scan under the row-invariant plan's row tiles), a ``qwen3_5_moe_text`` and a
  Gemma 4 MoE model run bitwise the one-device model: the logits of a greedy completion and
  the cache after a prefill;
* on every mesh the guarantees hold bitwise (chunked == token by token, verify == decode,
  and on the first two reuse == fresh and speculative == plain, with the conformance
  controls), also beside tensor parallelism (``tp=2, ep=4``);
* controls: a weight one bit off in an expert held by one device, and the ``k`` outputs added
  in another order, each break the bitwise equality;
* every bit pattern (``-0.0``, infinities, NaN; 32- and 16-bit values) comes back through
  the experts' all-reduce, which a float all-reduce would not (its control);
* ``init_sharded_params`` makes the experts in their shards;
* the compiled programs move activations, never weights: no collective's operand has an
  expert's width among its dimensions, and the experts' all-reduce is there;
* a mesh whose expert axis does not divide the experts, or a model without experts, is
  refused.

The suite's process has one device, so the checks run in a subprocess with eight (as
``tests/models/test_moe_parallel.py`` does) and print JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.parallel.tp_specs import check_divisible

#: The experts' width: no other dimension of the tiny models has this size, so a collective
#: whose operand has it would be moving expert weights.
WIDTH = 48

SCRIPT = textwrap.dedent('''
    import dataclasses, json, sys
    from turbospark_jax.testing import mesh_checks as M  # asks for 8 devices first
    import jax
    import jax.numpy as jnp
    import numpy as np
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.generation.completion import CompletionRequest
    from turbospark_jax.generation.driver import run_raw_completion
    from turbospark_jax.kernels.plan import kernel_plan
    from turbospark_jax.models import moe
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel, unstack_layers
    from turbospark_jax.models.gemma4.config import FULL, SLIDING, Gemma4Config
    from turbospark_jax.models.gemma4.model import Gemma4Model
    from turbospark_jax.models.qwen3_5.config import Qwen35Config
    from turbospark_jax.models.qwen3_5.model import Qwen35Model
    from turbospark_jax.parallel.sharding import ShardedProducer, init_sharded_params, tp_mesh

    WIDTH = int(sys.argv[1])
    REQUEST = CompletionRequest(prompt_ids=M.PROMPT, max_tokens=8, record_logits=True)

    def bits(a):
        a = np.asarray(a)
        return a.view(np.uint32) if a.dtype == np.float32 else a

    def logits(producer):
        return np.asarray(run_raw_completion(producer, REQUEST).logits, np.float32)

    def cache(producer):
        state = producer.prefill_chunk(producer.init_state(), M.PROMPT, 0)[1]
        return [np.asarray(x) for x in jax.tree.leaves(state.cache)]

    def same(a, b):
        return all(np.array_equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))

    def sharded(model, params, tp, ep):
        devices = jax.devices()[:tp * ep]
        return ShardedProducer(model, params, mesh=tp_mesh(devices, ep=ep), capacity=64,
                               width=4, steps_per_call=4)

    def run(name, model, params, tp, ep, leaf, full=True):
        model = model.for_mesh() if hasattr(model, "for_mesh") else model
        producer = sharded(model, params, tp, ep)
        result = M.conformance(producer, full=full)
        result.update(M.against_one_device(model, params, result))
        del result["logits"]
        one = BlockProducer(model, params, capacity=64, width=4, steps_per_call=4)
        result.update(name=name, tp=tp, ep=ep,
                      cache_bitwise=same(cache(producer), cache(one)),
                      expert_spec=str(leaf(producer.params).sharding.spec),
                      placement=str(producer.model.expert_parallel))
        return result

    def controls(model, params, name, ep):
        """The one-device logits against expert parallelism with the weights of the experts
        on the last device each one bit off, and with the k outputs added last to first."""
        model = model.for_mesh()
        want = logits(BlockProducer(model, params, capacity=64, width=4, steps_per_call=4))
        off = jax.tree.map(lambda x: x, params)
        for layer in off["layers"]:
            w = np.array(layer[name])
            held = w.shape[0] // ep
            w[-held:].view(np.uint32)[...] ^= np.uint32(1 << 12)
            layer[name] = jnp.asarray(w)
        perturbed = logits(sharded(model, off, 1, ep))
        plain = moe._weighted_sum

        def backwards(y, weights):
            flipped = None if weights is None else weights[:, ::-1]
            return plain(y[:, ::-1], flipped)

        moe._weighted_sum = backwards
        jax.clear_caches()  # trace again, with the patched sum
        try:
            reordered = logits(sharded(model, params, 1, ep))
        finally:
            moe._weighted_sum = plain
        return {"weight_bit_equal": bool(np.array_equal(bits(perturbed), bits(want))),
                "reordered_equal": bool(np.array_equal(bits(reordered), bits(want)))}

    dense = DenseConfig(model_type="qwen3_moe", vocab_size=M.VOCAB, hidden_size=64,
                        intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=16, num_experts=8,
                        num_experts_per_tok=3, moe_intermediate_size=WIDTH,
                        norm_topk_prob=True)  # three terms a row, whose order counts
    dmodel = DenseModel(dense, jnp.float32, scan_layers=False)
    dparams = unstack_layers(dmodel.init_params(jax.random.PRNGKey(7)))
    down = lambda p: p["layers"][0]["expert_down"]
    cases = [run("qwen3_moe", dmodel, dparams, 1, 8, down),
             run("qwen3_moe tp=2", dmodel, dparams, 2, 4, down, full=False)]
    # stacked layers in a scan, and the experts in the row-invariant plan's row tiles
    tiled = DenseModel(dense, jnp.float32, plan=kernel_plan("cpu", True, True))
    assert tiled.plan.row_invariant and tiled.scan_layers
    cases.append(run("qwen3_moe row tiles", tiled, tiled.init_params(jax.random.PRNGKey(10)),
                     1, 4, lambda p: p["layers"]["expert_up"], full=False))
    qwen = Qwen35Config(model_type="qwen3_5_moe_text", vocab_size=M.VOCAB, hidden_size=64,
                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_num_key_heads=4, linear_num_value_heads=8,
                        layer_types=("linear_attention", "full_attention"),
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=WIDTH,
                        shared_expert_intermediate_size=32)
    qmodel = Qwen35Model(qwen, jnp.float32)
    cases.append(run("qwen3_5_moe", qmodel, qmodel.init_params(jax.random.PRNGKey(8)), 1, 4,
                     lambda p: p["layers"][1]["expert_gate"]))
    gemma = Gemma4Config.from_hf_dict(dict(
        model_type="gemma4_text", vocab_size=M.VOCAB, hidden_size=32, intermediate_size=40,
        num_hidden_layers=2, layer_types=[SLIDING, FULL], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=3,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=M.VOCAB,
        enable_moe_block=True, num_experts=6, top_k_experts=2,
        moe_intermediate_size=WIDTH, initializer_range=0.1))
    gmodel = Gemma4Model(gemma, jnp.float32, ring_margin=8)
    cases.append(run("gemma4", gmodel, gmodel.init_params(jax.random.PRNGKey(9)), 1, 2,
                     lambda p: p["layers"][0]["experts_down"], full=False))
    def bit_patterns():
        """expert_outputs of a lookup, experts[t, j]'s row of a table [E, D] holding -0.0,
        inf and NaN, against the table read on one device: every float width and both 16-bit
        paths (an even and an odd D); and a float psum of the same, which loses -0.0."""
        mesh = tp_mesh(jax.devices()[:8], ep=4)
        place = moe.ExpertParallel(mesh, "ep")
        lookup = lambda rows, chosen, table: table[chosen]
        out = {}
        for dtype, d in (("float32", 6), ("bfloat16", 6), ("float16", 5)):
            table = jax.random.normal(jax.random.PRNGKey(d), (8, d)).astype(dtype)
            table = table.at[0, 0].set(-0.0).at[5, 1].set(-0.0).at[6, 2].set(jnp.inf)
            table = table.at[7, 3].set(jnp.nan).at[3].set(-0.0)
            experts = jax.random.randint(jax.random.PRNGKey(1), (5, 3), 0, 8)
            experts = experts.at[0].set(jnp.array([0, 3, 5]))
            got = jax.jit(lambda e, t: moe.expert_outputs(lookup, jnp.zeros((5, 1)), e, (t,),
                                                           place))(experts, table)
            want = np.asarray(table)[np.asarray(experts)]
            out[f"{dtype} D={d}"] = bool(np.array_equal(np.asarray(got).view(np.uint8),
                                                        want.view(np.uint8)))
        owner_sum = moe._owner_sum
        moe._owner_sum = lambda y, owned, axis: jax.lax.psum(
            jnp.where(owned[..., None], y, 0.0), axis)
        try:
            got = jax.jit(lambda e, t: moe.expert_outputs(lookup, jnp.zeros((5, 1)), e, (t,),
                                                           place))(experts, table)
        finally:
            moe._owner_sum = owner_sum
        out["float psum"] = bool(np.array_equal(np.asarray(got).view(np.uint8),
                                                want.view(np.uint8)))
        return out

    def made_in_shards():
        """init_sharded_params on an expert mesh: the experts on the ep axis, each device
        holding one expert of the model's shapes."""
        made = init_sharded_params(dmodel, jax.random.PRNGKey(7), tp_mesh(jax.devices(), ep=8),
                                   layer_layout="list")
        leaf = made["layers"][1]["expert_gate"]
        return {"spec": str(leaf.sharding.spec),
                "shards": sorted({s.data.shape for s in leaf.addressable_shards}),
                "shapes": jax.tree.map(lambda x: x.shape, made)
                == jax.tree.map(lambda x: x.shape, dparams)}

    def refusal():
        """A producer on an expert axis of 3 devices for 8 experts: its error."""
        try:
            sharded(dmodel, dparams, 2, 3)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "accepted"

    print(json.dumps({"devices": len(jax.devices()), "cases": cases, "refusal": refusal(),
                      "controls": controls(dmodel, dparams, "expert_down", 4),
                      "bit_patterns": bit_patterns(), "made_in_shards": made_in_shards()}))
''')


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hlo")
    flags = os.environ.get("XLA_FLAGS", "")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=8 "
                        f"--xla_dump_to={dump} --xla_dump_hlo_as_text".strip()}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(WIDTH)], env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["hlo"] = [p.read_text() for p in Path(dump).glob("*after_optimizations.txt")]
    return result


CASES = ["qwen3_moe", "qwen3_moe tp=2", "qwen3_moe row tiles", "qwen3_5_moe", "gemma4"]


def _case(report, name):
    return next(c for c in report["cases"] if c["name"] == name)


@pytest.mark.parametrize("name", CASES)
def test_guarantees_hold_bitwise_with_experts_split(report, name):
    case = _case(report, name)
    assert report["devices"] == 8
    assert case["passed"]
    assert "'ep'" in case["expert_spec"] and "ep" in case["placement"], case
    if "spec_equals_plain" in case:
        assert case["spec_equals_plain"]
        assert all(case["controls_fire"].values()), case["controls_fire"]


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe row tiles", "qwen3_5_moe", "gemma4"])
def test_expert_parallel_is_bitwise_one_device(report, name):
    case = _case(report, name)
    assert case["tp"] == 1 and case["ep"] > 1
    assert case["bitwise"] and case["same_tokens"]
    assert case["cache_bitwise"]


def test_beside_tensor_parallelism_the_logits_stay_near(report):
    case = _case(report, "qwen3_moe tp=2")
    assert case["max_abs_logit_diff"] < 1e-4 * max(1.0, case["max_logit"])
    assert case["same_tokens"]


def test_controls_break_the_bitwise_equality(report):
    controls = report["controls"]
    assert not controls["weight_bit_equal"], controls
    assert not controls["reordered_equal"], controls


def test_every_bit_pattern_comes_back(report):
    patterns = dict(report["bit_patterns"])
    # the control: a float all-reduce turns an expert's -0.0 into +0.0
    assert not patterns.pop("float psum"), "a float sum kept -0.0"
    assert all(patterns.values()), patterns


def test_params_made_in_their_shards(report):
    made = report["made_in_shards"]
    assert "'ep'" in made["spec"] and made["shapes"], made
    assert made["shards"] == [[1, 64, WIDTH]], made


_COLLECTIVE = re.compile(
    r" = (.*?) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
    r"(-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def _collectives(texts):
    """(op, [(dtype, dims)]) of every collective instruction: its result shapes."""
    found = []
    for text in texts:
        for line in text.splitlines():
            m = _COLLECTIVE.search(line)
            if m:
                shapes = [(t, [int(d) for d in dims.split(",") if d])
                          for t, dims in _SHAPE.findall(m.group(1))]
                found.append((m.group(2), shapes))
    return found


def test_only_activations_move(report):
    collectives = _collectives(report["hlo"])
    assert collectives, "no collective in the compiled programs"
    weights = [c for c in collectives if any(WIDTH in dims for _, dims in c[1])]
    assert not weights, weights
    # the experts' all-reduce: bit patterns [T, k, D] of each selection's output
    assert any(op == "all-reduce" and t == "u32" and dims[-2:] == [3, 64]
               for op, shapes in collectives for t, dims in shapes), collectives


def test_a_producer_on_an_expert_axis_that_cuts_the_experts_is_refused(report):
    assert report["refusal"].startswith("BadInputError"), report["refusal"]
    assert "num_experts=8 is not a multiple of 3" in report["refusal"], report["refusal"]


def test_an_expert_axis_that_cuts_the_experts_is_refused():
    config = DenseConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=64,
                         intermediate_size=96, num_hidden_layers=1, num_attention_heads=8,
                         num_key_value_heads=8, head_dim=8, num_experts=6,
                         num_experts_per_tok=2, moe_intermediate_size=12)
    check_divisible(config, 1, 3)
    check_divisible(config, 8, 2)  # the experts' width need not divide: they stay whole
    with pytest.raises(BadInputError, match=r"num_experts=6 is not a multiple of 4"):
        check_divisible(config, 1, 4)


def test_an_expert_axis_without_experts_is_refused():
    config = DenseConfig(model_type="qwen3", vocab_size=64, hidden_size=64,
                         intermediate_size=96, num_hidden_layers=1, num_attention_heads=8,
                         num_key_value_heads=8, head_dim=8)
    with pytest.raises(BadInputError, match="no experts"):
        check_divisible(config, 1, 2)


def test_an_expert_axis_that_does_not_divide_the_devices_is_refused():
    import jax

    from turbospark_jax.parallel.sharding import tp_mesh

    with pytest.raises(BadInputError, match="ep must be a positive divisor"):
        tp_mesh(jax.devices()[:1], ep=2)
