"""The small corpus, tokenizer and packed rows that the recipe's test modules share.

A 40-file, evenly spaced subset of the standard library and a 512-token vocabulary keep every
module quick; the result is cached so modules in one session build it once.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_recipe import Corpus, encode_documents, load_corpus, pack_rows, train_tokenizer

SEQ_LEN = 32


@dataclasses.dataclass(frozen=True)
class Setup:
    corpus: Corpus
    tokenizer: Tokenizer
    train_rows: np.ndarray
    heldout_rows: np.ndarray


@functools.cache
def recipe_setup() -> Setup:
    corpus = load_corpus(heldout_fraction=0.1, max_files=40)
    tokenizer = train_tokenizer([d.text for d in corpus.train], vocab_size=512)
    train_rows = pack_rows(encode_documents(tokenizer, corpus.train), SEQ_LEN)
    heldout_rows = pack_rows(encode_documents(tokenizer, corpus.heldout), SEQ_LEN)
    return Setup(corpus, tokenizer, train_rows, heldout_rows[:64])
