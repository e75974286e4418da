"""The wheel holds every package of the source tree: ``pyproject.toml`` lists its packages by
name, and a package left off that list works in an editable install and is missing from a
plain ``pip install .`` (a new user's first command)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _source_packages(top: str) -> set[str]:
    return {".".join(p.parent.relative_to(ROOT).parts)
            for p in (ROOT / top).rglob("__init__.py")}


def test_every_package_is_listed_for_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    for top in ("turbospark_jax", "turbospark_recipe"):
        missing = _source_packages(top) - listed
        assert not missing, f"pyproject.toml's packages miss {sorted(missing)}"


def test_control_a_missing_package_is_named():
    listed = {"turbospark_jax"}
    assert "turbospark_jax.quant" in _source_packages("turbospark_jax") - listed
