"""Loading and saving Hugging Face folders, and the tokenizer wrapper.

Every loader failure must be a :class:`ModelLoadError` whose message names what was wrong;
a folder we write must load both here (bitwise round trip) and in ``transformers`` (logits
within ``ATOL = 1e-4``, float32 on CPU); the chat template must render exactly as
``transformers`` renders it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from turbospark_jax.core.state import tree_bitwise_equal  # noqa: E402
from turbospark_jax.errors import (  # noqa: E402
    BadInputError,
    ModelLoadError,
    UnsupportedCapabilityError,
)
from turbospark_jax.io import loading  # noqa: E402
from turbospark_jax.io.loading import GenerationConfig, load_folder  # noqa: E402
from turbospark_jax.io.saving import save_folder  # noqa: E402
from turbospark_jax.io.tokenizer import Tokenizer  # noqa: E402
from turbospark_jax.kernels.layers import RopeScaling  # noqa: E402
from turbospark_jax.models.dense import model as dense  # noqa: E402
from turbospark_jax.models.dense.config import DenseConfig  # noqa: E402
from turbospark_jax.models.dense.model import DenseModel, init_params, stack_layers  # noqa: E402
from turbospark_jax.models.family import Family  # noqa: E402
from turbospark_jax.testing.fixtures import randomise_hf_norms_and_biases  # noqa: E402

ATOL = 1e-4
VOCAB = 40

WORDS = ["<s>", "</s>", "<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "hello", "world",
         "user", "assistant", "system", "how", "are", "you", "fine", "thanks", "be", "brief"]

TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}\n"
    "  {% if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "    {{ raise_exception('unknown role ' + message['role']) }}\n"
    "  {% endif %}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "hello world"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": " fine thanks "},
        {"role": "user", "content": "hello"},
    ],
]


def _word_tokenizer() -> Any:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return tok


def _hf_tokenizer() -> Any:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(), bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = TEMPLATE
    return fast




@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 folder written by transformers, with tokenizer and generation config."""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.1,
        bos_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    randomise_hf_norms_and_biases(model)
    folder = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(folder)
    _hf_tokenizer().save_pretrained(folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, 5]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


@pytest.fixture(scope="module")
def loaded(hf_folder: Path) -> Any:
    return load_folder(hf_folder)


