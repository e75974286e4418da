"""The newer families end to end, as a user meets them: a Gemma 4 and a Qwen3.5 folder written
by ``transformers`` (weights, tokenizer, chat template), loaded by the command line, by the
session pool and by a chat session.

* ``generate`` through the CLI prints the text of ``transformers``' own greedy ``generate`` on
  the same folder, with and without ``--chat`` (the folder's template applied by both sides);
* a session-pool turn that continues a conversation reuses the earlier turn's rows and equals
  the same turn served fresh, bit for bit (tokens and logits); so does a chat session's second
  turn.

The models are tiny and random (float32; ``initializer_range`` 0.1 keeps argmaxes clear of
ties); prompts run past the Gemma model's sliding window, so its ring is exercised.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from turbospark_jax import CompletionRequest, load
from turbospark_jax.cli import main
from turbospark_jax.generation.driver import run_raw_completion
from turbospark_jax.sessions.chat import ChatSession, default_stop_ids
from turbospark_jax.sessions.session_pool import SessionPool
from turbospark_jax.testing.tokenizers import byte_level_bpe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: A turn-structured template in the spirit of Gemma's, over the fixture tokenizer's specials.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>model\n{% endif %}"
)
NEW_TOKENS = 10


def _hf_model(family: str, vocab: int) -> Any:
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.1, bos_token_id=0, eos_token_id=1,
                  pad_token_id=2, max_position_embeddings=512)
    if family == "gemma4_text":
        config = transformers.Gemma4TextConfig(
            **common, head_dim=8, global_head_dim=16, num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            sliding_window=4, hidden_size_per_layer_input=4, vocab_size_per_layer_input=vocab,
            final_logit_softcapping=30.0)
        model = transformers.Gemma4ForCausalLM(config)
    else:
        config = transformers.Qwen3_5TextConfig(
            **common, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"])
        model = transformers.Qwen3_5ForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model.float().eval()


@pytest.fixture(scope="module", params=["gemma4_text", "qwen3_5_text"])
def folder(request, tmp_path_factory) -> tuple[Path, Any, Any]:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(), bos_token="<|bos|>", eos_token="<|eos|>",
        pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    hf = _hf_model(request.param, len(fast))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    fast.save_pretrained(path)
    return path, hf, fast


def _cli(*argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdin=io.StringIO(""), stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    return out.getvalue()


def _hf_greedy_text(hf: Any, fast: Any, ids: list[int]) -> str:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return fast.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def test_cli_greedy_equals_transformers(folder) -> None:
    path, hf, fast = folder
    prompt = "def add(a, b):\n    return"
    want = _hf_greedy_text(hf, fast, fast.encode(prompt))
    assert want  # something to compare: the reference did not stop at once
    got = _cli("generate", "--model", str(path), prompt, "--max-tokens", str(NEW_TOKENS),
               "--context", "128")
    assert got == want + "\n"


def test_cli_chat_applies_the_folders_template(folder) -> None:
    path, hf, fast = folder
    ids = fast.apply_chat_template([{"role": "user", "content": "reverse a list"}],
                                   add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    assert fast.decode(ids).startswith("<|bos|>user\nreverse a list<|eos|>\n<|bos|>model\n")
    want = _hf_greedy_text(hf, fast, ids)
    assert want
    got = _cli("generate", "--model", str(path), "--chat", "reverse a list", "--max-tokens",
               str(NEW_TOKENS), "--context", "256")
    assert got == want + "\n"


def _bits(c: Any) -> np.ndarray:
    return np.asarray(c.logits, np.float32).view(np.uint32)


def test_pool_turn_reuses_and_equals_fresh(folder) -> None:
    path = folder[0]
    model = load(path, context=128)
    pool = SessionPool(model.producer, slots=2)
    first = model.tokenizer.encode("import os\nimport sys\n")
    one = pool.generate("a", CompletionRequest(prompt_ids=first, max_tokens=6,
                                               record_logits=True))
    second = [*first, *one.token_ids, *model.tokenizer.encode("\ndef main():")]
    request = CompletionRequest(prompt_ids=second, max_tokens=6, record_logits=True)
    continued = pool.generate("a", request)
    fresh = pool.generate("b", request)
    assert continued.usage.reused_tokens > len(first) > 4  # past the sliding window
    assert fresh.usage.reused_tokens == 0
    assert continued.token_ids == fresh.token_ids
    assert np.array_equal(_bits(continued), _bits(fresh))


def test_chat_second_turn_equals_fresh(folder) -> None:
    path = folder[0]
    model = load(path, context=256)
    chat = ChatSession(model.producer, model.tokenizer, max_tokens=6, record_logits=True)
    chat.send("print hello")
    prompt = chat.render("now twice")
    second = chat.send("now twice")
    fresh = run_raw_completion(model.producer, CompletionRequest(
        prompt_ids=prompt, max_tokens=6, record_logits=True,
        stop_token_ids=default_stop_ids(model.tokenizer)))
    assert second.usage.reused_tokens > 0 and fresh.usage.reused_tokens == 0
    assert second.token_ids == fresh.token_ids
    assert np.array_equal(_bits(second), _bits(fresh))


def _write_assistant(folder: Path, vocab: int) -> None:
    """A random Gemma 4 assistant for the fixture's Gemma 4 target (its hidden size, KV heads
    and head dims), in the Hugging Face layout, at ``folder``."""
    from tests.testing.assistant_folders import write_assistant_folder

    centroids = next(n for n in (10, 12, 8, 6, 5, 4, 3, 2, 1) if vocab % n == 0)
    write_assistant_folder(folder, {
        "model_type": "gemma4_assistant", "backbone_hidden_size": 32,
        "use_ordered_embeddings": True, "num_centroids": centroids,
        "centroid_intermediate_top_k": max(1, centroids // 2),
        "tie_word_embeddings": True, "dtype": "float32",
        "text_config": dict(vocab_size=vocab, hidden_size=24, intermediate_size=40,
                            num_hidden_layers=2, layer_types=["sliding_attention",
                                                              "full_attention"],
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            global_head_dim=16, sliding_window=4,
                            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)},
        seed=1)


def test_cli_drafting_with_the_gemma4_assistant_prints_the_plain_text(folder) -> None:
    """``--drafter assistant`` finds ``<model>-assistant`` beside a Gemma 4 folder, drafts with
    it, and prints exactly what plain greedy decoding prints (and what ``transformers``'
    greedy ``generate`` gives)."""
    path, hf, fast = folder
    if hf.config.model_type != "gemma4_text":
        pytest.skip("the assistant drafts for Gemma 4 targets")
    _write_assistant(Path(f"{path}-assistant"), len(fast))
    prompt = "def add(a, b):\n    return"
    want = _hf_greedy_text(hf, fast, fast.encode(prompt))
    args = ("generate", "--model", str(path), prompt, "--max-tokens", str(NEW_TOKENS),
            "--context", "128")
    out, err = io.StringIO(), io.StringIO()
    code = main([*args, "--drafter", "assistant", "--draft-len", "3", "--stats"],
                stdin=io.StringIO(""), stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    assert out.getvalue() == want + "\n" == _cli(*args)
    stats = err.getvalue()
    assert "[drafter] assistant as asked, draft length 3" in stats
    rounds = re.search(r"speculative \((device|host) rounds\): (\d+) rounds", stats)
    assert rounds and int(rounds.group(2)) > 0, stats  # it drafted and verified
