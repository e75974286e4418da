"""The wheel holds every package of the source tree: ``pyproject.toml`` lists its packages by
name, and a package left off that list works in an editable install and is missing from a
plain ``pip install .`` (a new user's first command)."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

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


# -- Other platforms' wheels -------------------------------------------------------------
#
# pip resolves the runtime dependencies for a machine other than this one (``--platform``,
# binary wheels only, nothing downloaded beyond metadata) and reports what it would install.
# Each dependency is resolved on its own (``--no-deps``, which keeps the check to seconds);
# the picked wheels are then checked against each other's requirements, which catches a
# platform whose newest wheel of one package (jaxlib, say) is older than another package
# (jax) accepts. The checks need the package index: without it they skip, and a made-up name
# must fail, so an index that answers nothing cannot pass them.

#: The jax releases the project is verified on (pyproject.toml's comment on ``jax``).
VERIFIED_JAX = SpecifierSet(">=0.10,<0.13")
MAC = ("macosx_14_0_arm64",)
LINUX_ARM = ("manylinux2014_aarch64",
             *(f"manylinux_2_{minor}_aarch64" for minor in range(17, 29)))
#: The only wheel of the Metal plugin's jax-0.10 release is for CPython 3.13 on macOS 26.
METAL_MAC = ("macosx_26_0_arm64",)


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _runtime_requirements() -> list[Requirement]:
    reqs = [Requirement(r) for r in _project()["dependencies"]]
    jax = next(r for r in reqs if r.name == "jax")
    # jax's compiled half is what needs a platform's wheel: ask for it by name
    return [*reqs, Requirement(f"jaxlib{jax.specifier}")]


def _target_env(platforms: tuple[str, ...], python: str) -> dict[str, str]:
    mac = platforms[0].startswith("macosx")
    return {"sys_platform": "darwin" if mac else "linux",
            "platform_system": "Darwin" if mac else "Linux",
            "platform_machine": "arm64" if mac else "aarch64",
            "os_name": "posix", "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "python_version": python, "python_full_version": f"{python}.0", "extra": ""}


def _resolve(requirements: list[str], platforms: tuple[str, ...], python: str,
             tmp_path: Path, deps: bool = False) -> tuple[int, str, list[dict]]:
    """pip's dry-run install for a platform: (exit status, its output, the report's items)."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
           "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
           "--target", str(tmp_path / "target"), "--report", str(report),
           "--timeout", "15", "--retries", "1", "--disable-pip-version-check",
           *(a for p in platforms for a in ("--platform", p)),
           *([] if deps else ["--no-deps"]), *requirements]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    items = json.loads(report.read_text())["install"] if report.exists() else []
    return done.returncode, done.stdout + done.stderr, items


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """Skips the module's resolution tests where the package index cannot be reached."""
    tmp = tmp_path_factory.mktemp("index")
    rc, out, _ = _resolve(["numpy"], MAC, "3.12", tmp)
    if rc != 0:
        pytest.skip("the package index is not reachable (pip could not resolve numpy for "
                    f"macOS arm64): {out.strip().splitlines()[-1:]}")


def _mismatches(items: list[dict], env: dict[str, str]) -> list[str]:
    """Each picked wheel's requirement on another picked wheel that its version fails."""
    picked = {canonicalize_name(i["metadata"]["name"]): Version(i["metadata"]["version"])
              for i in items}
    bad = []
    for item in items:
        for text in item["metadata"].get("requires_dist", []):
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if name not in picked or (req.marker is not None and not req.marker.evaluate(env)):
                continue
            if not req.specifier.contains(picked[name], prereleases=True):
                bad.append(f"{item['metadata']['name']} needs {text}; picked {picked[name]}")
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("platforms,python", [(MAC, "3.12"), (MAC, "3.11"), (LINUX_ARM, "3.12")],
                         ids=["macos-arm64-cp312", "macos-arm64-cp311", "linux-aarch64-cp312"])
def test_every_runtime_dependency_has_a_wheel(index, platforms, python, tmp_path):
    reqs = _runtime_requirements()
    rc, out, items = _resolve([str(r) for r in reqs], platforms, python, tmp_path)
    assert rc == 0, f"no wheels for {platforms[0]}, CPython {python}:\n{out[-2000:]}"
    picked = {canonicalize_name(i["metadata"]["name"]): i for i in items}
    assert set(picked) == {canonicalize_name(r.name) for r in reqs}
    for item in items:  # a wheel built for the platform or for any, never a source build
        url = item["download_info"]["url"]
        assert url.endswith(".whl"), url
        tag = url.rsplit("-", 1)[-1]
        system = "macosx" if platforms[0].startswith("macosx") else "manylinux"
        machine = platforms[0].rsplit("_", 1)[-1]
        assert tag == "any.whl" or (system in tag and (machine in tag or "universal2" in tag)), url
    assert VERIFIED_JAX.contains(picked["jax"]["metadata"]["version"])
    assert not _mismatches(items, _target_env(platforms, python))


def test_control_a_made_up_name_does_not_resolve(index, tmp_path):
    rc, out, _ = _resolve(["tsj-no-such-package-b41f7c"], MAC, "3.12", tmp_path)
    assert rc != 0 and "No matching distribution" in out


def test_control_an_older_jaxlib_beside_jax_is_a_mismatch():
    items = [{"metadata": {"name": "jax", "version": "0.10.2",
                           "requires_dist": ["jaxlib<=0.10.2,>=0.10.2"]}},
             {"metadata": {"name": "jaxlib", "version": "0.7.1"}}]
    assert _mismatches(items, _target_env(MAC, "3.12")) == [
        "jax needs jaxlib<=0.10.2,>=0.10.2; picked 0.7.1"]


def _metal_requirement() -> Requirement:
    (req,) = (Requirement(r) for r in _project()["optional-dependencies"]["metal"])
    return req


def test_the_metal_extra_applies_only_to_apple_silicon():
    req = _metal_requirement()
    assert req.marker.evaluate(_target_env(MAC, "3.13"))
    assert not req.marker.evaluate(_target_env(LINUX_ARM, "3.13"))
    assert not req.marker.evaluate({**_target_env(MAC, "3.13"), "platform_machine": "x86_64"})


@pytest.mark.slow
def test_the_metal_extra_resolves_beside_our_jax(index, tmp_path):
    metal = _metal_requirement()
    jax = next(Requirement(r) for r in _project()["dependencies"]
               if Requirement(r).name == "jax")
    plugin = f"{metal.name}{metal.specifier}"
    rc, out, items = _resolve([plugin, str(jax)], METAL_MAC, "3.13", tmp_path, deps=True)
    assert rc == 0, f"the metal extra does not resolve beside {jax}:\n{out[-2000:]}"
    picked = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
              for i in items}
    assert VERIFIED_JAX.contains(picked["jax"]) and picked["jaxlib"] == picked["jax"]
    # control: the plugin's jax-0.9 releases cannot sit beside the jax we verify on
    rc, out, _ = _resolve([f"{metal.name}<0.10", f"jax{VERIFIED_JAX}"], METAL_MAC, "3.13",
                          tmp_path, deps=True)
    assert rc != 0 and "conflicting dependencies" in out, out[-2000:]
