"""End to end through the ``turbospark-jax`` command: folders written by transformers and by
our own code, sampling options, speculative modes, chat, help and version, progress, stats,
and one-line errors that cost no model load."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from turbospark_jax import cli
from turbospark_jax.cli import main
from turbospark_jax.cli.arguments import unescape
from turbospark_jax.io.loading import GenerationConfig
from turbospark_jax.io.saving import save_folder
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import init_params
from turbospark_jax.testing.tokenizers import byte_level_bpe

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


@pytest.mark.parametrize("extra", [["--ngram", "3"], ["--draft-model", "DRAFT"],
                                   ["--drafter", "ngram"]])
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
        (["generate", "--model", "FOLDER", "hi", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "--model", "FOLDER", "hi", "--context", "8", "--max-tokens", "50"],
         "positions"),
        (["generate", "--model", "FOLDER", "hi", "--ngram", "2", "--speculative"], "choose one"),
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


# -- issue 23: the first ten minutes ----------------------------------------------------------

#: The embedded target as this checkout has it (an editable install elsewhere may resolve the
#: embedded path to another checkout's folder).
EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tsj-pycoder"
EMBEDDED_DRAFT = EMBEDDED.parent / "tsj-pycoder-draft"

#: Library names that must not reach a user of the command line.
INTERNAL_WORDS = ("max_n", "capacity", "steps_per_call", "max_tokens", "draft_len", "top_p",
                  "top_k", "min_p", "repetition_penalty", "token id")


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything loads weights."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(cli, "_load", refuse)
    monkeypatch.setattr("turbospark_jax.io.loading.load_folder", refuse)


@pytest.fixture(scope="module")
def short_folder(our_folder, tmp_path_factory) -> Path:
    """``our_folder`` with a config that says 32 positions."""
    folder = tmp_path_factory.mktemp("short") / "model"
    shutil.copytree(our_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 32
    (folder / "config.json").write_text(json.dumps(config))
    return folder


LONG_PROMPT = "x = 1\n" * 3000


@pytest.mark.parametrize(
    "argv,stdin,needle",
    [
        ([], "", "COMMAND"),
        (["bogus"], "", "invalid choice"),
        (["generate", "hi", "--bogus"], "", "--bogus"),
        (["generate", "hi", "--max-tokens", "abc"], "", "--max-tokens"),
        (["generate", "hi", "--max-tokens", "0"], "", "--max-tokens"),
        (["generate", "hi", "--temperature", "-1"], "", "--temperature"),
        (["generate", "hi", "--temperature", "nan"], "", "--temperature"),
        (["generate", "hi", "--top-p", "0"], "", "--top-p"),
        (["generate", "hi", "--top-k", "-2"], "", "--top-k"),
        (["generate", "hi", "--min-p", "2"], "", "--min-p"),
        (["generate", "hi", "--repetition-penalty", "0"], "", "--repetition-penalty"),
        (["generate", "hi", "--seed", "-1"], "", "--seed"),
        (["generate", "hi", "--stop", ""], "", "--stop"),
        (["generate", "hi", "--context", "0"], "", "--context"),
        (["generate", "hi", "--width", "0"], "", "--width"),
        (["generate", "hi", "--slots", "2"], "", "--chat"),
        (["generate", "hi", "--dtype", "int8"], "", "--dtype"),
        (["generate", "hi", "--ngram", "0"], "", "--ngram"),
        (["generate", "hi", "--ngram", "-3"], "", "--ngram"),
        (["generate", "hi", "--draft-len", "3"], "", "--draft-len"),
        (["generate", "hi", "--speculative", "--draft-len", "0"], "", "--draft-len"),
        (["generate", "hi", "--ngram", "2", "--draft-len", "9"], "", "--draft-len"),
        (["generate", "hi", "--ngram", "2", "--speculative"], "", "choose one"),
        (["generate", "hi", "--ngram", "2", "--draft-model", "X"], "", "choose one"),
        (["generate", "hi", "--drafter", "block", "--ngram", "2"], "", "choose one"),
        (["generate", "hi", "--drafter", "auto", "--speculative", "--ngram", "2"], "",
         "choose one"),
        (["generate", "hi", "--drafter", "medusa"], "", "--drafter"),
        (["generate", "hi", "--drafter", "assistant"], "", "--drafter assistant: the assistant "
         "drafter is not available"),
        (["generate", "hi", "--drafter", "block", "--block-drafter", "/nonexistent/bd"], "",
         "--block-drafter /nonexistent/bd: no such folder"),
        (["generate", "--model", "/nonexistent/folder", "hi"], "", "/nonexistent/folder"),
        (["generate", "--draft-model", "/nonexistent/draft", "hi"], "", "--draft-model"),
        (["generate", ""], "", "the prompt is empty"),
        (["generate"], "", "the prompt is empty"),
        (["generate", "hi", "--context", "8", "--max-tokens", "50"], "", "--context 8"),
        (["generate", "--chat", "--context", "64", "--max-tokens", "100"], "", "--context 64"),
        (["generate", "--chat", "--max-tokens", "4000"], "", "--allow-long-context"),
        (["generate", LONG_PROMPT], "", "--allow-long-context"),
        (["generate", "--max-tokens", "2000"], LONG_PROMPT[:600], "--allow-long-context"),
    ],
    ids=lambda v: (v if isinstance(v, str) else " ".join(v))[:40],
)
def test_bad_command_lines_cost_no_load(no_loading, argv, stdin, needle):
    code, out, err = run(*argv, stdin=stdin)
    assert code == 1, err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("turbospark-jax: error: ") and needle in lines[0], lines[0]
    message = lines[0].removeprefix("turbospark-jax: error: ")
    assert not any(re.search(rf"(?<![-\w]){w}\b", message) for w in INTERNAL_WORDS), message


def test_the_long_prompt_message_names_both_numbers(no_loading):
    code, _, err = run("generate", LONG_PROMPT, "--max-tokens", "128")
    assert code == 1
    assert "--max-tokens 128" in err and "2,048" in err and "--allow-long-context" in err
    tokens = re.search(r"the prompt \(([\d,]+) tokens\)", err)
    assert tokens and int(tokens.group(1).replace(",", "")) > 2048


def test_the_draft_model_must_share_the_vocabulary(no_loading, our_folder):
    code, out, err = run("generate", "hi", "--draft-model", str(our_folder))
    assert code == 1 and out == ""
    assert "vocabulary" in err and "--draft-model" in err


def test_allow_long_context_runs_with_a_warning(short_folder):
    prompt = "def f(x):\n    return x\n" * 4
    argv = ("generate", "--model", str(short_folder), prompt, "--max-tokens", "4")
    code, _, err = run(*argv)
    assert code == 1 and "32" in err and "--allow-long-context" in err
    code, out, err = run(*argv, "--allow-long-context")
    assert code == 0, err
    assert "turbospark-jax: warning:" in err and "32" in err
    assert out.endswith("\n")


def test_help_names_every_flag_with_its_default():
    code, out, err = run("generate", "--help")
    assert code == 0 and err == ""
    text = " ".join(out.split())
    for flag in ("--model", "--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p",
                 "--repetition-penalty", "--seed", "--stop", "--chat", "--speculative",
                 "--drafter", "--draft-model", "--ngram", "--draft-len", "--context",
                 "--allow-long-context", "--width", "--dtype", "--parallel-prefill", "--slots",
                 "--progress", "--stats"):
        assert flag in text, flag
    for default in ("(default: 128)", "(default: 0.0)", "(default: 1.0)", "(default: 0)",
                    "else 4;", "(default: 1)"):
        assert default in text, default
    assert "standard input" in text
    assert "\\n\\n" in text  # --stop explains its escapes
    code, top, _ = run("--help")
    assert code == 0 and "--version" in top
    assert "``" not in out + top


@pytest.mark.parametrize(
    "raw,want",
    [
        ("\\n\\n", "\n\n"), ("a\\tb", "a\tb"), ("\\r\\n", "\r\n"), ("\\\\n", "\\n"),
        ("\\x41\\u00e9", "Aé"), ("\\d+", "\\d+"), ("\\x4", "\\x4"), ("plain", "plain"),
    ],
)
def test_stop_escapes(raw, want):
    assert unescape(raw) == want


def test_stop_blank_line_stops_the_embedded_model():
    prompt = "def is_prime(n):"
    # --no-block-end: the text runs on past the function, into the blank line after it
    base = ("generate", "--model", str(EMBEDDED), prompt, "--max-tokens", "64", "--no-block-end")
    code, full, _ = run(*base)
    assert code == 0
    assert "\n\n" in full.rstrip("\n"), "the control: the plain output has a blank line"
    code, cut, err = run(*base, "--stop", "\\n\\n", "--stats")  # as a shell passes "\n\n"
    assert code == 0
    assert cut == full[: full.index("\n\n")] + "\n"
    assert "[stop_string]" in err


def test_speculative_on_the_embedded_model_says_which_drafter_and_why():
    """--speculative is --drafter auto: the pick is the one drafter_choice makes for the
    embedded folder on this backend, --stats names it and why, and greedy stays lossless."""
    from turbospark_jax.speculative.choice import choose_drafter

    base = ("generate", "--model", str(EMBEDDED), "import os\nimport sys\n\n\ndef main(argv):",
            "--max-tokens", "32")
    code, plain, err = run(*base)
    assert code == 0, err
    code, spec, err = run(*base, "--speculative", "--stats")
    assert code == 0, err
    assert spec == plain
    want = choose_drafter(EMBEDDED, "auto", jax.default_backend())
    said = [line for line in err.splitlines() if line.startswith("[drafter] ")]
    assert said == [f"[drafter] {want.why}"]
    assert said[0].startswith(f"[drafter] auto picked {want.drafter} at draft length "
                              f"{want.draft_len}")
    assert "speculative (device rounds)" in err


def test_speculative_sampled_decodes_plainly_where_auto_measured_sampling_slower():
    """The embedded folder's figures on a CPU say its pick (the draft model) samples slower
    than plain decoding: a sampled --speculative run says so and decodes without drafting,
    the same text as the plain run; with --draft-len given it drafts (the control)."""
    from turbospark_jax.speculative.choice import choose_drafter

    want = choose_drafter(EMBEDDED, "auto", jax.default_backend())
    if want.plain_when_sampling is None:
        pytest.skip("this backend's figures measured the pick's sampling at 1x or more")
    base = ("generate", "--model", str(EMBEDDED), "def main(argv):", "--max-tokens", "16",
            "--temperature", "0.8", "--seed", "4", "--stats")
    code, plain, err = run(*base)
    assert code == 0, err
    code, spec, err = run(*base, "--speculative")
    assert code == 0, err
    assert spec == plain
    assert f"note: --speculative: {want.plain_when_sampling}" in err
    assert not any(line.startswith("[drafter] ") for line in err.splitlines())
    code, _, err = run(*base, "--speculative", "--draft-len", "2")
    assert code == 0, err
    assert re.search(r"speculative \((device|host) rounds\)", err)


STATS = re.compile(
    r"^\[(stop_token|stop_string|length)\] prompt \d+ tokens \(reused \d+, prefilled \d+\), "
    r"generated \d+; load \d+\.\d\ds, compile \d+\.\d\ds, prefill \d+\.\d\ds "
    r"\(\d+\.\d tok/s\), first token \d+\.\d\ds, decode \d+\.\d\ds \(\d+\.\d tok/s\)$"
)


def test_stats_line_keeps_compile_apart(our_folder):
    code, _, err = run("generate", "--model", str(our_folder), "hello world", "--max-tokens",
                       "12", "--context", "128", "--stats")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("[") and "prompt" in line]
    assert len(lines) == 1 and STATS.match(lines[0]), lines
    # The warm-up compiled everything: the run itself compiled nothing.
    assert "went to compiling" not in err


def test_stats_of_a_speculative_run_keep_compile_apart(our_folder):
    code, _, err = run("generate", "--model", str(our_folder), "x = 1\nx = 1\nx =",
                       "--max-tokens", "12", "--context", "128", "--draft-model",
                       str(our_folder), "--stats")
    assert code == 0, err
    assert "went to compiling" not in err and "speculative" in err


def test_progress_goes_to_stderr_only(our_folder, monkeypatch):
    monkeypatch.setattr("turbospark_jax.cli.progress.PROGRESS_DELAY_S", 0.0)
    argv = ("generate", "--model", str(our_folder), "hello world " * 20, "--max-tokens", "12",
            "--context", "256")
    code, quiet_out, quiet_err = run(*argv)
    assert code == 0 and "tok/s" not in quiet_err  # not a terminal, no --progress: no bars
    code, out, err = run(*argv, "--progress")
    assert code == 0, err
    assert out == quiet_out  # stdout stays the text alone
    assert "prefill" in err and "generate" in err and "tok/s" in err


def test_chat_on_the_embedded_model_separates_turns():
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.io.loading import load_folder
    from turbospark_jax.sessions.chat import ChatSession

    loaded = load_folder(EMBEDDED, dtype="float32", layer_layout="list")
    tok = loaded.tokenizer
    producer = BlockProducer(loaded.model, loaded.params, capacity=256, width=1)
    chat = ChatSession(producer, tok, max_tokens=12)
    first = chat.send("a function that adds two numbers")
    second = chat.send("and a test for it")
    assert tok.decode(first.prompt_ids) == "<|bos|># a function that adds two numbers\n"
    reply = first.text
    sep = "\n" if reply.endswith("\n") else "\n\n"
    assert tok.decode(second.prompt_ids) == (
        f"<|bos|># a function that adds two numbers\n{reply}{sep}# and a test for it\n"
    )
    assert second.usage.reused_tokens > len(first.prompt_ids)


@pytest.mark.parametrize("mode", [["--ngram", "2"], ["--draft-model", "FOLDER"]])
def test_a_drafting_mode_on_a_cpu_says_what_was_measured(our_folder, mode):
    mode = [str(our_folder) if m == "FOLDER" else m for m in mode]
    code, out, err = run("generate", "--model", str(our_folder), "x = 1\nx =", "--max-tokens",
                         "4", "--context", "128", *mode)
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("turbospark-jax: note:")]
    if jax.default_backend() != "cpu":
        assert not notes
        return
    assert len(notes) == 1 and mode[0] in notes[0]
    assert "slower than plain decoding" in notes[0] and "--draft-len" in notes[0]
    assert "note" not in out


@pytest.mark.parametrize("speedup", [0.5, 1.2])
def test_the_cpu_note_reads_the_model_folders_speculative_json(our_folder, tmp_path, speedup):
    from turbospark_jax.speculative.figures import Measurement, write_figures

    folder = tmp_path / "model"
    shutil.copytree(our_folder, folder)
    write_figures(folder, [Measurement(drafter="ngram", backend=jax.default_backend(),
                                       draft_len=3, speedup=speedup,
                                       mean_acceptance_length=1.5, acceptance_rate=0.2,
                                       command="a test's own figures")])
    code, _, err = run("generate", "--model", str(folder), "x = 1\nx =", "--max-tokens", "4",
                       "--context", "128", "--ngram", "2")
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("turbospark-jax: note:")]
    if jax.default_backend() != "cpu" or speedup >= 1:
        assert not notes  # figures of 1x or more: nothing to warn about
        return
    assert len(notes) == 1 and "measured 0.50x plain decoding" in notes[0]
    assert "speculative.json" in notes[0] and "--draft-len" in notes[0]


def test_a_long_exact_prefill_on_a_cpu_suggests_parallel_prefill(our_folder, monkeypatch):
    monkeypatch.setattr(cli, "LONG_PREFILL_TOKENS", 16)
    argv = ("generate", "--model", str(our_folder), "hello world " * 12, "--max-tokens", "2",
            "--context", "256")
    code, _, err = run(*argv, "--prefill-width", "1")  # one row a step: the slow prefill
    assert code == 0, err
    hinted = "--parallel-prefill" in err
    assert hinted == (jax.default_backend() == "cpu")
    for quicker in (("--parallel-prefill",), ("--no-exact",), ()):  # () : wide exact blocks
        code, _, err = run(*argv, *quicker)
        assert code == 0 and "note" not in err


def test_chat_through_the_cli_with_a_draft_model(our_folder):
    code, _, err = run("generate", "--model", str(our_folder), "--chat", "--draft-model",
                         str(our_folder), "--max-tokens", "6", "--context", "256",
                         stdin="hello\nhow are you\n")
    assert code == 0, err
    assert len([line for line in err.splitlines() if line.startswith("[turn]")]) == 2


def test_library_messages_are_put_in_the_flags_words():
    from turbospark_jax.cli.arguments import user_words

    assert user_words(
        "a prompt of 5 tokens plus max_tokens=9 needs 14 positions; the producer holds 8"
    ) == "a prompt of 5 tokens plus --max-tokens 9 needs 14 positions; --context is 8"
    assert user_words("draft_len must be in 1..8") == "--draft-len must be in 1..8"
    assert user_words("top_p must be in (0, 1]", {"top_p": "--top-p"}) == (
        "--top-p must be in (0, 1]"
    )


def test_generate_with_a_block_drafter(our_folder, tmp_path):
    from turbospark_jax import api
    from turbospark_jax.errors import BadInputError
    from turbospark_jax.io.drafter_folders import save_block_drafter
    from turbospark_jax.models import block_drafter as BD

    vocab = json.loads((our_folder / "config.json").read_text())["vocab_size"]
    config = BD.BlockDrafterConfig(hidden_size=32, vocab_size=vocab, target_layer_ids=(0, 1),
                                   target_num_hidden_layers=2, block_size=4, head_dim=8)
    save_block_drafter(tmp_path / "bd", config, BD.init_params(config, jax.random.PRNGKey(3)))
    argv = ("generate", "--model", str(our_folder), "def f(x):", "--max-tokens", "8")
    # Losslessness is test_block_drafter's; here the flag loads, pairs and runs the rounds.
    code, out, err = run(*argv, "--block-drafter", str(tmp_path / "bd"), "--draft-len", "3",
                         "--stats")
    assert code == 0, err
    assert out.endswith("\n") and "generated 8" in err
    # one line for a drafter made for another target, and for two drafters at once
    wider = BD.BlockDrafterConfig(hidden_size=32, vocab_size=vocab, target_layer_ids=(0, 2),
                                  target_num_hidden_layers=3, block_size=4, head_dim=8)
    save_block_drafter(tmp_path / "other", wider, BD.init_params(wider, jax.random.PRNGKey(3)))
    code, out, err = run(*argv, "--block-drafter", str(tmp_path / "other"))
    assert code == 1 and out == "" and len(err.splitlines()) == 1
    assert "number of layers is 3" in err and "--block-drafter" in err
    code, _, err = run(*argv, "--block-drafter", str(tmp_path / "bd"), "--ngram", "2")
    assert code == 1 and "choose one" in err
    with pytest.raises(BadInputError, match="choose one drafter"):
        api.load(our_folder, block_drafter=tmp_path / "bd", ngram=2)


def test_generate_with_a_block_drafter_over_a_qwen3_5_target(tmp_path):
    """A Qwen3.5 target folder (DeltaNet layers, tap rows in its cache) with --block-drafter:
    the flag loads the drafter, taps the target and runs the rounds."""
    from turbospark_jax.io.drafter_folders import save_block_drafter
    from turbospark_jax.models import block_drafter as BD
    from turbospark_jax.models.qwen3_5 import config as QC
    from turbospark_jax.models.qwen3_5 import model as Q

    tok = byte_level_bpe()
    config = QC.Qwen35Config.from_hf_dict(dict(
        model_type="qwen3_5_text", vocab_size=tok.get_vocab_size(), hidden_size=32,
        intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_hidden_layers=4, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=1,
    ))
    wrapper = Tokenizer.from_tokenizers(tok, bos="<|bos|>", eos="<|eos|>", pad="<|pad|>",
                                        chat_template=CHAT_TEMPLATE)
    save_folder(tmp_path / "t", config, Q.init_params(config, jax.random.PRNGKey(0)),
                tokenizer=wrapper,
                generation_config=GenerationConfig(eos_token_ids=(1,), bos_token_id=0))
    drafter = BD.BlockDrafterConfig(hidden_size=32, vocab_size=config.vocab_size,
                                    target_layer_ids=(0, 3), target_num_hidden_layers=4,
                                    block_size=4, head_dim=8)
    save_block_drafter(tmp_path / "bd", drafter, BD.init_params(drafter, jax.random.PRNGKey(3)))
    code, out, err = run("generate", "--model", str(tmp_path / "t"), "def f(x):",
                         "--max-tokens", "8", "--block-drafter", str(tmp_path / "bd"),
                         "--draft-len", "3", "--stats")
    assert code == 0, err
    assert out.endswith("\n") and "generated 8" in err


def test_python_dash_m_runs_the_command():
    """``python -m turbospark_jax`` is the ``turbospark-jax`` command: the same version line, and
    a mistyped flag gets the same one-line error and status."""
    done = subprocess.run([sys.executable, "-m", "turbospark_jax", "--version"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("turbospark-jax ")
    bad = subprocess.run([sys.executable, "-m", "turbospark_jax", "generate", "--no-such-flag"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--no-such-flag" in bad.stderr
