"""The package graph the README draws holds: no package imports from a layer above its own,
nor from another package of its own layer, and the runtime never imports the training recipe.

Each top-level package of ``turbospark_jax`` is one layer of the architecture; modules inside a
package may import each other freely. An import that reaches up (or sideways) is the first step
towards a cycle between concerns, so the test reads every module's imports and checks them.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "turbospark_jax"

#: Layer of each top-level package or module of ``turbospark_jax``. A unit may import only
#: units of strictly lower layers.
LAYERS: dict[str, int] = {
    "errors": 0,
    "core": 1,
    "quant": 2,
    "kernels": 3,
    "models": 4,
    "engine": 5, "io": 5,
    "speculative": 6,
    "generation": 7,
    "sessions": 8,
    "parallel": 9,
    "api": 10, "server": 10,
    "cli": 11, "testing": 11,
    "__init__": 12, "__main__": 12,
}


def _unit(dotted: str) -> str:
    head = dotted.split(".")[0]
    if head not in LAYERS:
        raise AssertionError(f"{dotted!r} belongs to no layer in LAYERS; give its package one")
    return head


def _imports(path: Path) -> list[str]:
    """The ``turbospark_jax`` units a module imports (dotted under the package), and
    ``turbospark_recipe`` where it imports the recipe."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "turbospark_jax":
                found += [f"turbospark_jax.{alias.name}" for alias in node.names]
            else:
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    prefix = "turbospark_jax."
    ours = [m[len(prefix):] for m in found if m.startswith(prefix)]
    # the package's own version string and names re-exported at the top count as __init__
    ours = [m if m.split(".")[0] in LAYERS else "__init__" for m in ours]
    return ours + [m for m in found if m.split(".")[0] == "turbospark_recipe"]


def _violations(at: Path, source: Path | None = None) -> list[str]:
    """The imports of ``source`` (default: the module at ``at``) that a module at ``at`` may
    not make."""
    own = _unit(".".join(at.relative_to(PACKAGE).with_suffix("").parts))
    bad = []
    for m in _imports(source or at):
        recipe = m.startswith("turbospark_recipe")
        if recipe or (_unit(m) != own and LAYERS[_unit(m)] >= LAYERS[own]):
            bad.append(m)
    return bad


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_upward_or_sideways(path):
    bad = _violations(path)
    assert not bad, f"{path.relative_to(PACKAGE)} imports from its own or a higher layer: {bad}"


def test_top_level_holds_packages_and_a_handful_of_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert modules == ["__init__.py", "__main__.py", "api.py", "errors.py"]


def test_control_an_upward_import_is_caught(tmp_path):
    """The check can fail: a core module importing the CLI, an engine module importing the io
    layer beside it, and a model importing the recipe are each reported."""
    for rel, line, expected in [
        ("core/fake.py", "from turbospark_jax.cli import main\n", ["cli"]),
        ("engine/fake.py", "from turbospark_jax.io import loading\n", ["io"]),
        ("models/fake.py", "import turbospark_recipe.train\n", ["turbospark_recipe.train"]),
    ]:
        fake = PACKAGE / rel
        body = tmp_path / "body.py"
        body.write_text(line)
        assert _violations(fake, body) == expected


@pytest.mark.parametrize("module", ["turbospark_jax.speculative.rounds",
                                    "turbospark_jax.speculative.pair",
                                    "turbospark_jax.speculative.drafters.draft_model"])
def test_a_module_imports_first_in_a_fresh_process(module):
    """The package loads its names lazily, so a module may be the first one a process imports:
    it must not meet a package still half-initialised (the rounds import the drafters package,
    whose modules must not import the rounds back at import time)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
