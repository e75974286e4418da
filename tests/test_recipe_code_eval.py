"""The function-body quality bar: which functions are asked for, where a body ends, what
passes; and one run on the embedded model."""

from __future__ import annotations

import pytest

from turbospark_jax.errors import BadInputError
from turbospark_jax.recipe.code_eval import (
    FunctionPrompt,
    cut_body,
    evaluate_functions,
    function_prompts,
    judge,
)
from turbospark_jax.recipe.corpus import Document

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
'''


def test_prompts_are_headers_with_docstrings_dedented() -> None:
    found = function_prompts([Document("m.py", SOURCE), Document("bad.py", "def (:")])
    assert [(f.name, f.prompt) for f in found] == [
        ("cached", '@functools.cache\ndef cached(x):\n    """Twice x."""\n'),
        ("method", "def method(self, a,\n           b):\n"),
    ]


@pytest.mark.parametrize("text,body,ended", [
    ("    return 1\n\n\ndef g():\n", "    return 1\n", True),
    ("    x = 1\n    return x\nprint(2)", "    x = 1\n    return x\n", True),
    ("    x = 1\n    y = (", "    x = 1\n", False),
    ("    x = 1", "", False),
    ("\ndef g():", "\n", True),
])
def test_a_body_ends_back_at_column_zero(text: str, body: str, ended: bool) -> None:
    assert cut_body(text) == (body, ended)


F = FunctionPrompt("m.py", 1, "f", "def f(x):\n")


@pytest.mark.parametrize("body,parses,loops,passes", [
    ("    return x + 1\n", True, False, True),
    ("    return (x +\n", False, False, False),
    ("    y = 1\n" * 4, True, True, False),
    ("    y = 1\n" * 3, True, False, True),
    ("", False, False, False),
])
def test_verdicts(body: str, parses: bool, loops: bool, passes: bool) -> None:
    result = judge(F, body)
    assert (result.parses, result.loops, result.passes) == (parses, loops, passes)


def test_embedded_model_completes_bodies() -> None:
    from turbospark_jax.api import load

    model = load(context=256)
    share, results = evaluate_functions(model, [Document("m.py", SOURCE)], n=2, max_tokens=24)
    assert [r.function.name for r in results] == ["cached", "method"]
    assert share == sum(r.passes for r in results) / 2
    assert all(r.body == cut_body(r.body)[0] or not r.body for r in results)
    with pytest.raises(BadInputError):
        evaluate_functions(model, [Document("m.py", "x = 1\n")])
