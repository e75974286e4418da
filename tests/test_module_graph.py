"""The module graph README.md draws holds: no module imports from a layer above its own.

Protocols sit at the centre; the engine and the models below the loops; the loops below
multi-turn; the entry points (API, CLI, recipe) on top. An import that reaches upward is the
first step towards a cycle, so the test reads every module's imports and checks the layers.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "turbospark_jax"

#: Layer of each module (by dotted name under ``turbospark_jax``; a package stands for its
#: modules). Lower layers never import higher ones.
LAYERS: dict[str, int] = {
    "errors": 0, "device_flags": 0, "checks": 0, "kv_prefix": 0, "state": 0, "sampling": 0,
    "stop": 0, "detokenize": 0, "tokenizer": 0, "streams": 0, "distributed": 0, "images": 0,
    "injection": 0, "loops": 0,
    "protocols": 1,
    "models": 2, "block_program": 2, "block_producer": 2, "sharding": 2, "tp_specs": 2,
    "rounds": 3, "drafters": 3, "batching": 3,
    "completion": 4, "generate": 4, "speculative": 4, "vision": 4,
    "session_pool": 5, "chat": 5, "replicas": 5,
    "loading": 6, "sharded_loading": 6, "drafter_figures": 6, "drafter_choice": 6,
    "api": 7, "server": 7, "cli": 8, "recipe": 8, "testing": 8, "__init__": 9,
}


def _layer(dotted: str) -> int:
    head = dotted.split(".")[0]
    if head not in LAYERS:
        raise AssertionError(f"module {dotted!r} has no layer in LAYERS; give it one")
    return LAYERS[head]


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    prefix = "turbospark_jax."
    return [m[len(prefix):] for m in found if m.startswith(prefix)]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_from_a_higher_layer(path):
    rel = path.relative_to(PACKAGE).with_suffix("")
    own = _layer(".".join(rel.parts))
    upward = [m for m in _imports(path) if _layer(m) > own]
    assert not upward, f"{rel} (layer {own}) imports from higher layers: {upward}"


def test_control_an_upward_import_is_caught(tmp_path):
    """The check can fail: a protocols module importing the CLI is reported."""
    fake = tmp_path / "protocols.py"
    fake.write_text("from turbospark_jax.cli import main\n")
    assert [m for m in _imports(fake) if _layer(m) > LAYERS["protocols"]] == ["cli"]
