"""Exact prefill in wide blocks (``BlockProducer(prefill_width=...)``), on the CPU.

* Under a row-invariant kernel plan a producer of width 1 that prefills in blocks of up to 64 rows,
  and one of width 4 with blocks of up to 16, leave bitwise the logits and the whole state
  (every leaf, dead rows included) that a width-1 producer leaves feeding the same tokens one
  by one; prompts of several lengths, in one chunk or split. The control: with XLA's kernels
  the same comparison between widths 1 and 16 differs in float32.
* Injected embeddings land in wide blocks as they do token by token (a test model that
  takes embeddings; its control: the injection changes the logits).
* Block widths (:func:`~turbospark_jax.engine.sizing.prefill_block_widths`): full blocks of
  ``prefill_width``, the rest in one power of two, so a few programs serve every length; the
  producer's calls follow them.
* Refusals, before any work: ``prefill_width`` other than ``width`` for a model whose widths
  do not agree (``BlockProducer``, ``tsj.load``, ``--prefill-width``), below ``width``, below
  1 or not an integer.
"""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import turbospark_jax as tsj
from turbospark_jax import api, cli
from turbospark_jax.cli import main
from turbospark_jax.core.injection import Injection
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.engine.sizing import prefill_block_widths
from turbospark_jax.errors import BadInputError
from turbospark_jax.io.loading import GenerationConfig
from turbospark_jax.io.saving import save_folder
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.models.dense import model as dense
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel
from turbospark_jax.testing.fixtures import backend_plan
from turbospark_jax.testing.tokenizers import byte_level_bpe
from turbospark_jax.testing.toy import ToyAttentionModel

#: The exact prefill's default block width on this backend (a dense model's widths agree).
DEFAULT_WIDE = api.default_prefill_width(1, widths_agree=True)
#: ``exact=False`` takes XLA's kernels only off a GPU (on a GPU the row-invariant ones are
#: the faster either way), so only there is a prefill width beside it refused.
XLA_WHEN_INEXACT = pytest.mark.skipif(jax.default_backend() == "gpu",
                                      reason="exact=False keeps the row-invariant kernels on a GPU")

ROWINV = backend_plan()

VOCAB = 96
CAPACITY = 160
LENGTHS = (1, 19, 64, 100, 150)


def _config(model_type: str = "qwen3") -> DenseConfig:
    # As tests/models/test_dense_widths_agree.py: there XLA's kernels round differently at
    # widths 1 and 16.
    return DenseConfig(
        model_type=model_type, vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        tie_word_embeddings=model_type == "qwen3", attention_bias=model_type == "qwen2",
    )


def _producer(model: DenseModel, params: Any, width: int,
              prefill_width: int | None = None) -> BlockProducer:
    return BlockProducer(model, params, capacity=CAPACITY, width=width, steps_per_call=2,
                         donate=False, prefill_width=prefill_width)


def _bits(x: Any) -> np.ndarray:
    x = np.ascontiguousarray(np.asarray(x))
    return x.view(np.uint8)


def _same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(_bits(a), _bits(b))


def _same_state(got: Any, want: Any) -> bool:
    """Every leaf bitwise equal, the producers' identities (``fed.owner``) aside."""
    got = got.replace(fed=got.fed.replace(owner=want.fed.owner))
    a, b = jax.tree.leaves(got), jax.tree.leaves(want)
    return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b, strict=True))


def _token_by_token(producer: BlockProducer, tokens: list[int], marks: tuple[int, ...],
                    injection: Injection | None = None) -> dict[int, tuple[Any, Any]]:
    """Feed ``tokens`` one by one (``produce_prefill``, ``produce`` at each mark); the logits
    and state after each of the first ``mark`` tokens."""
    state, out = producer.init_state(), {}
    for i, token in enumerate(tokens[: max(marks)]):
        if i + 1 in marks:
            logits, state = producer.produce(state, token, i, injection=injection)
            out[i + 1] = (logits, state)
        else:
            state = producer.produce_prefill(state, token, i, injection=injection)
    return out


def _chunked(producer: BlockProducer, tokens: list[int], cuts: tuple[int, ...] = (),
             injection: Injection | None = None) -> tuple[Any, Any]:
    edges = [0, *cuts, len(tokens)]
    state, logits = producer.init_state(), None
    for a, b in itertools.pairwise(edges):
        logits, state = producer.prefill_chunk_with_status(
            state, tokens[a:b], a, b == len(tokens), injection=injection)
    return logits, state


# -- chunked in wide blocks == token by token -----------------------------------------------


