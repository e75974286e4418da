"""Fault campaign, model folders: whatever is wrong with a folder, loading it either works or
raises our ModelLoadError, never anything else.

A tiny qwen3 folder (with tokenizer files) is written once with ``save_folder``; each property
corrupts a copy: a byte flipped in the safetensors header or data, the file truncated, a
config key given a value of the wrong type, a tokenizer file missing or damaged. Bytes flipped
in the tensor data are a valid file with other weights, so loading may succeed: the property
is about what can go wrong, not that something must. Each property has a control: the loader
with its error translation taken out, which the same property catches.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import jax
import pytest
from hypothesis import HealthCheck, Phase, example, find, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.io import loading
from turbospark_jax.io.loading import load_folder
from turbospark_jax.io.saving import save_folder
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import init_params
from turbospark_jax.testing.tokenizers import byte_level_bpe

CONFIG = DenseConfig(
    model_type="qwen3", vocab_size=300, hidden_size=16, intermediate_size=24,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    bos_token_id=0, eos_token_id=1,
)
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

FAULTS = settings(deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = Tokenizer.from_tokenizers(byte_level_bpe(), bos="<|bos|>", eos="<|eos|>",
                                          chat_template=TEMPLATE)
    save_folder(path, CONFIG, init_params(CONFIG, jax.random.PRNGKey(0)), tokenizer=tokenizer)
    return path


@pytest.fixture(scope="module")
def header_size(folder: Path) -> int:
    """Bytes before the tensor data: the 8-byte length, then the JSON header."""
    return 8 + struct.unpack("<Q", (folder / WEIGHTS).read_bytes()[:8])[0]


def _scratch(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("corrupt")
    shutil.rmtree(dest)
    shutil.copytree(folder, dest)
    return dest


def loads_or_refuses(path: Path) -> str:
    """'loaded' or 'refused' (ModelLoadError); anything else propagates to fail the test."""
    try:
        load_folder(path)
    except ModelLoadError:
        return "refused"
    return "loaded"


def flip(path: Path, position: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[position % len(data)] ^= mask
    path.write_bytes(bytes(data))


masks = st.integers(1, 255)


# -- safetensors ------------------------------------------------------------------------------


@FAULTS
@given(at=st.floats(0, 1, exclude_max=True), mask=masks)
@example(at=0.0, mask=0xFF).via("the header length's low byte")
@example(at=0.5, mask=0x02).via("inside the JSON header")
def test_a_flipped_header_byte_is_refused_or_harmless(folder, header_size, tmp_path_factory,
                                                     at, mask):
    path = _scratch(folder, tmp_path_factory)
    flip(path / WEIGHTS, int(at * header_size), mask)
    assert loads_or_refuses(path) in ("loaded", "refused")


@FAULTS
@given(at=st.floats(0, 1, exclude_max=True), mask=masks)
def test_a_flipped_data_byte_loads_other_weights(folder, header_size, tmp_path_factory, at,
                                                 mask):
    path = _scratch(folder, tmp_path_factory)
    size = (path / WEIGHTS).stat().st_size
    flip(path / WEIGHTS, header_size + int(at * (size - header_size)), mask)
    assert loads_or_refuses(path) == "loaded"  # the header is intact: only values changed


@FAULTS
@given(keep=st.floats(0, 1, exclude_max=True))
@example(keep=0.0)
def test_a_truncated_weights_file_is_refused(folder, tmp_path_factory, keep):
    path = _scratch(folder, tmp_path_factory)
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(data[: int(keep * len(data))])
    assert loads_or_refuses(path) == "refused"


# -- config.json ------------------------------------------------------------------------------

WRONG_VALUES = st.one_of(
    st.text(max_size=4), st.floats(allow_nan=True), st.booleans(), st.none(),
    st.lists(st.integers(-2, 2), max_size=2), st.dictionaries(st.text(max_size=2),
                                                              st.integers(), max_size=1),
    st.integers(-(2**40), 2**40),
)


@FAULTS
@given(data=st.data())
def test_a_config_value_of_the_wrong_type_is_refused_or_harmless(folder, tmp_path_factory, data):
    path = _scratch(folder, tmp_path_factory)
    config = json.loads((path / "config.json").read_text())
    key = data.draw(st.sampled_from(sorted(config)), label="key")
    config[key] = data.draw(WRONG_VALUES, label="value")
    (path / "config.json").write_text(json.dumps(config))
    assert loads_or_refuses(path) in ("loaded", "refused")


@pytest.mark.parametrize("key,value", [
    ("vocab_size", 2**40),  # would allocate terabytes before reading a tensor
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": "x"}),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}),
    ("hidden_act", 7),
    ("model_type", []),
    ("layer_types", ["full_attention", 3]),
    ("dtype", ["float32"]),
    ("eos_token_id", [1, "2"]),
])
def test_config_values_that_escaped_the_parser(folder, tmp_path_factory, key, value):
    """Values that once raised ValueError, TypeError or MemoryError out of the loader."""
    path = _scratch(folder, tmp_path_factory)
    config = json.loads((path / "config.json").read_text())
    config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    assert loads_or_refuses(path) == "refused"


@FAULTS
@given(data=st.data())
def test_a_generation_config_of_the_wrong_type_is_refused_or_harmless(folder, tmp_path_factory,
                                                                      data):
    path = _scratch(folder, tmp_path_factory)
    gen = json.loads((path / "generation_config.json").read_text())
    key = data.draw(st.sampled_from(["eos_token_id", "bos_token_id", "pad_token_id"]))
    gen[key] = data.draw(WRONG_VALUES, label="value")
    (path / "generation_config.json").write_text(json.dumps(gen))
    assert loads_or_refuses(path) in ("loaded", "refused")


# -- tokenizer files --------------------------------------------------------------------------


@FAULTS
@given(missing=st.sets(st.sampled_from(TOKENIZER_FILES)))
def test_missing_tokenizer_files_load_without_them(folder, tmp_path_factory, missing):
    path = _scratch(folder, tmp_path_factory)
    for name in missing:
        (path / name).unlink()
    loaded = load_folder(path)
    assert (loaded.tokenizer is None) == ("tokenizer.json" in missing)
    if loaded.tokenizer is not None:
        assert (loaded.tokenizer.chat_template is None) == ("chat_template.jinja" in missing)


@FAULTS
@given(name=st.sampled_from(TOKENIZER_FILES[:2]), at=st.floats(0, 1, exclude_max=True),
       mask=masks, cut=st.booleans())
def test_a_damaged_tokenizer_file_is_refused_or_harmless(folder, tmp_path_factory, name, at,
                                                        mask, cut):
    path = _scratch(folder, tmp_path_factory)
    data = (path / name).read_bytes()
    if cut:
        (path / name).write_bytes(data[: int(at * len(data))])
    else:
        flip(path / name, int(at * len(data)), mask)
    assert loads_or_refuses(path) in ("loaded", "refused")


def test_arguments_of_the_wrong_type_are_refused(folder, tmp_path):
    for bad in (None, 3, b"folder"):
        with pytest.raises(BadInputError, match="path"):
            load_folder(bad)  # type: ignore[arg-type]
    for dtype in (3, "float64", object()):
        with pytest.raises(BadInputError, match="dtype"):
            load_folder(folder, dtype=dtype)
    with pytest.raises(BadInputError, match="max_shard_bytes"):
        save_folder(tmp_path, CONFIG, init_params(CONFIG, jax.random.PRNGKey(0)),
                    max_shard_bytes=0)
    with pytest.raises(BadInputError, match="config"):
        save_folder(tmp_path, {"model_type": "qwen3"}, {})
    with pytest.raises(BadInputError, match="tokenizer"):
        save_folder(tmp_path, CONFIG, init_params(CONFIG, jax.random.PRNGKey(0)),
                    tokenizer="tok")  # type: ignore[arg-type]


# -- controls ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _raw_safetensors(path: str):
    """The control: safe_open without the translation into ModelLoadError."""
    with safe_open(path, framework="np") as f:
        yield f


def test_control_the_header_property_catches_a_loader_that_leaks_library_errors(
    folder, header_size, tmp_path_factory, monkeypatch
):
    monkeypatch.setattr(loading, "_open_safetensors", _raw_safetensors)

    def leaks(args: Any) -> bool:
        at, mask = args
        path = _scratch(folder, tmp_path_factory)
        flip(path / WEIGHTS, int(at * header_size), mask)
        try:
            loads_or_refuses(path)
        except Exception:  # what the control is looking for
            return True
        return False

    found = find(st.tuples(st.floats(0, 1, exclude_max=True), masks), leaks,
                 settings=settings(max_examples=50, phases=[Phase.generate], deadline=None))
    assert found is not None


def test_control_the_truncation_property_catches_a_loader_that_leaks_library_errors(
    folder, tmp_path_factory, monkeypatch
):
    monkeypatch.setattr(loading, "_open_safetensors", _raw_safetensors)
    path = _scratch(folder, tmp_path_factory)
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(data[: len(data) // 3])
    with pytest.raises(Exception) as info:
        loads_or_refuses(path)
    assert not isinstance(info.value, ModelLoadError)
