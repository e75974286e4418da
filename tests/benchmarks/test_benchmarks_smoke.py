"""The benchmark suites' smoke preset runs on the CPU and writes well-formed results, and the
report is built from them. Nothing here looks at a timing: CI machines are shared and noisy.

The suites that compile programs of their own run here (decode, prefill, kernels, train,
serve); the speculative suite compiles a round program per drafter, so its writer and table
are checked on made-up cases instead."""

import json

import pytest

from benchmarks.__main__ import main
from benchmarks.report import write_report

RUN = ("decode", "prefill", "kernels", "train", "serve")
META = ("device_kind", "backend", "jax", "jaxlib", "date", "command", "preset", "settings")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    assert main(["--suite", ",".join(RUN), "--preset", "smoke", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("suite", RUN)
def test_each_suite_writes_a_well_formed_file(smoke, suite):
    data = json.loads((smoke / f"{suite}_smoke.json").read_text())
    assert data["suite"] == suite and data["preset"] == "smoke"
    assert all(data["meta"][key] for key in META)
    assert data["meta"]["command"].startswith("python -m benchmarks --suite")
    assert data["errors"] == [] and data["skipped"] == []
    assert data["cases"]
    for case in data["cases"]:
        figures = [v for k, v in case.items()
                   if k.endswith(("tokens_per_s", "us", "step_s")) and not isinstance(v, list)]
        assert figures and all(isinstance(v, int | float) and v > 0 for v in figures), case


def test_the_cases_cover_each_suite(smoke):
    def cases(suite):
        return json.loads((smoke / f"{suite}_smoke.json").read_text())["cases"]

    assert {c["sampling"] for c in cases("decode")} == {"greedy", "sampled"}
    assert all(c["fraction_of_roofline"] > 0 and c["step_bytes"] > 0 for c in cases("decode"))
    assert all(c["exact_tokens_per_s"] > 0 and c["parallel_tokens_per_s"] > 0
               for c in cases("prefill"))
    assert {c["kernel"] for c in cases("kernels")} == {"matvec", "norm", "attention",
                                                        "delta_rule"}
    assert [c["concurrency"] for c in cases("serve")] == [1, 2]
    assert all(c["tokens"] == 4 * c["concurrency"] for c in cases("serve"))


def test_the_report_is_built_from_the_files(smoke):
    text = (smoke / "REPORT.md").read_text()
    for title in ("## Decode", "## Prefill", "## Kernels", "## Training step", "## Serving"):
        assert title in text
    assert "| tiny | True | 1 | 16 | greedy |" in text
    for png in ("decode_smoke.png", "serve_smoke.png"):
        assert (smoke / png).read_bytes()[:8] == PNG
    assert "interpreter" in text  # the kernels' times on a CPU say whose they are


def test_an_unknown_suite_or_shape_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--suite", "decode,nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["--suite", "decode", "--shapes", "tiny,nope", "--out", str(tmp_path)])


def test_a_run_of_some_shapes_keeps_the_other_shapes_cases(tmp_path):
    """A preset run in parts: the second part replaces its shape's entries and keeps the
    first part's other shapes; entries of no shape are the part's to measure again."""
    from benchmarks.common import Results
    from benchmarks.decode import PRESETS

    first = Results("decode", "smoke", PRESETS["smoke"], tmp_path, "one")
    for shape in ("a", "b"):
        first.add({"shape": shape, "tokens_per_s": 1.0})
    first.data["errors"].append({"shape": "b", "error": "old"})
    first.data["skipped"].append({"reason": "no shape"})
    first.write()
    second = Results("decode", "smoke", PRESETS["smoke"], tmp_path, "two", only_shapes=("b",))
    assert second.cases == [{"shape": "a", "tokens_per_s": 1.0}]
    assert second.data["errors"] == second.data["skipped"] == []
    assert second.data["meta"]["earlier_commands"] == ["one"]
    assert json.loads(first.path.read_text())["cases"] == second.cases


def _speculative_file(folder):
    meta = {"device_kind": "cpu", "backend": "cpu", "jax": "0", "jaxlib": "0",
            "date": "2026-01-02T00:00:00", "preset": "cpu", "command": "python -m benchmarks x",
            "settings": {"tokens": 8}, "prompts": ["def f():"]}
    spec = {"acceptance_by_position": [0.5, 0.25], "mean_acceptance_length": 1.75,
            "acceptance_rate": 0.375, "width": 3, "tokens_per_s": 12.0}
    cases = [{"drafter": "plain", "mode": "greedy", "draft_len": 0, "width": 1,
              "tokens_per_s": 10.0},
             {**spec, "drafter": "ngram", "mode": "greedy", "draft_len": 2, "speedup": 1.2,
              "equal_to_plain": True},
             {**spec, "drafter": "ngram", "mode": "greedy", "draft_len": 4, "speedup": 0.9,
              "equal_to_plain": True},
             {**spec, "drafter": "ngram", "mode": "sampled", "draft_len": 2, "speedup": 1.1},
             {**spec, "drafter": "mtp", "mode": "greedy", "draft_len": 2, "speedup": 1.5,
              "equal_to_plain": False}]
    data = {"suite": "speculative", "preset": "cpu", "meta": meta, "cases": cases,
            "errors": [], "skipped": [{"drafter": "block", "reason": "out of time"}]}
    (folder / "speculative_cpu.json").write_text(json.dumps(data))
    return data


def test_speculative_figures_are_written_for_auto_to_read(tmp_path):
    """Each drafter's fastest greedy draft length goes to the model's speculative.json with the
    sampled speed-up at that length; a drafter whose greedy output differed is marked lossy
    (and ``auto`` never picks it). The report shows the table and the skipped case."""
    from benchmarks.speculative import write_speculative_json
    from turbospark_jax.speculative.figures import read_figures

    data = _speculative_file(tmp_path)
    model = tmp_path / "m"
    model.mkdir()
    write_speculative_json(model, data)
    figures = {m.drafter: m for m in read_figures(model).measurements}
    assert set(figures) == {"ngram", "mtp"}
    ngram = figures["ngram"]
    assert (ngram.draft_len, ngram.speedup, ngram.sampled_speedup, ngram.lossless) == (
        2, 1.2, 1.1, True)
    assert ngram.backend == "cpu" and ngram.command == "python -m benchmarks x"
    assert figures["mtp"].lossless is False
    text = write_report(tmp_path).read_text()
    assert "| ngram | greedy | 2 | 3 | 1.75 | 0.38 | 0.50 0.25 | 12.0 | 1.20x | yes |" in text
    assert "| mtp | greedy | 2 |" in text and "**NO**" in text
    assert "skipped: drafter block: out of time" in text
    assert (tmp_path / "speculative_cpu.png").read_bytes()[:8] == PNG