@pytest.fixture(scope="module")
def rowinv() -> dict[str, Any]:
    model = DenseModel(_config(), jnp.float32, plan=ROWINV)
    params = model.init_params(jax.random.PRNGKey(3))
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB, max(LENGTHS))]
    decoder = _producer(model, params, 1)
    return {
        "tokens": tokens,
        "reference": _token_by_token(decoder, tokens, LENGTHS),
        "wide": _producer(model, params, 1, prefill_width=64),
        "mid": _producer(model, params, 4, prefill_width=16),
    }


@pytest.mark.parametrize("length", LENGTHS)
def test_wide_blocks_equal_token_by_token(rowinv, length):
    want_logits, want_state = rowinv["reference"][length]
    prompt = rowinv["tokens"][:length]
    for name in ("wide", "mid"):
        logits, state = _chunked(rowinv[name], prompt)
        assert _same_bits(logits, want_logits), f"{name}: logits differ at length {length}"
        assert _same_state(state, want_state), f"{name}: state differs at length {length}"


def test_wide_blocks_in_split_chunks_equal_token_by_token(rowinv):
    want_logits, want_state = rowinv["reference"][150]
    for cuts in ((37, 101), (64, 65)):
        logits, state = _chunked(rowinv["wide"], rowinv["tokens"], cuts)
        assert _same_bits(logits, want_logits) and _same_state(state, want_state), cuts


def test_control_a_one_bit_change_is_seen(rowinv):
    """The comparison itself can fail: one bit of one leaf, or of the logits, is caught."""
    logits, state = rowinv["reference"][19]
    flipped = np.array(state.cache.k)
    flipped.reshape(-1).view(np.uint32)[5] ^= 1
    assert not _same_state(state.replace(cache=state.cache.replace(k=flipped)), state)
    nudged = np.array(logits)
    nudged.view(np.uint32)[0] ^= 1
    assert not _same_bits(nudged, logits)


def test_control_xla_kernels_differ_across_widths_in_float32():
    """The check can fail: with XLA's kernels a width-16 program's chunked prefill and a
    width-1 program's token-by-token one round differently in float32."""
    model = DenseModel(_config(), jnp.float32)
    params = model.init_params(jax.random.PRNGKey(3))
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB, 19)]
    want_logits, want_state = _token_by_token(_producer(model, params, 1), tokens, (19,))[19]
    logits, state = _chunked(_producer(model, params, 16), tokens)
    assert not (_same_bits(logits, want_logits) and _same_state(state, want_state))


# -- injected embeddings in wide blocks ------------------------------------------------------


class _EmbeddingDense(DenseModel):
    """A dense model that takes injected rows (test only): each block appends its ``embeds``
    to the embedding table and points the injected rows at them, so a row's input is exactly
    the injected embedding (a gather) and the rest is the row-invariant dense model. The
    head is untied, so the longer table is only read by the lookup."""

    accepts_embeddings = True

    @property
    def embedding_size(self) -> int:
        return self.config.hidden_size

    @property
    def embedding_dtype(self) -> Any:
        return self.dtype

    def block_forward(self, params, cache, tokens, positions, live, need_head, *,
                      key_limit=None, fresh=False, embeds=None, embed_rows=None,
                      last_row_head=False):
        table = jnp.concatenate([params["embed_tokens"], embeds.astype(self.dtype)])
        rows = self.vocab_size + jnp.arange(tokens.shape[0], dtype=tokens.dtype)
        return super().block_forward(
            {**params, "embed_tokens": table}, cache, jnp.where(embed_rows, rows, tokens),
            positions, live, need_head, key_limit=key_limit, fresh=fresh,
            last_row_head=last_row_head)


def test_injected_rows_in_wide_blocks_equal_token_by_token():
    model = _EmbeddingDense(_config("llama"), jnp.float32, plan=ROWINV)
    params = model.init_params(jax.random.PRNGKey(5))
    rng = np.random.default_rng(11)
    tokens = [int(t) for t in rng.integers(0, VOCAB, 100)]
    positions = np.r_[10:30, 70:76]  # two images, one across the 64-row block's end
    injection = Injection(positions, rng.standard_normal((len(positions), 48), np.float32),
                          np.where(positions < 50, 7, 9))
    want_logits, want_state = _token_by_token(_producer(model, params, 1), tokens, (100,),
                                              injection)[100]
    wide = _producer(model, params, 1, prefill_width=64)
    for cuts in ((), (20, 71)):
        logits, state = _chunked(wide, tokens, cuts, injection)
        assert _same_bits(logits, want_logits) and _same_state(state, want_state), cuts
    assert tuple(state.fed.to_host().injected[:100]) == tuple(
        injection.identity_map().get(i, 0) for i in range(100))
    # Control: the injected rows matter; without them the logits differ.
    plain, _ = _chunked(wide, tokens)
    assert not _same_bits(plain, want_logits)


