"""``kernels="rowinv"`` as a user reaches it: ``load_folder``, ``tsj.load`` and ``--kernels``.

* The embedded draft model (qwen3) loaded with row-invariant kernels at width 1 and at width 16
  gives bitwise the same greedy completion, tokens and the logits each token was sampled
  from; with XLA's kernels (float32) the same two widths round differently (the control).
* A family without row-invariant kernels (Qwen3.5, Gemma 4) is refused with
  :class:`~turbospark_jax.errors.UnsupportedCapabilityError` naming the family and the mode,
  and a value that is neither mode with :class:`~turbospark_jax.errors.BadInputError`, both
  before any tensor is read.
* ``--kernels`` parses for ``generate`` and ``serve`` and reaches the model they build.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import turbospark_jax as tsj
from turbospark_jax import api, cli
from turbospark_jax.cli import main
from turbospark_jax.cli.arguments import parser
from turbospark_jax.errors import BadInputError, TurbosparkError, UnsupportedCapabilityError
from turbospark_jax.io import loading
from turbospark_jax.io.loading import GenerationConfig, load_folder, save_folder
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.models.dense import model as dense
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.gemma4 import model as gemma4
from turbospark_jax.models.gemma4.config import Gemma4Config
from turbospark_jax.models.qwen3_5 import model as qwen3_5
from turbospark_jax.models.qwen3_5.config import Qwen35Config
from turbospark_jax.testing.tokenizers import byte_level_bpe

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"  # 19 tokens: two blocks at W=16
NEW_TOKENS = 12


#: A dense model of real weights (the embedded target is Qwen3.5, which has no such kernels).
DENSE_FOLDER = loading.embedded_model_path(loading.DEFAULT_DRAFT)


def _complete(kernels: str, width: int) -> Any:
    model = tsj.load(DENSE_FOLDER, kernels=kernels, width=width, dtype="float32", context=128)
    assert model.loaded.model.kernels == kernels and model.producer.width == width
    return tsj.generate(model, PROMPT, max_tokens=NEW_TOKENS, record_logits=True,
                        stop_token_ids=())


def _bits(completion: Any) -> np.ndarray:
    return np.asarray(completion.logits, np.float32).view(np.uint32)


def test_rowinv_widths_give_the_same_bits_on_an_embedded_model():
    """Width 1 prefills token by token and decodes one row; width 16 prefills the prompt in
    blocks of 16 rows and decodes one live row of 16: different programs, the same bits."""
    narrow, wide = _complete("rowinv", 1), _complete("rowinv", 16)
    assert len(narrow.token_ids) == NEW_TOKENS
    assert narrow.token_ids == wide.token_ids
    np.testing.assert_array_equal(_bits(narrow), _bits(wide))


def test_control_xla_kernels_differ_across_widths():
    """The check can fail: with XLA's kernels a one-row program and a sixteen-row one sum in
    other orders, so the logits differ in float32 (the greedy tokens happen to agree)."""
    narrow, wide = _complete("xla", 1), _complete("xla", 16)
    assert not np.array_equal(_bits(narrow), _bits(wide))


def test_rowinv_default_width_is_decodes_on_every_backend(monkeypatch):
    """XLA's kernels need one program for every path, 16 rows on a GPU; row-invariant kernels
    let decode run at its own width on every backend."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert api.default_width(False) == 16
    assert api.default_width(True, 3) == 16
    assert api.default_width(False, kernels="rowinv") == 1
    assert api.default_width(True, 3, kernels="rowinv") == 4
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert api.default_width(False, kernels="rowinv") == api.default_width(False) == 1


# -- refusals -------------------------------------------------------------------------------

VOCAB = byte_level_bpe().get_vocab_size()
QWEN35 = Qwen35Config.from_hf_dict(dict(
    model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    num_hidden_layers=4, bos_token_id=0, eos_token_id=1))
GEMMA4 = Gemma4Config.from_hf_dict(dict(
    model_type="gemma4_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
    num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    sliding_window=4, hidden_size_per_layer_input=4, vocab_size_per_layer_input=VOCAB,
    bos_token_id=0, eos_token_id=1))
