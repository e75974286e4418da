"""The train suite's matmul bound on training MFU runs on the CPU at tiny shapes, lists every
product of the step, and counts their FLOPs right. No timing is compared: CI machines are shared
and noisy."""

import math

import jax
import pytest

from benchmarks.train_bound import matmul_bound

B, T = 2, 64


def test_matmul_bound_lists_every_product_and_counts_them():
    from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path
    from turbospark_jax.io.tokenizer import Tokenizer
    from turbospark_recipe import train as rt

    assert "tiny35" in rt.PRESETS
    r = matmul_bound("tiny35", B, T, iters=2, repeats=1)
    for key in ("products", "groups", "matmul_flops", "attention_flops", "time_s", "tflops",
                "fraction_of_peak", "peak_flops", "model_flops_per_step", "mfu_ceiling",
                "delta_rule_chunk_flops", "traced_step_dot_flops", "unaccounted_flops"):
        assert key in r, key
    assert r["peak_flops"] is None and r["mfu_ceiling"] is None  # a CPU has no known peak

    config = rt.model_config("tiny35", Tokenizer.from_folder(embedded_model_path(DEFAULT_TARGET)))
    params = jax.eval_shape(
        lambda: rt.build_model(config, "float32").init_params(jax.random.PRNGKey(0)))
    skipped = ("embed_tokens", "norm", "A_log", "dt_bias", "conv1d")
    matrices = {jax.tree_util.keystr(path): leaf.shape
                for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                if leaf.ndim >= 2 and not any(w in jax.tree_util.keystr(path) for w in skipped)}
    products = r["products"]
    listed = {p["weight"] for p in products if p["weight"]}
    # Every matrix that multiplies activations, and the tied head through the embedding table.
    assert listed == set(matrices) | {"['embed_tokens']"}
    for weight in listed:
        assert sorted(p["kind"] for p in products if p["weight"] == weight) == (
            ["dw", "dw", "dx", "dx", "fwd", "fwd"] if weight == "['embed_tokens']"
            else ["dw", "dx", "fwd"])

    # The total, once from the listed shapes and once from the config alone.
    def from_shapes(p):
        # The output is [batch..., lhs's free axis, rhs's free axis]: what else lhs holds is
        # the contracted length.
        contracted = math.prod(p["lhs"]) // math.prod(p["out"][:-1])
        assert contracted * math.prod(p["out"][:-1]) == math.prod(p["lhs"])
        return 2 * math.prod(p["out"]) * contracted

    assert all(from_shapes(p) == p["flops"] for p in products)
    assert r["matmul_flops"] == sum(p["flops"] for p in products)
    m = B * T
    weights = sum(2 * m * math.prod(shape) for shape in matrices.values())
    head = 2 * 2 * m * config.hidden_size * config.vocab_size  # trunk and MTP head
    attending = config.layer_types.count("full_attention") + config.mtp_num_hidden_layers
    attention = attending * 6 * 2 * B * config.num_attention_heads * T * T * config.head_dim
    assert r["attention_flops"] == attention
    assert r["matmul_flops"] == 3 * weights + 3 * head + attention
    # The recipe's own step, traced, holds no product beyond these and the delta rule's.
    assert r["unaccounted_flops"] == 0 and r["delta_rule_chunk_flops"] > 0

    assert r["time_s"] > 0 and all(t > 0 for t in r["times_s"])
    assert r["groups"] and all(g["time_s"] > 0 and g["tflops"] > 0 for g in r["groups"])
    assert sum(g["count"] for g in r["groups"]) == len(products)
    assert sum(g["flops"] for g in r["groups"]) == r["matmul_flops"]


def test_matmul_bound_refuses_a_dense_preset():
    with pytest.raises(ValueError, match=r"not a Qwen3\.5 model"):
        matmul_bound("tiny", B, T, iters=1, repeats=1)
