"""Every ```python block of README.md and of the documentation site runs as written, so the
pages cannot rot; and the site builds with ``mkdocs build --strict``.

README.md's blocks each run in a fresh namespace, in the page's order: a reader copies one
block, not the page, so every block must be self-contained. A page under ``docs/`` is read as a
tutorial: its blocks run in order in one namespace, a later block using what an earlier one
made. ``bash``, ``text`` and other blocks are not executed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line number, source) of every python block of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


def run_block(page: Path, line: int, source: str, namespace: dict) -> None:
    where = f"{page.relative_to(ROOT)}, block at line {line}"
    exec(compile(source, where, "exec"), namespace)


README_BLOCKS = python_blocks(README)
DOC_PAGES = sorted(p for p in DOCS.rglob("*.md") if python_blocks(p))


def test_the_readme_and_the_docs_have_python_blocks():
    assert README_BLOCKS
    assert len(DOC_PAGES) >= 5


@pytest.mark.parametrize("line,source", README_BLOCKS,
                         ids=[f"README line {n}" for n, _ in README_BLOCKS])
def test_readme_block_runs(line, source, capsys):
    run_block(README, line, source, {"__name__": f"readme_line_{line}"})
    capsys.readouterr()  # blocks print; the test only asks that they run


@pytest.mark.parametrize("page", DOC_PAGES, ids=[str(p.relative_to(DOCS)) for p in DOC_PAGES])
def test_doc_page_blocks_run_in_order(page, capsys):
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for line, source in python_blocks(page):
        run_block(page, line, source, namespace)
    capsys.readouterr()


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()
