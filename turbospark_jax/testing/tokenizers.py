"""Fixture tokenizers trained in-process: no files, no downloads, the same result every call.

Two families cover how real tokenizers cut multi-byte characters:

* :func:`byte_level_bpe`: GPT-2 / Qwen style. Text is turned into bytes, each byte shown as one
  printable character; merges are learned over those. With a small vocabulary a Korean syllable
  (3 bytes) or an emoji (4 bytes) is split across tokens that decode to nothing readable alone.
* :func:`byte_fallback_bpe`: sentencepiece / Llama style. Merges are learned over characters
  (spaces shown as ``▁``); a character outside the learned alphabet is spelled as byte tokens
  ``<0x00>`` .. ``<0xFF>``, which the decoder joins back into UTF-8.

Both are deterministic: training runs once per argument set and each call returns a fresh
:class:`tokenizers.Tokenizer` rebuilt from the cached JSON, so a caller that changes settings
(padding, truncation) on its copy affects nobody else.
"""

from __future__ import annotations

import collections
import functools
import json
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from turbospark_jax.errors import BadInputError

__all__ = [
    "BYTE_FALLBACK_SPECIALS",
    "BYTE_LEVEL_SPECIALS",
    "CORPUS",
    "byte_fallback_bpe",
    "byte_level_bpe",
    "byte_level_token",
    "byte_token_ids",
]

#: Special tokens of :func:`byte_level_bpe`, in id order (ids 0, 1, 2).
BYTE_LEVEL_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
#: Special tokens of :func:`byte_fallback_bpe`, in id order (ids 0, 1, 2).
BYTE_FALLBACK_SPECIALS = ("<unk>", "<s>", "</s>")

#: The built-in training text: several scripts, accents, emoji (some with modifiers) and code.
CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "안녕하세요, 세계! 오늘 날씨가 정말 좋네요.",
    "감사합니다. 다음에 또 만나요. 한국어 문장을 토큰으로 나눕니다.",
    "日本語のテキストも少し入れておきます。東京は晴れです。",
    "中文文本：今天天气很好，我们去公园散步吧。",
    "Emoji: 🙂 🎉 👍🏽 ❤️ 🚀 and a family 👨‍👩‍👧 in one line.",
    "Café, naïve, façade, jalapeño, Straße, smörgåsbord.",
    "def add(a, b):\n    return a + b  # simple code\n",
    "for i in range(10): print(i ** 2)",
    "Numbers 0123456789 and symbols <>{}[]()!?@#$%^&*-+=~",
    "Привет, мир! Ελληνικά γράμματα. שלום עולם. مرحبا بالعالم.",
    "the the the and and of of to to in in is is it it",
)


def _byte_level_chars() -> dict[int, str]:
    """The printable character that byte-level BPE uses for each byte value.

    Bytes that are already visible Latin-1 characters stand for themselves; the rest (controls,
    space, a few others) are shifted to code points from 256 up, in byte order.
    """
    visible = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in visible}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return chars


_BYTE_LEVEL_CHARS = _byte_level_chars()


def byte_level_token(byte: int) -> str:
    """The byte-level BPE token string that spells the single byte ``byte`` (0..255)."""
    return _BYTE_LEVEL_CHARS[byte]


def _corpus_key(corpus: Sequence[str] | None) -> tuple[str, ...]:
    if corpus is None:
        return CORPUS
    if isinstance(corpus, str) or not all(isinstance(line, str) for line in corpus):
        raise BadInputError("corpus must be a sequence of str (one training text per item)")
    if not corpus:
        raise BadInputError("corpus must hold at least one training text")
    return tuple(corpus)


def _check_vocab_size(vocab_size: int, floor: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < floor:
        raise BadInputError(
            f"vocab_size must be an integer >= {floor} (the fixed tokens), got {vocab_size!r}"
        )


@functools.lru_cache(maxsize=16)
def _byte_level_json(vocab_size: int, corpus: tuple[str, ...]) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BYTE_LEVEL_SPECIALS),
        # Every byte gets a token even if the corpus never uses it, so any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer.to_str()


