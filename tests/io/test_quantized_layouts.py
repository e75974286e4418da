"""Quantized folders in the layouts publishers ship load straight into quantized weights.

Each test folder is built here from its format's own description: a numpy packer per format
writes random stored values and scales, and a reference dequantizer (also written here, from
the description) says which matrix they stand for. A loaded weight must dequantize to that
matrix bitwise, and the loaded model must compute what a plain folder of those matrices
computes, bitwise; the controls (a packing order or zero-point convention read the other way)
must fail. Configs we do not load are refused by name before any tensor is read.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from turbospark_jax.errors import BadInputError, ModelLoadError, UnsupportedCapabilityError
from turbospark_jax.io.loading import load_folder
from turbospark_jax.io.saving import save_folder
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import init_params
from turbospark_jax.quant.weights import QuantizedWeight, dequantize

pytestmark = pytest.mark.usefixtures("full_precision_products")

CONFIG = DenseConfig(
    model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=256,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
)
TOKENS = np.array([[3, 17, 5, 60, 41, 9, 2, 33, 14, 30]], np.int32)
FP8 = ml_dtypes.float8_e4m3fn
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the column in each nibble of an AWQ word


# -- packers and reference dequantizers, from each format's description ----------------------


def _pack_words(values: np.ndarray, axis: int) -> np.ndarray:
    """Eight 4-bit values per int32 along ``axis``: value ``8w + i`` in bits ``4i`` of word
    ``w``."""
    v = np.moveaxis(np.asarray(values, np.int64), axis, 0)
    v = v.reshape(v.shape[0] // 8, 8, *v.shape[1:])
    weights = (16 ** np.arange(8)).reshape(1, 8, *([1] * (v.ndim - 2)))
    words = (v * weights).sum(axis=1)
    words = np.where(words >= 2**31, words - 2**32, words).astype(np.int32)
    return np.moveaxis(words, 0, axis)


def _scales(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return rng.uniform(0.002, 0.02, shape).astype(dtype)


def _gptq(rng: np.random.Generator, n: int, k: int, group: int = 32,
          v1: bool = True) -> tuple[dict[str, np.ndarray], np.ndarray]:
    q = rng.integers(0, 16, (k, n))
    zero = rng.integers(1, 16, (k // group, n))  # v1 stores zero - 1: keep it a nibble
    scale = _scales(rng, (k // group, n), np.float16)
    tensors = {"qweight": _pack_words(q, 0), "qzeros": _pack_words(zero - v1, 1),
               "scales": scale, "g_idx": (np.arange(k) // group).astype(np.int32)}
    rows = np.arange(k) // group
    ref = (q.astype(np.float32) - zero[rows].astype(np.float32)) * scale[rows].astype(
        np.float32)
    return tensors, ref.T


def _awq(rng: np.random.Generator, n: int, k: int, group: int = 64,
         order: list[int] = AWQ_PACK_ORDER) -> tuple[dict[str, np.ndarray], np.ndarray]:
    q = rng.integers(0, 16, (k, n))
    zero = rng.integers(0, 16, (k // group, n))
    scale = _scales(rng, (k // group, n), np.float16)
    # Column 8c + order[i] goes to nibble i of word c.
    shuffle = (np.arange(n) // 8 * 8).reshape(-1, 8) + np.array(order)
    tensors = {"qweight": _pack_words(q[:, shuffle.ravel()], 1),
               "qzeros": _pack_words(zero[:, shuffle.ravel()], 1), "scales": scale}
    rows = np.arange(k) // group
    ref = (q.astype(np.float32) - zero[rows].astype(np.float32)) * scale[rows].astype(
        np.float32)
    return tensors, ref.T


def _fp8_block(rng: np.random.Generator, n: int, k: int) -> tuple[dict[str, np.ndarray],
                                                                  np.ndarray]:
    weight = rng.normal(0, 60, (n, k)).clip(-448, 448).astype(FP8)
    inverse = _scales(rng, (n // 128, k // 128), np.float32)
    full = np.kron(inverse, np.ones((128, 128), np.float32))
    return ({"weight": weight, "weight_scale_inv": inverse},
            weight.astype(np.float32) * full)


def _ct_int4(rng: np.random.Generator, n: int, k: int, group: int = 32,
             symmetric: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray]:
    values = rng.integers(-8, 8, (n, k))  # signed, stored offset by 8
    scale = _scales(rng, (n, k // group), ml_dtypes.bfloat16)
    zp = np.zeros((n, k // group), np.int64) if symmetric else rng.integers(-8, 8,
                                                                          (n, k // group))
    tensors = {"weight_packed": _pack_words(values + 8, 1), "weight_scale": scale,
               "weight_shape": np.array([n, k], np.int64)}
    if not symmetric:
        tensors["weight_zero_point"] = _pack_words(zp + 8, 0)
    cols = np.arange(k) // group
    ref = (values.astype(np.float32) - zp[:, cols].astype(np.float32)) * scale[:, cols].astype(
        np.float32)
    return tensors, ref


def _ct_int8(rng: np.random.Generator, n: int, k: int) -> tuple[dict[str, np.ndarray],
                                                                np.ndarray]:
    values = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scale = _scales(rng, (n, 1), np.float16)
    return ({"weight": values, "weight_scale": scale},
            values.astype(np.float32) * scale.astype(np.float32))


def _ct_fp8(rng: np.random.Generator, n: int, k: int) -> tuple[dict[str, np.ndarray],
                                                               np.ndarray]:
    weight = rng.normal(0, 60, (n, k)).clip(-448, 448).astype(FP8)
    scale = _scales(rng, (n, 1), ml_dtypes.bfloat16)
    return ({"weight": weight, "weight_scale": scale},
            weight.astype(np.float32) * scale.astype(np.float32))


def _renamed(parts: tuple[dict[str, np.ndarray], np.ndarray],
             names: dict[str, str]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    tensors, ref = parts
    return {names.get(key, key): value for key, value in tensors.items()}, ref


def _ct_fp8_per_tensor(rng: np.random.Generator, n: int, k: int) -> tuple[dict[str, Any],
                                                                          np.ndarray]:
    weight = rng.normal(0, 60, (n, k)).clip(-448, 448).astype(FP8)
    scale = _scales(rng, (1,), np.float32)
    return {"weight": weight, "weight_scale": scale}, weight.astype(np.float32) * scale[0]


def _ct_config(fmt: str, weights: dict[str, Any], ignore: list[str]) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}}}


#: name -> (config's quantization_config, packer). The output head stays plain in each.
LAYOUTS: dict[str, tuple[dict[str, Any], Callable[..., Any]]] = {
    "gptq-v1": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                 "sym": False, "checkpoint_format": "gptq"}, _gptq),
    "gptq-v2": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                 "sym": True, "checkpoint_format": "gptq_v2"},
                lambda rng, n, k: _gptq(rng, n, k, v1=False)),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm",
             "zero_point": True, "modules_to_not_convert": None}, _awq),
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}, _fp8_block),
    "ct-int4": (_ct_config("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False,
                                              "strategy": "group", "group_size": 32},
                           ["lm_head"]), _ct_int4),
    "ct-int4-sym": (_ct_config("pack-quantized", {"num_bits": 4, "type": "int",
                                                  "symmetric": True, "strategy": "group",
                                                  "group_size": 32}, ["lm_head"]),
                    lambda rng, n, k: _ct_int4(rng, n, k, symmetric=True)),
    "ct-int8": (_ct_config("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True,
                                             "strategy": "channel"}, ["lm_head"]), _ct_int8),
    "ct-fp8": (_ct_config("float-quantized", {"num_bits": 8, "type": "float",
                                              "symmetric": True, "strategy": "channel"},
                          ["lm_head"]), _ct_fp8),
    "gptq-one-group": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": False},
                       lambda rng, n, k: _gptq(rng, n, k, group=k)),
    "ct-int4-channel": (_ct_config("pack-quantized", {"num_bits": 4, "type": "int",
                                                      "symmetric": False,
                                                      "strategy": "channel"}, ["lm_head"]),
                        lambda rng, n, k: _ct_int4(rng, n, k, group=k)),
    "ct-fp8-block": (_ct_config("float-quantized", {"num_bits": 8, "type": "float",
                                                    "strategy": "block",
                                                    "block_structure": [128, 128]},
                                ["lm_head"]),
                     lambda rng, n, k: _renamed(_fp8_block(rng, n, k),
                                                {"weight_scale_inv": "weight_scale"})),
    "ct-fp8-tensor": (_ct_config("float-quantized", {"num_bits": 8, "type": "float",
                                                     "strategy": "tensor"}, ["lm_head"]),
                      _ct_fp8_per_tensor),
}


def _is_quantized_linear(name: str, array: np.ndarray) -> bool:
    return name.endswith("proj.weight") and array.ndim == 2


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dense")
    save_folder(folder, CONFIG, init_params(CONFIG, jax.random.PRNGKey(0)))
    return folder


def build_layout(dense: Path, dest: Path, layout: str, seed: int = 0,
                 packer: Callable[..., Any] | None = None,
                 quantization_config: dict[str, Any] | None = None,
                 skip: Callable[[str], bool] = lambda name: False) -> dict[str, np.ndarray]:
    """Write ``dest``: ``dense`` with its linear layers in ``layout``; also ``dest/reference``:
    the same model with those layers as the plain matrices they stand for. Returns the
    reference matrices ``[N, K]`` by weight name."""
    config, default_packer = LAYOUTS[layout]
    packer = packer or default_packer
    rng = np.random.default_rng(seed)
    tensors = load_file(dense / "model.safetensors")
    packed: dict[str, np.ndarray] = {}
    plain = dict(tensors)
    references = {}
    for name, array in tensors.items():
        if not _is_quantized_linear(name, array) or skip(name):
            packed[name] = array
            continue
        parts, ref = packer(rng, *array.shape)
        module = name.removesuffix(".weight")
        packed.update({f"{module}.{key}": value for key, value in parts.items()})
        plain[name] = ref
        references[name] = ref
    for folder, weights, qc in ((dest, packed, quantization_config or config),
                                (dest / "reference", plain, None)):
        folder.mkdir(parents=True, exist_ok=True)
        for file in ("config.json", "generation_config.json"):
            shutil.copy(dense / file, folder / file)
        # safetensors writes an array's memory, not its logical order: make each contiguous.
        weights = {key: np.ascontiguousarray(value) for key, value in weights.items()}
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        raw = json.loads((folder / "config.json").read_text())
        if qc is not None:
            raw["quantization_config"] = qc
        (folder / "config.json").write_text(json.dumps(raw))
    return references


def _weight(params: Any, name: str) -> Any:
    """The params leaf (one layer of it) that HF weight ``name`` fills."""
    parts = name.split(".")
    layers = params["layers"]
    return layers[parts[-2]][int(parts[2])]


def _differing(params: Any, references: dict[str, np.ndarray]) -> list[str]:
    """The weights (names) whose quantized leaf does not dequantize to its reference."""
    differing = []
    for name, ref in references.items():
        weight = _weight(params, name)
        assert isinstance(weight, QuantizedWeight), name
        if not np.array_equal(np.asarray(dequantize(weight.matrix(), jnp.float32)), ref.T):
            differing.append(name)
    return differing


def _forward(loaded: Any) -> np.ndarray:
    return np.asarray(jax.jit(loaded.model.forward)(loaded.params, jnp.asarray(TOKENS)))


# -- loading what publishers ship ------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_loads_as_the_matrices_its_format_describes(dense_folder: Path, tmp_path: Path,
                                                           layout: str) -> None:
    references = build_layout(dense_folder, tmp_path / layout, layout)
    loaded = load_folder(tmp_path / layout)
    assert isinstance(loaded.params["lm_head"], jax.Array)  # excluded: a plain tensor
    assert _differing(loaded.params, references) == []
    # The model computes what a plain folder of those matrices computes, bitwise.
    reference = load_folder(tmp_path / layout / "reference")
    assert np.array_equal(_forward(loaded), _forward(reference))


def test_awq_read_in_plain_column_order_is_not_the_model(dense_folder: Path,
                                                         tmp_path: Path) -> None:
    """Control: a folder packed in sequential column order reads as other matrices."""
    references = build_layout(dense_folder, tmp_path, "awq",
                              packer=lambda rng, n, k: _awq(rng, n, k, order=list(range(8))))
    assert _differing(load_folder(tmp_path).params, references) == list(references)


def test_gptq_zero_point_convention_follows_checkpoint_format(dense_folder: Path,
                                                              tmp_path: Path) -> None:
    """Control: v1 zero points read as v2 are one off, so the matrices differ."""
    config = dict(LAYOUTS["gptq-v1"][0], checkpoint_format="gptq_v2")
    references = build_layout(dense_folder, tmp_path, "gptq-v1", quantization_config=config)
    assert _differing(load_folder(tmp_path).params, references) == list(references)


def test_quantized_folder_generates_as_its_reference(dense_folder: Path,
                                                     tmp_path: Path) -> None:
    import turbospark_jax as tsj

    build_layout(dense_folder, tmp_path, "ct-int4")
    prompt = TOKENS[0].tolist()
    ours = tsj.generate(tsj.load(tmp_path), prompt, max_tokens=6, temperature=0.0)
    theirs = tsj.generate(tsj.load(tmp_path / "reference"), prompt, max_tokens=6,
                          temperature=0.0)
    assert len(ours.token_ids) == 6 and ours.token_ids == theirs.token_ids


def test_excluded_modules_load_as_plain_tensors(dense_folder: Path, tmp_path: Path) -> None:
    config = _ct_config("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False,
                                           "strategy": "group", "group_size": 32},
                        ["lm_head", "re:.*mlp\\.down_proj$"])
    build_layout(dense_folder, tmp_path, "ct-int4", quantization_config=config,
                 skip=lambda name: "down_proj" in name)
    loaded = load_folder(tmp_path)
    assert isinstance(loaded.params["layers"]["down_proj"], jax.Array)
    assert isinstance(loaded.params["layers"]["up_proj"], QuantizedWeight)
    reference = load_folder(tmp_path / "reference")
    assert np.array_equal(_forward(loaded), _forward(reference))


def test_list_layout_loads_quantized_leaves(dense_folder: Path, tmp_path: Path) -> None:
    build_layout(dense_folder, tmp_path, "gptq-v1")
    loaded = load_folder(tmp_path, layer_layout="list")
    stacked = load_folder(tmp_path)
    layer = loaded.params["layers"][1]["q_proj"]
    assert isinstance(layer, QuantizedWeight) and layer.shape == (128, 4, 32)
    assert np.array_equal(np.asarray(layer.q), np.asarray(stacked.params["layers"]["q_proj"].q[1]))


# -- what transformers reads ----------------------------------------------------------------


def _transformers_fp8(monkeypatch: pytest.MonkeyPatch) -> Any:
    """transformers, able to read block-wise fp8 folders on this CPU: its fp8 integration
    asks for ``accelerate`` before anything else, though dequantizing on a CPU does not use
    it; when ``accelerate`` is not installed the check is answered yes here."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers.quantizers import quantizer_finegrained_fp8

    monkeypatch.setattr(quantizer_finegrained_fp8, "is_accelerate_available", lambda: True)
    return transformers


