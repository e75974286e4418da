"""The flags of issue 54 on the embedded code model: --json, --logprobs, -n, --prompts-file,
--prompt-file, --system, --quantize, the block end, and chat turns marked apart."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from turbospark_jax.cli import main
from turbospark_jax.generation.completion import TokenLogprob, open_block

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tsj-pycoder"
BASE = ("generate", "--model", str(EMBEDDED))


def run(*argv: str, stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main([*BASE[:1], *BASE[1:], *argv] if argv and argv[0] != "generate" else list(argv),
                stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def test_json_is_the_text_with_its_finish_usage_and_timings():
    code, plain, _ = run("def add(a, b):", "--max-tokens", "24")
    assert code == 0
    code, out, err = run("def add(a, b):", "--max-tokens", "24", "--json")
    assert code == 0, err
    (record,) = records(out)
    assert record["text"] + "\n" == plain
    assert record["finish_reason"] in ("block_end", "length", "stop_token")
    assert record["usage"]["prompt_tokens"] > 0
    assert record["usage"]["generated_tokens"] <= 24
    assert {"load_s", "compile_s", "prefill_s", "first_token_s", "decode_s",
            "total_s"} <= set(record["timings"])
    assert "logprobs" not in record


def test_logprobs_name_each_token_and_its_alternatives():
    code, out, err = run("import os\n", "--max-tokens", "6", "--logprobs", "3")
    assert code == 0, err
    (record,) = records(out)  # --logprobs implies --json
    entries = record["logprobs"]
    assert len(entries) == record["usage"]["generated_tokens"]
    for e in entries:
        top = [t["logprob"] for t in e["top"]]
        assert len(top) == 3 and top == sorted(top, reverse=True) and top[0] <= 0
        assert e["top"][0]["token"] == e["token"]  # greedy takes the likeliest
        assert e["logprob"] == top[0]
    assert "".join(e["text"] for e in entries).startswith(record["text"])


def test_token_logprob_of_a_row_is_its_log_softmax():
    row = np.array([1.0, 3.0, -2.0, 3.0], np.float32)
    entry = TokenLogprob.of_row(row, 2, 2)
    want = row - np.log(np.exp(row).sum())
    assert math.isclose(entry.logprob, float(want[2]), rel_tol=1e-6)
    assert [t for t, _ in entry.top] == [1, 3]  # ties keep the lower id first
    assert TokenLogprob.of_row(row, 0, 0).top == ()


def test_the_python_api_reports_logprobs():
    import turbospark_jax as tsj

    model = tsj.load(EMBEDDED)
    result = tsj.generate(model, "import os\n", max_tokens=4, logprobs=2)
    assert len(result.logprobs) == len(result.token_ids)
    assert all(len(e.top) == 2 and e.top[0][0] == e.token for e in result.logprobs)
    assert tsj.generate(model, "import os\n", max_tokens=4).logprobs is None  # the control


def test_n_completions_are_those_of_their_seeds_decoded_alone(tmp_path):
    """-n 2 decodes two samples together; sample k is the batch run of --seed + k alone."""
    sampled = ("--max-tokens", "12", "--temperature", "0.9", "--no-block-end")
    code, out, err = run("def add(a, b):", "-n", "2", "--seed", "5", "--json", *sampled)
    assert code == 0, err
    both = records(out)
    assert [r["sample"] for r in both] == [0, 1]
    assert both[0]["text"] != both[1]["text"]  # two seeds, two samples
    prompts = tmp_path / "one.txt"
    prompts.write_text("def add(a, b):\n")
    code, out, err = run("--prompts-file", str(prompts), "--seed", "6", *sampled)
    assert code == 0, err
    assert records(out)[0]["text"] == both[1]["text"]


def test_a_prompts_file_gives_json_lines_in_order(tmp_path):
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "def add(a, b):"}\n\n{"prompt": "class Stack:"}\n'
                     '{"prompt": "import os\\nimport sys\\n"}\n')
    code, out, err = run("--prompts-file", str(lines), "--max-tokens", "10", "--stats")
    assert code == 0, err
    got = records(out)
    assert [r["index"] for r in got] == [0, 1, 2]
    assert [r["prompt"] for r in got] == ["def add(a, b):", "class Stack:",
                                          "import os\nimport sys\n"]
    assert "[batch] 3 completions of 3 prompts" in err
    # the same prompts, one a line
    plain = tmp_path / "prompts.txt"
    plain.write_text("def add(a, b):\nclass Stack:\n")
    code, out, _ = run("--prompts-file", str(plain), "--max-tokens", "10")
    assert code == 0
    assert [r["text"] for r in records(out)] == [r["text"] for r in got[:2]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    code, out, err = run("--prompts-file", str(bad))
    assert code == 1 and out == "" and 'needs a "prompt" string' in err


def test_a_prompt_file_is_the_prompt(tmp_path):
    path = tmp_path / "p.py"
    path.write_text("def add(a, b):")
    _, by_flag, _ = run("--prompt-file", str(path), "--max-tokens", "10")
    _, by_arg, _ = run("def add(a, b):", "--max-tokens", "10")
    assert by_flag == by_arg


def test_system_goes_first_through_the_chat_template():
    code, out, err = run("add two numbers", "--system", "write python", "--json",
                         "--max-tokens", "4")
    assert code == 0, err
    code, chat, _ = run("add two numbers", "--chat", "--json", "--max-tokens", "4")
    with_system, without = records(out)[0], records(chat)[0]
    # "# write python\n" comes first in the embedded template's rendering
    assert with_system["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]


def test_quantize_loads_int8_weights():
    code, out, err = run("def add(a, b):", "--max-tokens", "6", "--quantize", "int8", "--json")
    assert code == 0, err
    assert records(out)[0]["usage"]["generated_tokens"] >= 1


@pytest.mark.parametrize("text,want", [
    ("def f(x):", (0, False)),
    ("def f(x):\n    y = 1\n", (0, True)),
    ("class A:\n    def f(self):\n        pass\n    def g(self):", (4, False)),
    ("def f(a,\n      b):", (0, False)),
    ("import os\n", None),
    ("def f():\n    pass\nx = 1\n", None),
])
def test_open_block_finds_the_innermost_def_or_class(text, want):
    assert open_block(text) == want


def test_a_code_completion_stops_where_its_block_ends():
    """The embedded folder asks for the block end: the completion of a def ends before the
    next top-level line; --no-block-end (the control) runs on into it."""
    prompt = "def is_prime(n):"
    code, stopped, err = run(prompt, "--max-tokens", "96", "--json")
    assert code == 0, err
    record = records(stopped)[0]
    assert record["finish_reason"] == "block_end"
    body = record["text"]
    assert body.startswith("\n") and all(
        not line or line[0] in " \t" for line in body.split("\n")[1:]), body
    code, full, _ = run(prompt, "--max-tokens", "96", "--json", "--no-block-end")
    whole = records(full)[0]["text"]
    assert whole.startswith(body) and len(whole) > len(body)
    assert any(line and line[0] not in " \t" for line in whole[len(body):].split("\n")[1:])


def test_chat_turns_from_a_pipe_are_separated_and_take_commands():
    code, out, err = run("--chat", "--max-tokens", "6",
                         stdin="a function that adds\n/reset\nand a test\n/exit\nnever sent\n")
    assert code == 0, err
    assert out.count("\n--------\n") == 2  # one separator after each reply
    assert "[turn] the conversation starts over" in err
    assert len([line for line in err.splitlines() if line.startswith("[turn] prompt")]) == 2


def test_help_names_the_new_flags():
    code, out, _ = run("generate", "--help")
    assert code == 0
    text = " ".join(out.split())
    for flag in ("--system", "--prompt-file", "--prompts-file", "--json", "--logprobs",
                 "--num-completions", "--quantize", "--block-end", "--no-block-end",
                 "--compile-cache", "--no-compile-cache", "--kv-dtype"):
        assert flag in text, flag


def test_the_warm_up_compiles_what_the_run_calls():
    """A prompt past the warm-up's own length, prefilled in one parallel pass as wide as
    itself, and a reply long enough for a second decode burst: every program is compiled
    before the run, so the run's prefill and decode times are not compile time."""
    code, _, err = run("x = 1\n" * 70, "--no-exact", "--max-tokens", "24", "--no-block-end",
                       "--stats")
    assert code == 0, err
    stats = [line for line in err.splitlines() if line.startswith("[length]")]
    assert len(stats) == 1 and "prefilled 2" in stats[0], err  # 2xx tokens: a 512-row pass
    assert "went to compiling" not in err, err
