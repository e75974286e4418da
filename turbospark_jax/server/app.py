"""The HTTP layer: OpenAI-compatible routes over an :class:`~turbospark_jax.server.engine.Engine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming with SSE or
not; ``response_format`` on both, ``tools`` and ``tool_choice`` on chat, tool calls parsed into
``tool_calls`` and streamed as OpenAI streams them), ``GET /v1/models``, ``GET /health``,
``GET /metrics``. ``n`` asks for several choices (at most the engine's slots): each is its own
request with its own seed (:func:`~turbospark_jax.server.requests.choice_seed`), the prompt
prefilled once, and stream chunks name their choice by ``index``. A chat message may hold
``image_url`` parts with ``data:`` URLs for a model with a vision tower (``ServerConfig.vision``):
each becomes the model's image token in the rendered prompt, grown into the image's span, and
the request carries the tower's output as its injection. Every refusal is an OpenAI error
body ``{"error": {"message", "type", "param", "code"}}``: bad input is a 400 raised before the
request reaches the engine (so no slot is touched), a full queue a 429 and an engine that takes
no work at all (shutting down, its scheduler stopped or failed) a 503, both with ``Retry-After``
(``GET /health`` answers 503 too then: ``status: stopping`` while a graceful shutdown lets the
requests in flight finish, and ``status: starting`` while the engine still compiles its
programs at start; requests sent meanwhile wait until it is ready). A request that fails after
its stream started ends with an ``error`` event and ``[DONE]`` (code ``server_shutdown`` when
a shutdown's grace period ran out before it ended; a response without streaming is then a
503); a client that disconnects cancels its request, which frees its slot before the next
decode step (a response without streaming notices within :data:`DISCONNECT_POLL_S`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import os
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from turbospark_jax.core.sampling import SamplingConfig
from turbospark_jax.errors import (
    BadInputError,
    ContextOverflowError,
    OverloadedError,
    TurbosparkError,
    UnavailableError,
)
from turbospark_jax.generation.completion import CompletionRequest
from turbospark_jax.server import responses, tools
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.metrics import ServerMetrics
from turbospark_jax.server.requests import (
    UNAVAILABLE_RETRY_S,
    Delta,
    Done,
    Failed,
    ServeRequest,
    Ticket,
)
from turbospark_jax.server.router import ReplicaRouter
from turbospark_jax.server.wire import (
    ApiError,
    ChatBody,
    CompletionBody,
    from_validation_error,
)

__all__ = ["ServerConfig", "build_app"]


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the routes need besides the engine.

    Fields:
      model_name: the id ``/v1/models`` lists and requests must name.
      tokenizer: encodes prompts, renders chat templates, names logprob tokens.
      stop_token_ids: ids that end a completion (end of sequence).
      chat_stop_token_ids: ids that end a chat reply (end of sequence and end of turn).
      prefill_chunk: prompt tokens per prefill chunk of a speculative request (batched requests
        follow the engine's own ``prefill_chunk``).
      default_chat_tokens: ``max_tokens`` of a chat request that sets none (at most what the
        context has left).
      vision: the model's vision tower (``None``: text only; image parts are refused).
    """

    model_name: str
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    chat_stop_token_ids: tuple[int, ...]
    prefill_chunk: int = 64
    default_chat_tokens: int = 256
    vision: Any = None


def build_app(engine: Engine | ReplicaRouter, config: ServerConfig,
              metrics: ServerMetrics | None = None) -> Starlette:
    """The Starlette application over one engine or a router over replicas; the caller
    starts and stops ``engine``."""
    metrics = metrics or ServerMetrics()
    routes = _Routes(engine, config, metrics)
    return Starlette(routes=[
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.metrics_page, methods=["GET"]),
    ])


def _error_response(err: ApiError) -> JSONResponse:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


#: How often a request without streaming checks whether its client is still there.
DISCONNECT_POLL_S = 0.1


