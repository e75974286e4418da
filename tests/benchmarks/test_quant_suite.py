"""The quantization suites: the random quantized weights have exactly the stored layout that
quantizing gives and sit where the loader would put them; the smoke presets of ``quant`` and
``quality`` run on the CPU, write well-formed results, and the report shows them. Nothing here
looks at a timing."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import common, quant
from benchmarks.__main__ import main
from turbospark_jax.io.loading import quantize_params
from turbospark_jax.quant.weights import (
    Quantization,
    dequantize,
    is_quantized,
    quantize,
    quantize_leaf,
)

SPECS = ("int8", "int4", "int4-g64", "int4-g32", "fp8", "fp8-block")


def _layout(tree):
    """A tree's structure (static fields included) and each leaf's shape and dtype."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]


@pytest.mark.parametrize("name", SPECS)
def test_the_stored_layout_is_what_quantizing_stores(name):
    spec = Quantization.parse(name)
    leaf = np.random.default_rng(0).standard_normal((256, 2, 128)).astype(np.float32)
    made = quantize_leaf(leaf, 256, 0, spec, jnp.bfloat16)
    drawn = quant.stored_layout(jax.ShapeDtypeStruct(leaf.shape, jnp.float32), 256, spec,
                                jnp.bfloat16)
    assert _layout(drawn) == _layout(made)
    assert drawn.stored_bytes == made.stored_bytes
    assert (drawn.in_shape, drawn.out_shape) == ((256,), (2, 128))


def test_a_layout_of_another_group_differs():
    """The control: the comparison above tells groups apart."""
    matrix = np.ones((256, 128), np.float32)
    drawn = quant.stored_layout(jax.ShapeDtypeStruct((256, 128), jnp.float32), 256,
                                Quantization("int4", 64), jnp.bfloat16)
    assert _layout(drawn) != _layout(quantize(matrix, "int4", group=128))


@pytest.mark.parametrize(("shape", "name", "count"), [
    ("tiny-llama", "int4", 14), ("tiny-llama", "fp8", 14), ("tiny", "int4", 2),
    ("tiny", "fp8-block", 0)])
def test_the_quantized_leaves_are_those_the_loader_quantizes(shape, name, count):
    """The loader's rule on host weights (in the family's own layout, then the list layout
    the suite runs) and the suite's shapes agree leaf for leaf. ``tiny``'s matrices have
    fewer inputs than a group or block but for its down projection (128 inputs, 64 outputs),
    which takes int4 and not 128 x 128 blocks: both keep the others as they are."""
    family, config, model = common.model_of(shape, "float32")
    spec = Quantization.parse(name)
    native = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    host = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), native)
    loaded = quantize_params(host, family.hf_tensors(config), spec, jnp.float32)
    loaded = family.to_layer_layout(jax.tree.map(jnp.asarray, loaded), "list")
    shapes = quant.quantized_shapes(family, config, model, name)
    assert _layout(shapes) == _layout(loaded)
    assert sum(map(is_quantized, jax.tree.leaves(shapes, is_leaf=is_quantized))) == count
    assert not is_quantized(shapes["embed_tokens"])
    assert not is_quantized(shapes.get("lm_head"))


def test_random_quantized_weights_are_in_range_and_dequantize_finite():
    family, config, model = common.model_of("tiny-llama", "float32")
    for name in ("int8", "int4", "fp8", "fp8-block"):
        params = quant.random_quantized_params(
            quant.quantized_shapes(family, config, model, name))
        weights = [w for w in jax.tree.leaves(params, is_leaf=is_quantized) if is_quantized(w)]
        assert weights
        for w in weights:
            assert bool((w.scale > 0).all())
            if w.zero is not None:
                assert int(w.zero.max()) <= 15
            if w.scheme == "int8":
                assert int(jnp.abs(w.q.astype(jnp.int32)).max()) <= 127
            values = dequantize(w)
            assert bool(jnp.isfinite(values).all()) and float(jnp.abs(values).max()) > 0


def test_step_bytes_count_quantized_weights_as_stored():
    family, config, model = common.model_of("tiny-llama", "float32")
    plain = quant.quantized_shapes(family, config, model, quant.BASELINE)
    int4 = quant.quantized_shapes(family, config, model, "int4")
    saved = 0
    for w in jax.tree.leaves(int4, is_leaf=is_quantized):
        if is_quantized(w):
            saved += w.k * w.n * 4 - w.stored_bytes
    assert saved > 0
    assert (common.step_bytes(config, plain, 16) - common.step_bytes(config, int4, 16)
            == saved)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("quant")
    assert main(["--suite", "quant,quality", "--preset", "smoke", "--out", str(out)]) == 0
    return out