def _transformers_logits(transformers: Any, folder: Path) -> tuple[Any, np.ndarray]:
    import torch

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf, hf(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


def test_transformers_reads_the_fp8_folder_as_we_do(dense_folder: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = _transformers_fp8(monkeypatch)
    references = build_layout(dense_folder, tmp_path, "fp8-block")
    hf, theirs = _transformers_logits(transformers, tmp_path)
    name = next(iter(references))
    assert np.array_equal(hf.state_dict()[name].numpy(), references[name])
    ours = _forward(load_folder(tmp_path))
    assert float(np.abs(ours - theirs).max()) < 1e-4


# -- what is refused, and when ---------------------------------------------------------------


def _with_config(dense: Path, dest: Path, qc: Any, corrupt: bool = True) -> Path:
    """``dense``'s config with ``quantization_config`` ``qc`` and (``corrupt``) weights that
    cannot be read: a refusal then shows the config was checked before any tensor."""
    dest.mkdir(parents=True, exist_ok=True)
    raw = json.loads((dense / "config.json").read_text())
    raw["quantization_config"] = qc
    (dest / "config.json").write_text(json.dumps(raw))
    (dest / "model.safetensors").write_bytes(b"\x00" * 7 if corrupt else
                                            (dense / "model.safetensors").read_bytes())
    return dest


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ["bitsandbytes", "gptq", "awq"]),
    ({"quant_method": "hqq"}, ["hqq"]),
    ({"quant_method": "eetq"}, ["eetq"]),
    ({"quant_method": "mystery"}, ["mystery"]),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, ["3 bits"]),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, ["8 bits"]),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, ["marlin"]),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, ["gemv"]),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, ["e5m2"]),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}, ["[64, 64]"]),
    (_ct_config("pack-quantized", {"num_bits": 2, "type": "int", "strategy": "group",
                                   "group_size": 32}, []), ["2-bit"]),
    (_ct_config("nvfp4-pack-quantized", {"num_bits": 4, "type": "float",
                                         "strategy": "tensor_group", "group_size": 16}, []),
     ["nvfp4"]),
    (dict(_ct_config("float-quantized", {"num_bits": 8, "type": "float",
                                         "strategy": "channel"}, []),
          kv_cache_scheme={"num_bits": 8, "type": "float"}), ["kv_cache_scheme"]),
])
def test_unsupported_quantization_is_refused_before_reading(dense_folder: Path, tmp_path: Path,
                                                            qc: Any, words: list[str]) -> None:
    with pytest.raises(UnsupportedCapabilityError) as info:
        load_folder(_with_config(dense_folder, tmp_path, qc))
    for word in words:
        assert word in str(info.value)