# -- block widths: a few programs for every length --------------------------------------------


def test_block_widths_are_full_blocks_then_one_power_of_two():
    assert prefill_block_widths(5000, 1, 2048) == [2048, 2048, 1024]
    assert prefill_block_widths(0, 1, 2048) == []
    assert prefill_block_widths(1, 1, 2048) == [1]
    assert prefill_block_widths(3, 5, 64) == [5]  # never below width
    assert prefill_block_widths(7, 4, 16) == [8]
    assert prefill_block_widths(70, 1, 100) == [100]  # never above prefill_width
    assert prefill_block_widths(19, 4, 4) == [4] * 5  # one width: today's one program
    seen = set()
    for n in range(1, 3 * 2048):
        *full, last = prefill_block_widths(n, 1, 2048)
        rest = n - 2048 * len(full)
        assert set(full) <= {2048} and rest <= last < 2 * rest  # the rest's block is tight
        seen.update((*full, last))
    assert seen == {1 << i for i in range(12)}  # 12 programs for every length


@pytest.mark.parametrize("args", [(-1, 1, 8), (5, 0, 8), (5, 4, 2), (5, 1.5, 8), (True, 1, 8)])
def test_block_widths_refuse_bad_arguments(args):
    with pytest.raises(BadInputError):
        prefill_block_widths(*args)


def test_the_producer_calls_the_programs_of_its_block_widths(rowinv, monkeypatch):
    calls = []

    def record(producer: BlockProducer) -> None:
        original = producer._call

        def recording(state, plan, control, n_steps, last_row_head=False):
            assert last_row_head  # the widths agree: the head runs on the last row only
            calls.append((tuple(plan.tokens.shape), int(n_steps)))
            return original(state, plan, control, n_steps, last_row_head)

        monkeypatch.setattr(producer, "_call", recording)

    record(rowinv["wide"])
    record(rowinv["mid"])
    _chunked(rowinv["wide"], rowinv["tokens"][:150])
    # 64 + 64 in one call of the prefill_width program (it holds PREFILL_CALL_ROWS rows'
    # worth of blocks, at most steps_per_call = 2), then a rest of 22 in one 32-row block (a
    # wider program than width holds steps_per_call x width rows' worth: one block)
    assert calls == [((2, 64), 2), ((1, 32), 1)]
    calls.clear()
    _chunked(rowinv["mid"], rowinv["tokens"][:19])
    assert calls == [((2, 16), 1), ((2, 4), 1)]  # a rest of 3 at the producer's width 4


# -- refusals --------------------------------------------------------------------------------


def test_a_prefill_width_for_xla_kernels_is_refused():
    model = DenseModel(_config(), jnp.float32)
    params = model.init_params(jax.random.PRNGKey(3))
    for width, wide in ((1, 16), (16, 32)):
        with pytest.raises(BadInputError, match="exact=True") as caught:
            _producer(model, params, width, prefill_width=wide)
        assert "token-by-token" in str(caught.value)
    assert _producer(model, params, 4, prefill_width=4).prefill_width == 4
    assert _producer(model, params, 4).prefill_width == 4
    toy = ToyAttentionModel()
    assert not toy.widths_agree and not model.widths_agree
    with pytest.raises(BadInputError, match="do not agree"):
        BlockProducer(toy, toy.init_params(jax.random.PRNGKey(0)), capacity=32, width=1,
                      prefill_width=8)


@pytest.mark.parametrize("bad", [0, -3, 1.5, "8", True])
def test_a_bad_prefill_width_is_refused(bad):
    model = DenseModel(_config(), jnp.float32, plan=ROWINV)
    params = model.init_params(jax.random.PRNGKey(3))
    with pytest.raises(BadInputError, match="prefill_width must be an integer >= 1"):
        _producer(model, params, 1, prefill_width=bad)
    with pytest.raises(BadInputError, match="prefill_width must be an integer >= 1"):
        tsj.load("/nonexistent/folder", prefill_width=bad)


def test_a_prefill_width_below_width_is_refused():
    model = DenseModel(_config(), jnp.float32, plan=ROWINV)
    assert model.widths_agree
    with pytest.raises(BadInputError, match="below width=8"):
        _producer(model, model.init_params(jax.random.PRNGKey(3)), 8, prefill_width=4)


