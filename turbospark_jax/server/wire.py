"""The OpenAI wire format: request bodies validated with pydantic, errors in OpenAI's shape.

Bodies are validated strictly (a string where a number belongs is an error, not coerced) and
unknown fields are refused, so a misspelt setting is reported rather than silently ignored.
A chat message's content may hold ``image_url`` parts (``data:`` URLs only, read by the routes).
Beyond OpenAI's fields a body may carry ``session_id`` (continue that conversation's slot),
``top_k``, ``min_p`` and ``repetition_penalty``. ``response_format`` (both endpoints) and
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (chat) are read into constraints by
:mod:`turbospark_jax.server.tools`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "MAX_STOP_STRINGS",
    "ApiError",
    "ChatBody",
    "CompletionBody",
    "from_validation_error",
]

#: Stop strings a request may carry (OpenAI's limit).
MAX_STOP_STRINGS = 4

_Seed = Annotated[int, Field(ge=0, lt=2**64)]
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class ApiError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI's error fields.

    Args:
      status: the HTTP status (400 bad input, 429/503 overload, 500 a server fault).
      message: what was wrong and what to send instead.
      param: the body field at fault, if one is.
      code: a short machine-readable reason.
      kind: OpenAI's error ``type``.
      retry_after: seconds to wait before retrying (sent as ``Retry-After``).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.retry_after = kind, retry_after

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def from_validation_error(exc: ValidationError) -> ApiError:
    """The first pydantic complaint as a 400 naming the field."""
    errors = exc.errors(include_url=False)
    # A union reports one complaint per member; a value complaint (too long, out of range)
    # says more than "not a str" from the member that was never meant.
    values = [e for e in errors if not _is_type_error(e["type"])]
    first = (values or errors)[0]
    param = ".".join(str(p) for p in first["loc"] if _is_field(p)) or None
    kind = first["type"]
    code = "invalid_type" if _is_type_error(kind) else (
        "unknown_parameter" if kind == "extra_forbidden" else "invalid_value")
    if param == "stop" and kind == "too_long":
        code = "too_many_stop_strings"
    if param == "messages" and kind == "too_short":
        code = "empty_messages"
    return ApiError(400, f"{param}: {first['msg']}", param=param, code=code)


def _is_type_error(kind: str) -> bool:
    return kind.endswith(("_type", "_parsing")) or kind == "none_required"


def _is_field(part: object) -> bool:
    """A location part naming a field or an index, not a union member's type tag."""
    return isinstance(part, int) or (
        isinstance(part, str) and part.isidentifier()
        and part not in ("str", "int", "float", "bool", "list", "dict", "none")
    )


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk carrying the usage."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the reply must be valid under (``strict``
    or not, the reply is constrained to it)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (free), ``json_object`` (any JSON object) or
    ``json_schema``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(BaseModel):
    """A tool's function: its name, what it does and its parameters' JSON schema."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one function to call."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call an assistant message made (sent back in the conversation)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: CalledFunction


class _Settings(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None  # omitted: the served model (as vLLM takes it)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    presence_penalty: _Penalty = 0.0
    frequency_penalty: _Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    seed: _Seed | None = None
    stop: (Annotated[str, Field(min_length=1)]
           | Annotated[list[Annotated[str, Field(min_length=1)]],
                       Field(max_length=MAX_STOP_STRINGS)]
           | None) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] = 1  # at most the server's slots (checked by the routes)
    user: str | None = None
    session_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    response_format: ResponseFormat | None = None

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (a single string is one stop string)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionBody(_Settings):
    """``POST /v1/completions``: ``prompt`` is text or token ids; ``logprobs`` is how many
    alternatives to report per token (0..20)."""

    prompt: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False


class TextPart(BaseModel):
    """One text part of a message's content list."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    """``image_url``: the image as a ``data:`` URL (``detail`` is accepted and ignored: the
    model's processor decides the resolution)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    """One image part of a message's content list."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["image_url"]
    image_url: ImageUrl


_Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(BaseModel):
    """A chat message; content is a string or a list of text and image parts."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self, image_marker: str = "") -> str:
        """The content as one string, each image part written as ``image_marker`` (the
        model's image token, which the image's span replaces)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, TextPart) else image_marker
                       for part in self.content)

    def image_urls(self) -> list[str]:
        """The URLs of the content's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)]


class ChatBody(_Settings):
    """``POST /v1/chat/completions``: ``logprobs`` switches log-probabilities on,
    ``top_logprobs`` says how many alternatives (0..20)."""

    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
