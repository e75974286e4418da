"""The benchmark command's tiny configuration runs on the CPU and writes well-formed results.
Nothing here looks at a timing: CI machines are shared and noisy."""

import json

import numpy as np
import pytest

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


def test_profile_train_rows_can_be_skewed_like_code():
    import numpy as np

    from benchmarks.profile_train import token_rows

    rng = np.random.default_rng(0)
    flat = token_rows(rng, (64, 129), 8192, "zipf").ravel()
    assert flat.min() >= 3 and flat.max() < 8192 and flat.dtype == np.int32
    uniform = token_rows(rng, (64, 129), 8192, "uniform").ravel()
    # the most common id covers far more of a zipf row than of a uniform one
    assert np.bincount(flat).max() > 20 * np.bincount(uniform).max()


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


def test_profile_idle_gaps_are_placed_after_the_event_they_follow():
    """The profile's idle accounting: gaps between events, charged to the event before them;
    an event that overlaps another (a second stream) leaves no gap."""
    from benchmarks.profile_decode import idle_gaps

    events = [("norm", 0, 10_000), ("MemcpyD2H", 30_000, 1_000), ("matvec", 100_000, 5_000),
              ("copy", 101_000, 1_000), ("attention", 106_000, 1_000)]
    idle = idle_gaps(events)
    assert idle["total_ns"] == 20_000 + 69_000 + 1_000
    assert idle["after"] == [("MemcpyD2H", (1, 69_000)), ("norm", (1, 20_000)),
                             ("matvec", (1, 1_000))]
    assert idle["sizes"] == {"<2us": 1, "2-10us": 0, "10-50us": 1, ">=50us": 1}
    assert idle["widest"] == [(69_000, "MemcpyD2H", "matvec"), (20_000, "norm", "MemcpyD2H"),
                              (1_000, "matvec", "attention")]
    assert idle_gaps([("a", 0, 5), ("b", 5, 5)])["total_ns"] == 0


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


