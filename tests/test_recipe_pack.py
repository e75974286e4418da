"""Packing folders into parts and back, and the recipe's command line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.recipe import pack
from turbospark_jax.recipe.__main__ import main


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
    assert "python -m turbospark_jax.recipe" in out
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