def byte_level_bpe(vocab_size: int = 300, corpus: Sequence[str] | None = None) -> Tokenizer:
    """A GPT-2 style byte-level BPE tokenizer trained on ``corpus``.

    Args:
      vocab_size: total vocabulary: 3 special tokens, 256 byte tokens, then learned merges.
        The default leaves few merges, so most multi-byte characters span several tokens.
      corpus: training texts; ``None`` uses :data:`CORPUS`.

    Returns:
      A fresh tokenizer. Ids 0, 1, 2 are ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` (special).
      Encoding and decoding round-trip any text exactly.

    Raises:
      BadInputError: ``vocab_size`` is below 259, or ``corpus`` is not a non-empty sequence
        of strings.
    """
    _check_vocab_size(vocab_size, len(BYTE_LEVEL_SPECIALS) + 256)
    return Tokenizer.from_str(_byte_level_json(vocab_size, _corpus_key(corpus)))


@functools.lru_cache(maxsize=16)
def _byte_fallback_json(vocab_size: int, corpus: tuple[str, ...], alphabet_size: int) -> str:
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # Llama's decoder chain: spaces back, bytes to text, one string, drop the prepended space.
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    # Only the most frequent characters join the alphabet; the rest fall back to bytes. The
    # trainer's own ``limit_alphabet`` breaks ties between equal counts in hash order, which
    # changes the vocabulary from run to run, so the alphabet is chosen here, ties by code point.
    counts: collections.Counter[str] = collections.Counter()
    for text in corpus:
        for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text):
            counts.update(piece)
    ranked = sorted(counts, key=lambda char: (-counts[char], char))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # Listing the byte tokens here reserves ids 3..258 for them, before any learned token.
        special_tokens=[*BYTE_FALLBACK_SPECIALS, *byte_tokens],
        initial_alphabet=ranked[:alphabet_size],
        limit_alphabet=alphabet_size,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    spec = json.loads(tokenizer.to_str())
    # The byte tokens must stay ordinary vocabulary entries: as added special tokens they would
    # be matched in input text and dropped by ``decode(..., skip_special_tokens=True)``.
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_tokens]
    return json.dumps(spec, ensure_ascii=False)


def byte_fallback_bpe(
    vocab_size: int = 400,
    corpus: Sequence[str] | None = None,
    alphabet_size: int = 60,
) -> Tokenizer:
    """A sentencepiece-like BPE tokenizer with byte fallback, trained on ``corpus``.

    Args:
      vocab_size: total vocabulary: 3 special tokens, 256 byte tokens ``<0x00>``..``<0xFF>``,
        then the learned alphabet and merges.
      corpus: training texts; ``None`` uses :data:`CORPUS`.
      alphabet_size: how many of the most frequent characters become tokens of their own;
        every other character is spelled with byte tokens.

    Returns:
      A fresh tokenizer. Ids 0, 1, 2 are ``<unk>``, ``<s>``, ``</s>`` (special); ids 3 + b are
      the byte tokens. Spaces are encoded as ``▁``; decoding drops the one space that encoding
      puts in front of the text.

    Raises:
      BadInputError: ``vocab_size`` is below 259, ``alphabet_size`` is not positive, or
        ``corpus`` is not a non-empty sequence of strings.
    """
    _check_vocab_size(vocab_size, len(BYTE_FALLBACK_SPECIALS) + 256)
    if isinstance(alphabet_size, bool) or not isinstance(alphabet_size, int) or alphabet_size < 1:
        raise BadInputError(f"alphabet_size must be a positive integer, got {alphabet_size!r}")
    return Tokenizer.from_str(_byte_fallback_json(vocab_size, _corpus_key(corpus), alphabet_size))


def byte_token_ids(tokenizer: Tokenizer, data: bytes) -> list[int]:
    """Ids of the single-byte tokens spelling ``data``, one token per byte.

    Useful to build token sequences that cut characters anywhere, as a model may generate them.
    Works for both fixture families (byte-level characters or ``<0xNN>`` tokens).

    Raises:
      BadInputError: the tokenizer has no single-byte token for some byte.
    """
    ids = []
    for byte in data:
        for name in (byte_level_token(byte), f"<0x{byte:02X}>"):
            token_id = tokenizer.token_to_id(name)
            if token_id is not None:
                ids.append(token_id)
                break
        else:
            raise BadInputError(f"tokenizer has no single-byte token for byte 0x{byte:02X}")
    return ids
