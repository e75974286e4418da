"""The structured-output suite: its smoke preset runs on the CPU, every finished output it
records validates, the speed case measures both paths, and the report shows them. Nothing
here looks at a timing beyond its being positive."""

import json

import pytest

from benchmarks import structured
from benchmarks.__main__ import main
from benchmarks.common import Results


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("structured")
    assert main(["--suite", "structured", "--preset", "smoke", "--out", str(out)]) == 0
    return out


def test_the_smoke_file_is_well_formed(smoke):
    data = json.loads((smoke / "structured_smoke.json").read_text())
    assert data["suite"] == "structured" and data["preset"] == "smoke"
    assert data["meta"]["command"].startswith("python -m benchmarks --suite structured")
    assert data["meta"]["schemas"] == {"source": "local", "count": 3}
    assert data["errors"] == [] and data["skipped"] == []
    runs = [c for c in data["cases"] if c["kind"] == "run"]
    summary = [c for c in data["cases"] if c["kind"] == "validity"]
    speed = [c for c in data["cases"] if c["kind"] == "speed"]
    assert {(r["schema"], r["mode"]) for r in runs} == {
        (name, mode) for name in list(structured.LOCAL_SCHEMAS)[:3]
        for mode in ("greedy", "sampled")}
    assert all(r["valid"] is True for r in runs if r["valid"] is not None)
    [s] = summary
    assert (s["schemas"], s["compiled"], s["refused"], s["runs"]) == (3, 3, 0, 6)
    assert s["finished"] == s["valid"] == sum(r["valid"] is not None for r in runs)
    assert s["compile_ms_p50"] > 0
    [c] = speed
    assert c["model"] == "tiny" and c["generated"] == c["plain_generated"] == 8
    assert c["plain_tokens_per_s"] > 0 and c["constrained_tokens_per_s"] > 0
    assert isinstance(c["meets_bar"], bool)
    [server] = [c for c in data["cases"] if c["kind"] == "server"]
    assert server["streams"] == 2 and server["plain_tokens"] > 0
    assert server["half_constrained_tokens"] > 0 and server["ratio"] > 0
    assert isinstance(server["meets_bar"], bool)


def test_the_report_shows_the_suite(smoke):
    text = (smoke / "REPORT.md").read_text()
    assert "## Structured output" in text
    assert "| 3 | 0 | 3 |" in text
    assert "| tiny | 1 | 8 |" in text


def test_without_the_bench_folder_the_local_set_runs_and_says_so(tmp_path, monkeypatch):
    """The bench preset falls back to the local schemas with a note; with a folder it reads an
    even sample of each source folder and leaves out a file that is not JSON."""
    preset = structured.PRESETS["cpu"]
    monkeypatch.delenv(structured.BENCH_ENV, raising=False)
    results = Results("structured", "cpu", preset, tmp_path, "x")
    assert structured.schema_set(preset, results) == structured.LOCAL_SCHEMAS
    assert results.data["skipped"][0]["schemas"] == "bench"
    for source in ("a", "b"):
        (tmp_path / "data" / source).mkdir(parents=True)
        for i in range(20):
            (tmp_path / "data" / source / f"s{i:02d}.json").write_text(
                "not json" if (source, i) == ("b", 0) else json.dumps({"type": "integer"}))
    monkeypatch.setenv(structured.BENCH_ENV, str(tmp_path / "data"))
    results = Results("structured", "cpu", preset, tmp_path, "x")
    schemas = structured.schema_set(preset, results)
    assert sorted(schemas)[:3] == ["a/s00", "a/s02", "a/s04"]
    assert len(schemas) == 2 * 8 - 1 and "b/s00" not in schemas
    assert results.data["skipped"] == []
