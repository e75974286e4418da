"""The function-body quality bar: which functions are asked for, where a body ends, what
passes; and one run on the embedded model."""

from __future__ import annotations

import pytest

from turbospark_jax.errors import BadInputError
from turbospark_recipe.code_eval import (
    FunctionPrompt,
    cut_body,
    evaluate_functions,
    function_prompts,
    judge,
)
from turbospark_recipe.corpus import Document

SOURCE = '''
import functools


@functools.cache
def cached(x):
    """Twice x."""
    return 2 * x


def one_liner(x): return x


class A:
    def method(self, a,
               b):
        total = a + b
        return total

    def only_doc(self):
        """Nothing else."""


def commented():
    # a comment first
    return 1


if True:
    try:
        import os
    except ImportError:
        @functools.cache
        class B(
                object):
            """Doc."""

            @staticmethod
            def nested(y):
                return y
'''


def test_prompts_are_headers_after_their_enclosing_scopes_openings() -> None:
    found = function_prompts([Document("m.py", SOURCE), Document("bad.py", "def (:")])
    assert [(f.name, f.context, f.prompt, f.indent) for f in found] == [
        ("cached", "", '@functools.cache\ndef cached(x):\n    """Twice x."""', 0),
        ("method", "class A:\n", "    def method(self, a,\n               b):", 4),
        # an if's and a try's first lines; a class's whole header, not its decorators or
        # docstring; the method's own decorator is in its prompt only
        ("nested", "if True:\n    try:\n        class B(\n                object):\n",
         "            @staticmethod\n            def nested(y):", 12),
    ]


@pytest.mark.parametrize("text,indent,body,ended", [
    ("\n    return 1\n\n\ndef g():\n", 0, "\n    return 1\n", True),
    ("\n    x = 1\n    return x\nprint(2)", 0, "\n    x = 1\n    return x\n", True),
    ("\n        x = 1\n    def g(self):", 4, "\n        x = 1\n", True),
    ("\n        x = 1\n        y = (", 4, "\n        x = 1\n", False),
    ("  # note\n    x = 1", 0, "  # note\n", False),
    ("\ndef g():", 0, "\n", True),
])
def test_a_body_ends_back_at_the_defs_indentation(text: str, indent: int, body: str,
                                                   ended: bool) -> None:
    assert cut_body(text, indent) == (body, ended)


F = FunctionPrompt("m.py", 1, "f", "    def f(x):", 4)


@pytest.mark.parametrize("body,parses,loops,passes", [
    ("\n        return x + 1\n", True, False, True),
    ("\n        return (x +\n", False, False, False),
    ("\n" + "        y = 1\n" * 4, True, True, False),
    ("\n" + "        y = 1\n" * 3, True, False, True),
    ("\n", False, False, False),
])
def test_verdicts(body: str, parses: bool, loops: bool, passes: bool) -> None:
    result = judge(F, body)
    assert (result.parses, result.loops, result.passes) == (parses, loops, passes)


def test_embedded_model_completes_bodies() -> None:
    from turbospark_jax.api import load

    model = load(context=256)
    share, results = evaluate_functions(model, [Document("m.py", SOURCE)], n=3, max_tokens=24)
    assert [r.function.name for r in results] == ["cached", "method", "nested"]
    assert share == sum(r.passes for r in results) / 3
    assert all(cut_body(r.body, r.function.indent)[0] == r.body for r in results if r.body)
    with pytest.raises(BadInputError):
        evaluate_functions(model, [Document("m.py", "x = 1\n")])


def test_the_card_section_shows_shares_and_both_kinds_of_body():
    from turbospark_recipe.code_eval import quality_section

    def sample(body: str, parses: bool, loops: bool) -> dict:
        return {"path": "m.py", "line": 3, "prompt": "def f():", "body": body,
                "parses": parses, "loops": loops}

    report = {"corpus": "a test corpus", "functions": 3, "max_tokens": 64, "passing": 1 / 3,
              "parsing": 1.0, "looping": 0.0,
              "samples": [sample("\n", True, False), sample("\n    return 1\n", True, False),
                          sample("\n    x = 1\n" * 5, True, True)]}
    text = quality_section(report, samples=3)
    assert "a test corpus" in text and "at most 64 tokens" in text and "**33.3%**" in text
    assert "asked with its header alone" in text  # a report without "prompts": the first kind
    scoped = quality_section({**report, "prompts": "scopes", "samples": [
        {**sample("\n        return 1\n", True, False), "context": "class A:\n",
         "prompt": "    def f(self):"}]}, samples=2)
    assert "enclosing scopes" in scoped and "class A:\n    def f(self):\n        return 1" in scoped
    assert "line 3, passes" in text and "line 3, is empty" in text and "line 3, loops" in text
    assert text.index("passes") < text.index("is empty")  # passing bodies first
