"""A quantized model saves in a published layout and loads back bitwise.

``save_folder`` writes block-wise fp8 in the ``fp8`` layout (which ``transformers`` reads) and
every other scheme in compressed-tensors' layout; loading the folder gives back the same
quantized leaves, bit for bit (a perturbed tensor is the control that must fail), and the
block-wise fp8 folder gives ``transformers`` the matrices we dequantize.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.io.test_quantized_layouts import (
    CONFIG,
    _forward,
    _transformers_fp8,
    _transformers_logits,
    build_layout,
)
from turbospark_jax.core.state import tree_bitwise_equal
from turbospark_jax.errors import BadInputError
from turbospark_jax.io.loading import load_folder
from turbospark_jax.io.saving import save_folder
from turbospark_jax.models.dense.model import init_params
from turbospark_jax.quant.weights import Quantization, QuantizedWeight, dequantize, quantize

pytestmark = pytest.mark.usefixtures("full_precision_products")

#: spec -> the quant_method its folder names.
SPECS = {"int8": "compressed-tensors", "int4-g32": "compressed-tensors",
         "int4": "compressed-tensors", "fp8": "compressed-tensors", "fp8-block": "fp8"}


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dense")
    save_folder(folder, CONFIG, init_params(CONFIG, jax.random.PRNGKey(0)))
    return folder


def _save_and_reload(loaded: Any, folder: Path, layer_layout: str = "stacked",
                     **kwargs: Any) -> Any:
    save_folder(folder, loaded.config, loaded.params, **kwargs)
    return load_folder(folder, layer_layout=layer_layout)


def _flip_a_byte(path: Path, prefix: str) -> None:
    """Change one byte of the stored values of the first tensor named ``prefix...`` (in the
    file itself: numpy's safetensors reader has no float8)."""
    data = bytearray(path.read_bytes())
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    name = next(n for n in sorted(header) if n.startswith(prefix)
                and n.endswith(("weight", "weight_packed")))
    data[8 + size + header[name]["data_offsets"][0] + 5] ^= 0x11
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("spec", list(SPECS))
def test_saved_quantized_model_loads_back_bitwise(dense_folder: Path, tmp_path: Path,
                                                  spec: str) -> None:
    loaded = load_folder(dense_folder, quantize=spec)
    assert isinstance(loaded.params["layers"]["down_proj"], QuantizedWeight)
    again = _save_and_reload(loaded, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == SPECS[spec]
    assert tree_bitwise_equal(loaded.params, again.params)
    assert np.array_equal(_forward(loaded), _forward(again))
    # Control: one stored value changed is seen.
    _flip_a_byte(tmp_path / "model.safetensors", "model.layers.1.mlp.up_proj.weight")
    assert not tree_bitwise_equal(loaded.params, load_folder(tmp_path).params)


def test_quantized_head_and_sharded_list_layout_round_trip(dense_folder: Path,
                                                           tmp_path: Path) -> None:
    loaded = load_folder(dense_folder, quantize=Quantization("int8", head=True),
                         layer_layout="list")
    assert isinstance(loaded.params["lm_head"], QuantizedWeight)
    again = _save_and_reload(loaded, tmp_path, max_shard_bytes=40_000, layer_layout="list")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"][
        "ignore"] == []
    assert tree_bitwise_equal(loaded.params, again.params)


def test_published_layout_saves_and_loads_back_bitwise(dense_folder: Path,
                                                       tmp_path: Path) -> None:
    build_layout(dense_folder, tmp_path / "awq", "awq")
    loaded = load_folder(tmp_path / "awq")
    again = _save_and_reload(loaded, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert tree_bitwise_equal(loaded.params, again.params)


def test_mixed_schemes_save_in_one_config_group_each(dense_folder: Path,
                                                     tmp_path: Path) -> None:
    loaded = load_folder(dense_folder, quantize="int4-g32")
    layers = dict(loaded.params["layers"])
    down = np.asarray(layers["down_proj"].dequantize(jnp.float32))
    layers["down_proj"] = jax.tree.map(jnp.asarray, _stacked(
        [quantize(m, "int8", dtype=jnp.float32) for m in down]))
    params = dict(loaded.params, layers=layers)
    save_folder(tmp_path, loaded.config, params)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision" and len(config["config_groups"]) == 2
    assert tree_bitwise_equal(params, load_folder(tmp_path).params)


def _stacked(parts: list[QuantizedWeight]) -> QuantizedWeight:
    return jax.tree.map(lambda *leaves: np.stack(leaves), *parts)


def test_transformers_reads_our_fp8_folder(dense_folder: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = _transformers_fp8(monkeypatch)
    loaded = load_folder(dense_folder, quantize="fp8-block")
    save_folder(tmp_path, loaded.config, loaded.params)
    hf, theirs = _transformers_logits(transformers, tmp_path)
    ours = np.asarray(dequantize(loaded.params["layers"]["gate_proj"][1], jnp.float32))
    assert np.array_equal(hf.state_dict()["model.layers.1.mlp.gate_proj.weight"].numpy(),
                          ours.T)
    assert float(np.abs(_forward(loaded) - theirs).max()) < 1e-4


def test_block_scales_that_differ_within_a_block_are_refused(dense_folder: Path,
                                                             tmp_path: Path) -> None:
    loaded = load_folder(dense_folder, quantize="fp8-block")
    layers = dict(loaded.params["layers"])
    w = layers["up_proj"]
    layers["up_proj"] = QuantizedWeight(w.q, w.scale.at[0, 0, 3].multiply(2.0), w.zero,
                                        w.scheme, w.group, w.in_shape, w.out_shape, w.dtype,
                                        w.block_columns)
    with pytest.raises(BadInputError, match=r"up_proj.*one per 128-column block"):
        save_folder(tmp_path, loaded.config, dict(loaded.params, layers=layers))


@pytest.mark.parametrize("scheme, tied", [("fp8-block", False), ("int4", True)])
def test_quantized_embedding_table_round_trips(tmp_path: Path, scheme: str, tied: bool) -> None:
    config = dataclasses.replace(CONFIG, vocab_size=128, tie_word_embeddings=tied)
    save_folder(tmp_path / "dense", config, init_params(config, jax.random.PRNGKey(2)))
    spec = Quantization(scheme, group=32, embeddings=True, head=not tied)
    loaded = load_folder(tmp_path / "dense", quantize=spec)
    assert isinstance(loaded.params["embed_tokens"], QuantizedWeight)
    again = _save_and_reload(loaded, tmp_path / "saved")
    qc = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"  # the fp8 layout has no tables
    assert "model.embed_tokens" in qc["config_groups"]["group_0"]["targets"]
    assert tree_bitwise_equal(loaded.params, again.params)
    assert np.array_equal(_forward(loaded), _forward(again))


def test_sharded_loading_refuses_a_quantized_folder(dense_folder: Path, tmp_path: Path) -> None:
    from turbospark_jax.errors import UnsupportedCapabilityError
    from turbospark_jax.parallel.loading import load_sharded
    from turbospark_jax.parallel.sharding import tp_mesh

    loaded = load_folder(dense_folder, quantize="int8")
    save_folder(tmp_path, loaded.config, loaded.params)
    with pytest.raises(UnsupportedCapabilityError, match="quantized checkpoint"):
        load_sharded(tmp_path, tp_mesh())