# -- through tsj.load and the command line ---------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny dense folder, weights and tokenizer, as ``save_folder`` writes it."""
    vocab = byte_level_bpe().get_vocab_size()
    config = DenseConfig(model_type="qwen3", vocab_size=vocab, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=1)
    tokenizer = Tokenizer.from_tokenizers(byte_level_bpe(), bos="<|bos|>", eos="<|eos|>",
                                          pad="<|pad|>")
    path = tmp_path_factory.mktemp("dense")
    save_folder(path, config, dense.init_params(config, jax.random.PRNGKey(0)),
                tokenizer=tokenizer,
                generation_config=GenerationConfig(eos_token_ids=(1,), bos_token_id=0))
    return path


def test_load_passes_prefill_width_and_defaults_it(folder):
    wide = tsj.load(folder, width=2, prefill_width=32, context=64)
    assert (wide.producer.width, wide.producer.prefill_width) == (2, 32)
    assert wide.prefill_width == 32
    assert tsj.load(folder, context=64).producer.prefill_width == DEFAULT_WIDE
    plain = tsj.load(folder, exact=False, width=3, context=64)
    if jax.default_backend() != "gpu":  # XLA's kernels: one width
        assert plain.producer.prefill_width == 3 and plain.prefill_width == 3


def test_load_in_wide_blocks_gives_the_same_tokens_and_logits(folder, requests_seen):
    """Through ``tsj.load`` and ``tsj.generate``: prefill blocks of 1, 16 and the backend's
    default rows, the same tokens and logits bit for bit; ``stream``'s chunks hold at
    least one widest block."""
    prompt = "def f(x):\n    return x + 1\n" * 3
    runs = []
    for wide in (1, 16, None):
        model = tsj.load(folder, width=1, prefill_width=wide, context=256)
        runs.append(tsj.generate(model, prompt, max_tokens=6, record_logits=True,
                                 stop_token_ids=()))
    assert [r.prefill_chunk_size for r in requests_seen] == [DEFAULT_WIDE] * 3
    tsj.generate(model, prompt, max_tokens=1, prefill_chunk_size=20)  # the caller's wins
    assert requests_seen[-1].prefill_chunk_size == 20
    assert len(runs[0].token_ids) == 6
    for run in runs[1:]:
        assert run.token_ids == runs[0].token_ids
        assert _same_bits(np.asarray(run.logits, np.float32),
                          np.asarray(runs[0].logits, np.float32))


def test_load_refuses_a_prefill_width_below_width(folder, no_tensor_read):
    with pytest.raises(BadInputError, match="below width=4"):
        tsj.load(folder, width=4, prefill_width=2)


@XLA_WHEN_INEXACT
def test_load_refuses_a_prefill_width_with_xla_kernels(folder, no_tensor_read):
    with pytest.raises(BadInputError, match="exact=True"):
        tsj.load(folder, exact=False, width=1, prefill_width=64)


def test_default_prefill_width_by_backend(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert api.default_prefill_width(16) == 16
    assert api.default_prefill_width(1, widths_agree=True) == 2048
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert api.default_prefill_width(1) == 1
    assert api.default_prefill_width(5, widths_agree=True) == 256
    assert api.default_prefill_width(512, widths_agree=True) == 512


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdin=io.StringIO(""), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_prefill_width_below_one_is_a_clean_cli_error(value):
    code, out, err = _run("generate", "hi", "--prefill-width", value)
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert f"--prefill-width must be >= 1, got {value}" in err


@XLA_WHEN_INEXACT
def test_a_prefill_width_with_xla_kernels_is_a_clean_cli_error(folder, no_tensor_read):
    code, out, err = _run("generate", "--model", str(folder), "hi", "--width", "2",
                          "--prefill-width", "8", "--no-exact")
    assert code == 1 and out == "" and "Traceback" not in err, err
    assert err.count("\n") == 1 and "--prefill-width 8 differs from --width 2" in err, err
    assert "with --exact" in err, err


def test_the_prefill_width_flag_reaches_the_producer_and_keeps_the_text(folder, monkeypatch):
    built = []
    original = cli._block_producer

    def recording(loaded, args, capacity):
        producer = original(loaded, args, capacity)
        built.append((producer.width, producer.prefill_width))
        return producer

    monkeypatch.setattr(cli, "_block_producer", recording)
    argv = ("generate", "--model", str(folder), "def f(x):\n    return x + 1\n" * 3,
            "--max-tokens", "6", "--context", "256")
    texts = []
    for extra in (("--prefill-width", "1"), ("--prefill-width", "16"), ()):
        code, out, err = _run(*argv, *extra)
        assert code == 0, err
        texts.append(out)
    assert built == [(1, 1), (1, 16), (1, DEFAULT_WIDE)]
    assert texts[0] == texts[1] == texts[2]  # this random model's text: newlines
