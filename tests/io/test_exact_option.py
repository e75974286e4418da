"""``exact`` as a user reaches it: ``load_folder``'s plan, ``tsj.load`` and ``--exact``.

* The embedded draft model (qwen3) loaded exact (on a CPU: the row-invariant plan) at width 1
  and at width 16 gives bitwise the same greedy completion, tokens and the logits each token
  was sampled from; loaded with ``exact=False`` (XLA's kernels on a CPU) the same two widths
  round differently (the control).
* A family without row-invariant kernels (Qwen3.5, Gemma 4) serves exact on XLA's kernels at
  one width: a wider prefill block is refused with
  :class:`~turbospark_jax.errors.BadInputError`, a row-invariant plan with
  :class:`~turbospark_jax.errors.UnsupportedCapabilityError`, and a bad ``exact`` with
  :class:`~turbospark_jax.errors.BadInputError`, all before any tensor is read.
* ``--exact`` / ``--no-exact`` parse for ``generate`` and reach the model it builds.
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
from turbospark_jax.errors import BadInputError, UnsupportedCapabilityError
from turbospark_jax.io import loading
from turbospark_jax.io.loading import GenerationConfig, load_folder, serving_plan
from turbospark_jax.io.saving import save_folder
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.kernels.plan import KernelPlan
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


def _complete(exact: bool, width: int) -> Any:
    model = tsj.load(DENSE_FOLDER, exact=exact, width=width, dtype="float32", context=128)
    assert model.loaded.model.plan.row_invariant == exact and model.producer.width == width
    return tsj.generate(model, PROMPT, max_tokens=NEW_TOKENS, record_logits=True,
                        stop_token_ids=(), parallel_prefill=False)


def _bits(completion: Any) -> np.ndarray:
    return np.asarray(completion.logits, np.float32).view(np.uint32)


def test_exact_widths_give_the_same_bits_on_an_embedded_model():
    """Width 1 prefills token by token and decodes one row; width 16 prefills the prompt in
    blocks of 16 rows and decodes one live row of 16: different programs, the same bits."""
    narrow, wide = _complete(True, 1), _complete(True, 16)
    assert len(narrow.token_ids) == NEW_TOKENS
    assert narrow.token_ids == wide.token_ids
    np.testing.assert_array_equal(_bits(narrow), _bits(wide))


def test_control_xla_kernels_differ_across_widths():
    """The check can fail: with XLA's kernels (``exact=False`` on a CPU) a one-row program
    and a sixteen-row one sum in other orders, so the logits differ in float32 (the greedy
    tokens happen to agree)."""
    narrow, wide = _complete(False, 1), _complete(False, 16)
    assert not np.array_equal(_bits(narrow), _bits(wide))


def test_default_width_is_decodes_where_widths_agree(monkeypatch):
    """XLA's kernels need one program for every path, 16 rows on a GPU; row-invariant kernels
    let decode run at its own width on every backend."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert api.default_width(False) == 16
    assert api.default_width(True, 3) == 16
    assert api.default_width(False, widths_agree=True) == 1
    assert api.default_width(True, 3, widths_agree=True) == 4
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert api.default_width(False, widths_agree=True) == api.default_width(False) == 1


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
def test_a_family_without_rowinv_is_exact_at_one_width(folders, no_tensor_read, family,
                                                       monkeypatch):
    # the backend's kernels, never row-invariant ones, whatever exact says
    real = jax.default_backend
    for backend, pallas in (("cpu", "off"), ("gpu", "compiled"), ("tpu", "tpu")):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        for exact in (True, False):
            assert serving_plan(folders[family], exact) == KernelPlan(pallas=pallas)
    monkeypatch.setattr(jax, "default_backend", real)
    with pytest.raises(BadInputError, match="prefill_width=64 differs from width=1"):
        tsj.load(folders[family], width=1, prefill_width=64)
    with pytest.raises(UnsupportedCapabilityError) as caught:
        load_folder(folders[family], layer_layout="list", plan=KernelPlan(row_invariant=True))
    assert f"the {family} family" in str(caught.value), caught.value
    config, module = FAMILIES[family]
    assert not module.FAMILY.build(config, np.float32, "list").row_invariant_kernels


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_a_family_with_backend_kernels_loads_with_the_plan_it_is_given(folders, family):
    plan = KernelPlan(pallas="tpu_interpret")
    assert load_folder(folders[family], layer_layout="list", plan=plan).model.plan == plan