def _file(folder, suite):
    data = json.loads((folder / f"{suite}_smoke.json").read_text())
    assert data["suite"] == suite and data["errors"] == [] and data["skipped"] == []
    return data


def test_the_quant_suite_measures_every_format_against_the_unquantized(smoke):
    data = _file(smoke, "quant")
    everything = [c for c in data["cases"] if c["kind"] == "decode"]
    decode = [c for c in everything if c["exact"]]
    fast = [c for c in everything if not c["exact"]]
    prefill = [c for c in data["cases"] if c["kind"] == "prefill"]
    assert [c["format"] for c in decode] == ["float32", "int4", "int8", "fp8"]
    # the plan exact=False loads decodes each quantized format too, against the same baseline
    assert [c["format"] for c in fast] == ["int4", "int8", "fp8"]
    assert all(c["tokens_per_s"] > 0 and c["speedup_over_baseline"] > 0 for c in fast)
    assert [c["format"] for c in prefill] == ["float32", "int4", "int8", "fp8"]
    assert decode[0]["speedup_over_baseline"] == 1.0 and prefill[0]["ratio_to_baseline"] == 1.0
    for c in decode:
        assert c["tokens_per_s"] > 0 and c["generated"] == 8 and c["fraction_of_roofline"] > 0
        assert c["speedup_over_baseline"] > 0
    bytes_read = {c["format"]: c["weight_bytes"] for c in decode}
    assert bytes_read["int4"] < bytes_read["int8"] == bytes_read["fp8"] < bytes_read["float32"]
    assert all(isinstance(c["meets_bar"], bool) for c in prefill)


def test_the_quant_suite_decodes_with_each_kv_cache_form(smoke):
    data = _file(smoke, "quant")
    kv = [c for c in data["cases"] if c["kind"] == "kv_decode"]
    assert [c["kv_dtype"] for c in kv] == ["float32", "int8", "fp8"]
    assert kv[0]["speedup_over_baseline"] == 1.0
    assert all(c["tokens_per_s"] > 0 and c["context"] == 24 for c in kv)
    sizes = {c["kv_dtype"]: c["cache_bytes"] for c in kv}
    # one byte a value and a float32 scale a row and head, against four bytes a value
    assert sizes["int8"] == sizes["fp8"] < sizes["float32"] / 2


def test_the_quality_suite_compares_each_format_with_the_reference(smoke):
    data = _file(smoke, "quality")
    cases = {c["format"]: c for c in data["cases"]}
    assert list(cases) == ["float32", "int8", "int4-g32"]
    assert "greedy_agreement" not in cases["float32"]
    assert data["meta"]["text"]["files"] > 0
    for name in ("int8", "int4-g32"):
        c = cases[name]
        assert c["positions"] == cases["float32"]["positions"] == 2 * 64
        assert 0 < c["greedy_agreement"] <= 1 and c["mean_kl"] >= 0
        assert c["quantized_matrices"] > 0 and c["kept_matrices"] == 0
    # 8 bits a weight lose less than 4: the figures tell the formats apart
    assert cases["int8"]["mean_kl"] < cases["int4-g32"]["mean_kl"]
    assert cases["int8"]["bits_per_quantized_weight"] > cases["int4-g32"][
        "bits_per_quantized_weight"]


def test_the_report_shows_both_suites(smoke):
    text = (smoke / "REPORT.md").read_text()
    assert "## Quantized weights: speed" in text and "## Quantized weights: quality" in text
    assert "| tiny-llama | int4 | 16 |" in text
    assert "| tsj-pycoder-draft | int8 |" in text


def test_a_format_too_large_for_the_device_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(quant, "device_memory", lambda: 1 << 16)
    preset = quant.PRESETS["smoke"]
    results = common.Results("quant", "smoke", preset, tmp_path, "test")
    quant.run(preset, results)
    assert results.cases == []
    assert {s["format"] for s in results.data["skipped"]} == {"float32", "int8", "int4", "fp8"}
    assert all("GiB" in s["reason"] for s in results.data["skipped"])
