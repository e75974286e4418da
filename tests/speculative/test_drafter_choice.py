"""Which drafter a model has and which one ``auto`` picks (``drafter_choice``), the
``speculative.json`` format (``drafter_figures``), and the Python API's ``drafter=``.

Selection reads ``config.json`` files only, so most folders here hold nothing else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.models.block_drafter import BlockDrafterConfig
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.gemma4.config import Gemma4Config
from turbospark_jax.models.qwen3_5.config import Qwen35Config
from turbospark_jax.speculative.choice import (
    FALLBACK_ORDER,
    available_drafters,
    choose_drafter,
    requested_drafter,
)
from turbospark_jax.speculative.figures import (
    SPECULATIVE_FILE,
    Measurement,
    read_figures,
    write_figures,
)

VOCAB = 64
DENSE = DenseConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8).to_hf_dict()
QWEN35_MTP = Qwen35Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                          mtp_num_hidden_layers=1).to_hf_dict()
GEMMA4 = Gemma4Config(vocab_size=VOCAB).to_hf_dict()
BLOCK = {**BlockDrafterConfig(hidden_size=32, vocab_size=VOCAB, target_layer_ids=(0, 1),
                              target_num_hidden_layers=2, block_size=4).to_hf_dict()}
ASSISTANT = {"model_type": "gemma4_assistant", "backbone_hidden_size": GEMMA4["hidden_size"]}


def _folder(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _entry(drafter: str, backend: str, speedup: float, draft_len: int = 3,
           **extra: Any) -> dict[str, Any]:
    return {"drafter": drafter, "backend": backend, "draft_len": draft_len, "speedup": speedup,
            "mean_acceptance_length": 2.0, "acceptance_rate": 0.5,
            "command": "python -m benchmarks.drafters --target m --out o", **extra}


def _figures(target: Path, *entries: dict[str, Any], **extra: Any) -> None:
    (target / SPECULATIVE_FILE).write_text(
        json.dumps({"format": 1, "measurements": list(entries), **extra}))


# Each case: target config, sibling folders {suffix: config}, speculative.json entries,
# then what auto picks on the CPU and on the GPU, and the draft length on the CPU.
CASES = {
    "nothing beside it": (DENSE, {}, None, "ngram", "ngram", 4),
    "a draft model beside it": (DENSE, {"-draft": DENSE}, None, "draft-model", "ngram", 4),
    "a block drafter too": (DENSE, {"-draft": DENSE, "-block": BLOCK}, None, "block", "block", 3),
    "an MTP head": (QWEN35_MTP, {"-draft": QWEN35_MTP}, None, "mtp", "mtp", 4),
    "a Gemma 4 assistant": (GEMMA4, {"-assistant": ASSISTANT}, None, "assistant", "assistant",
                            4),
    "a draft model of another vocabulary": (
        DENSE, {"-draft": {**DENSE, "vocab_size": VOCAB + 1}}, None, "ngram", "ngram", 4),
    "figures pick per backend": (
        DENSE, {"-draft": DENSE, "-block": BLOCK},
        [_entry("draft-model", "cpu", 1.3), _entry("ngram", "cpu", 1.5, 2),
         _entry("draft-model", "gpu", 2.0)], "ngram", "draft-model", 2),
    "a measured drafter beats an unmeasured one": (
        DENSE, {"-block": BLOCK}, [_entry("ngram", "cpu", 1.1, 5)], "ngram", "block", 5),
    "figures of a missing drafter are ignored": (
        DENSE, {}, [_entry("block", "cpu", 3.0), _entry("draft-model", "cpu", 2.0)],
        "ngram", "ngram", 4),
    "a drafter measured not lossless is never picked there": (
        DENSE, {"-draft": DENSE, "-block": BLOCK},
        [_entry("block", "gpu", 3.0, lossless=False), _entry("ngram", "gpu", 1.5, 4,
                                                             lossless=True)],
        "block", "ngram", 3),
    "nor by the fallback": (
        DENSE, {"-draft": DENSE, "-block": BLOCK}, [_entry("block", "gpu", 3.0, lossless=False)],
        "block", "ngram", 3),
    "the best of one drafter's draft lengths": (
        DENSE, {"-draft": DENSE}, [_entry("draft-model", "cpu", 1.2, 2),
                                   _entry("draft-model", "cpu", 1.4, 6)],
        "draft-model", "ngram", 6),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_auto_picks_per_the_table(tmp_path: Path, case: str) -> None:
    config, siblings, entries, on_cpu, on_gpu, cpu_len = CASES[case]
    target = _folder(tmp_path / "m", config)
    for suffix, sibling in siblings.items():
        _folder(tmp_path / f"m{suffix}", sibling)
    if entries is not None:
        _figures(target, *entries)
    cpu = choose_drafter(target, "auto", "cpu")
    assert (cpu.drafter, cpu.draft_len) == (on_cpu, cpu_len), cpu.why
    assert choose_drafter(target, "auto", "gpu").drafter == on_gpu
    assert cpu.why.startswith(f"auto picked {on_cpu}")
    assert ("the best measured" in cpu.why) == (cpu.measured is not None)
    if cpu.measured is None:
        assert "fallback order" in cpu.why


def test_why_names_the_figures_and_what_is_missing(tmp_path: Path) -> None:
    target = _folder(tmp_path / "m", DENSE)
    _figures(target, _entry("ngram", "cpu", 0.8))
    choice = choose_drafter(target, "auto", "cpu")
    assert "0.80x" in choice.why and "benchmarks.drafters" in choice.why
    assert "slower than plain" in choice.why
    assert "block: no folder" in choice.why and "mtp: not a Qwen3.5" in choice.why
    gpu = choose_drafter(target, "auto", "gpu")
    assert "has no figures for gpu" in gpu.why
    assert ", ".join(FALLBACK_ORDER["gpu"]) in gpu.why


def test_auto_decodes_sampled_requests_plainly_when_sampling_measured_slower(
        tmp_path: Path) -> None:
    """A drafter auto picks whose sampled figure on the backend is under 1x says that sampled
    requests decode without it; one at or over 1x, one with no sampled figure, and one asked
    for by name draft (the controls)."""
    target = _folder(tmp_path / "m", DENSE)
    _folder(tmp_path / "m-draft", DENSE)
    _figures(target, _entry("draft-model", "cpu", 1.3, 2, sampled_speedup=0.78),
             _entry("draft-model", "gpu", 1.3, 2, sampled_speedup=1.0))
    cpu = choose_drafter(target, "auto", "cpu")
    assert cpu.auto and cpu.plain_when_sampling is not None
    assert "0.78x plain sampled decoding" in cpu.plain_when_sampling
    assert cpu.plain_when_sampling in cpu.why
    assert choose_drafter(target, "auto", "gpu").plain_when_sampling is None
    named = choose_drafter(target, "draft-model", "cpu")
    assert not named.auto and named.plain_when_sampling is None
    _figures(target, _entry("draft-model", "cpu", 1.3, 2))
    assert choose_drafter(target, "auto", "cpu").plain_when_sampling is None
    fallback = choose_drafter(_folder(tmp_path / "n", DENSE), "auto", "cpu")
    assert fallback.auto and fallback.plain_when_sampling is None


def test_a_drafter_measured_not_lossless_warns_when_asked_for(tmp_path: Path) -> None:
    target = _folder(tmp_path / "m", DENSE)
    _folder(tmp_path / "m-block", BLOCK)
    _figures(target, _entry("block", "gpu", 3.0, lossless=False))
    asked = choose_drafter(target, "block", "gpu")
    assert asked.drafter == "block" and asked.warning is not None
    assert "differed from plain greedy decoding on gpu" in asked.warning
    assert asked.warning in asked.why
    assert choose_drafter(target, "block", "cpu").warning is None
    auto = choose_drafter(target, "auto", "gpu")
    assert auto.drafter == "ngram" and "block: measured not lossless on gpu" in auto.why


def test_speculative_json_may_name_the_folders(tmp_path: Path) -> None:
    target = _folder(tmp_path / "m", DENSE)
    _folder(tmp_path / "elsewhere" / "small", DENSE)
    _figures(target, folders={"draft-model": "../elsewhere/small"})
    table, _ = available_drafters(target)
    assert table["draft-model"].available
    assert table["draft-model"].folder == (tmp_path / "elsewhere" / "small").resolve()
    # a folder the caller names takes its place
    _folder(tmp_path / "mine", DENSE)
    table, _ = available_drafters(target, {"draft-model": tmp_path / "mine"})
    assert table["draft-model"].folder == tmp_path / "mine"


@pytest.mark.parametrize("asked,config,needle", [
    ("mtp", DENSE, "not a Qwen3.5"),
    ("mtp", {**QWEN35_MTP, "mtp_num_hidden_layers": 0}, "no MTP head"),
    ("mtp", {**QWEN35_MTP, "mtp_num_hidden_layers": 2}, "chains one"),
    ("block", DENSE, "no folder"),
    ("assistant", DENSE, "no folder"),
    ("draft-model", DENSE, "no folder"),
])
def test_a_drafter_asked_for_by_name_must_be_there(tmp_path: Path, asked: str,
                                                   config: dict[str, Any], needle: str) -> None:
    target = _folder(tmp_path / "m", config)
    with pytest.raises(BadInputError, match=needle) as info:
        choose_drafter(target, asked, "cpu")
    assert f"the {asked} drafter is not available" in str(info.value)


def test_folders_made_for_another_target_are_refused_by_name(tmp_path: Path) -> None:
    target = _folder(tmp_path / "m", DENSE)
    _folder(tmp_path / "m-block", {**BLOCK, "target_num_hidden_layers": 3})
    _folder(tmp_path / "m-assistant", ASSISTANT)
    with pytest.raises(BadInputError, match="number of layers is 3"):
        choose_drafter(target, "block", "cpu")
    with pytest.raises(BadInputError, match="for a Gemma 4 model"):
        choose_drafter(target, "assistant", "cpu")
    with pytest.raises(ModelLoadError, match="does not exist"):
        choose_drafter(target, "block", "cpu", folders={"block": tmp_path / "nowhere"})
    with pytest.raises(ModelLoadError, match="does not exist"):
        choose_drafter(tmp_path / "no-model", "auto", "cpu")


def test_by_name_the_measured_draft_length_unless_told(tmp_path: Path) -> None:
    target = _folder(tmp_path / "m", DENSE)
    _figures(target, _entry("ngram", "cpu", 1.2, 6))
    assert choose_drafter(target, "ngram", "cpu").draft_len == 6
    assert choose_drafter(target, "ngram", "cpu", draft_len=2).draft_len == 2
    assert choose_drafter(target, "ngram", "gpu").draft_len == 4
    assert choose_drafter(target, "ngram", "cpu", ngram=5).ngram == 5


def test_requests_that_name_two_drafters_are_refused() -> None:
    assert requested_drafter([]) is None
    assert requested_drafter([("--drafter ngram", "ngram"), ("--ngram 2", "ngram")]) == "ngram"
    with pytest.raises(BadInputError, match="choose one drafter: --speculative asks for auto "
                                            "and --ngram 2 for ngram"):
        requested_drafter([("--speculative", "auto"), ("--ngram 2", "ngram")])
    with pytest.raises(BadInputError, match="no drafter 'medusa'"):
        requested_drafter([("drafter='medusa'", "medusa")])


BAD_FILES = {
    "not JSON": ("{", "not valid JSON"),
    "not an object": ("[]", "must hold a JSON object"),
    "another format": ('{"format": 2}', "'format' must be 1"),
    "an unknown key": ('{"format": 1, "figures": []}', "unknown key"),
    "measurements not a list": ('{"format": 1, "measurements": {}}', "must be a list"),
    "an entry not an object": ('{"format": 1, "measurements": [3]}', r"measurements\[0\]"),
    "a missing field": (json.dumps({"format": 1, "measurements": [
        {k: v for k, v in _entry("ngram", "cpu", 1.0).items() if k != "command"}]}),
        "no 'command'"),
    "an unknown field": (json.dumps({"format": 1, "measurements": [
        {**_entry("ngram", "cpu", 1.0), "speed": 2}]}), "unknown key"),
    "a bool draft length": (json.dumps({"format": 1, "measurements": [
        {**_entry("ngram", "cpu", 1.0), "draft_len": True}]}), "draft_len must be an integer"),
    "an unknown drafter": (json.dumps({"format": 1, "measurements": [
        _entry("medusa", "cpu", 1.0)]}), "drafter must be one of"),
    "a draft length of 9": (json.dumps({"format": 1, "measurements": [
        _entry("ngram", "cpu", 1.0, 9)]}), r"draft_len must be in 1\.\.8"),
    "a negative speedup": (json.dumps({"format": 1, "measurements": [
        _entry("ngram", "cpu", -1.0)]}), "speedup must be a positive number"),
    "a rate above 1": (json.dumps({"format": 1, "measurements": [
        {**_entry("ngram", "cpu", 1.0), "acceptance_rate": 1.5}]}), r"acceptance_rate must be in"),
    "a folder for ngram": ('{"format": 1, "folders": {"ngram": "x"}}', r"folders\['ngram'\]"),
    "lossless not a bool": (json.dumps({"format": 1, "measurements": [
        _entry("ngram", "cpu", 1.0, lossless=1)]}), "lossless must be true or false"),
    "a bool speedup": (json.dumps({"format": 1, "measurements": [
        _entry("ngram", "cpu", True)]}), "speedup must be a number"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_speculative_json_is_refused_by_name(tmp_path: Path, case: str) -> None:
    text, needle = BAD_FILES[case]
    target = _folder(tmp_path / "m", DENSE)
    (target / SPECULATIVE_FILE).write_text(text)
    with pytest.raises(ModelLoadError, match=needle) as info:
        choose_drafter(target, "auto", "cpu")
    assert SPECULATIVE_FILE in str(info.value)


def test_written_figures_replace_their_pairs_and_keep_the_rest(tmp_path: Path) -> None:
    target = _folder(tmp_path / "m", DENSE)
    _figures(target, _entry("ngram", "cpu", 1.1), _entry("ngram", "gpu", 1.4),
             folders={"draft-model": "../d"})
    fresh = Measurement("ngram", "cpu", 5, 1.6, 2.5, 0.4, "python -m benchmarks.drafters",
                        device="cpu", date="2026-12-10")
    write_figures(target, [fresh])
    figures = read_figures(target)
    assert figures is not None
    assert figures.best("ngram", "cpu") == fresh
    assert figures.best("ngram", "gpu").speedup == 1.4
    assert figures.folders["draft-model"] == (tmp_path / "d").resolve()
    assert read_figures(tmp_path) is None
    (target / SPECULATIVE_FILE).write_text("{")
    with pytest.raises(ModelLoadError):
        write_figures(target, [fresh])
    assert (target / SPECULATIVE_FILE).read_text() == "{"  # not overwritten


# -- through the Python API, on a tiny model whose draft model sits beside it ---------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from turbospark_jax.io.loading import GenerationConfig
    from turbospark_jax.io.saving import save_folder
    from turbospark_jax.models.dense.model import init_params

    config = DenseConfig.from_hf_dict(DENSE)
    root = tmp_path_factory.mktemp("pair")
    for name, seed in (("m", 0), ("m-draft", 1)):
        save_folder(root / name, config, init_params(config, jax.random.PRNGKey(seed)),
                    generation_config=GenerationConfig(eos_token_ids=()))
    return root / "m"


def test_load_with_drafter_auto_pairs_the_pick_and_stays_lossless(tiny_pair: Path) -> None:
    import turbospark_jax as tsj

    prompt = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 6)]
    plain = tsj.generate(tsj.load(tiny_pair, context=64), prompt, max_tokens=10)
    model = tsj.load(tiny_pair, drafter="auto", context=64)
    assert model.drafter is not None and model.drafter.drafter == (
        "draft-model" if jax.default_backend() == "cpu" else "ngram")
    spec = tsj.generate(model, prompt, max_tokens=10)
    assert spec.speculative is not None and spec.token_ids == plain.token_ids
    with pytest.raises(BadInputError, match="choose one drafter"):
        tsj.load(tiny_pair, drafter="auto", ngram=2)


def test_generate_with_auto_decodes_a_sampled_request_plainly_when_told_to(
        tiny_pair: Path, tmp_path: Path) -> None:
    """With figures saying the pick samples slower than plain on this backend, a sampled
    request decodes without drafting (the same tokens as a model loaded without a drafter)
    unless ``draft_len`` is given; a greedy request drafts. Without such figures a sampled
    request drafts (the control)."""
    import shutil

    import turbospark_jax as tsj

    backend = jax.default_backend()
    folder = tmp_path / "m"
    shutil.copytree(tiny_pair, folder)
    shutil.copytree(tiny_pair.parent / "m-draft", tmp_path / "m-draft")
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 6)]
    sampled = dict(max_tokens=10, temperature=0.9, seed=3)
    _figures(folder, *(_entry(d, backend, 1.5, 2, sampled_speedup=0.7)
                       for d in ("draft-model", "ngram")))
    model = tsj.load(folder, drafter="auto", context=64)
    assert model.drafter.plain_when_sampling is not None
    plain = tsj.generate(tsj.load(folder, context=64), prompt, **sampled)
    got = tsj.generate(model, prompt, **sampled)
    assert got.speculative is None and got.token_ids == plain.token_ids
    assert tsj.generate(model, prompt, draft_len=2, **sampled).speculative is not None
    assert tsj.generate(model, prompt, max_tokens=10).speculative is not None  # greedy
    with pytest.raises(BadInputError, match="temperature"):
        tsj.generate(model, prompt, max_tokens=10, temperature="hot")
    _figures(folder, *(_entry(d, backend, 1.5, 2, sampled_speedup=1.2)
                       for d in ("draft-model", "ngram")))
    control = tsj.load(folder, drafter="auto", context=64)
    assert control.drafter.plain_when_sampling is None
    assert tsj.generate(control, prompt, **sampled).speculative is not None
    with pytest.raises(BadInputError, match="not available"):
        tsj.load(tiny_pair, drafter="mtp")
    with pytest.raises(BadInputError, match="drafter must be"):
        tsj.load(tiny_pair, drafter=3)


def test_an_assistant_folder_loads_as_written(tmp_path: Path) -> None:
    """load_assistant reads a Gemma 4 assistant folder in the Hugging Face layout (the
    token ordering stays integer), and refuses a missing or an unexpected tensor."""
    from safetensors.numpy import save_file

    from tests.testing.assistant_folders import write_assistant_folder
    from turbospark_jax.io.drafter_folders import load_assistant

    raw = {"model_type": "gemma4_assistant", "backbone_hidden_size": 32,
           "use_ordered_embeddings": True, "num_centroids": 8, "centroid_intermediate_top_k": 2,
           "tie_word_embeddings": True, "dtype": "float32",
           "text_config": dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=40,
                               num_hidden_layers=2, layer_types=["sliding_attention",
                                                                 "full_attention"],
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               global_head_dim=16, sliding_window=4,
                               hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)}
    folder = tmp_path / "a"
    config, params, tensors = write_assistant_folder(folder, raw)
    got_config, got = load_assistant(folder)
    assert got_config == config
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), params, got)
    assert all(jax.tree.leaves(same))
    assert got["token_ordering"].dtype == np.int32
    missing = {k: v for k, v in tensors.items() if k != "masked_embedding.centroids.weight"}
    unexpected = {**tensors, "extra": np.zeros(2, np.float32)}
    for needle, broken in (("is missing", missing), ("unexpected tensor extra", unexpected)):
        save_file(broken, str(folder / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=needle):
            load_assistant(folder)