@pytest.mark.parametrize("bad", ["yes", None, 1])
def test_a_bad_exact_value_is_refused_before_the_folder_is_read(no_tensor_read, bad):
    with pytest.raises(BadInputError, match="exact must be True or False"):
        tsj.load("/nonexistent/folder", exact=bad)
    with pytest.raises(BadInputError, match="exact must be True or False"):
        serving_plan("/nonexistent/folder", bad)
    with pytest.raises(BadInputError, match="plan must be a KernelPlan"):
        load_folder("/nonexistent/folder", plan="rowinv")


@pytest.mark.parametrize("family", ["dense", "qwen3_5"])
def test_not_exact_prefills_in_parallel_unless_asked_not_to(folders, requests_seen, family):
    for exact in (True, False):
        model = tsj.load(folders[family], exact=exact, context=64)
        assert model.exact is exact
        tsj.generate(model, "hi", max_tokens=2)
    tsj.generate(model, "hi", max_tokens=2, parallel_prefill=False)  # the caller's wins
    assert [r.parallel_prefill for r in requests_seen] == [False, True, False]


def test_the_dense_family_loads_under_either_plan(folders):
    assert load_folder(folders["dense"]).model.plan == KernelPlan()
    rowinv = KernelPlan(row_invariant=True)
    assert serving_plan(folders["dense"], True) == rowinv  # on this CPU
    assert serving_plan(folders["dense"], False) == KernelPlan()
    stacked = load_folder(folders["dense"], plan=rowinv)
    listed = load_folder(folders["dense"], layer_layout="list", plan=rowinv)
    assert stacked.model.plan == listed.model.plan == rowinv
    assert stacked.model.scan_layers and not listed.model.scan_layers


# -- the command line -----------------------------------------------------------------------


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdin=io.StringIO(""), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_the_exact_flag_parses_for_generate():
    assert parser().parse_args(["generate", "hi"]).exact is True
    assert parser().parse_args(["generate", "hi", "--no-exact"]).exact is False
    assert not hasattr(parser().parse_args(["serve"]), "exact")
    code, out, _ = _run("generate", "--help")
    assert code == 0 and "--exact, --no-exact" in out and "--kernels" not in out


def test_the_exact_flag_reaches_the_model_and_any_width_gives_the_same_text(folders,
                                                                            monkeypatch):
    built = []
    original = cli._block_producer

    def recording(loaded, args, capacity):
        built.append((loaded.model.plan.row_invariant, args.width))
        return original(loaded, args, capacity)

    monkeypatch.setattr(cli, "_block_producer", recording)
    argv = ("generate", "--model", str(folders["dense"]), "def f(x):", "--max-tokens", "8",
            "--context", "256")
    texts = []
    for extra in ((), ("--width", "5"), ("--no-exact",)):
        code, out, err = _run(*argv, *extra)
        assert code == 0, err
        texts.append(out)
    assert built == [(True, 1), (True, 5), (False, 1)]
    assert texts[0] == texts[1] and texts[0].strip()


def test_a_wide_prefill_for_a_family_without_it_is_a_clean_error(folders, no_tensor_read):
    code, out, err = _run("generate", "--model", str(folders["qwen3_5"]), "hi",
                          "--prefill-width", "64")
    assert code == 1 and out == "" and "Traceback" not in err
    last = err.splitlines()[-1]  # before any tensor
    assert last.startswith("turbospark-jax: error: --prefill-width 64 differs"), err
    code, _, err = _run("generate", "hi", "--kernels", "rowinv")
    assert code == 1 and "unrecognized arguments" in err and "Traceback" not in err
