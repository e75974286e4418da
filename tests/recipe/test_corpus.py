"""The recipe's data on the CPU: the corpus split, the tokenizer, framing, packing, data order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.recipe.data import SEQ_LEN, Setup, recipe_setup
from turbospark_jax.errors import BadInputError
from turbospark_recipe import corpus as rc
from turbospark_recipe.tokenizer_training import train_tokenizer


@pytest.fixture(scope="module")
def setup() -> Setup:
    return recipe_setup()


# -- corpus ------------------------------------------------------------------------------------


def test_corpus_excludes_third_party_and_splits_by_file() -> None:
    paths = rc.list_corpus_files(rc.stdlib_root())
    assert paths == sorted(paths) and len(paths) > 500
    assert not any(p.startswith(("site-packages/", "pydoc_data/")) for p in paths)
    assert not any("__pycache__" in p or p.startswith("lib2to3/tests/data/") for p in paths)
    held = [p for p in paths if rc.is_heldout(p, 0.03)]
    assert 0.01 < len(held) / len(paths) < 0.06
    # The split of a file depends on its path alone: any subset splits the same way.
    held_set = set(held)
    assert all(rc.is_heldout(p, 0.03) == (p in held_set) for p in paths[::7])


def test_heldout_split_is_disjoint_and_complete(setup: Setup) -> None:
    train_paths = {d.path for d in setup.corpus.train}
    held_paths = {d.path for d in setup.corpus.heldout}
    assert train_paths and held_paths and not train_paths & held_paths
    assert len(train_paths) + len(held_paths) + len(setup.corpus.skipped) == 40
    assert all(rc.is_heldout(p, 0.1) for p in held_paths)
    assert not any(rc.is_heldout(p, 0.1) for p in train_paths)


# -- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_special_tokens(setup: Setup) -> None:
    tok = setup.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert [tok.id_to_token(i) for i in range(3)] == ["<|bos|>", "<|eos|>", "<|pad|>"]
    ids = tok.encode("def f():\n    return 1\n")
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert 300 < tok.vocab_size <= 512
    assert tok.apply_chat_template([{"role": "user", "content": "import os"}]) == (
        "<|bos|># import os\n"
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
    a = train_tokenizer(texts, vocab_size=400)
    b = train_tokenizer(texts, vocab_size=400)
    assert a.backend.to_str() == b.backend.to_str()


# -- data --------------------------------------------------------------------------------------


def test_documents_are_framed_and_packed_without_loss(setup: Setup) -> None:
    tok = setup.tokenizer
    docs = setup.corpus.train[:3]
    stream = rc.encode_documents(tok, docs)
    assert stream.dtype == np.int32
    assert stream[0] == tok.bos_token_id and stream[-1] == tok.eos_token_id
    assert int((stream == tok.bos_token_id).sum()) == 3 == int((stream == tok.eos_token_id).sum())
    rows = rc.pack_rows(stream, SEQ_LEN)
    assert rows.shape == ((len(stream) - 1) // SEQ_LEN, SEQ_LEN + 1)
    # Consecutive rows overlap by exactly one token and together they are the stream.
    np.testing.assert_array_equal(rows[:-1, -1], rows[1:, 0])
    rebuilt = np.concatenate([rows[0], *[r[1:] for r in rows[1:]]])
    np.testing.assert_array_equal(rebuilt, stream[: len(rebuilt)])


def test_data_order_is_deterministic_and_covers_each_epoch() -> None:
    a = rc.DataOrder(50, 8, seed=3)
    b = rc.DataOrder(50, 8, seed=3)
    steps = range(20)
    assert all(np.array_equal(a.indices(s), b.indices(s)) for s in steps)
    # Control: another seed gives another order.
    c = rc.DataOrder(50, 8, seed=4)
    assert not all(np.array_equal(a.indices(s), c.indices(s)) for s in steps)
    per_epoch = a.batches_per_epoch
    for epoch in range(2):
        seen = np.concatenate([a.indices(epoch * per_epoch + j) for j in range(per_epoch)])
        assert len(set(seen.tolist())) == len(seen) == per_epoch * 8
    assert not np.array_equal(a.indices(0), a.indices(per_epoch))
    with pytest.raises(BadInputError):
        rc.DataOrder(5, 8, seed=0)
