"""A thin tokenizer over the ``tokenizers`` library, read from Hugging Face tokenizer files.

A folder saved by transformers 5.x holds ``tokenizer.json`` (the fast tokenizer itself),
``tokenizer_config.json`` (special tokens, the ``add_bos_token`` / ``add_eos_token`` flags)
and ``chat_template.jinja``; older folders keep the chat template as the ``chat_template`` key
of ``tokenizer_config.json`` (a string, or a list of named templates) and special tokens as
strings or ``{"content": ...}`` objects, possibly in ``special_tokens_map.json``. All of these
are read.

What matches transformers' generic fast tokenizer (``TokenizersBackend``): ``encode``, whose
BOS/EOS handling is the ``post_processor`` in ``tokenizer.json`` (an ``add_bos_token`` flag in
``tokenizer_config.json`` is not consulted: the generic class ignores it too, and
model-specific tokenizer classes that rebuild the post-processor are not mimicked);
``decode`` without ``clean_up_tokenization_spaces`` (transformers' default); and
``apply_chat_template`` (same sandboxed jinja2 settings, ``raise_exception``,
``strftime_now``, and the named special tokens as template variables).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from turbospark_jax.errors import BadInputError, ModelLoadError, UnsupportedCapabilityError

#: Named special tokens, in the order transformers lists them; each is a template variable.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _token_text(value: Any) -> str | None:
    # Special tokens appear as plain strings or as serialized AddedToken objects.
    if value is None:
        return None
    if isinstance(value, Mapping):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value)


def _template_raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _template_tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class Tokenizer:
    """Encode, decode and render chat templates.

    Build one with :meth:`from_folder` (Hugging Face files) or :meth:`from_tokenizers` (an
    in-memory ``tokenizers.Tokenizer``); :meth:`save` writes the files back.
    """

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        """Wrap ``tokenizer``.

        Args:
          tokenizer: the ``tokenizers.Tokenizer``.
          special_tokens: token text for any of :data:`SPECIAL_TOKEN_NAMES`.
          extra_special_tokens: further special tokens (chat markers and the like).
          chat_template: a jinja2 chat template, or ``None``.
          config: the rest of ``tokenizer_config.json``, kept so :meth:`save` writes it back.

        Raises:
          ModelLoadError: a named special token is not in the vocabulary.
        """
        self._tok = tokenizer
        self._special: dict[str, str] = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := (special_tokens or {}).get(name)) is not None
        }
        for name, text in self._special.items():
            if tokenizer.token_to_id(text) is None:
                raise ModelLoadError(f"{name} {text!r} is not in the tokenizer's vocabulary")
        self._extra = tuple(extra_special_tokens)
        self.chat_template = chat_template
        self._config = dict(config or {})
        self._compiled: jinja2.Template | None = None

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` plus ``tokenizer_config.json`` and the chat template.

        Args:
          path: a Hugging Face model or tokenizer folder.

        Returns:
          The tokenizer.

        Raises:
          ModelLoadError: ``tokenizer.json`` is missing or unreadable, or a config file is
            not valid JSON.
        """
        folder = os.fspath(path)
        tok_path = os.path.join(folder, TOKENIZER_FILE)
        if not os.path.isfile(tok_path):
            raise ModelLoadError(f"no {TOKENIZER_FILE} in {folder}")
        try:
            tok = _HFTokenizer.from_file(tok_path)
        except Exception as e:  # the Rust library raises a bare Exception on bad files
            raise ModelLoadError(f"could not read {tok_path}: {e}") from e
        config = _read_json(os.path.join(folder, TOKENIZER_CONFIG_FILE)) or {}
        legacy_map = _read_json(os.path.join(folder, "special_tokens_map.json")) or {}
        special = {
            name: _token_text(config.get(name, legacy_map.get(name)))
            for name in SPECIAL_TOKEN_NAMES
        }
        extra_raw = (
            config.get("extra_special_tokens")
            or config.get("additional_special_tokens")
            or legacy_map.get("additional_special_tokens")
            or []
        )
        if isinstance(extra_raw, Mapping):  # the named form: {"image_token": "<img>", ...}
            extra_raw = list(extra_raw.values())
        extra = [t for t in (_token_text(x) for x in extra_raw) if t is not None]
        template = _find_chat_template(folder, config)
        kept = {
            k: v for k, v in config.items()
            if k not in SPECIAL_TOKEN_NAMES and k not in ("chat_template", "extra_special_tokens",
                                                          "additional_special_tokens")
        }
        return cls(tok, special_tokens=special, extra_special_tokens=extra,
                   chat_template=template, config=kept)

    @classmethod
    def from_tokenizers(
        cls,
        tokenizer: _HFTokenizer,
        *,
        bos: str | int | None = None,
        eos: str | int | None = None,
        pad: str | int | None = None,
        unk: str | int | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Wrap an in-memory ``tokenizers.Tokenizer``.

        Args:
          tokenizer: the tokenizer.
          bos, eos, pad, unk: each a token's text or id, or ``None``.
          extra_special_tokens: further special tokens' text.
          chat_template: a jinja2 chat template, or ``None``.

        Returns:
          The tokenizer.

        Raises:
          ModelLoadError: a special token is not in the vocabulary.
        """

        def text(value: str | int | None, name: str) -> str | None:
            if value is None or isinstance(value, str):
                return value
            found = tokenizer.id_to_token(int(value))
            if found is None:
                raise ModelLoadError(f"{name} id {value} is not in the tokenizer's vocabulary")
            return found

        special = {
            "bos_token": text(bos, "bos_token"),
            "eos_token": text(eos, "eos_token"),
            "pad_token": text(pad, "pad_token"),
            "unk_token": text(unk, "unk_token"),
        }
        return cls(tokenizer, special_tokens=special, extra_special_tokens=extra_special_tokens,
                   chat_template=chat_template)

    def save(self, folder: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``.

        Args:
          folder: the destination (created if needed).
        """
        folder = os.fspath(folder)
        os.makedirs(folder, exist_ok=True)
        self._tok.save(os.path.join(folder, TOKENIZER_FILE))
        config: dict[str, Any] = {"tokenizer_class": "TokenizersBackend", **self._config}
        config.update(self._special)
        if self._extra:
            config["extra_special_tokens"] = list(self._extra)
        with open(os.path.join(folder, TOKENIZER_CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")
        template_path = os.path.join(folder, CHAT_TEMPLATE_FILE)
        if self.chat_template is not None:
            with open(template_path, "w", encoding="utf-8") as f:
                f.write(self.chat_template)

    # -- vocabulary -------------------------------------------------------------------------

    @property
    def backend(self) -> _HFTokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens that are set, e.g. ``{"eos_token": "</s>"}``."""
        return dict(self._special)

    @property
    def extra_special_tokens(self) -> tuple[str, ...]:
        """Special tokens beyond the named ones."""
        return self._extra

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every named and extra special token, without repeats."""
        ids: list[int] = []
        for text in (*self._special.values(), *self._extra):
            i = self._tok.token_to_id(text)
            if i is not None and i not in ids:
                ids.append(i)
        return ids

    def _special_id(self, name: str) -> int | None:
        text = self._special.get(name)
        return None if text is None else self._tok.token_to_id(text)

    @property
    def bos_token(self) -> str | None:
        """Beginning-of-sequence token text, if any."""
        return self._special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """End-of-sequence token text, if any."""
        return self._special.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        """Padding token text, if any."""
        return self._special.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence id, if any."""
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """End-of-sequence id, if any."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """Padding id, if any."""
        return self._special_id("pad_token")

    def id_to_token(self, token_id: int) -> str | None:
        """The token text of ``token_id``, or ``None`` outside the vocabulary."""
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token``, or ``None`` when it is not one token."""
        return self._tok.token_to_id(token)

    # -- text -------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (BOS etc.)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``.

        Raises:
          BadInputError: an id outside the vocabulary.
        """
        ids = [int(i) for i in ids]
        size = self.vocab_size
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise BadInputError(f"token id {bad[0]} is outside the vocabulary (size {size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the chat template, as transformers would.

        The template runs in jinja2's immutable sandbox with ``trim_blocks`` and
        ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``,
        ``strftime_now`` and a ``tojson`` that does not HTML-escape; the named special tokens
        (``bos_token``, ``eos_token``, ...) are variables. ``kwargs`` become variables too
        (``tools``, ``enable_thinking``...) and win over the special tokens.

        Args:
          messages: ``{"role": ..., "content": ...}`` dicts.
          add_generation_prompt: append the header that starts the assistant's turn.
          **kwargs: further template variables.

        Returns:
          The rendered prompt text (not tokenized; encode it with
          ``add_special_tokens=False``, as transformers does).

        Raises:
          UnsupportedCapabilityError: the tokenizer has no chat template.
          BadInputError: the template refused the messages (``raise_exception``), or the
            conversation is empty.
        """
        if self.chat_template is None:
            raise UnsupportedCapabilityError(
                "this tokenizer has no chat template (no chat_template.jinja and no "
                "chat_template in tokenizer_config.json); format the prompt yourself"
            )
        if not messages:
            raise BadInputError("cannot apply a chat template to an empty conversation")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        variables: dict[str, Any] = {**self._special, **kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        plain = [_plain_message(m) for m in messages]
        try:
            return self._compiled.render(
                messages=plain, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as e:
            raise BadInputError(f"the chat template refused these messages: {e}") from e


#: Names a message's reasoning may come under; templates read the first (Qwen) or "thinking".
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # As transformers does: drop None-valued keys, and expose reasoning under both names
    # templates read, whichever name the caller used.
    out = {k: v for k, v in dict(message).items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _template_tojson
    env.globals["raise_exception"] = _template_raise
    env.globals["strftime_now"] = _template_now
    return env.from_string(source)


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _find_chat_template(folder: str, config: Mapping[str, Any]) -> str | None:
    jinja_path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if template is None:
        template = (_read_json(os.path.join(folder, "chat_template.json")) or {}).get(
            "chat_template"
        )
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None
