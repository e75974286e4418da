"""Packing folders into parts and back, and the recipe's command line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_recipe import pack
from turbospark_recipe.__main__ import main


def test_pack_and_unpack_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    src = tmp_path / "src" / "model"
    (src / "sub").mkdir(parents=True)
    files = {"a.bin": rng.bytes(5000), "sub/b.txt": b"hello\n" * 300}
    for name, data in files.items():
        (src / name).write_bytes(data)
    written = pack.pack_folders([src], tmp_path / "parts", name="m", part_bytes=1024)
    parts = [p for p in written if ".part-" in p.name]
    assert len(parts) > 2 and all(p.stat().st_size <= 1024 for p in parts)
    (out,) = pack.unpack_parts(tmp_path / "parts", tmp_path / "dest", name="m")
    assert {n: (out / n).read_bytes() for n in files} == files

    # Control: a damaged part is caught before anything is extracted.
    raw = bytearray(parts[1].read_bytes())
    raw[10] ^= 1
    parts[1].write_bytes(bytes(raw))
    with pytest.raises(BadInputError, match="corrupt"):
        pack.unpack_parts(tmp_path / "parts", tmp_path / "dest2", name="m")
    assert not (tmp_path / "dest2").exists()


def test_cli_pack_and_unpack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = np.random.default_rng(1).bytes(10_000)  # incompressible: more than one part
    src = tmp_path / "model"
    src.mkdir()
    (src / "w.bin").write_bytes(data)
    assert main(["pack", str(src), "--out", str(tmp_path / "parts"), "--part-mib", "0.004"]) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) >= 3 and printed[-1].endswith("models.manifest.json")
    assert main(["unpack", str(tmp_path / "parts"), "--to", str(tmp_path / "dest")]) == 0
    assert (tmp_path / "dest" / "model" / "w.bin").read_bytes() == data


def test_cli_help_lists_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "python -m turbospark_recipe" in out
    for command in ("tokenizer", "train", "recipe", "pack", "unpack"):
        assert command in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bogus"], "invalid choice: 'bogus'"),
        ([], "required: command"),
        (["pack", "x"], "required: --out"),
        (["train", "--tokenizer", "t", "--out", "o", "--seq-len", "many"], "invalid int value"),
        (["unpack", "/nonexistent/parts", "--to", "d"], "no models.manifest.json"),
        (["tokenizer", "--out", "o", "--corpus-root", "/nonexistent"], "not a directory"),
    ],
)
def test_cli_errors_are_one_line_and_status_1(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("turbospark-jax recipe: error: ") and says in lines[0]


def test_recipe_runs_end_to_end_with_a_block_drafter(tmp_path: Path) -> None:
    """``recipe`` on a tiny corpus with the embedded tokenizer reused: draft, Qwen3.5 target
    and its block drafter trained, exported, packed and summarised; each folder loads."""
    import json

    from turbospark_jax.io.drafter_folders import load_block_drafter
    from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path, load_folder
    from turbospark_jax.io.tokenizer import Tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(24):
        (corpus / f"m{i}.py").write_text(
            f"def f{i}(x):\n    return x * {i} + {i % 5}\n\n\nclass C{i}:\n    n = {i}\n" * 3)
    out = tmp_path / "run"
    tokenizer = embedded_model_path(DEFAULT_TARGET)
    assert main(["recipe", "--out", str(out), "--corpus-root", str(corpus),
                 "--heldout-fraction", "0.25", "--tokenizer", str(tokenizer),
                 "--target-preset", "tiny35", "--draft-preset", "tiny", "--seq-len", "16",
                 "--target-steps", "2", "--draft-steps", "2", "--target-batch-size", "2",
                 "--draft-batch-size", "2", "--block-steps", "2", "--block-batch-size", "2",
                 "--no-progress", "--pack-out", str(tmp_path / "parts")]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["vocab_size"] == Tokenizer.from_folder(tokenizer).vocab_size
    assert summary["block"]["steps_done"] == 2 and summary["block"]["params"] > 0
    assert len(summary["block"]["acceptance_by_position"]) == 7  # the default block of 8
    assert load_folder(out / "target", dtype="float32", layer_layout="list").config.model_type \
        == "qwen3_5_text"
    config, _ = load_block_drafter(out / "block", dtype="float32")
    assert config.target_num_hidden_layers == 4
    assert summary["parts"] and (tmp_path / "parts" / "summary.json").is_file()
    # A second run continues that target from its folder and takes that draft as it is.
    again = tmp_path / "again"
    assert main(["recipe", "--out", str(again), "--corpus-root", str(corpus),
                 "--heldout-fraction", "0.25", "--tokenizer", str(tokenizer),
                 "--target-preset", "tiny35", "--seq-len", "16", "--target-steps", "2",
                 "--target-batch-size", "2", "--target-init", str(out / "target"),
                 "--draft-from", str(out / "draft"), "--no-progress"]) == 0
    summary = json.loads((again / "summary.json").read_text())
    assert summary["draft"] == {"from": str(out / "draft")}
    assert (again / "draft" / "model.safetensors").read_bytes() == (
        out / "draft" / "model.safetensors").read_bytes()
    assert f"the weights of `{out / 'target'}`" in (again / "target" / "README.md").read_text()


def test_recipe_refuses_a_draft_with_another_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path
    from turbospark_jax.testing.tokenizers import byte_level_bpe

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x\n" * 40)
    other = tmp_path / "other_draft"
    other.mkdir()
    byte_level_bpe().save(str(other / "tokenizer.json"))
    assert main(["recipe", "--out", str(tmp_path / "run"), "--corpus-root", str(corpus),
                 "--heldout-fraction", "0.5", "--tokenizer",
                 str(embedded_model_path(DEFAULT_TARGET)), "--seq-len", "16",
                 "--draft-from", str(other), "--no-progress"]) == 1
    assert "another tokenizer" in capsys.readouterr().err
