"""The embedded default models: present, documented, and equal to transformers' reading of
them token for token."""

import json

import numpy as np
import pytest

from turbospark_jax import CompletionRequest, run_raw_completion
from turbospark_jax.cli import DEFAULT_DRAFT, DEFAULT_TARGET, embedded_model_path
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.io.loading import load_folder

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TARGET = embedded_model_path(DEFAULT_TARGET)
DRAFT = embedded_model_path(DEFAULT_DRAFT)


BLOCK = embedded_model_path(DEFAULT_TARGET + "-block")


def test_folders_are_complete_and_documented():
    assert (BLOCK / "README.md").is_file() and (BLOCK / "config.json").is_file()
    assert "## Held-out acceptance" in (BLOCK / "README.md").read_text()
    for folder in (TARGET, DRAFT):
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", "README.md"):
            assert (folder / name).is_file(), f"{folder.name}/{name}"
        for shard in folder.glob("*.safetensors"):
            assert shard.stat().st_size <= 15 * 2**20, shard.name
        card = (folder / "README.md").read_text()
        assert "perplexity" in card and "## Reproduce" in card
    assert json.loads((TARGET / "config.json").read_text())["model_type"] == "qwen3_5_text"
    assert (TARGET / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("prompt", ["def ", "class ", "import "])
def test_transformers_greedy_equals_ours(prompt):
    loaded = load_folder(TARGET, dtype="float32", layer_layout="list")
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    producer = BlockProducer(loaded.model, loaded.params, capacity=128, width=4,
                             steps_per_call=8)
    ours = run_raw_completion(producer, CompletionRequest(prompt_ids=ids, max_tokens=24))
    model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs = out[0, len(ids):].tolist()
    assert ours.token_ids == theirs
    assert np.all(np.array(theirs) < loaded.config.vocab_size)