DENSE = DenseConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
FAMILIES = {"qwen3_5": (QWEN35, qwen3_5), "gemma4": (GEMMA4, gemma4), "dense": (DENSE, dense)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny folder of each family, weights and tokenizer, as ``save_folder`` writes them."""
    tokenizer = Tokenizer.from_tokenizers(byte_level_bpe(), bos="<|bos|>", eos="<|eos|>",
                                          pad="<|pad|>")
    out = {}
    for name, (config, module) in FAMILIES.items():
        out[name] = tmp_path_factory.mktemp(name)
        save_folder(out[name], config, module.init_params(config, jax.random.PRNGKey(0)),
                    tokenizer=tokenizer,
                    generation_config=GenerationConfig(eos_token_ids=(1,), bos_token_id=0))
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_a_family_without_rowinv_is_refused_before_any_tensor(folders, no_tensor_read, family):
    for load in (lambda: load_folder(folders[family], layer_layout="list", kernels="rowinv"),
                 lambda: tsj.load(folders[family], kernels="rowinv")):
        with pytest.raises(UnsupportedCapabilityError) as caught:
            load()
        message = str(caught.value)
        assert f"the {family} family" in message and "kernels='rowinv'" in message, message
    config, module = FAMILIES[family]
    assert not module.FAMILY.build(config, np.float32, "list").row_invariant_kernels


@pytest.mark.parametrize("bad", ["pallas", "ROWINV", None, 1])
def test_a_bad_kernels_value_is_refused_before_the_folder_is_read(no_tensor_read, bad):
    with pytest.raises(BadInputError, match="kernels must be one of xla, rowinv"):
        load_folder("/nonexistent/folder", kernels=bad)
    with pytest.raises(BadInputError, match="kernels must be one of xla, rowinv"):
        tsj.load("/nonexistent/folder", kernels=bad)


def test_the_dense_family_loads_in_either_mode(folders):
    assert load_folder(folders["dense"]).model.kernels == "xla"
    stacked = load_folder(folders["dense"], kernels="rowinv")
    listed = load_folder(folders["dense"], layer_layout="list", kernels="rowinv")
    assert stacked.model.kernels == listed.model.kernels == "rowinv"
    assert stacked.model.scan_layers and not listed.model.scan_layers


# -- the command line -----------------------------------------------------------------------


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdin=io.StringIO(""), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_the_kernels_flag_parses_for_generate_and_serve():
    assert parser().parse_args(["generate", "hi"]).kernels == "xla"
    assert parser().parse_args(["generate", "hi", "--kernels", "rowinv"]).kernels == "rowinv"
    assert parser().parse_args(["serve"]).kernels == "xla"
    assert parser().parse_args(["serve", "--kernels", "rowinv"]).kernels == "rowinv"
    code, out, _ = _run("generate", "--help")
    assert code == 0 and "--kernels {xla,rowinv}" in out and "(default: xla)" in out


def test_the_kernels_flag_reaches_the_model_and_any_width_gives_the_same_text(folders,
                                                                              monkeypatch):
    built = []
    original = cli._block_producer

    def recording(loaded, args, capacity):
        built.append((loaded.model.kernels, args.width))
        return original(loaded, args, capacity)

    monkeypatch.setattr(cli, "_block_producer", recording)
    argv = ("generate", "--model", str(folders["dense"]), "def f(x):", "--max-tokens", "8",
            "--context", "256")
    texts = []
    for extra in ((), ("--kernels", "rowinv"), ("--kernels", "rowinv", "--width", "5")):
        code, out, err = _run(*argv, *extra)
        assert code == 0, err
        texts.append(out)
    assert built == [("xla", 1), ("rowinv", 1), ("rowinv", 5)]
    assert texts[1] == texts[2] and texts[1].strip()


def test_the_kernels_flag_for_a_family_without_it_is_a_clean_error(folders, no_tensor_read):
    code, out, err = _run("generate", "--model", str(folders["qwen3_5"]), "hi",
                          "--kernels", "rowinv")
    assert code == 1 and out == "" and "Traceback" not in err
    last = err.splitlines()[-1]  # after the spinner's "loading" line, before any tensor
    assert last.startswith("turbospark-jax: error: the qwen3_5 family"), err
    assert "--kernels rowinv is not available" in last and "--kernels xla" in last, err
    code, _, err = _run("generate", "hi", "--kernels", "fast")
    assert code == 1 and "invalid choice: 'fast'" in err and err.count("\n") == 1


def test_serve_passes_the_kernels_flag_to_the_server(monkeypatch):
    build = pytest.importorskip("turbospark_jax.server.build")
    asked = {}

    def stop_here(path, **kwargs):
        asked.update(kwargs)
        raise TurbosparkError("stopped before loading")

    monkeypatch.setattr(build, "load_server", stop_here)
    code, _, err = _run("serve", "--kernels", "rowinv")
    assert code == 1 and "stopped before loading" in err
    assert asked["kernels"] == "rowinv"