def test_malformed_quantization_config_is_named(dense_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="group_size"):
        load_folder(_with_config(dense_folder, tmp_path / "a", {
            "quant_method": "gptq", "bits": 4, "group_size": "big"}))
    with pytest.raises(ModelLoadError, match="config_groups"):
        load_folder(_with_config(dense_folder, tmp_path / "b", {
            "quant_method": "compressed-tensors", "format": "pack-quantized"}))


def test_refusals_come_before_reading_control(dense_folder: Path,
                                                               tmp_path: Path) -> None:
    """Control for the refusals above: the corrupt weights do fail once the config passes."""
    qc = LAYOUTS["awq"][0]
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_folder(_with_config(dense_folder, tmp_path, qc))


def _edit(folder: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_quantized_tensor_is_named(dense_folder: Path, tmp_path: Path) -> None:
    build_layout(dense_folder, tmp_path, "gptq-v1")
    _edit(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.qzeros"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.qzeros"):
        load_folder(tmp_path)


def test_wrong_shape_is_named_with_both_shapes(dense_folder: Path, tmp_path: Path) -> None:
    build_layout(dense_folder, tmp_path, "awq")
    name = "model.layers.0.self_attn.o_proj.scales"
    _edit(tmp_path, lambda t: t.update({name: t[name][:1]}))
    with pytest.raises(ModelLoadError, match=rf"{name}.*\[1, 128\].*\[2, 128\]"):
        load_folder(tmp_path)


def test_wrong_dtype_is_named(dense_folder: Path, tmp_path: Path) -> None:
    build_layout(dense_folder, tmp_path, "ct-int8")
    name = "model.layers.0.mlp.gate_proj.weight"
    _edit(tmp_path, lambda t: t.update({name: t[name].astype(np.float32)}))
    with pytest.raises(ModelLoadError, match=rf"{name}.*F32.*I8"):
        load_folder(tmp_path)


def test_gptq_v1_zero_point_of_sixteen_is_refused_by_name(dense_folder: Path,
                                                        tmp_path: Path) -> None:
    build_layout(dense_folder, tmp_path, "gptq-v1")
    name = "model.layers.1.self_attn.v_proj.qzeros"
    _edit(tmp_path, lambda t: t.update({name: np.full_like(t[name], -1)}))
    with pytest.raises(UnsupportedCapabilityError, match=rf"{name}.*16"):
        load_folder(tmp_path)


def test_act_order_groups_are_refused(dense_folder: Path, tmp_path: Path) -> None:
    config = dict(LAYOUTS["gptq-v1"][0], desc_act=True)
    build_layout(dense_folder, tmp_path, "gptq-v1", quantization_config=config)
    loaded = load_folder(tmp_path)  # desc_act with groups in order loads
    assert isinstance(loaded.params["layers"]["q_proj"], QuantizedWeight)
    name = "model.layers.0.self_attn.q_proj.g_idx"
    _edit(tmp_path, lambda t: t.update({name: t[name][::-1].copy()}))
    with pytest.raises(UnsupportedCapabilityError, match=name):
        load_folder(tmp_path)


def test_fp8_blocks_that_do_not_tile_are_refused_by_name(tmp_path: Path) -> None:
    config = DenseConfig(model_type="llama", vocab_size=64, hidden_size=128,
                         intermediate_size=192, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=32)
    dense = tmp_path / "dense"
    save_folder(dense, config, init_params(config, jax.random.PRNGKey(1)))

    def packer(rng: np.random.Generator, n: int, k: int) -> Any:
        blocks = (-(-n // 128), -(-k // 128))
        weight = rng.normal(0, 1, (n, k)).astype(FP8)
        return {"weight": weight, "weight_scale_inv": np.ones(blocks, np.float32)}, weight
    build_layout(dense, tmp_path / "fp8", "fp8-block", packer=packer)
    with pytest.raises(UnsupportedCapabilityError, match=r"mlp\.gate_proj\.weight.*\[192, 128\]"):
        load_folder(tmp_path / "fp8")


def test_layers_of_one_leaf_stored_differently_are_refused(dense_folder: Path,
                                                           tmp_path: Path) -> None:
    config = dict(LAYOUTS["ct-fp8"][0], ignore=["lm_head", "model.layers.0.mlp.up_proj"])
    build_layout(dense_folder, tmp_path, "ct-fp8", quantization_config=config,
                 skip=lambda name: name == "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ModelLoadError, match="up_proj"):
        load_folder(tmp_path)


def test_quantizing_a_quantized_folder_is_refused(dense_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"quantized already \(gptq\)"):
        load_folder(_with_config(dense_folder, tmp_path, LAYOUTS["gptq-v1"][0]),
                    quantize="int8")


def test_a_multimodal_configs_text_part_names_the_quantization() -> None:
    from turbospark_jax.io.quantized import checkpoint_quantization

    text = {"quantization_config": dict(LAYOUTS["awq"][0], modules_to_not_convert=[
        "vision_tower", "mlp.down_proj"])}
    stored = checkpoint_quantization({"model_type": "gemma4", "text_config": text})
    assert stored is not None and stored.method == "awq"
    assert stored.format_of("model.language_model.layers.0.mlp.down_proj") is None
    assert stored.format_of("model.language_model.layers.0.mlp.up_proj") is not None
    assert stored.format_of("model.language_model.layers.10.mlp.up_proj") is not None
    assert stored.format_of("lm_head") is None  # AWQ writers never quantize the head
    assert checkpoint_quantization({"model_type": "llama"}) is None
