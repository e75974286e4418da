"""Constraints on what a completion may generate: a JSON schema, a regular expression or a
grammar, matched token by token by a grammar engine.

This module is the only one that talks to the engine (llguidance,
``docs/decisions/0019-grammar-engine.md``); the rest of the package sees two objects:

* :class:`ConstraintSpec`, what the user asked for. Making one checks it (a schema the engine
  does not support, a regex or grammar that does not parse, is refused with BadInputError
  naming the construct), before any work on the device.
* :class:`Constraint`, a spec bound to a tokenizer and followed through one completion:
  :meth:`Constraint.allowed_mask` is the boolean mask of the ids the next token may take
  (:meth:`Constraint.allowed_words` the same packed in bits),
  :meth:`Constraint.advance` takes the token that was chosen, :meth:`Constraint.forced` is the
  run of tokens the grammar allows as the only continuation, and :attr:`Constraint.is_done`
  says that nothing but the end may follow.

A grammar is written in the engine's Lark dialect (``start: ...`` rules, with ``%json`` for
embedded schemas). The end of the text is a stop token of the request: the mask allows the
request's stop ids once the text so far satisfies the constraint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from turbospark_jax.errors import BadInputError

__all__ = ["KINDS", "Constraint", "ConstraintSpec"]

#: What a constraint may be: a JSON schema, any JSON object, a regular expression over the
#: whole text, or a Lark grammar.
KINDS = ("json_schema", "json_object", "regex", "grammar")

#: A whitespace-free JSON form: the engine's default separators ("," and ":") with no
#: flexible whitespace, so a constrained model does not spend tokens on indentation.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _engine() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a runtime dependency
        raise BadInputError(
            "structured output needs the llguidance package: pip install llguidance"
        ) from exc
    return llguidance


@dataclasses.dataclass(frozen=True)
class ConstraintSpec:
    """What a completion's text must match.

    Build one with :meth:`json_schema`, :meth:`json_object`, :meth:`regex` or
    :meth:`grammar`; each checks its argument now.

    Fields:
      kind: one of :data:`KINDS`.
      source: the schema (as JSON text), the regex or the grammar.
      compiled: the engine's grammar for it.
    """

    kind: str
    source: str
    compiled: str = dataclasses.field(repr=False)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool) -> ConstraintSpec:
        """Text that is one JSON value valid under ``schema`` (a dict or its JSON text).

        Raises:
          BadInputError: the schema is not JSON, or uses a construct the engine does not
            support (the message names it).
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise BadInputError(f"json_schema is not valid JSON: {exc}") from exc
        if schema is True:
            schema = {}
        if not isinstance(schema, Mapping):
            raise BadInputError(
                f"json_schema must be a JSON object (a dict), got {type(schema).__name__}")
        source = json.dumps(schema, sort_keys=True)
        ll = _engine()
        try:
            grammar = ll.LLMatcher.grammar_from_json_schema(source, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise BadInputError(f"json_schema: {exc}") from exc
        return cls._checked("json_schema", source, grammar)

    @classmethod
    def json_object(cls) -> ConstraintSpec:
        """Text that is one JSON object (any keys and values)."""
        return cls.json_schema({"type": "object"})._replace_kind("json_object")

    @classmethod
    def regex(cls, pattern: str) -> ConstraintSpec:
        """Text that matches ``pattern`` whole (Rust ``regex`` syntax: no lookaround, no
        backreferences).

        Raises:
          BadInputError: the pattern does not parse or uses an unsupported construct.
        """
        if not isinstance(pattern, str) or not pattern:
            raise BadInputError("regex must be a non-empty string")
        return cls._checked("regex", pattern, _engine().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def grammar(cls, lark: str) -> ConstraintSpec:
        """Text that the Lark grammar ``lark`` derives from its ``start`` rule.

        Raises:
          BadInputError: the grammar does not parse or uses an unsupported construct.
        """
        if not isinstance(lark, str) or not lark.strip():
            raise BadInputError("grammar must be a non-empty string (a Lark grammar)")
        return cls._checked("grammar", lark, _engine().LLMatcher.grammar_from_lark(lark))

    @classmethod
    def of(cls, *, json_schema: Any = None, regex: str | None = None,
           grammar: str | None = None) -> ConstraintSpec | None:
        """The spec one of the keyword arguments asks for, ``None`` when all are ``None``.

        Raises:
          BadInputError: more than one is given, or the one given is refused.
        """
        given = [name for name, value in (("json_schema", json_schema), ("regex", regex),
                                          ("grammar", grammar)) if value is not None]
        if len(given) > 1:
            raise BadInputError(f"give at most one of json_schema, regex and grammar, got "
                                f"{', '.join(given)}")
        if json_schema is not None:
            return cls.json_schema(json_schema)
        if regex is not None:
            return cls.regex(regex)
        if grammar is not None:
            return cls.grammar(grammar)
        return None

    @classmethod
    def _checked(cls, kind: str, source: str, grammar: str) -> ConstraintSpec:
        error = _engine().LLMatcher.validate_grammar(grammar)
        if error:
            raise BadInputError(f"{kind}: {error.strip()}")
        return cls(kind, source, grammar)

    def _replace_kind(self, kind: str) -> ConstraintSpec:
        return dataclasses.replace(self, kind=kind)

    def bind(self, tokenizer: Any, vocab_size: int,
             stop_ids: Iterable[int] = ()) -> Constraint:
        """A fresh :class:`Constraint` for one completion over ``tokenizer``'s ids, with masks
        of ``vocab_size`` entries (the model's, which may exceed the tokenizer's).

        ``stop_ids``: the ids that end the text; they are allowed once the text satisfies the
        constraint.

        Raises:
          BadInputError: ``tokenizer`` has no ``tokenizers`` backend (``.backend``).
        """
        return Constraint(self, _token_table(tokenizer), int(vocab_size), stop_ids)


#: One engine token table per tokenizer backend (building one reads the whole vocabulary).
_TABLES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _token_table(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise BadInputError(
            f"a constraint needs a tokenizer with a `tokenizers` backend (.backend, as "
            f"turbospark_jax.io.tokenizer.Tokenizer has), got {type(tokenizer).__name__}")
    try:
        return _TABLES[tokenizer]
    except (KeyError, TypeError):
        pass
    eos = getattr(tokenizer, "eos_token_id", None)
    table = _engine().LLTokenizer(backend.to_str(), eos_token=eos)
    with contextlib.suppress(TypeError):  # a tokenizer that cannot be weakly referenced
        _TABLES[tokenizer] = table
    return table


class Constraint:
    """A :class:`ConstraintSpec` followed through one completion (see the module docstring).

    The object is stateful: :meth:`advance` moves it one token on. :meth:`fork` copies it
    (for a branch that must not disturb this one).
    """

    def __init__(self, spec: ConstraintSpec, table: Any, vocab_size: int,
                 stop_ids: Iterable[int]) -> None:
        ll = _engine()
        self.spec = spec
        self.vocab_size = vocab_size
        self._table = table
        self._stop = np.array(sorted({int(i) for i in stop_ids if 0 <= int(i) < vocab_size}),
                              np.int64)
        self._matcher = ll.LLMatcher(table, spec.compiled, log_level=0)
        if self._matcher.is_error():
            raise BadInputError(f"{spec.kind}: {self._matcher.get_error()}")
        self._words = (table.vocab_size + 31) // 32

    def fork(self) -> Constraint:
        """An independent copy at the same point."""
        other = object.__new__(Constraint)
        other.__dict__.update(self.__dict__)
        other._matcher = self._matcher.deep_copy()
        return other

    def allowed_mask(self) -> np.ndarray:
        """``bool[vocab_size]``: the ids the next token may take (the request's stop ids once
        the text so far is complete; ids past the tokenizer's vocabulary never)."""
        bits = np.unpackbits(self.allowed_words().view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def allowed_words(self) -> np.ndarray:
        """:meth:`allowed_mask` packed 32 ids a word: ``uint32[ceil(vocab_size / 32)]``, id
        ``i`` at bit ``i % 32`` of word ``i // 32`` (bits past ``vocab_size`` clear). Built
        from the engine's own bitmask without unpacking it, a thirty-second of the mask's
        bytes to send to a device (``sampling.unpack_mask`` unpacks it there)."""
        v = self.vocab_size
        n = min(v, self._table.vocab_size)  # ids the engine has bits for
        engine = np.frombuffer(self._matcher.compute_bitmask(), "<u4")
        words = np.zeros(-(-v // 32), "<u4")
        whole = n // 32
        words[:whole] = engine[:whole]
        if n % 32:
            words[whole] = engine[whole] & np.uint32((1 << (n % 32)) - 1)
        eos = self._table.eos_token
        if 0 <= eos < v:
            words[eos // 32] &= np.uint32(~(1 << (eos % 32)) & 0xFFFFFFFF)  # spelled by stops
        if self._matcher.is_accepting():
            for t in self._stop.tolist():
                words[t // 32] |= np.uint32(1 << (t % 32))
        return words

    def allows(self, token: int) -> bool:
        """Whether ``allowed_mask()[token]`` is set, read from the engine's bitmask for this
        one id (no full mask is built)."""
        t = int(token)
        if not 0 <= t < self.vocab_size:
            return False
        if self._matcher.is_accepting() and t in self._stop:
            return True
        if t == self._table.eos_token or t >= self._table.vocab_size:
            return False
        bits = self._matcher.compute_bitmask()
        return bool(bits[t // 8] >> (t % 8) & 1)

    def follow(self, tokens: Sequence[int]) -> int:
        """Take the longest prefix of ``tokens`` that token-by-token greedy constrained
        decoding could have emitted itself, and return its length.

        A greedy draw over the masked logits is the unmasked draw whenever the mask allows
        that: so each token is taken while the mask allows it and the grammar forces no run
        at its place (a forced run is emitted without sampling, whatever the model prefers);
        a stop id ends the prefix after it, and so does a token after which the text is done.
        """
        taken = 0
        for t in tokens:
            if taken and self.forced_next():
                break
            if not self.allows(t):
                break
            self.advance(t)
            taken += 1
            if int(t) in self._stop or self.is_done:
                break
        return taken

    def forced_next(self) -> bool:
        """Whether the grammar forces a run here (:meth:`forced` would take tokens)."""
        return not self.is_done and bool(self._matcher.compute_ff_tokens())

    def advance(self, token: int) -> None:
        """Take ``token`` (a stop id ends the text and is not matched).

        Raises:
          BadInputError: the token is not allowed here (the caller sampled outside the mask).
        """
        if int(token) in self._stop:
            return
        if not self._matcher.consume_token(int(token)):
            raise BadInputError(
                f"token {token} breaks the {self.spec.kind} constraint: "
                f"{self._matcher.get_error()}")

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar allows as the only continuation (at most ``limit``), taken
        (the constraint moves past them)."""
        if limit <= 0 or self.is_done:
            return []
        run = list(self._matcher.compute_ff_tokens())[:limit]
        if run and not self._matcher.consume_tokens(run):
            raise BadInputError(f"{self.spec.kind}: {self._matcher.get_error()}")
        return run

    @property
    def is_done(self) -> bool:
        """Nothing but the end may follow: the text is complete."""
        return bool(self._matcher.is_stopped())

    @property
    def is_satisfied(self) -> bool:
        """The text so far is a complete match (the end may come here)."""
        return bool(self._matcher.is_accepting())
