"""The benchmark command's tiny configuration runs on the CPU and writes well-formed results.
Nothing here looks at a timing: CI machines are shared and noisy."""

import json

from benchmarks.run import main


def test_smoke_preset_writes_results(tmp_path):
    assert main(["--preset", "smoke", "--out", str(tmp_path)]) == 0
    for part in ("ours", "hf", "exact"):
        data = json.loads((tmp_path / f"{part}.json").read_text())
        assert data["meta"]["jax"] and data["records"]
        for record in data["records"]:
            assert record["part"] == part and record["shape"] == "tiny"
    exact = json.loads((tmp_path / "exact.json").read_text())["records"]
    assert all(r.get("logits_equal") for r in exact)
    workloads = {r["workload"] for r in json.loads((tmp_path / "ours.json").read_text())["records"]}
    assert {"decode", "prefill", "width_sweep_decode", "width_sweep_prefill"} <= workloads
    table = (tmp_path / "results.md").read_text()
    assert "## Decode" in table and "| tiny |" in table
    assert (tmp_path / "decode_vs_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_probe_runs_and_records(tmp_path):
    """The decode profiler runs on the CPU (where the trace has no GPU streams, which it
    reports instead of failing) and appends one record per width."""
    from benchmarks.profile_decode import main as profile_main

    args = ["--shape", "tiny", "--widths", "1,4", "--context", "16", "--tokens", "4",
            "--burst", "4", "--out", str(tmp_path)]
    assert profile_main(args) == 0
    rows = json.loads((tmp_path / "profile_tiny.json").read_text())
    assert [r["width"] for r in rows] == [1, 4]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["roofline_tokens_per_s"] > 0
        assert "error" in row["profile"] or row["profile"]["kernels_per_token"] > 0


def test_family_figures_harness_runs(tmp_path):
    """The Qwen3.5 / Gemma 4 figures harness runs on the CPU at tiny shapes (no timing read)."""
    from benchmarks.families import main as families_main

    # One family here (the run takes ~15 s a family on a 2-core CPU); both run the same code.
    assert families_main(["--preset", "smoke", "--no-hf", "--shapes", "qwen3.5-tiny", "--out",
                          str(tmp_path)]) == 0
    records = json.loads((tmp_path / "families.json").read_text())["records"]
    by_kind = {(r.get("shape"), r["workload"]) for r in records}
    for shape in ("qwen3.5-tiny",):
        assert {(shape, "decode"), (shape, "prefill"), (shape, "verify")} <= by_kind
    decode = [r for r in records if r["workload"] == "decode"]
    assert all(r["step_bytes"] > 0 and r["fraction_of_roofline"] > 0 for r in decode)