def _copy(folder: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(folder, dest)
    return dest


def _edit_weights(folder: Path, edit: Any) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _load_error(folder: Path | str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_folder(folder)
    return str(info.value)


# -- what a folder provides ---------------------------------------------------------------


def test_load_reads_config_tokenizer_and_generation_config(loaded: Any) -> None:
    assert loaded.config.model_type == "qwen3"
    assert loaded.model.dtype == jnp.float32
    assert loaded.params["layers"]["q_norm"].shape == (2, 8)
    assert "lm_head" in loaded.params
    assert loaded.generation_config.eos_token_ids == (1, 5)
    assert loaded.generation_config.bos_token_id == 0
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token_id == 1


def test_folder_without_tokenizer_loads_with_none(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    os.remove(folder / "tokenizer.json")
    os.remove(folder / "generation_config.json")
    result = load_folder(folder)
    assert result.tokenizer is None
    assert result.generation_config.eos_token_ids == (1,)  # from config.json


# -- errors -------------------------------------------------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    assert "does not exist" in _load_error(tmp_path / "nowhere")


def test_missing_config(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    os.remove(folder / "config.json")
    assert "config.json" in _load_error(folder)


def test_missing_weights(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    os.remove(folder / "model.safetensors")
    assert "model.safetensors" in _load_error(folder)


def test_pickled_weights_are_refused_not_loaded(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    os.remove(folder / "model.safetensors")
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    assert "never loaded" in _load_error(folder)


def test_unsupported_model_type_lists_supported(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    message = _load_error(folder)
    assert "gpt2" in message
    for name in ("llama", "mistral", "qwen2", "qwen3"):
        assert name in message


def test_missing_config_key(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    assert "hidden_size" in _load_error(folder)


def test_heads_must_split_hidden_size_without_head_dim(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="llama", hidden_size=30)  # 4 heads
    del config["head_dim"]
    (folder / "config.json").write_text(json.dumps(config))
    message = _load_error(folder)
    assert "hidden_size (30)" in message and "num_attention_heads (4)" in message
    # Control: with head_dim given, the heads need not split hidden_size.
    config["head_dim"] = 8
    assert DenseConfig.from_hf_dict(config).head_dim == 8


def test_bad_layer_layout_is_refused_before_any_tensor_is_read(
    hf_folder: Path, tmp_path: Path
) -> None:
    folder = _copy(hf_folder, tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)  # reading it would fail
    with pytest.raises(BadInputError, match="layer_layout"):
        load_folder(folder, layer_layout="rows")  # type: ignore[arg-type]


def test_garbage_config_json(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    (folder / "config.json").write_text("{this is not json")
    message = _load_error(folder)
    assert "config.json" in message and "JSON" in message


def test_missing_tensor_is_named(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    _edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert "model.layers.1.mlp.up_proj.weight" in _load_error(folder)


def test_extra_tensor_is_named(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    _edit_weights(folder, lambda t: t.update({"model.layers.0.surprise.weight": np.ones(3)}))
    assert "model.layers.0.surprise.weight" in _load_error(folder)


def test_rotary_buffers_are_tolerated(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _edit_weights(folder, lambda t: t.update({name: np.ones(4, np.float32)}))
    load_folder(folder)


def test_shape_mismatch_names_tensor_and_shapes(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    _edit_weights(folder, lambda t: t.update({name: np.zeros((8, 32), np.float32)}))
    message = _load_error(folder)
    assert name in message and "[8, 32]" in message and "[16, 32]" in message


def test_truncated_safetensors_names_file(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert "model.safetensors" in _load_error(folder)


def test_garbage_safetensors_names_file(hf_folder: Path, tmp_path: Path) -> None:
    folder = _copy(hf_folder, tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "model.safetensors" in _load_error(folder)


def test_missing_shard_is_named(loaded: Any, tmp_path: Path) -> None:
    save_folder(tmp_path, loaded.config, loaded.params, max_shard_bytes=20_000)
    shard = sorted(p for p in os.listdir(tmp_path) if p.startswith("model-"))[-1]
    os.remove(tmp_path / shard)
    assert shard in _load_error(tmp_path)


# -- tied heads ---------------------------------------------------------------------------


def _tied_folder(tmp_path: Path) -> tuple[Path, DenseConfig, Any]:
    config = DenseConfig(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    params = init_params(config, jax.random.PRNGKey(0))
    save_folder(tmp_path, config, params)
    return tmp_path, config, params


def test_tied_model_tolerates_equal_lm_head(tmp_path: Path) -> None:
    folder, _, params = _tied_folder(tmp_path)
    _edit_weights(folder, lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    assert tree_bitwise_equal(load_folder(folder).params, params)


def test_tied_model_refuses_different_lm_head(tmp_path: Path) -> None:
    folder, _, _ = _tied_folder(tmp_path)
    _edit_weights(folder, lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"] + 1.0}))
    assert "lm_head.weight" in _load_error(folder)


# -- round trips ----------------------------------------------------------------------------


def test_round_trip_is_bitwise(loaded: Any, tmp_path: Path) -> None:
    save_folder(tmp_path, loaded.config, loaded.params, tokenizer=loaded.tokenizer,
                generation_config=loaded.generation_config)
    again = load_folder(tmp_path)
    assert tree_bitwise_equal(again.params, loaded.params)
    assert again.config == loaded.config
    assert again.generation_config == loaded.generation_config
    assert again.tokenizer is not None
    assert again.tokenizer.special_tokens == loaded.tokenizer.special_tokens
    assert again.tokenizer.apply_chat_template(CONVERSATIONS[1]) == (
        loaded.tokenizer.apply_chat_template(CONVERSATIONS[1])
    )
    # Control: the comparison sees a one-ulp change.
    bumped = jax.tree.map(lambda a: a, again.params)
    bumped["norm"] = jnp.nextafter(bumped["norm"], jnp.inf)
    assert not tree_bitwise_equal(bumped, loaded.params)


def test_list_layout_loads_and_saves(hf_folder: Path, loaded: Any, tmp_path: Path) -> None:
    listed = load_folder(hf_folder, layer_layout="list")
    assert isinstance(listed.params["layers"], list) and len(listed.params["layers"]) == 2
    assert tree_bitwise_equal(stack_layers(listed.params), loaded.params)
    save_folder(tmp_path, listed.config, listed.params)
    assert tree_bitwise_equal(load_folder(tmp_path).params, loaded.params)


def _listed_dense_family() -> Family:
    """The dense family declared the way a family with mixed layers declares itself: params
    with a list of per-layer dicts, tensor keys that index that list, one layout only."""

    def shapes(config: DenseConfig) -> Any:
        tree = dense.param_shapes(config)
        layer = {k: s[1:] for k, s in tree["layers"].items()}
        return {**tree, "layers": [dict(layer) for _ in range(config.num_hidden_layers)]}

    def tensors(config: DenseConfig) -> Any:
        return [
            t if t.stacked is None
            else dataclasses.replace(t, key=(*t.key[:-1], t.stacked, t.key[-1]), stacked=None)
            for t in dense.hf_tensors(config)
        ]

    return dataclasses.replace(dense.FAMILY, name="listed dense", param_shapes=shapes,
                               hf_tensors=tensors, list_layout_only=True, to_layer_layout=None)


def test_a_list_layout_family_loads_and_saves_through_the_same_code(
    hf_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = load_folder(hf_folder, layer_layout="list")
    monkeypatch.setattr(loading, "family_of", lambda model_type: _listed_dense_family())
    listed = load_folder(hf_folder, layer_layout="list")
    assert tree_bitwise_equal(listed.params, reference.params)
    with pytest.raises(BadInputError, match="'list' layer layout"):
        load_folder(hf_folder)  # the default, "stacked", is not a layout this family has
    save_folder(tmp_path, listed.config, listed.params)
    assert tree_bitwise_equal(load_folder(tmp_path, layer_layout="list").params, listed.params)


def test_sharded_round_trip(loaded: Any, tmp_path: Path) -> None:
    save_folder(tmp_path, loaded.config, loaded.params, max_shard_bytes=20_000)
    files = os.listdir(tmp_path)
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files
    assert "model.safetensors" not in files
    assert tree_bitwise_equal(load_folder(tmp_path).params, loaded.params)


def test_bfloat16_load_and_round_trip(hf_folder: Path, loaded: Any, tmp_path: Path) -> None:
    bf16 = load_folder(hf_folder, dtype="bfloat16")
    assert bf16.model.dtype == jnp.bfloat16
    leaves = jax.tree.leaves(bf16.params)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in leaves)
    expected = jax.tree.map(lambda a: a.astype(jnp.bfloat16), loaded.params)
    assert tree_bitwise_equal(bf16.params, expected)
    save_folder(tmp_path, bf16.config, bf16.params)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    again = load_folder(tmp_path)  # dtype from config.json
    assert again.model.dtype == jnp.bfloat16
    assert tree_bitwise_equal(again.params, bf16.params)


CONFIGS_FOR_TRANSFORMERS = {
    "llama_tied_bias": DenseConfig(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=12,
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_theta=500.0,
        initializer_range=0.1,
    ),
    "qwen2_window": DenseConfig(
        model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=4, max_window_layers=1,
        layer_types=("full_attention", "sliding_attention"), initializer_range=0.1,
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS_FOR_TRANSFORMERS))
def test_transformers_loads_our_folder(name: str, tmp_path: Path) -> None:
    config = CONFIGS_FOR_TRANSFORMERS[name]
    params = init_params(config, jax.random.PRNGKey(3))
    params = jax.tree_util.tree_map_with_path(  # non-trivial norms and biases
        lambda p, a: a + 0.1 if p[-1].key.endswith(("norm", "bias")) else a, params
    )
    save_folder(tmp_path, config, params, max_shard_bytes=30_000)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(hf).__name__ == json.loads((tmp_path / "config.json").read_text())[
        "architectures"][0]
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(1, 12))
    with torch.no_grad():
        ref = hf.float().eval()(torch.tensor(tokens)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        forward = jax.jit(DenseModel(config).forward)
        ours = np.asarray(forward(params, jnp.asarray(tokens, jnp.int32)))
    assert float(np.abs(ours - ref).max()) < ATOL


CONFIG_ROUND_TRIPS = {
    "llama3_rope_eos_list": DenseConfig(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, rope_theta=5e5, eos_token_id=(1, 2),
        rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=16),
    ),
    "qwen3_yarn_window": DenseConfig(
        model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, head_dim=16, max_position_embeddings=64,
        rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16),
        sliding_window=8, layer_types=("full_attention", "sliding_attention"),
        max_window_layers=1,
    ),
    "mistral_linear_mqa": DenseConfig(
        model_type="mistral", vocab_size=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, sliding_window=8,
        rope_scaling=RopeScaling("linear", factor=2.0),
    ),
}


@pytest.mark.parametrize("name", list(CONFIG_ROUND_TRIPS))
def test_config_round_trips_through_transformers(name: str, tmp_path: Path) -> None:
    config = CONFIG_ROUND_TRIPS[name]
    theirs = transformers.AutoConfig.for_model(**config.to_hf_dict())
    theirs.save_pretrained(tmp_path)
    assert DenseConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text())) == config


def test_legacy_rope_layout_is_read() -> None:
    base = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4)
    legacy = DenseConfig.from_hf_dict(
        {**base, "rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert legacy.rope_theta == 500.0
    assert legacy.rope_scaling == RopeScaling("linear", factor=2.0)
    with pytest.raises(ModelLoadError, match="dynamic"):
        DenseConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2}})
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        DenseConfig.from_hf_dict({**base, "partial_rotary_factor": 0.5})
    with pytest.raises(ModelLoadError, match="hidden_act"):
        DenseConfig.from_hf_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        DenseConfig.from_hf_dict({**base, "num_hidden_layers": "two"})


def test_generation_config_round_trip() -> None:
    gen = GenerationConfig.from_hf_dict(
        {"eos_token_id": [2, 7], "bos_token_id": 1, "temperature": 0.6, "do_sample": True}
    )
    assert gen.eos_token_ids == (2, 7) and gen.extra["temperature"] == 0.6
    assert GenerationConfig.from_hf_dict(gen.to_hf_dict()) == gen
    with pytest.raises(ModelLoadError, match="eos_token_id"):
        GenerationConfig.from_hf_dict({"eos_token_id": "two"})


# -- tokenizer ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_pair(hf_folder: Path) -> tuple[Tokenizer, Any]:
    return Tokenizer.from_folder(hf_folder), transformers.AutoTokenizer.from_pretrained(hf_folder)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer_pair: Any, conversation: int, add_generation_prompt: bool
) -> None:
    ours, theirs = tokenizer_pair
    messages = CONVERSATIONS[conversation]
    expected = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_special_tokens_encode_decode_match_transformers(tokenizer_pair: Any) -> None:
    ours, theirs = tokenizer_pair
    for name in ("bos", "eos", "pad"):
        assert getattr(ours, f"{name}_token") == getattr(theirs, f"{name}_token")
        assert getattr(ours, f"{name}_token_id") == getattr(theirs, f"{name}_token_id")
    assert ours.vocab_size == len(theirs)
    assert sorted(ours.all_special_ids) == sorted(theirs.all_special_ids)
    text = ours.apply_chat_template(CONVERSATIONS[1])
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.encode("hello world") == theirs.encode("hello world")
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip
        )
    assert ours.id_to_token(6) == "hello"
    with pytest.raises(BadInputError):
        ours.decode([len(WORDS) + 5])


def test_post_processor_bos_matches_transformers(tmp_path: Path) -> None:
    # Llama-style: tokenizer.json's post-processor prepends BOS when special tokens are added.
    tok = _word_tokenizer()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")
    fast.save_pretrained(tmp_path)
    ours = Tokenizer.from_folder(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for special in (True, False):
        assert ours.encode("hello world", special) == theirs.encode("hello world",
                                                                     add_special_tokens=special)
    assert ours.encode("hello world") == [0, 6, 7]


def test_legacy_template_in_tokenizer_config(tmp_path: Path) -> None:
    _hf_tokenizer().save_pretrained(tmp_path)
    template = (tmp_path / "chat_template.jinja").read_text()
    os.remove(tmp_path / "chat_template.jinja")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    config["bos_token"] = {"content": "<s>", "special": True}  # the older AddedToken form
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_folder(tmp_path)
    assert ours.bos_token == "<s>"
    assert ours.apply_chat_template(CONVERSATIONS[0]).startswith("<s><|im_start|>user\n")


def test_template_errors() -> None:
    bare = Tokenizer.from_tokenizers(_word_tokenizer(), eos="</s>")
    with pytest.raises(UnsupportedCapabilityError, match="chat template"):
        bare.apply_chat_template(CONVERSATIONS[0])
    templated = Tokenizer.from_tokenizers(_word_tokenizer(), bos="<s>", chat_template=TEMPLATE)
    with pytest.raises(BadInputError, match="unknown role robot"):
        templated.apply_chat_template([{"role": "robot", "content": "hello"}])
    with pytest.raises(BadInputError):
        templated.apply_chat_template([])
    with pytest.raises(ModelLoadError, match="not in the tokenizer"):
        Tokenizer.from_tokenizers(_word_tokenizer(), eos="<missing>")


def test_in_memory_tokenizer_saves_a_folder_transformers_reads(tmp_path: Path) -> None:
    ours = Tokenizer.from_tokenizers(
        _word_tokenizer(), bos=0, eos="</s>", pad="<pad>", unk="<unk>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=TEMPLATE,
    )
    assert ours.bos_token == "<s>" and ours.eos_token_id == 1
    ours.save(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert theirs.bos_token == "<s>" and theirs.eos_token_id == 1
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    again = Tokenizer.from_folder(tmp_path)
    assert again.special_tokens == ours.special_tokens
    assert again.extra_special_tokens == ours.extra_special_tokens
