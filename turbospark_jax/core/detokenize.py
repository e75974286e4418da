"""Incremental, UTF-8-safe detokenization: token ids in, finished text out.

Decoding one token at a time does not work: a byte-level BPE token may hold half a Korean
syllable, a sentencepiece byte-fallback token ``<0xE3>`` a third of one, and a sentencepiece
decoder drops the leading space of whatever sequence it is given first. So
:class:`IncrementalDetokenizer` lets the tokenizer decode a short sliding window of ids and emits
the difference:

* ``prefix_offset .. read_offset`` are ids whose text was already emitted. They stay in the
  window as context, so whatever the decoder does at the start of a sequence (dropping a
  space) happens to the context and not to the new text.
* ``read_offset ..`` are the ids whose text is not (fully) emitted yet.

Each push decodes the window. If its text ends in U+FFFD (the replacement character a decoder
writes for an incomplete UTF-8 sequence) the last character is unfinished: the text before the
trailing U+FFFD run is emitted, the rest waits. Once the window decodes cleanly, its text is
emitted in full and the window slides forward: the ids just read become the new context.

The result: for byte-level BPE tokenizers, everything pushed plus :meth:`flush` equals
``tokenizer.decode(all_generated_ids)``, and no U+FFFD is emitted for valid UTF-8. A literal
U+FFFD at the end of the window is indistinguishable from an unfinished character; it is held
until the next token arrives or :meth:`flush`. Other tokenizers get the same for valid UTF-8
(tested with sentencepiece-style byte fallback); on invalid bytes they may differ from a
whole-sequence decode, for example ByteFallback writes U+FFFD for every byte of an invalid run
of byte tokens, ASCII ones included, while the stream has already emitted those finished
characters.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Protocol

from turbospark_jax.errors import BadInputError

__all__ = ["TOKENIZER_CALLS", "IncrementalDetokenizer", "TokenizerLike", "provides"]

#: What decoders write for bytes that are not (yet) valid UTF-8.
REPLACEMENT = "\ufffd"

#: Prompt ids kept as context before the first generated token: enough for any decoder seen in
#: practice to decide the first token's leading space, and few enough to decode cheaply.
PROMPT_CONTEXT_IDS = 5


class TokenizerLike(Protocol):
    """The two tokenizer calls the detokenizer needs; :class:`tokenizers.Tokenizer` has both.
    (The loops refuse an object without them before any work: :func:`provides` with
    :data:`TOKENIZER_CALLS`.)"""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence is written as U+FFFD."""
        ...

    def id_to_token(self, id: int, /) -> str | None:
        """The token string of ``id``, or ``None`` when the id is not in the vocabulary."""
        ...


def provides(obj: object, names: tuple[str, ...]) -> bool:
    """Whether ``obj`` has every attribute in ``names``, looked up as a call would look it up,
    so a wrapper that forwards through ``__getattr__`` counts. (From Python 3.12 on,
    ``isinstance`` against a runtime-checkable protocol looks its members up statically and
    refuses such a wrapper, which 3.11 accepts.)"""
    return all(hasattr(obj, name) for name in names)


#: What :class:`TokenizerLike` asks of an object.
TOKENIZER_CALLS = ("decode", "id_to_token")


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of finished text.

    Args:
      tokenizer: anything with ``decode(ids, skip_special_tokens=...)`` and ``id_to_token``.
      prompt_ids: the prompt's ids (or just its tail), used only as context so the first
        generated token decodes as it would after the prompt (its leading space kept). Their
        own text is never emitted.
      skip_special_tokens: passed to every ``decode``; ``True`` leaves special tokens such as
        ``<|eos|>`` out of the text.

    Raises:
      BadInputError: a prompt id is not in the tokenizer's vocabulary.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = () if prompt_ids is None else prompt_ids
        self._ids: list[int] = [self._checked(i, "prompt id") for i in context]
        self._generated: list[int] = []
        self._pieces: list[str] = []
        self._flushed = False
        self._read = len(self._ids)
        self._prefix = max(0, self._read - PROMPT_CONTEXT_IDS)
        # A window of ids that decode to nothing (skipped special tokens) is no context: the
        # first generated token would lose its leading space. Widen it (doubling) until it
        # holds text or reaches the prompt's start.
        while self._prefix > 0 and not self._decode(self._prefix, self._read):
            self._prefix = max(0, self._read - 2 * (self._read - self._prefix))
        # A window that starts inside a multi-byte character would begin with U+FFFD; step back
        # to a character boundary so the context decodes the way it reads.
        while self._prefix > 0 and self._decode(self._prefix, self._read).startswith(REPLACEMENT):
            self._prefix -= 1
        self._prefix_text = self._decode(self._prefix, self._read)
        # Characters of the window's text already accounted for. A prompt that ends inside a
        # character leaves that character to the generated text that completes it.
        self._shown = len(self._prefix_text.rstrip(REPLACEMENT))

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    @property
    def token_ids(self) -> list[int]:
        """The generated ids pushed so far (a copy; the prompt is not included)."""
        return list(self._generated)

    def push(self, token_id: int) -> str:
        """Add one generated token and return the text it completes (possibly ``""``).

        Args:
          token_id: the next generated id.

        Returns:
          Newly finished text. Never ends inside a character.

        Raises:
          BadInputError: the id is not in the tokenizer's vocabulary, or the detokenizer was
            already flushed.
        """
        if self._flushed:
            raise BadInputError("push after flush: the detokenizer has already finished")
        self._ids.append(self._checked(token_id, "token id"))
        self._generated.append(self._ids[-1])
        window = self._decode(self._prefix, len(self._ids))
        finished = window.rstrip(REPLACEMENT)
        out = window[self._shown : len(finished)]
        self._shown = max(self._shown, len(finished))
        # Slide only once the whole window is finished and holds new text: sliding over ids
        # that decode to nothing (a skipped special token) would leave the next token without
        # context and lose its leading space.
        if len(finished) == len(window) and len(window) > len(self._prefix_text):
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._decode(self._prefix, self._read)
            self._shown = len(self._prefix_text)
        return self._emit(out)

    def flush(self) -> str:
        """End of generation: return whatever is still held, unfinished characters included.

        An unfinished character comes out as the decoder writes it (U+FFFD). Calling flush
        again returns ``""``.
        """
        if self._flushed:
            return ""
        self._flushed = True
        return self._emit(self._decode(self._prefix, len(self._ids))[self._shown :])

    def _decode(self, start: int, stop: int) -> str:
        if start >= stop:
            return ""
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip_special)

    def _checked(self, token_id: int, what: str) -> int:
        try:
            # operator.index accepts Python, NumPy and 0-d JAX integers, and refuses floats.
            index = operator.index(token_id)
        except TypeError:
            index = None
        if index is None or isinstance(token_id, bool):
            raise BadInputError(f"{what} must be an integer, got {token_id!r}")
        token_id = index
        if token_id < 0 or self._tokenizer.id_to_token(token_id) is None:
            raise BadInputError(f"{what} {token_id} is not in the tokenizer's vocabulary")
        return token_id

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text
