"""Tool-call parsing and the streamed hold-back (turbospark_jax.server.tools), for the Qwen and
Gemma 4 forms, without a model."""

import json
from types import SimpleNamespace

import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.server import tools as t

TOOLS = [SimpleNamespace(function=SimpleNamespace(name=n, parameters=None))
         for n in ("add", "write_file")]


def args(call):
    return json.loads(call["function"]["arguments"])


def test_qwen_blocks_become_calls_and_unknown_ones_stay_text():
    text = ('ok <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    reply = t.parse_reply(text, TOOLS)
    assert [c["function"]["name"] for c in reply.tool_calls] == ["add"]
    assert args(reply.tool_calls[0]) == {"a": 1, "b": 2}
    assert reply.content == 'ok <tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert t.parse_reply("just text", TOOLS).content == "just text"
    assert t.parse_reply(text, []).tool_calls == []  # no tools offered: all text


def test_gemma4_calls():
    assert t.tool_format("{{ '<|tool_call>' }}") == t.GEMMA4 and t.tool_format(None) == t.QWEN
    text = ('<|tool_call>call:write_file{path:<|"|>a.py<|"|>,body:<|"|>x = {1: 2}, y<|"|>,'
            'mode:1,flags:[true,null]}<tool_call|>')
    reply = t.parse_reply(text, TOOLS, t.GEMMA4)
    (call,) = reply.tool_calls
    assert reply.content is None and call["function"]["name"] == "write_file"
    assert args(call) == {"path": "a.py", "body": "x = {1: 2}, y", "mode": 1,
                          "flags": [True, None]}


@pytest.mark.parametrize("form, block", [
    (t.QWEN, '<tool_call>{"name": "add", "arguments": {}}</tool_call>'),
    (t.GEMMA4, "<|tool_call>call:add{}<tool_call|>"),
])
def test_stream_holds_back_from_a_block_on(form, block):
    f = t.ToolTextFilter(form)
    cut = 5
    sent = [f.push(x) for x in ("hello ", block[:cut], block[cut:])]
    assert "".join(sent) == "hello " and sent[1] == ""
    rest, calls = f.finish(TOOLS)
    assert rest == "" and [c["function"]["name"] for c in calls] == ["add"]
    plain = t.ToolTextFilter(form)
    start = block[:3]  # may still grow into a block: held
    assert plain.push("a " + start) == "a " and plain.finish(TOOLS) == (start, [])


def test_forcing_a_call_in_the_gemma_form_is_refused():
    with pytest.raises(BadInputError, match="Qwen"):
        t.constraint_for(TOOLS, "required", True, t.GEMMA4)
    assert t.constraint_for(TOOLS, "auto", True, t.GEMMA4) is None