async def _next_event(request: Request, queue: asyncio.Queue[Any]) -> Any:
    """The request's next engine event, or ``None`` once its client has disconnected (a
    response without streaming writes nothing until the end, so only polling notices)."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                return None


class _Routes:
    def __init__(self, engine: Engine | ReplicaRouter, config: ServerConfig,
                 metrics: ServerMetrics) -> None:
        self.engine, self.config, self.metrics = engine, config, metrics
        self.texts = responses.TokenTexts(config.tokenizer)
        self.tool_form = tools.tool_format(getattr(config.tokenizer, "chat_template", None))
        self.capacity = engine.producer.max_positions
        self._vision_lock = threading.Lock()

    # -- plain routes -----------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self.metrics.http.labels(endpoint="models", status="200").inc()
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": 0,
            "owned_by": "turbospark_jax",
        }]})

    async def health(self, request: Request) -> Response:
        if self.engine.stopping:  # draining: the requests in flight finish, no new ones
            return JSONResponse({"status": "stopping", **self.engine.load()}, status_code=503,
                                headers={"Retry-After": str(round(UNAVAILABLE_RETRY_S))})
        reason = self.engine.unavailable()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason,
                                 **self.engine.load()}, status_code=503)
        if self.engine.starting:  # still compiling: requests wait until it is done
            return JSONResponse({"status": "starting", **self.engine.load()}, status_code=503,
                                headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok", **self.engine.load()})

    async def metrics_page(self, request: Request) -> Response:
        return Response(self.metrics.render(self.engine.load()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- generation routes ----------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            body = await self._body(request, ChatBody if chat else CompletionBody)
            if chat and any(m.image_urls() for m in body.messages):
                # the images are decoded and the tower runs off the event loop
                serve = await asyncio.to_thread(self._serve_request, body, chat)
            else:
                serve = self._serve_request(body, chat)
            offered = self._offered_tools(body) if chat else []
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Any] = asyncio.Queue()

            def sink(event: Any) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, event)

            ticket = self._submit(serve, sink)
        except ApiError as err:
            self.metrics.http.labels(endpoint=endpoint, status=str(err.status)).inc()
            return _error_response(err)
        self.metrics.http.labels(endpoint=endpoint, status="200").inc()
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "created": responses.now(), "model": self.config.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._stream(queue, ticket, meta, chat, body.session_id, include_usage,
                                  offered, body.n)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return await self._whole(request, queue, meta, chat, body.session_id, offered,
                                     body.n)
        finally:
            ticket.cancel()  # a client gone before the end frees the slot; after it, a no-op

    async def _body(self, request: Request, model: type[Any]) -> Any:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        try:
            body = model.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from exc
        if body.model is not None and body.model != self.config.model_name:
            raise ApiError(400, f"model {body.model!r} is not served here; this server serves "
                           f"{self.config.model_name!r} (GET /v1/models)", param="model",
                           code="model_not_found")
        return body

    @staticmethod
    def _offered_tools(body: Any) -> list[Any]:
        """The tools a chat reply may call (none with ``tool_choice: none``)."""
        return list(body.tools or []) if body.tool_choice != "none" else []

    def _constraint(self, body: Any, chat: bool) -> Any:
        """The reply's constraint from ``response_format`` or ``tool_choice`` (400 when the
        engine refuses a schema, naming it)."""
        param = "response_format"
        try:
            spec = tools.response_format_constraint(body.response_format)
            if chat and body.tools:
                param = "tool_choice"
                called = tools.constraint_for(self._offered_tools(body), body.tool_choice,
                                              body.parallel_tool_calls, self.tool_form)
                if called is not None and spec is not None:
                    raise BadInputError("give response_format or a tool_choice that forces a "
                                        "call, not both")
                spec = spec or called
        except BadInputError as exc:
            raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_value") from exc
        return spec

    @staticmethod
    def _message(m: Any, image_marker: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {"role": m.role if m.role != "developer" else "system",
                               "content": m.text(image_marker)}
        if m.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
        return out

    def _serve_request(self, body: Any, chat: bool) -> ServeRequest:
        tok = self.config.tokenizer
        constraint = self._constraint(body, chat)
        injection = None
        if chat:
            images, marker = self._images(body)
            messages = [self._message(m, marker) for m in body.messages]
            offered = self._offered_tools(body)
            extra = {"tools": [t.model_dump(exclude_none=True) for t in offered]} if offered else {}
            try:
                rendered = tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
            except TurbosparkError as exc:
                raise ApiError(400, f"the chat template refused the messages: {exc}",
                               param="messages", code="invalid_value") from exc
            ids = list(tok.encode(rendered, add_special_tokens=False)) if isinstance(
                rendered, str) else list(rendered)
            if images:
                ids, injection = self._with_images(ids, images)
            stops = self.config.chat_stop_token_ids
            top = (body.top_logprobs or 0) if body.logprobs else None
            asked = body.max_completion_tokens or body.max_tokens
        else:
            ids = (list(tok.encode(body.prompt, add_special_tokens=False))
                   if isinstance(body.prompt, str) else list(body.prompt))
            stops = self.config.stop_token_ids
            top = body.logprobs
            asked = body.max_tokens or 16
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt",
                           code="invalid_value")
        room = self.capacity - len(ids)
        max_tokens = asked if asked is not None else min(self.config.default_chat_tokens, room)
        if max_tokens < 1 or len(ids) + max_tokens > self.capacity:
            raise ApiError(
                400, f"the prompt has {len(ids)} tokens and asks for {max(max_tokens, 1)} more; "
                f"the context holds {self.capacity}: shorten the prompt or lower max_tokens",
                param="messages" if chat else "prompt", code="context_length_exceeded",
            )
        seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(4), "little")
        completion = CompletionRequest(
            prompt_ids=ids, max_tokens=max_tokens, stop_token_ids=stops,
            stop_strings=body.stop_strings(), seed=seed,
            prefill_chunk_size=self.config.prefill_chunk,
            sampling=SamplingConfig(
                temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
            ),
            constraint=constraint, injection=injection,
        )
        limit = self.engine.max_choices
        if body.n > limit:
            raise ApiError(400, f"n is {body.n}, but this server generates at most {limit} "
                           f"choices a request (one a session slot): ask for fewer or send "
                           f"several requests", param="n", code="invalid_value")
        return ServeRequest(completion=completion, session_id=body.session_id, top_logprobs=top,
                            n=body.n)

    def _images(self, body: Any) -> tuple[list[bytes], str]:
        """The chat's images (decoded from their ``data:`` URLs, in order) and the text that
        places each in its message (the model's image token); 400 for images a model
        without a vision tower is sent, too many, or a URL that is not a base64 ``data:``
        URL."""
        urls = [url for m in body.messages for url in m.image_urls()]
        if not urls:
            return [], ""
        vision = self.config.vision
        if vision is None:
            raise ApiError(400, f"the messages hold {len(urls)} image(s), but "
                           f"{self.config.model_name!r} takes text only (no vision tower); "
                           f"send text, or serve a model with one", param="messages",
                           code="images_not_supported")
        if len(urls) > MAX_IMAGES:
            raise ApiError(400, f"the messages hold {len(urls)} images; at most {MAX_IMAGES} "
                           f"a request", param="messages", code="too_many_images")
        marker = self.config.tokenizer.id_to_token(vision.tokens.image)
        if marker is None:  # a folder whose tokenizer lacks its own image token
            raise ApiError(400, "this model's tokenizer has no image token; send text",
                           param="messages", code="images_not_supported")
        return [_data_url_bytes(url, k) for k, url in enumerate(urls)], marker

    def _with_images(self, ids: list[int], images: list[bytes]) -> tuple[list[int], Any]:
        """The prompt with each image token grown into its image's span, and the injection
        that fills the spans (the tower runs here, once per distinct image)."""
        try:
            with self._vision_lock:  # the encoder's cache of tower outputs is shared
                return self.config.vision.prompt(ids, images)
        except BadInputError as exc:
            raise ApiError(400, f"an image could not be used: {exc}", param="messages",
                           code="invalid_image") from exc

    def _submit(self, serve: ServeRequest, sink: Any) -> Ticket:
        try:
            return self.engine.submit(serve, sink)
        except UnavailableError as exc:
            raise ApiError(503, str(exc), code="unavailable", kind="server_error",
                           retry_after=exc.retry_after) from exc
        except OverloadedError as exc:
            raise ApiError(429, str(exc), code="overloaded", kind="rate_limit_error",
                           retry_after=exc.retry_after) from exc
        except ContextOverflowError as exc:
            raise ApiError(400, str(exc), code="context_length_exceeded") from exc
        except TurbosparkError as exc:
            raise ApiError(400, str(exc), code="invalid_value") from exc

    # -- answers ------------------------------------------------------------------------------

    def _choice(self, chat: bool, index: int, text: str | None, entries: list[Any], offset: int,
                finish: str | None, delta: bool,
                calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        logprobs = None
        if entries:
            logprobs = (responses.chat_logprobs(entries, self.texts) if chat
                        else responses.text_logprobs(entries, self.texts, offset))
        if chat:
            key = "delta" if delta else "message"
            content = {"content": text} if delta else {"role": "assistant", "content": text}
            if calls:
                content["tool_calls"] = calls
            return {"index": index, key: content, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    async def _whole(self, request: Request, queue: asyncio.Queue[Any], meta: dict[str, Any],
                     chat: bool, session_id: str | None, offered: list[Any],
                     n: int) -> Response:
        done: dict[int, Done] = {}
        while len(done) < n:
            event = await _next_event(request, queue)
            if event is None:  # the client went away: answer no one, free the slots
                return Response(status_code=499)
            if isinstance(event, Failed):
                return _error_response(_failure(event))
            if isinstance(event, Done):
                done[event.index] = event
        choices = []
        for index in range(n):
            event = done[index]
            c = event.completion
            finish = responses.finish_reason(c)
            parsed = tools.parse_reply(c.text, offered, self.tool_form)
            if parsed.tool_calls:
                finish = "tool_calls"
            choice = self._choice(chat, index, parsed.content, event.logprobs, 0, finish, False,
                                  parsed.tool_calls)
            choice["token_ids"] = list(c.token_ids)  # an extension: the generated ids
            choices.append(choice)
        obj = "chat.completion" if chat else "text_completion"
        usage = responses.usage([done[i].completion for i in range(n)], session_id)
        return JSONResponse({**meta, "object": obj, "choices": choices, "usage": usage})

    async def _stream(self, queue: asyncio.Queue[Any], ticket: Ticket, meta: dict[str, Any],
                      chat: bool, session_id: str | None, include_usage: bool,
                      offered: list[Any], n: int) -> AsyncIterator[str]:
        """The SSE events of a request's ``n`` choices, interleaved as they come; each chunk
        carries one choice, named by its ``index``."""
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[Any], **extra: Any) -> str:
            return _sse({**meta, "object": obj, "choices": choices, **extra})

        offsets = [0] * n
        held = [tools.ToolTextFilter(self.tool_form) if offered else None for _ in range(n)]
        done: dict[int, Any] = {}
        try:
            if chat:
                for index in range(n):
                    yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            while len(done) < n:
                event = await queue.get()
                if isinstance(event, Failed):
                    yield _sse(_failure(event).body())
                    yield "data: [DONE]\n\n"
                    return
                i, filt = event.index, held[event.index]
                if isinstance(event, Delta):
                    text = event.text if filt is None else filt.push(event.text)
                    if text or event.logprobs or filt is None:
                        yield chunk([self._choice(chat, i, text, event.logprobs, offsets[i],
                                                  None, True)])
                    offsets[i] += len(event.text)
                    continue
                c = event.completion
                done[i] = c
                finish, tail = responses.finish_reason(c), event.tail
                if filt is not None:
                    filt.push(tail)
                    tail, calls = filt.finish(offered)
                    if calls:
                        finish = "tool_calls"
                        yield chunk([{"index": i, "delta": {"tool_calls": [
                            {"index": k, **call} for k, call in enumerate(calls)]},
                            "logprobs": None, "finish_reason": None}])
                yield chunk([self._choice(chat, i, tail, [], offsets[i], finish, True)])
            if include_usage:
                yield chunk([], usage=responses.usage([done[i] for i in range(n)], session_id))
            yield "data: [DONE]\n\n"
        finally:
            ticket.cancel()  # a disconnect lands here (the task is cancelled at the await)


#: Images one request may carry.
MAX_IMAGES = 8


def _data_url_bytes(url: str, k: int) -> bytes:
    """The image bytes of a ``data:image/...;base64,`` URL (400 naming image ``k`` for any
    other URL: remote images are not fetched)."""
    param = "messages"
    if not url.startswith("data:"):
        raise ApiError(400, f"image {k}: only data: URLs are accepted (data:image/png;base64,"
                       f"...); this server does not fetch remote images", param=param,
                       code="unsupported_image_url")
    head, sep, payload = url[len("data:"):].partition(",")
    if not sep or not head.endswith(";base64") or not head.startswith("image/"):
        raise ApiError(400, f"image {k}: a data URL must read data:image/<type>;base64,<data>",
                       param=param, code="unsupported_image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(400, f"image {k}: its data is not valid base64: {exc}", param=param,
                       code="invalid_image") from exc


def _failure(event: Failed) -> ApiError:
    """The error a failed request answers with (in its stream, or as the response): a 503
    with a retry hint when the server shut down before the reply was complete."""
    if event.shutdown:
        return ApiError(503, f"{event.message}; retry later", code="server_shutdown",
                        kind="server_error", retry_after=UNAVAILABLE_RETRY_S)
    return ApiError(500, f"generation failed: {event.message}", code="generation_failed",
                    kind="server_error")


def _arguments(text: str) -> Any:
    """A sent tool call's arguments as chat templates read them: the JSON object it holds
    (the text itself when it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text
