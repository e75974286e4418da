"""``response_format`` and tool calls for the OpenAI routes: what a body asks for becomes a
:class:`~turbospark_jax.core.constraints.ConstraintSpec`, and a reply's text becomes content
and ``tool_calls``.

Two forms of tool call are read, each the one its family's chat template teaches:

* Qwen3 / Qwen3.5 (the default): one ``<tool_call>`` block per call, holding
  ``{"name": ..., "arguments": {...}}`` as JSON, closed by ``</tool_call>``;
* Gemma 4 (a template that mentions ``<|tool_call>``): ``<|tool_call>call:NAME{ARGS}<tool_call|>``
  with bare keys and strings between ``<|"|>`` marks.

``tool_choice``:

* ``none``: the tools are not rendered into the prompt and the reply is text;
* ``auto`` (the default with tools): the reply is free; blocks in it become ``tool_calls``;
* ``required``: the reply is one or more blocks (one with ``parallel_tool_calls`` false),
  each call's arguments constrained by its function's parameter schema;
* a named function: one block calling it.

Forcing a call (``required`` or a named function) writes the Qwen form; for a Gemma 4 template
it is refused by name rather than forced into a form the model was not taught.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from turbospark_jax.core.constraints import ConstraintSpec
from turbospark_jax.errors import BadInputError

__all__ = ["CLOSE", "GEMMA4", "OPEN", "QWEN", "ParsedReply", "ToolTextFilter", "constraint_for",
           "parse_reply", "response_format_constraint", "tool_format"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
GEMMA_OPEN, GEMMA_CLOSE, GEMMA_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
QWEN, GEMMA4 = "qwen", "gemma4"
_BLOCKS = {
    QWEN: re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S),
    GEMMA4: re.compile(re.escape(GEMMA_OPEN) + r"\s*(.*?)\s*" + re.escape(GEMMA_CLOSE), re.S),
}
_OPENS = {QWEN: OPEN, GEMMA4: GEMMA_OPEN}


def tool_format(chat_template: str | None) -> str:
    """The tool-call form a chat template teaches: :data:`GEMMA4` when it writes Gemma 4's
    markers, else :data:`QWEN`."""
    return GEMMA4 if chat_template and GEMMA_OPEN in chat_template else QWEN


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


def constraint_for(tools: Sequence[Any], choice: Any, parallel: bool,
                   form: str = QWEN) -> ConstraintSpec | None:
    """The constraint ``tool_choice`` puts on a reply (``None`` for ``auto`` and ``none``).

    Raises:
      BadInputError: a named function that is not among ``tools``, a parameter schema the
        engine refuses (named), or a forced call in a form other than Qwen's.
    """
    if not tools or choice in (None, "auto", "none"):
        return None
    if form != QWEN:
        raise BadInputError(f"forcing a tool call is supported in the Qwen <tool_call> form "
                            f"only; this model's template writes {form} calls (use "
                            "tool_choice auto)")
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

    def __init__(self, text: str, tools: Sequence[Any], form: str = QWEN) -> None:
        names = {t.function.name for t in tools}
        self.tool_calls: list[dict[str, Any]] = []
        rest = text
        block = _BLOCKS[form]
        read = _read_call if form == QWEN else _read_gemma_call
        if tools:
            kept, at = [], 0
            for match in block.finditer(text):
                call = read(match.group(1), names)
                if call is not None:  # a block that does not parse stays in the content
                    self.tool_calls.append(call)
                    kept.append(text[at:match.start()])
                    at = match.end()
            rest = "".join(kept) + text[at:]
        rest = rest.strip() if self.tool_calls else rest
        self.content: str | None = rest if (rest or not self.tool_calls) else None


def parse_reply(text: str, tools: Sequence[Any], form: str = QWEN) -> ParsedReply:
    """:class:`ParsedReply` of ``text``, its calls written in ``form``."""
    return ParsedReply(text, tools, form)


def _read_call(body: str, names: set[str]) -> dict[str, Any] | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return _call(data["name"], arguments)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


_GEMMA_CALL = re.compile(r"call:([A-Za-z0-9_.-]+)\s*(\{.*\})\s*$", re.S)
_BARE_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w.-]*)\s*:")


def _read_gemma_call(body: str, names: set[str]) -> dict[str, Any] | None:
    """``call:NAME{key:value,...}`` with ``<|"|>``-quoted strings, as JSON arguments."""
    match = _GEMMA_CALL.match(body)
    if match is None or match.group(1) not in names:
        return None
    strings: list[str] = []

    def hold(m: re.Match[str]) -> str:
        strings.append(m.group(1))
        return f"\x00{len(strings) - 1}\x00"

    quoted = re.escape(GEMMA_QUOTE)
    text = re.sub(quoted + "(.*?)" + quoted, hold, match.group(2), flags=re.S)
    text = _BARE_KEY.sub(r'\1"\2":', text)
    text = re.sub("\x00(\\d+)\x00", lambda m: json.dumps(strings[int(m.group(1))]), text)
    try:
        arguments = json.loads(text)
    except ValueError:
        return None
    return _call(match.group(1), arguments) if isinstance(arguments, dict) else None


class ToolTextFilter:
    """Streamed text with tool-call blocks held back: :meth:`push` returns the content that can
    go out now (text before a block, never a prefix of ``<tool_call>`` that may still grow into
    one); from the first block on, everything is held for :meth:`finish`."""

    def __init__(self, form: str = QWEN) -> None:
        self.text = ""
        self.sent = 0
        self.holding = False
        self.form = form
        self.open = _OPENS[form]

    def push(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        at = self.text.find(self.open, self.sent)
        if at >= 0:
            self.holding = True
            out, self.sent = self.text[self.sent:at], at
            return out
        keep = 0
        for k in range(min(len(self.open) - 1, len(self.text) - self.sent), 0, -1):
            if self.open.startswith(self.text[len(self.text) - k:]):
                keep = k
                break
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self, tools: Sequence[Any]) -> tuple[str, list[dict[str, Any]]]:
        """The content still to send and the tool calls of the whole reply."""
        parsed = parse_reply(self.text, tools, self.form)
        if not parsed.tool_calls:
            return self.text[self.sent:], []
        rest = parse_reply(self.text[self.sent:], tools, self.form).content or ""
        return rest, parsed.tool_calls
