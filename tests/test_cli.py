"""End to end through the ``turbospark-jax`` command: folders written by transformers and by
our own code, sampling options, speculative modes, chat, and one-line errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import jax
import pytest

from turbospark_jax.cli import main
from turbospark_jax.loading import GenerationConfig, save_folder
from turbospark_jax.models.dense import init_params
from turbospark_jax.models.dense_config import DenseConfig
from turbospark_jax.testing.tokenizers import byte_level_bpe
from turbospark_jax.tokenizer import Tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
)


def _fast_tokenizer():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(), bos_token="<|bos|>", eos_token="<|eos|>",
        pad_token="<|pad|>",
    )


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A llama folder written by ``save_pretrained``."""
    fast = _fast_tokenizer()
    fast.chat_template = CHAT_TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    folder = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def our_folder(tmp_path_factory) -> Path:
    """A qwen3 folder written by our own ``save_folder``."""
    tok = byte_level_bpe()
    config = DenseConfig(
        model_type="qwen3", vocab_size=tok.get_vocab_size(), hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=1,
    )
    params = init_params(config, jax.random.PRNGKey(0))
    folder = tmp_path_factory.mktemp("ours")
    wrapper = Tokenizer.from_tokenizers(tok, bos="<|bos|>", eos="<|eos|>",
                                        pad="<|pad|>", chat_template=CHAT_TEMPLATE)
    save_folder(folder, config, params, tokenizer=wrapper,
                generation_config=GenerationConfig(eos_token_ids=(1,), bos_token_id=0))
    return folder


def run(*argv: str, stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("which", ["hf_folder", "our_folder"])
def test_generate_streams_text(which, request):
    folder = request.getfixturevalue(which)
    code, out, err = run("generate", "--model", str(folder), "hello world", "--max-tokens", "12",
                         "--context", "128", "--stats")
    assert code == 0, err
    assert out.endswith("\n") and len(out) > 1
    assert "generated" in err and "prompt" in err


def test_sampling_options_are_seeded(our_folder):
    args = ("generate", "--model", str(our_folder), "def f(x):", "--max-tokens", "10",
            "--context", "128", "--temperature", "0.9", "--top-p", "0.9", "--top-k", "40",
            "--seed", "3")
    a, b = run(*args), run(*args)
    assert a[0] == 0 and a[1] == b[1]


def test_stop_string_cuts_the_output(our_folder):
    _, full, _ = run("generate", "--model", str(our_folder), "abc", "--max-tokens", "16",
                     "--context", "128")
    text = full.rstrip("\n")
    if len(text) < 4:
        pytest.skip("the random model's greedy text is too short to cut")
    stop = text[2:4]
    _, cut, err = run("generate", "--model", str(our_folder), "abc", "--max-tokens", "16",
                      "--context", "128", "--stop", stop, "--stats")
    assert cut.rstrip("\n") == text[: text.index(stop)]
    assert "stop_string" in err


@pytest.mark.parametrize("extra", [["--ngram", "3"], ["--draft-model", "DRAFT"]])
def test_speculative_modes_match_plain_greedy(our_folder, extra):
    extra = [str(our_folder) if e == "DRAFT" else e for e in extra]
    base = ("generate", "--model", str(our_folder), "x = 1\nx = 1\nx =", "--max-tokens", "12",
            "--context", "128")
    _, plain, _ = run(*base)
    code, spec, err = run(*base, *extra, "--stats")
    assert code == 0, err
    assert spec == plain
    assert "speculative" in err


def test_chat_mode_keeps_a_session_and_reports_reuse(our_folder):
    code, _, err = run("generate", "--model", str(our_folder), "--chat", "--max-tokens", "6",
                         "--context", "256", stdin="hello\nhow are you\n")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "reused" in line]
    assert len(lines) == 2
    assert "reused 0" in lines[0] and "reused 0" not in lines[1]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "--model", "/nonexistent/folder", "hi"], "/nonexistent/folder"),
        (["generate", "--model", "FOLDER", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "--model", "FOLDER", "hi", "--max-tokens", "0"], "max_tokens"),
        (["generate", "--model", "FOLDER", "hi", "--context", "8", "--max-tokens", "50"],
         "positions"),
        (["generate", "--model", "FOLDER", "hi", "--ngram", "2", "--speculative"], "one of"),
    ],
)
def test_errors_are_one_line_and_nonzero(our_folder, argv, needle):
    argv = [str(our_folder) if a == "FOLDER" else a for a in argv]
    code, _, err = run(*argv)
    assert code == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("turbospark-jax: error:") and needle in lines[-1]
    assert "Traceback" not in err


def test_unsupported_model_type_is_a_clean_error(our_folder, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(our_folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = run("generate", "--model", str(bad), "hi")
    assert code == 1 and "gpt2" in err and "Traceback" not in err
