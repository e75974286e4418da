"""``response_format`` and tool calls for the OpenAI routes: what a body asks for becomes a
:class:`~turbospark_jax.core.constraints.ConstraintSpec`, and a reply's text becomes content
and ``tool_calls``.

Tool calls are written in the Qwen3 / Qwen3.5 form the chat templates of those families teach
the model: one ``<tool_call>`` block per call, holding ``{"name": ..., "arguments": {...}}`` as
JSON, closed by ``</tool_call>``. ``tool_choice``:

* ``none``: the tools are not rendered into the prompt and the reply is text;
* ``auto`` (the default with tools): the reply is free; blocks in it become ``tool_calls``;
* ``required``: the reply is one or more blocks (one with ``parallel_tool_calls`` false),
  each call's arguments constrained by its function's parameter schema;
* a named function: one block calling it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from turbospark_jax.core.constraints import ConstraintSpec
from turbospark_jax.errors import BadInputError

__all__ = ["CLOSE", "OPEN", "ParsedReply", "ToolTextFilter", "constraint_for", "parse_reply",
           "response_format_constraint"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def response_format_constraint(fmt: Any) -> ConstraintSpec | None:
    """The constraint of a ``response_format`` (``text``: none).

    Raises:
      BadInputError: a ``json_schema`` without a schema, or one the engine refuses (named).
    """
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ConstraintSpec.json_object()
    spec = fmt.json_schema
    if spec is None or spec.schema_ is None:
        raise BadInputError("response_format.json_schema needs a schema")
    return ConstraintSpec.json_schema(spec.schema_)


def _call_schema(function: Any) -> dict[str, Any]:
    params = function.parameters if function.parameters is not None else {
        "type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function.name},
                                             "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def constraint_for(tools: Sequence[Any], choice: Any, parallel: bool) -> ConstraintSpec | None:
    """The constraint ``tool_choice`` puts on a reply (``None`` for ``auto`` and ``none``).

    Raises:
      BadInputError: a named function that is not among ``tools``, or a parameter schema the
        engine refuses (named).
    """
    if not tools or choice in (None, "auto", "none"):
        return None
    by_name = {t.function.name: t.function for t in tools}
    if isinstance(choice, str):  # "required"
        functions = list(by_name.values())
    else:
        name = choice.function.name
        if name not in by_name:
            raise BadInputError(f"tool_choice names {name!r}, which is not among the tools "
                                f"({', '.join(sorted(by_name))})")
        functions, parallel = [by_name[name]], False
    schemas = [_call_schema(f) for f in functions]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    call["x-guidance"] = {"whitespace_flexible": False}  # compact JSON, as for json_schema
    # A Lark grammar with the call's JSON embedded by the engine's %json directive.
    block = f'"{OPEN}\\n" %json {json.dumps(call)} "\\n{CLOSE}"'
    rules = f"start: call{'+' if parallel else ''}\ncall: {block}\n"
    try:
        return ConstraintSpec.grammar(rules)
    except BadInputError as exc:
        raise BadInputError(f"tools: a function's parameters: {exc}") from exc


class ParsedReply:
    """A reply split into ``content`` (text outside the tool-call blocks, ``None`` when empty
    beside calls) and ``tool_calls`` (OpenAI's objects, each with a fresh id)."""

    def __init__(self, text: str, tools: Sequence[Any]) -> None:
        names = {t.function.name for t in tools}
        self.tool_calls: list[dict[str, Any]] = []
        rest = text
        if tools:
            for match in _BLOCK.finditer(text):
                call = _read_call(match.group(1), names)
                if call is not None:
                    self.tool_calls.append(call)
            if self.tool_calls:
                rest = _BLOCK.sub("", text)
        rest = rest.strip() if self.tool_calls else rest
        self.content: str | None = rest if (rest or not self.tool_calls) else None


def parse_reply(text: str, tools: Sequence[Any]) -> ParsedReply:
    """:class:`ParsedReply` of ``text``."""
    return ParsedReply(text, tools)


def _read_call(body: str, names: set[str]) -> dict[str, Any] | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": data["name"], "arguments": json.dumps(arguments)}}


class ToolTextFilter:
    """Streamed text with tool-call blocks held back: :meth:`push` returns the content that can
    go out now (text before a block, never a prefix of ``<tool_call>`` that may still grow into
    one); from the first block on, everything is held for :meth:`finish`."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.holding = False

    def push(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            self.holding = True
            out, self.sent = self.text[self.sent:at], at
            return out
        keep = 0
        for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
            if OPEN.startswith(self.text[len(self.text) - k:]):
                keep = k
                break
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self, tools: Sequence[Any]) -> tuple[str, list[dict[str, Any]]]:
        """The content still to send and the tool calls of the whole reply."""
        parsed = parse_reply(self.text, tools)
        if not parsed.tool_calls:
            return self.text[self.sent:], []
        rest = _BLOCK.sub("", self.text[self.sent:])
        return rest.strip(), parsed.tool_calls
