"""Every ```python block of README.md runs as written (so the README cannot rot).

Each block runs in a fresh namespace, in the README's order: a reader copies one block, not
the page, so every block must be self-contained (its own imports and its own ``tsj.load()``).
``bash`` and ``text`` blocks are not executed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks() -> list[tuple[int, str]]:
    """(line number, source) of every python block."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = python_blocks()


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("line,source", BLOCKS, ids=[f"line {n}" for n, _ in BLOCKS])
def test_python_block_runs(line, source, capsys):
    code = compile(source, f"README.md, block at line {line}", "exec")
    exec(code, {"__name__": f"readme_line_{line}"})
    capsys.readouterr()  # blocks print; the test only asks that they run
