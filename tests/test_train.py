"""The training recipe on the CPU: corpus split, tokenizer, packing, the step, resume, export.

Everything runs on a small, evenly spaced subset of the standard library and a tiny model, so
the module stays well under a minute; one set of settings is shared so every training run
reuses the same compiled step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from turbospark_jax import loading, train
from turbospark_jax.errors import BadInputError

SEQ_LEN = 32
TC = train.TrainConfig(
    steps=12,
    batch_size=8,
    seq_len=SEQ_LEN,
    peak_lr=1e-2,
    warmup_steps=3,
    eval_every=0,
    log_every=4,
)
TINY = (
    ("hidden_size", 32),
    ("num_hidden_layers", 2),
    ("num_attention_heads", 4),
    ("num_key_value_heads", 2),
    ("head_dim", 8),
    ("intermediate_size", 64),
)


@dataclasses.dataclass
class Setup:
    corpus: train.Corpus
    tokenizer: train.Tokenizer
    train_rows: np.ndarray
    heldout_rows: np.ndarray


@pytest.fixture(scope="module")
def setup() -> Setup:
    corpus = train.load_corpus(heldout_fraction=0.1, max_files=40)
    tokenizer = train.train_tokenizer([d.text for d in corpus.train], vocab_size=512)
    train_rows = train.pack_rows(train.encode_documents(tokenizer, corpus.train), SEQ_LEN)
    heldout_rows = train.pack_rows(train.encode_documents(tokenizer, corpus.heldout), SEQ_LEN)
    return Setup(corpus, tokenizer, train_rows, heldout_rows[:64])


@pytest.fixture(scope="module")
def trained(setup: Setup, tmp_path_factory: pytest.TempPathFactory) -> train.TrainResult:
    config = train.model_config(TINY, setup.tokenizer)
    return train.train_model(
        config, TC, setup.train_rows, setup.heldout_rows,
        checkpoint_dir=tmp_path_factory.mktemp("full"), progress=False,
    )


# -- corpus ------------------------------------------------------------------------------------


def test_corpus_excludes_third_party_and_splits_by_file() -> None:
    paths = train.list_corpus_files(train.stdlib_root())
    assert paths == sorted(paths) and len(paths) > 500
    assert not any(p.startswith(("site-packages/", "pydoc_data/")) for p in paths)
    assert not any("__pycache__" in p or p.startswith("lib2to3/tests/data/") for p in paths)
    held = [p for p in paths if train.is_heldout(p, 0.03)]
    assert 0.01 < len(held) / len(paths) < 0.06
    # The split of a file depends on its path alone: any subset splits the same way.
    held_set = set(held)
    assert all(train.is_heldout(p, 0.03) == (p in held_set) for p in paths[::7])


def test_heldout_split_is_disjoint_and_complete(setup: Setup) -> None:
    train_paths = {d.path for d in setup.corpus.train}
    held_paths = {d.path for d in setup.corpus.heldout}
    assert train_paths and held_paths and not train_paths & held_paths
    assert len(train_paths) + len(held_paths) + len(setup.corpus.skipped) == 40
    assert all(train.is_heldout(p, 0.1) for p in held_paths)
    assert not any(train.is_heldout(p, 0.1) for p in train_paths)


# -- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_special_tokens(setup: Setup) -> None:
    tok = setup.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert [tok.id_to_token(i) for i in range(3)] == ["<|bos|>", "<|eos|>", "<|pad|>"]
    ids = tok.encode("def f():\n    return 1\n")
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert 300 < tok.vocab_size <= 512
    assert tok.apply_chat_template([{"role": "user", "content": "import os"}]) == (
        "<|bos|>import os"
    )


@given(st.text(max_size=200))
def test_tokenizer_round_trips_any_text(setup: Setup, text: str) -> None:
    tok = setup.tokenizer
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


@pytest.mark.parametrize(
    "text",
    ["héllo wörld ñ", "日本語のテキスト", "emoji 🐍🚀 zwj 👩‍💻", "tabs\tand\r\nCRLF\x00nul",
     "  leading  and trailing  ", "e\u0301 combining", ""],
)
def test_tokenizer_round_trips_non_ascii(setup: Setup, text: str) -> None:
    tok = setup.tokenizer
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_tokenizer_training_is_deterministic(setup: Setup) -> None:
    texts = [d.text for d in setup.corpus.train[:10]]
    a = train.train_tokenizer(texts, vocab_size=400)
    b = train.train_tokenizer(texts, vocab_size=400)
    assert a.backend.to_str() == b.backend.to_str()


# -- data --------------------------------------------------------------------------------------


def test_documents_are_framed_and_packed_without_loss(setup: Setup) -> None:
    tok = setup.tokenizer
    docs = setup.corpus.train[:3]
    stream = train.encode_documents(tok, docs)
    assert stream.dtype == np.int32
    assert stream[0] == tok.bos_token_id and stream[-1] == tok.eos_token_id
    assert int((stream == tok.bos_token_id).sum()) == 3 == int((stream == tok.eos_token_id).sum())
    rows = train.pack_rows(stream, SEQ_LEN)
    assert rows.shape == ((len(stream) - 1) // SEQ_LEN, SEQ_LEN + 1)
    # Consecutive rows overlap by exactly one token and together they are the stream.
    np.testing.assert_array_equal(rows[:-1, -1], rows[1:, 0])
    rebuilt = np.concatenate([rows[0], *[r[1:] for r in rows[1:]]])
    np.testing.assert_array_equal(rebuilt, stream[: len(rebuilt)])


def test_data_order_is_deterministic_and_covers_each_epoch() -> None:
    a = train.DataOrder(50, 8, seed=3)
    b = train.DataOrder(50, 8, seed=3)
    steps = range(20)
    assert all(np.array_equal(a.indices(s), b.indices(s)) for s in steps)
    # Control: another seed gives another order.
    c = train.DataOrder(50, 8, seed=4)
    assert not all(np.array_equal(a.indices(s), c.indices(s)) for s in steps)
    per_epoch = a.batches_per_epoch
    for epoch in range(2):
        seen = np.concatenate([a.indices(epoch * per_epoch + j) for j in range(per_epoch)])
        assert len(set(seen.tolist())) == len(seen) == per_epoch * 8
    assert not np.array_equal(a.indices(0), a.indices(per_epoch))
    with pytest.raises(BadInputError):
        train.DataOrder(5, 8, seed=0)


# -- training ----------------------------------------------------------------------------------


def test_training_lowers_the_loss(trained: train.TrainResult) -> None:
    losses = [h["loss"] for h in trained.history if h["kind"] == "train"]
    assert trained.finished and trained.steps_done == TC.steps
    assert losses[-1] < losses[0] - 0.5
    # Uniform guessing over the vocabulary is the untrained baseline.
    assert trained.eval_loss is not None
    assert trained.eval_loss < np.log(trained.config.vocab_size)
    assert trained.tokens_seen == TC.steps * TC.batch_size * SEQ_LEN


def test_decay_mask_spares_norms(trained: train.TrainResult) -> None:
    mask = train._decay_mask(trained.params)
    assert mask["embed_tokens"] and mask["layers"]["q_proj"] and mask["layers"]["down_proj"]
    assert not mask["norm"] and not mask["layers"]["input_layernorm"]
    assert not mask["layers"]["q_norm"]


def _leaves_equal(a: object, b: object) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(
    setup: Setup, trained: train.TrainResult, tmp_path: Path
) -> None:
    config = trained.config
    ckpt = tmp_path / "ckpt"
    first = train.train_model(config, TC, setup.train_rows, setup.heldout_rows,
                              checkpoint_dir=ckpt, stop_at_step=5, progress=False)
    assert first.steps_done == 5 and not first.finished
    meta = json.loads((ckpt / train.CHECKPOINT_META).read_text())
    assert meta["step"] == 5 and meta["samples_seen"] == 5 * TC.batch_size
    resumed = train.train_model(config, TC, setup.train_rows, setup.heldout_rows,
                                checkpoint_dir=ckpt, resume=True, progress=False)
    assert resumed.steps_done == TC.steps and resumed.finished
    assert _leaves_equal(resumed.params, trained.params)
    train_losses = [h for h in resumed.history if h["kind"] == "train"]
    assert [h["step"] for h in train_losses] == [4, 5, 8, 12]

    # Control: the same resume from a checkpoint with one weight nudged does not match.
    template = jax.eval_shape(
        lambda: train.init_state(config, TC, train.make_optimizer(TC))
    )
    state, meta = train.load_checkpoint(ckpt, template)
    bumped = dict(state.params, norm=state.params["norm"].at[0].add(1e-3))
    meta = {k: v for k, v in meta.items() if k != "step"}
    first_ckpt = tmp_path / "bumped"
    train.save_checkpoint(first_ckpt, state.replace(step=jnp.int32(5), params=bumped), meta)
    other = train.train_model(config, TC, setup.train_rows, setup.heldout_rows,
                              checkpoint_dir=first_ckpt, resume=True, progress=False)
    assert not _leaves_equal(other.params, trained.params)


def test_resume_refuses_other_settings(
    setup: Setup, trained: train.TrainResult, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    train.train_model(trained.config, TC, setup.train_rows, setup.heldout_rows,
                      checkpoint_dir=ckpt, stop_at_step=1, progress=False)
    other = dataclasses.replace(TC, peak_lr=5e-3)
    with pytest.raises(BadInputError, match="train_config"):
        train.train_model(trained.config, other, setup.train_rows, setup.heldout_rows,
                          checkpoint_dir=ckpt, resume=True, progress=False)
    with pytest.raises(BadInputError, match="data"):
        train.train_model(trained.config, TC, setup.train_rows[::-1], setup.heldout_rows,
                          checkpoint_dir=ckpt, resume=True, progress=False)


def test_deadline_stops_cleanly_with_a_checkpoint(
    setup: Setup, trained: train.TrainResult, tmp_path: Path
) -> None:
    result = train.train_model(trained.config, TC, setup.train_rows, setup.heldout_rows,
                               checkpoint_dir=tmp_path, deadline=0.0, progress=False)
    assert result.steps_done == 0 and not result.finished
    assert json.loads((tmp_path / train.CHECKPOINT_META).read_text())["step"] == 0


# -- export ------------------------------------------------------------------------------------


def test_exported_folder_matches_in_our_loader_and_transformers(
    setup: Setup, trained: train.TrainResult, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = setup.tokenizer
    samples = train.greedy_complete(trained.config, trained.params, tok, ["def "],
                                    max_new_tokens=4)
    assert samples[0].startswith("def ")
    card = train.model_card(
        name="tiny", result=trained, train_config=TC, corpus=setup.corpus.describe(),
        tokens={"train": 1000, "heldout": 100}, samples=samples,
        command=train.command_line(["recipe", "--out", "x"]), save_dtype="float32", role="",
    )
    folder = tmp_path / "model"
    train.export_model(folder, trained, tok, card, save_dtype="float32")
    readme = (folder / "README.md").read_text()
    assert "python -m turbospark_jax.train recipe --out x" in readme
    assert f"{trained.eval_loss:.4f}" in readme and "```python\ndef " in readme

    loaded = loading.load_folder(folder)
    assert loaded.config == dataclasses.replace(trained.config, dtype="float32")
    assert _leaves_equal(loaded.params, trained.params)
    assert loaded.tokenizer is not None
    text = "import os\nclass Foo:\n    def bar(self): return 'é'\n"
    ids = loaded.tokenizer.encode(text)
    assert ids == tok.encode(text)

    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids, skip_special_tokens=True) == text
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.eval()
    tokens = np.asarray([ids, setup.heldout_rows[0, : len(ids)].tolist()], np.int32)
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(loaded.model.forward(loaded.params, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# -- packing and the command line --------------------------------------------------------------


def test_pack_and_unpack_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    src = tmp_path / "src" / "model"
    (src / "sub").mkdir(parents=True)
    files = {"a.bin": rng.bytes(5000), "sub/b.txt": b"hello\n" * 300}
    for name, data in files.items():
        (src / name).write_bytes(data)
    written = train.pack_folders([src], tmp_path / "parts", name="m", part_bytes=1024)
    parts = [p for p in written if ".part-" in p.name]
    assert len(parts) > 2 and all(p.stat().st_size <= 1024 for p in parts)
    (out,) = train.unpack_parts(tmp_path / "parts", tmp_path / "dest", name="m")
    assert {n: (out / n).read_bytes() for n in files} == files

    # Control: a damaged part is caught before anything is extracted.
    raw = bytearray(parts[1].read_bytes())
    raw[10] ^= 1
    parts[1].write_bytes(bytes(raw))
    with pytest.raises(BadInputError, match="corrupt"):
        train.unpack_parts(tmp_path / "parts", tmp_path / "dest2", name="m")
    assert not (tmp_path / "dest2").exists()


def test_cli_help_lists_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("tokenizer", "train", "recipe", "pack", "unpack"):
        assert command in out