def test_drafters_benchmark_measures_against_plain_and_writes_the_figures(tmp_path):
    """benchmarks/drafters.py on tiny random models: a target with a draft model and a block
    drafter beside it, prompts from a small corpus; the block drafter is measured greedy and
    sampled against plain decoding, greedy is checked equal to plain, and speculative.json is
    written from the greedy figures (which drafter_choice then reads). Only the block drafter
    runs: each drafter compiles its own rounds program (10-20 s on a 2-core CPU), and the
    benchmark drives every drafter through the same code."""
    import jax

    from benchmarks.drafters import main as drafters_main
    from turbospark_jax.io.loading import GenerationConfig, save_block_drafter, save_folder
    from turbospark_jax.io.tokenizer import Tokenizer
    from turbospark_jax.models import block_drafter as BD
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import init_params
    from turbospark_jax.speculative.choice import choose_drafter
    from turbospark_jax.testing.tokenizers import byte_level_bpe

    tok = byte_level_bpe()
    wrapper = Tokenizer.from_tokenizers(tok, bos="<|bos|>", eos="<|eos|>", pad="<|pad|>")
    config = DenseConfig(model_type="qwen3", vocab_size=tok.get_vocab_size(), hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    for name, seed in (("m", 0), ("m-draft", 1)):
        save_folder(tmp_path / name, config, init_params(config, jax.random.PRNGKey(seed)),
                    tokenizer=wrapper, generation_config=GenerationConfig(eos_token_ids=()))
    block = BD.BlockDrafterConfig(hidden_size=32, vocab_size=config.vocab_size, head_dim=8,
                                  target_layer_ids=(0, 1), target_num_hidden_layers=2,
                                  block_size=3)
    save_block_drafter(tmp_path / "m-block", block, BD.init_params(block, jax.random.PRNGKey(2)))
    (tmp_path / "m" / "README.md").write_text("# m\n\n## Reproduce\n\nsomehow\n")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"mod{i}.py").write_text(
            f'def f{i}(x, y):\n    """Add."""\n    return x + y * {i}\n')
    out = tmp_path / "out"
    assert drafters_main(["--target", str(tmp_path / "m"), "--out", str(out), "--preset",
                          "smoke", "--corpus-root", str(corpus), "--heldout-fraction", "0.5",
                          "--drafters", "block", "--write-speculative-json"]) == 0
    backend = jax.default_backend()
    data = json.loads((out / f"drafters_{backend}.json").read_text())
    assert len(data["meta"]["prompts"]) == 2
    assert all(p.startswith("def f") for p in data["meta"]["prompts"])
    assert data["meta"]["drafters"]["draft-model"] == str(tmp_path / "m-draft")  # found
    seen = {(r["drafter"], r["mode"]) for r in data["records"]}
    assert seen == {(d, m) for d in ("plain", "block") for m in ("greedy", "sampled")}
    for r in data["records"]:
        if r["drafter"] != "plain":
            assert len(r["acceptance_by_position"]) == r["draft_len"]
            assert r["mean_acceptance_length"] >= 1.0
            assert r.get("equal_to_plain", r["mode"] == "sampled") is True
    assert (out / f"drafters_{backend}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| block | greedy | 2 |" in (out / f"drafters_{backend}.md").read_text()
    figures = json.loads((tmp_path / "m" / "speculative.json").read_text())["measurements"]
    assert [(m["drafter"], m["draft_len"], m["backend"], m["lossless"]) for m in figures] == [
        ("block", 2, backend, True)]
    card = (tmp_path / "m" / "README.md").read_text()
    assert "## Speculative decoding on" in card and "| block | greedy | 2 |" in card
    assert card.index("## Speculative decoding") < card.index("## Reproduce")
    assert choose_drafter(tmp_path / "m", "block", backend).measured is not None


def test_assistant_oracle_benchmark_runs_and_is_lossless(tmp_path):
    """benchmarks/assistant_oracle.py at tiny shapes: a random Gemma 4 target and assistant,
    the assistant's proposals overruled by the oracle at alpha 0, 0.5 and 1. Every run equals
    plain greedy decoding on the device loop; alpha 1 keeps every proposal, alpha 0 none, and
    alpha 0.5 lands in between (no timing is read)."""
    from benchmarks.assistant_oracle import PRESETS
    from benchmarks.assistant_oracle import main as assistant_main

    preset = PRESETS["smoke"]
    assert assistant_main(["--preset", "smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "assistant_oracle.json").read_text())
    assert data["meta"]["jax"] and data["meta"]["device"] and data["meta"]["date"]
    assert data["meta"]["assistant"]["model_type"] == "gemma4_assistant"
    (plain,) = [r for r in data["records"] if r["workload"] == "plain"]
    assert plain["new_tokens"] == preset.new_tokens
    assert set(plain["t_draft_s"]) == set(plain["t_verify_s"]) == {
        str(k) for k in preset.draft_lens}
    spec = {(r["alpha"], r["draft_len"]): r for r in data["records"]
            if r["workload"] == "speculative"}
    assert set(spec) == {(a, k) for a in preset.alphas for k in preset.draft_lens}
    for (alpha, k), r in spec.items():
        assert r["equal_to_plain"] is True and r["on_device"] is True
        assert r["drafted"] > 0 and r["ideal_speedup"] > 0 and r["t_draft_s"] > 0
        if alpha == 1.0:
            assert r["accepted"] == r["drafted"]
            # every round but the last drafts k (the last may be cut short by the budget)
            assert r["mean_acceptance_length"] >= 1 + k * (r["rounds"] - 1) / r["rounds"]
        elif alpha == 0.0:
            assert r["accepted"] == 0 and r["mean_acceptance_length"] == 1.0
        else:
            assert 0 < r["accepted"] < r["drafted"]


def test_delta_rule_kernel_benchmark_compares_the_kernel_with_the_xla_loop(tmp_path):
    """The delta-rule kernel's benchmark runs on the CPU with the kernel interpreted, and the
    layer it measures agrees with the XLA row loop on every output leaf."""
    from benchmarks.delta_rule_kernel import main as kernel_main

    out = tmp_path / "kernel.json"
    records = kernel_main(["--shapes", "tiny", "--kernel", "interpret", "--width", "4",
                           "--repeats", "1", "--out", str(out)])
    assert [r["live"] for r in records] == [1, 4]
    assert json.loads(out.read_text()) == records
    for r in records:
        assert len(r["max_diff_leaves"]) == 5 and max(r["max_diff_leaves"]) < 1e-2


def test_rowinv_model_benchmark_checks_widths_and_times_both_modes(tmp_path):
    """The row-invariant model benchmark on the tiny shape: every width agrees bitwise with
    kernels="rowinv", XLA's kernels at two widths do not (its control), and the products and
    speeds come out as records (no timing is asserted)."""
    from benchmarks import rowinv_model

    assert rowinv_model.main(["--preset", "smoke", "--parts", "products,exact,speed,attention",
                              "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "rowinv_model.json").read_text())
    assert data["errors"] == [] and data["skipped"] == []
    exact = {r["kernels"]: r for r in data["records"] if r["part"] == "exact"}
    assert exact["rowinv"]["all_equal"] and len(exact["rowinv"]["agree"]) == 2
    assert exact["rowinv"]["burst_equals_steps"] and exact["rowinv"]["short_burst_equals_steps"]
    assert all(a["burst_logits"] for a in exact["rowinv"]["agree"])
    assert not exact["xla"]["all_equal"]
    speeds = [r for r in data["records"] if r["part"] == "speed"]
    assert {(r["kernels"], r["workload"]) for r in speeds} == {
        (k, w) for k in ("rowinv", "xla") for w in ("decode", "completion", "prefill")}
    assert all(r["tokens_per_s"] > 0 for r in speeds)
    products = [r for r in data["records"] if r["part"] == "products"]
    assert {r["product"] for r in products} == {"qkv", "o", "gate_up", "down", "head"}
    attention = [r for r in data["records"] if r["part"] == "attention"]
    assert len(attention) == len(rowinv_model.ATTENTION_TILES) + len(
        rowinv_model.DECODE_ATTENTION_TILES)
    assert sum(r["rows"] == 1 for r in attention) == len(rowinv_model.DECODE_ATTENTION_TILES)
    assert all(r["same_bits_as_default"] and r["ms"] > 0 for r in attention)


def test_rowinv_model_benchmark_filters_products_and_profiles_each_context(tmp_path):
    """``--products`` times only the products named (an unknown name is refused), and the
    profile part traces a burst after each of ``--profile-contexts`` in a cache that holds
    the longest."""
    from benchmarks import rowinv_model

    assert rowinv_model.main(["--preset", "smoke", "--parts", "products,profile", "--modes",
                              "rowinv", "--products", "gate_up,o", "--profile-contexts",
                              "16,40", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "rowinv_model.json").read_text())
    assert data["errors"] == [] and data["skipped"] == []
    products = [r for r in data["records"] if r["part"] == "products"]
    assert products and {r["product"] for r in products} == {"gate_up", "o"}
    profiles = [r for r in data["records"] if r["part"] == "profile"]
    assert sorted({r["context"] for r in profiles}) == [16, 40]
    assert all(r["capacity"] >= 40 for r in profiles)
    with pytest.raises(SystemExit):
        rowinv_model.main(["--preset", "smoke", "--parts", "products", "--products", "qkvo",
                           "--out", str(tmp_path)])


def test_rowinv_model_profile_refuses_a_trace_of_one_step_for_a_burst(tmp_path, monkeypatch):
    """A traced burst whose kernels hold fewer product launches a token than the shape has
    layers (what a trace of loop graphs records) is an error naming the cause; a whole one
    gets its products' rates."""
    from benchmarks import profile_decode, rowinv_model

    layers = rowinv_model.ALL_SHAPES["tiny"].num_hidden_layers
    traces = iter([{"all_kernels": {"rowinv_matvec_down": [layers / 8, 1.0]}},
                   {"all_kernels": {"rowinv_matvec_down": [layers, 8.0]}}])
    monkeypatch.setattr(profile_decode, "profile_burst", lambda *a, **k: next(traces))
    assert rowinv_model.main(["--preset", "smoke", "--parts", "profile", "--shapes", "tiny",
                              "--modes", "rowinv", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "rowinv_model.json").read_text())
    assert len(data["errors"]) == 1 and "did not record every step" in data["errors"][0]["error"]
    whole = [r for r in data["records"] if r["part"] == "profile" and "kernel_rates" in r]
    assert len(whole) == 1 and whole[0]["sampling"] == "sampled"


def test_rowinv_kernel_rates_read_the_labelled_products():
    from benchmarks.rowinv_model import ALL_SHAPES, kernel_rates

    shape = ALL_SHAPES["llama-3.2-1b"]
    rates = kernel_rates(shape, {"rowinv_matvec_head": [1.0, 125.0],
                                 "rowinv_matvec_gate_up": [16.0, 320.0],
                                 "row_rms_norm": [33.0, 40.0]})
    by = {r["kernel"]: r for r in rates}
    assert by["rowinv_matvec_head"]["weight_GBps"] == round(128256 * 2048 * 2 / 125e-6 / 1e9, 1)
    assert by["rowinv_matvec_gate_up"]["weight_GBps"] == round(
        2048 * 16384 * 2 * 16 / 320e-6 / 1e9, 1)
    assert "weight_GBps" not in by["row_rms_norm"]


def test_prefill_profile_sorts_kernels_into_groups_and_rates_the_products(monkeypatch):
    """The prefill profile's arithmetic on a made-up trace (a GPU writes the real one):
    our kernels and the libraries' by name, the span and busy time, the products' FLOP rate
    from the shape's weights and the rows."""
    from benchmarks import rowinv_model

    events = [("rowinv_matmul_qkv", 0, 4_000_000), ("nvjet_sm90_tst_128x256", 4_000_000, 2_000_000),
              ("cached_attention_folding", 6_000_000, 1_000_000),
              ("cudnn_flash_fprop", 7_000_000, 500_000), ("row_rms_norm__1", 8_000_000, 250_000),
              ("rope_store", 8_250_000, 250_000), ("loop_add_fusion", 9_000_000, 1_000_000)]
    monkeypatch.setattr(rowinv_model, "_device_events", lambda call: events)
    shape = rowinv_model.ALL_SHAPES["llama-3.2-1b"]
    out = rowinv_model.prefill_profile(None, 2048, shape.vocab_size, "exact", shape)
    assert out["groups_ms"] == {"attention": 1.5, "norms": 0.25, "other": 1.0, "products": 6.0,
                                "rope_store": 0.25}
    assert out["span_ms"] == 10.0 and out["busy_ms"] == 9.0
    layer = sum(k * sum(ns) for name, k, ns, _ in rowinv_model.products_of(shape)
                if name != "head")
    flop = 2 * layer * shape.num_hidden_layers * 2048 + 2 * shape.hidden_size * shape.vocab_size
    assert out["products_TFLOPs"] == round(flop / 6e-3 / 1e12, 1)
    assert out["top_kernels"][0] == {"kernel": "rowinv_matmul_qkv", "calls": 1, "ms": 4.0}
    assert out["idle_ms"] == 1.0 and out["widest_gaps"] == [
        {"us": 500.0, "after": "rope_store", "before": "loop_add_fusion"},
        {"us": 500.0, "after": "cudnn_flash_fprop", "before": "row_rms_norm__1"}]
    monkeypatch.setattr(rowinv_model, "_device_events", lambda call: [])
    assert rowinv_model.prefill_profile(None, 8, 100, "exact", shape) == {"events": 0}


@pytest.mark.parametrize("keys", ["100", "0"])
def test_rowinv_model_refuses_keys_per_split_off_the_key_tile(tmp_path, keys):
    from benchmarks import rowinv_model
    from turbospark_jax.kernels import attention as pallas_attention

    before = pallas_attention.KEYS_PER_SPLIT
    with pytest.raises(SystemExit):
        rowinv_model.main(["--preset", "smoke", "--parts", "exact", "--keys-per-split", keys,
                           "--out", str(tmp_path)])
    assert before == pallas_attention.KEYS_PER_SPLIT


def test_rowinv_model_refuses_a_key_tile_that_is_not_a_power_of_two(tmp_path):
    from benchmarks import rowinv_model
    from turbospark_jax.kernels import attention as pallas_attention

    before = pallas_attention.KEY_TILE
    with pytest.raises(SystemExit):
        rowinv_model.main(["--preset", "smoke", "--parts", "exact", "--key-tile", "100",
                           "--out", str(tmp_path)])
    assert before == pallas_attention.KEY_TILE


def test_decode_bound_splits_a_profile_and_carries_it_to_another_bandwidth(tmp_path):
    """The bound reader on a made-up profile of the tiny shape: products that take exactly
    their stream at the source rate, 30 us of other kernels and 10 us idle; at twice the
    bandwidth the streaming halves and the rest stays. A record without a copy rate in its
    file's meta is refused."""
    from benchmarks.decode_bound import bound, group_of, main, weight_bytes
    from benchmarks.run import SHAPES

    assert [group_of(n) for n in ("rowinv_matvec_qkv", "cached_attention_fold",
                                  "rope_store_attention_split", "row_rms_norm__1",
                                  "rope_store", "sort_6_1")] == [
        "products", "attention", "attention", "norms", "rope_store", "loop"]
    stream = weight_bytes(SHAPES["tiny"]) / 1e6  # us at 1,000 GB/s
    layers = SHAPES["tiny"].num_hidden_layers
    record = {"part": "profile", "kernels": "rowinv", "shape": "tiny", "context": 8,
              "sampling": "greedy", "wall_per_token_us": stream + 40.0,
              "all_kernels": {"rowinv_matvec_qkv": [layers, stream],
                              "row_rms_norm": [1.0, 20.0], "rope_store": [1.0, 10.0]}}
    row = bound(record, 1000.0, 2000.0, bar=("share", 0.5))
    assert row["products_share_of_copy_rate"] == 1.0 and row["idle_us"] == 10.0
    assert abs(row["beyond_stream_us"] - 40.0) < 0.1
    expect = 1e6 / (stream / 2 + 40.0)
    for reading in ("streaming_scales", "rates_scale"):
        assert abs(row["target_tokens_per_s"][reading] - expect) < 0.1
        assert row["target_tokens_per_s"][reading + "_no_idle"] > expect
    assert row["beyond_stream_allowed_us"] > 0
    assert bound(record, 1000.0, 2000.0, bar=("tokens_per_s", 1e6 / stream))[
        "beyond_stream_allowed_us"] == round(stream / 2, 1)
    with pytest.raises(ValueError, match="a bar is"):
        bound(record, 1000.0, 2000.0, bar=("percent", 50.0))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"meta": {"copy_bandwidth_GBps": 1000.0}, "records": [record]}))
    assert main([str(path), "--out", str(tmp_path / "bound.json")]) == 0
    assert json.loads((tmp_path / "bound.json").read_text())[0]["shape"] == "tiny"
    path.write_text(json.dumps({"meta": {}, "records": [record]}))
    with pytest.raises(SystemExit, match="copy_bandwidth_GBps"):
        main([str(path)])
    # a trace of one step for a whole burst (loop graphs on): fewer product launches a token
    # than layers, refused by name; the file's other records still read
    partial = {**record, "all_kernels": {"rowinv_matvec_qkv": [layers / 8, stream / 8]}}
    with pytest.raises(ValueError, match="did not record every step"):
        bound(partial, 1000.0, 2000.0)
    path.write_text(json.dumps({"meta": {"copy_bandwidth_GBps": 1000.0},
                                "records": [partial, record]}))
    assert main([str(path), "--out", str(tmp_path / "bound.json")]) == 1
    assert len(json.loads((tmp_path / "bound.json").read_text())) == 1


def test_decode_bound_fits_the_products_fixed_cost_and_rate():
    """The products' line on a made-up profile of the 1B shape whose kernels take exactly
    3 us plus their bytes at 4 TB/s: the fit gives both back, and their sum over the calls a
    token; the head is left out of the fit; a profile whose products do not rise with their
    bytes, or with one product kernel, gives none."""
    from benchmarks.decode_bound import product_line
    from benchmarks.rowinv_model import products_of
    from benchmarks.run import SHAPES

    shape = SHAPES["llama-3.2-1b"]
    layers = shape.num_hidden_layers
    kernels = {}
    for name, k, ns, _ in products_of(shape):
        us = 3.0 + k * sum(ns) * 2 / 4e6
        calls = 1 if name == "head" else layers
        kernels[f"rowinv_matvec_{name}"] = [calls, us * calls * (3 if name == "head" else 1)]
    kernels["row_rms_norm__1"] = [2 * layers, 70.0]
    line = product_line({"all_kernels": kernels}, shape)
    assert line == {"us_per_kernel": 3.0, "stream_TBps": 4.0,
                    "fixed_us_per_token": round(3.0 * 4 * layers, 1)}
    flat = {k: [v[0], 5.0 * v[0]] for k, v in kernels.items()}
    assert product_line({"all_kernels": flat}, shape) is None
    one = {"rowinv_matvec_o": kernels["rowinv_matvec_o"]}
    assert product_line({"all_kernels": one}, shape) is None


def test_call_overhead_splits_a_call_into_its_phases(monkeypatch):
    """``benchmarks/call_overhead.py`` on the tiny shape: a per-call cost and a per-step cost
    fitted over the burst lengths, and each length's phases (checks, dispatch, wait, rest)
    adding up to the call's whole time; the same fit over chained bursts."""
    from benchmarks import call_overhead

    monkeypatch.setattr(call_overhead, "LENGTHS", (2, 8))
    monkeypatch.setattr(call_overhead, "REPEATS", 3)
    rec = call_overhead.measure("tiny", "rowinv", capacity=256)
    # (timings, not asserted: a shared CI machine's clock is noisy; the fit is made)
    assert np.isfinite(rec["per_call_ms"]) and set(rec["phases_ms"]) == {2, 8}
    for phases in rec["phases_ms"].values():
        parts = phases["checks"] + phases["dispatch"] + phases["wait"] + phases["rest"]
        assert abs(parts - phases["total"]) < 1e-2
        assert min(phases[k] for k in ("checks", "dispatch", "wait")) > 0
    # and the chained bursts' fit (each burst queued before the one before is read)
    assert np.isfinite(rec["chained_per_call_ms"]) and set(rec["chained_burst_ms"]) == {2, 8}
    assert min(rec["chained_burst_ms"].values()) > 0


def test_compare_speed_puts_runs_side_by_side(tmp_path):
    """``benchmarks/compare_speed.py``: a row a (shape, kernels, workload, context), a column
    a file, the change against the first file in percent; a missing file or a wrong count
    of names is refused."""
    from benchmarks import compare_speed

    def run(path, greedy, sampled):
        recs = [{"part": "speed", "shape": "s", "kernels": "rowinv", "workload": "completion",
                 "context": 128, "sampling": kind, "tokens_per_s": rate}
                for kind, rate in (("greedy", greedy), ("sampled", sampled))]
        recs.append({"part": "exact", "shape": "s"})  # not a speed record: left out
        path.write_text(json.dumps({"records": recs}))
        return path

    a, b = run(tmp_path / "a.json", 100.0, 90.0), run(tmp_path / "b.json", 110.0, 90.0)
    text = compare_speed.table([a, b], ["base", "new"])
    lines = text.splitlines()
    assert lines[0] == "| shape, kernels, workload, context | base | new |"
    assert lines[2] == ("| s, rowinv, completion, 128 | 100.0 / 90.0 | "
                        "110.0 (+10.0%) / 90.0 (+0.0%) |")
    assert len(lines) == 3  # the exact part's record made no row
    with pytest.raises(SystemExit):
        compare_speed.main([str(a), str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit):
        compare_speed.main([str(a), str(b), "--names", "one"])


def test_loop_graphs_probe_runs_every_case_and_its_check_can_fail(tmp_path):
    """On the CPU the recorded-loop option changes nothing, so every case agrees; the
    comparison sees a one-ulp change (the control)."""
    import json

    import numpy as np

    from benchmarks import probe_loop_graphs

    out = tmp_path / "probe.json"
    assert probe_loop_graphs.main(["--out", str(out), "--seeds", "1"]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["case"] for r in records} == {"cond_sort", "cond_top_k", "cond_draw",
                                            "cond_sampling", "nested_cond_sort",
                                            "cond_no_sort"}
    assert all(r["differing"] == 0 for r in records)
    a = (np.int32(3), np.float32(1.5))
    assert probe_loop_graphs.same_bits(a, (np.int32(3), np.float32(1.5)))
    assert not probe_loop_graphs.same_bits(a, (np.int32(3), np.nextafter(np.float32(1.5),
                                                                          np.float32(2))))
