"""Chat sessions: a message history rendered with the chat template, served through a pool.

Each turn renders the WHOLE history (system prompt, every user message, every reply so far,
then the header of the assistant's next turn) with the tokenizer's chat template, encodes it
and runs it as one completion in the session's slot of a
:class:`~turbospark_jax.sessions.session_pool.SessionPool`. Nothing is appended to a cached token
list:
the previous reply comes back re-tokenized from its TEXT, exactly as a stateless server would
see it, and the producer reuses whatever prefix its state actually fed
(:mod:`turbospark_jax.core.kv_prefix`). When the model generated the canonical split of its reply,
reuse runs to the end of the reply; when it generated another split of the same text (or bytes
that do not form valid UTF-8), reuse stops where the two diverge. Either way the output is the
same as serving the history from a fresh state.

A message may carry images (a session given a
:class:`~turbospark_jax.io.vision.VisionEncoder`): the message gets one image token per image
(unless its text already places them), the rendered history's image tokens grow into spans,
and every image of the conversation so far is injected into its span each turn. The images
stay with their messages, so a later turn renders the same spans at the same positions with
the same identities, and their KV is reused like any other prefix.

Generation stops on the tokenizer's end-of-sequence id and any end-of-turn marker it knows
(:func:`default_stop_ids`), unless the session is given ``stop_token_ids``.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Generator, Mapping, Sequence
from typing import Any, Protocol

from turbospark_jax.core.checks import as_int
from turbospark_jax.core.detokenize import provides
from turbospark_jax.core.streams import Stream, StreamEvent
from turbospark_jax.errors import BadInputError, SessionError, UnsupportedCapabilityError
from turbospark_jax.generation.completion import Completion, CompletionRequest, FinishReason
from turbospark_jax.io.images import PreparedImage
from turbospark_jax.io.images import as_list as as_image_list
from turbospark_jax.io.vision import VisionEncoder, require_vision
from turbospark_jax.sessions.session_pool import SessionId, SessionPool

__all__ = ["END_OF_TURN_TOKENS", "ChatSession", "default_stop_ids"]

#: Tokens that end an assistant turn in common chat templates (ChatML / Qwen, Llama 3,
#: Gemma, Phi). Those that are single tokens of a tokenizer stop generation by default.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")

#: What :class:`ChatTokenizer` asks for, for messages.
_TOKENIZER_NEEDS = ("eos_token_id", "chat_template", "token_to_id", "encode", "decode",
                    "id_to_token", "apply_chat_template")

#: Request settings a session accepts as defaults or per-turn overrides.
REQUEST_FIELDS = tuple(
    f.name for f in dataclasses.fields(CompletionRequest)
    if f.name not in ("prompt_ids", "injection")  # both come from the history
)


class ChatTokenizer(Protocol):
    """What a chat session needs of a tokenizer (:class:`turbospark_jax.io.tokenizer.Tokenizer`
    has all of it). ``chat_template`` is ``None`` when the tokenizer has none. A session
    refuses a tokenizer that lacks any of it (:data:`_TOKENIZER_NEEDS`) before any work."""

    eos_token_id: int | Sequence[int] | None
    chat_template: str | None

    def token_to_id(self, token: str) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str | list[int]: ...


def default_stop_ids(tokenizer: ChatTokenizer) -> tuple[int, ...]:
    """The ids that end a reply: the end-of-sequence id(s) and the end-of-turn markers the
    tokenizer knows as single tokens.

    Returns:
      The distinct ids, end-of-sequence first; empty when the tokenizer names none.

    Raises:
      BadInputError: the tokenizer answers with something that is not an integer id.
    """
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for candidate in eos if isinstance(eos, Sequence) else [eos]:
        if candidate is not None and as_int("eos_token_id", candidate) not in ids:
            ids.append(int(candidate))
    for text in END_OF_TURN_TOKENS:
        found = tokenizer.token_to_id(text)
        if found is not None and as_int(f"the id of {text}", found) not in ids:
            ids.append(int(found))
    return tuple(ids)


class ChatSession:
    """A conversation with a model, one :meth:`send` per user message.

    Args:
      pool_or_producer: a :class:`~turbospark_jax.sessions.session_pool.SessionPool` shared with
      other
        sessions, or a producer (the session then gets a pool of one slot to itself).
      tokenizer: encodes, decodes and renders the chat template: ``apply_chat_template(
        messages, add_generation_prompt=True, **template_kwargs)`` returning text (encoded with
        ``encode(text, add_special_tokens=False)``) or ids; ``decode`` and ``id_to_token`` for
        the reply text; ``eos_token_id`` / ``token_to_id`` for the default stop ids.
        :class:`turbospark_jax.io.tokenizer.Tokenizer` has all of them.
      session_id: this conversation's id in the pool; a random one when ``None``.
      system: a system prompt, sent as the first message of every turn.
      template_kwargs: extra chat-template variables (``enable_thinking=False``, ...).
      vision: the model's vision tower, for messages with images (``None``: text only).
      **defaults: request settings for every turn (``max_tokens``, ``sampling``, ``seed``,
        ``stop_strings``, ``stop_token_ids``, ``record_logits``, ...; see
        :class:`~turbospark_jax.generation.driver.CompletionRequest`). ``stop_token_ids`` defaults
        to
        :func:`default_stop_ids` of the tokenizer. A speculative producer drafts (``draft_len``
        sets the proposals per round; 0 decodes plainly).

    Raises:
      BadInputError: an unknown or invalid request setting, a ``draft_len`` for a producer
        that cannot draft, a tokenizer that is not a :class:`ChatTokenizer`, a ``system``
        that is not a str, ``template_kwargs`` that are not a mapping, or something other
        than a pool or a producer.
      UnsupportedCapabilityError: the tokenizer has no chat template.
      SessionError: an unusable ``session_id`` (``None`` is replaced by a random one).

    One session runs one turn at a time (a second concurrent turn raises
    :class:`SessionError`); sessions sharing a pool run concurrently in their own slots.
    """

    def __init__(
        self,
        pool_or_producer: SessionPool | Any,
        tokenizer: ChatTokenizer,
        *,
        session_id: SessionId | None = None,
        system: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        vision: VisionEncoder | None = None,
        **defaults: Any,
    ) -> None:
        if not provides(tokenizer, _TOKENIZER_NEEDS):
            raise BadInputError(
                f"tokenizer must provide {', '.join(_TOKENIZER_NEEDS)} "
                f"(turbospark_jax.io.tokenizer.Tokenizer does), got {type(tokenizer).__name__}"
            )
        if system is not None and not isinstance(system, str):
            raise BadInputError(f"system must be a str or None, got {type(system).__name__}")
        if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
            raise BadInputError(
                f"template_kwargs must be a mapping, got {type(template_kwargs).__name__}"
            )
        if vision is not None and not isinstance(vision, VisionEncoder):
            raise BadInputError(f"vision must be a VisionEncoder or None, got "
                                f"{type(vision).__name__}")
        self.vision = vision
        if isinstance(pool_or_producer, SessionPool):
            self.pool = pool_or_producer
        else:
            self.pool = SessionPool(pool_or_producer, 1)
        self.tokenizer = tokenizer
        self.session_id: SessionId = uuid.uuid4().hex if session_id is None else session_id
        self.system = system
        self.template_kwargs = dict(template_kwargs or {})
        _check_fields(defaults)
        defaults.setdefault("stop_token_ids", default_stop_ids(tokenizer))
        self.defaults = defaults
        if tokenizer.chat_template is None:
            raise UnsupportedCapabilityError(
                "this tokenizer has no chat template, so a chat session cannot render its "
                "history; use a model folder with chat_template.jinja, or run raw completions"
            )
        # Building a turn validates without running it: settings no turn could run with
        # (max_tokens beyond the context, a draft length for a producer that cannot draft)
        # fail now.
        self.pool.stream(
            self.session_id, CompletionRequest(prompt_ids=[0], **defaults), tokenizer=tokenizer
        )
        self._history: list[dict[str, str]] = []
        self._images: list[tuple[PreparedImage, ...]] = []  # per user message, in order
        self._version = 0  # bumped whenever the history changes
        self._busy = threading.Lock()

    @property
    def messages(self) -> list[dict[str, str]]:
        """The conversation so far (system message first when set), as copies."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [dict(m) for m in (*head, *self._history)]

    def render(self, user_text: str | None = None) -> list[int]:
        """The prompt ids of the history (plus ``user_text`` as the next user message).

        Raises:
          BadInputError: ``user_text`` is not a str or None, or the template refused the
            messages or rendered nothing.
        """
        if user_text is not None and not isinstance(user_text, str):
            raise BadInputError(f"user_text must be a str, got {type(user_text).__name__}")
        messages = self.messages
        if user_text is not None:
            messages.append({"role": "user", "content": user_text})
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **self.template_kwargs
        )
        if isinstance(rendered, str):
            ids = list(self.tokenizer.encode(rendered, add_special_tokens=False))
        else:
            ids = list(rendered)
        if not ids:
            raise BadInputError("the chat template rendered an empty prompt")
        return [int(t) for t in ids]

    def stream(self, user_text: str, images: Sequence[Any] = (),
               **overrides: Any) -> Stream[Completion]:
        """Start a turn; iterate for the reply's events, then read ``.result``.

        Args:
          user_text: the user's message; with images, an image token in it places each one
            (otherwise they go before the text).
          images: image files, bytes or Pillow images shown with this message (a session
            with a vision tower only); kept for every later turn.
          **overrides: request settings for this turn only (as the constructor's defaults).

        Returns:
          The turn's stream; its result is the turn's
          :class:`~turbospark_jax.generation.completion.Completion` (``text`` is the reply,
          ``prompt_ids`` the rendered history, ``usage`` names the slot). The history grows by
          the user message and the reply when the stream ends without an error; after an error
          (non-finite logits, an exception, a closed stream) it is unchanged, so the message
          can be sent again.

        Raises:
          BadInputError: an unknown or invalid setting, a prompt that does not fit, images
            for a session without a vision tower, or an unreadable image (all before any
            work; the history is unchanged).
        """
        if not isinstance(user_text, str):
            raise BadInputError(f"user_text must be a str, got {type(user_text).__name__}")
        _check_fields(overrides)
        images = as_image_list(images)
        require_vision(self.vision, len(images))
        prepared = tuple(self.vision.prepare(s) for s in images) if self.vision else ()
        content = self._content(user_text, len(prepared))
        prompt, injection = self.render(content), None
        shown = [image for turn in (*self._images, prepared) for image in turn]
        if shown:
            assert self.vision is not None
            prompt, injection = self.vision.prompt(prompt, shown)
        request = CompletionRequest(prompt_ids=prompt, injection=injection,
                                    **{**self.defaults, **overrides})
        turn = self.pool.stream(self.session_id, request, tokenizer=self.tokenizer)
        return Stream(self._turn(content, prepared, turn, self._version))

    def _content(self, user_text: str, images: int) -> str:
        """The message as the template sees it: one image token per image before the text,
        unless the text already holds exactly that many."""
        if not images:
            return user_text
        assert self.vision is not None
        marker = self.tokenizer.id_to_token(self.vision.tokens.image)
        if marker is None:
            raise BadInputError(f"the tokenizer has no token for the image token id "
                                f"{self.vision.tokens.image}")
        if user_text.count(marker) == images:
            return user_text
        return marker * images + "\n" + user_text

    def send(self, user_text: str, images: Sequence[Any] = (),
             **overrides: Any) -> Completion:
        """Run a turn to the end (see :meth:`stream`) and return it.

        Raises:
          BadInputError: an unknown or invalid setting, or a prompt that does not fit.
          SessionError: another turn of this session is running, or the pool refused to wait.
        """
        return self.stream(user_text, images=images, **overrides).drain()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and free the session's slot.

        Raises:
          SessionError: a turn of this session is running.
        """
        if not self._busy.acquire(blocking=False):
            raise SessionError(f"session {self.session_id!r} is running a turn; reset after it")
        try:
            self._history.clear()
            self._images.clear()
            self._version += 1
            if self.pool.slot_of(self.session_id) is not None:
                self.pool.drop(self.session_id)
        finally:
            self._busy.release()

    def _turn(
        self, user_text: str, images: tuple[PreparedImage, ...], turn: Stream[Completion],
        version: int,
    ) -> Generator[StreamEvent, None, Completion]:
        if not self._busy.acquire(blocking=False):
            turn.close()
            raise SessionError(
                f"session {self.session_id!r} is already running a turn; one conversation "
                "takes one message at a time"
            )
        try:
            if self._version != version:
                # The prompt was rendered from a history that has since changed.
                raise SessionError(
                    f"session {self.session_id!r} moved on since this turn was prepared; "
                    "call stream() again"
                )
            with turn:
                yield from turn
            completion = turn.result
            assert completion is not None
            if completion.finish_reason is not FinishReason.ERROR:
                self._append(user_text, completion.text, images)
            return completion
        finally:
            self._busy.release()

    def _append(self, user_text: str, reply: str,
                images: tuple[PreparedImage, ...] = ()) -> None:
        self._history.append({"role": "user", "content": user_text})
        self._images.append(images)
        self._history.append({"role": "assistant", "content": reply})
        self._version += 1


def _check_fields(settings: Mapping[str, Any]) -> None:
    unknown = sorted(set(settings) - set(REQUEST_FIELDS))
    if unknown:
        raise BadInputError(
            f"unknown request setting(s) {unknown}; a chat turn accepts {list(REQUEST_FIELDS)} "
            "(the prompt is rendered from the history)"
        )
