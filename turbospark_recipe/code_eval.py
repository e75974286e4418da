"""Does the model write working function bodies? A quality bar measured on held-out code.

Loss and perplexity say little about what a user of the main command sees: whether a
completion is Python, and whether it stops repeating itself. This module measures that
directly, on functions from files the model never trained on:

1. **Functions.** Every ``def`` (top level or method) in the held-out split's files, in path
   and line order, whose header is short enough; ``n`` of them evenly spaced over that list
   (so the sample spans every file and is the same on every run).
2. **Prompt.** The function's decorators, signature and docstring (when it has one), as the
   file has them (a method keeps its indentation), ending on the colon or the docstring's
   closing quotes: the newline and the body's indentation are the model's to write, since a
   prompt that ends inside that run of whitespace splits a token boundary the model never
   saw in training. Before it come the lines that open the function's enclosing scopes (an
   enclosing class's or function's header, another compound statement's first line), so a
   method's prompt starts as a file does, at column 0: no training document starts indented,
   and with the header alone a nested function's body often came back at the ``def``'s own
   indentation, an empty body (``scopes=False`` asks with the header alone).
3. **Completion.** Greedy, up to ``max_tokens``; the body ends at the first non-blank line
   indented no deeper than the ``def`` (the file's next statement), and generation stops
   there.
4. **Verdict.** The body *parses* when prompt + body, dedented, is valid Python
   (``ast.parse``); a body *loops* when any non-blank line (stripped) occurs more than three
   times. A function passes when its body parses and does not loop; an empty body (the model
   ended the function at once) does not pass.

:func:`evaluate_functions` returns the share that pass and every sample, for the model card.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

from turbospark_jax.errors import BadInputError
from turbospark_recipe.corpus import Document

#: A body line repeated more times than this is a loop.
MAX_REPEATS = 3
#: Headers (decorators + signature + docstring) longer than this many characters are skipped.
MAX_HEADER_CHARS = 1200


@dataclasses.dataclass(frozen=True)
class FunctionPrompt:
    """One held-out function: where it is, and its header as the prompt."""

    path: str
    line: int
    name: str
    prompt: str
    #: columns before the ``def``: a body line indented no deeper ends the body
    indent: int = 0
    #: the lines opening the enclosing scopes, each ending in a newline ("" at top level)
    context: str = ""


@dataclasses.dataclass(frozen=True)
class FunctionResult:
    """The model's body for one function and the verdict on it."""

    function: FunctionPrompt
    body: str
    parses: bool
    loops: bool

    @property
    def passes(self) -> bool:
        return bool(self.body.strip()) and self.parses and not self.loops


def _scope_opening(node: ast.stmt, lines: list[str]) -> str:
    """The lines that open a compound statement around a function: a class's or function's
    header (without decorators, up to its first statement), else the statement's first line."""
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        first = node.body[0]
        end = min([first.lineno, *(d.lineno for d in getattr(first, "decorator_list", ()))])
        return "".join(line + "\n" for line in lines[node.lineno - 1: end - 1])
    return lines[node.lineno - 1] + "\n"


def _functions_in_scopes(tree: ast.Module) -> Iterator[tuple[ast.stmt, tuple[ast.stmt, ...]]]:
    """Every function definition with the compound statements around it, outermost first."""
    stack: list[tuple[ast.AST, tuple[ast.stmt, ...]]] = [(tree, ())]
    while stack:
        node, scopes = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ExceptHandler | ast.match_case):
                stack.append((child, scopes))  # inside the try or match already opened
                continue
            if not isinstance(child, ast.stmt):
                continue
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield child, scopes
            if any(isinstance(getattr(child, field, None), list)
                   for field in ("body", "orelse", "handlers", "finalbody", "cases")):
                stack.append((child, (*scopes, child)))


def function_prompts(documents: Sequence[Document]) -> list[FunctionPrompt]:
    """Every function header in the documents, in path and line order, with the openings of
    its enclosing scopes (see the module doc)."""
    found: list[FunctionPrompt] = []
    for doc in sorted(documents, key=lambda d: d.path):
        try:
            tree = ast.parse(doc.text)
        except (SyntaxError, ValueError):
            continue
        lines = doc.text.splitlines()
        for node, scopes in _functions_in_scopes(tree):
            if not node.body:
                continue
            first = node.body[0]
            has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                       and isinstance(first.value.value, str))
            if has_doc and len(node.body) == 1:
                continue  # nothing but a docstring: no body to ask for
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            end = (first.end_lineno if has_doc else first.lineno - 1) or first.lineno - 1
            header = "\n".join(lines[start:end])
            if not header.rstrip().endswith((":", '"', "'")):
                continue  # a body on the def's own line, or comments before it
            prompt = header.rstrip()
            if len(prompt) <= MAX_HEADER_CHARS:
                context = "".join(_scope_opening(scope, lines) for scope in scopes)
                found.append(FunctionPrompt(doc.path, node.lineno, node.name, prompt,
                                            node.col_offset, context))
    found.sort(key=lambda f: (f.path, f.line))
    return found


def spaced_sample(items: Sequence[Any], n: int) -> list[Any]:
    """``n`` items evenly spaced over ``items`` (all of them when there are fewer)."""
    if len(items) <= n:
        return list(items)
    stride = len(items) / n
    return [items[int(i * stride)] for i in range(n)]


def cut_body(text: str, indent: int = 0) -> tuple[str, bool]:
    """The body within a completion of a header indented by ``indent`` columns: up to the
    first non-blank line (after the header's own) indented no deeper than that.

    Returns:
      The body (from the header's line end), and whether it ended there (``False``: the
      completion ran out first; the body is then cut after its last whole line).
    """
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if i > 0 and line.strip() and len(line) - len(line.lstrip()) <= indent:
            return "\n".join(lines[:i]).rstrip() + "\n", True
    return "\n".join(lines[:-1]) + "\n" if len(lines) > 1 else "", False


def judge(function: FunctionPrompt, body: str) -> FunctionResult:
    """The verdict on one body (see the module docstring)."""
    try:
        ast.parse(textwrap.dedent(function.prompt + body))
        parses = True
    except (SyntaxError, ValueError):
        parses = False
    counts = collections.Counter(line.strip() for line in body.splitlines() if line.strip())
    loops = any(c > MAX_REPEATS for c in counts.values())
    return FunctionResult(function, body, parses, loops)


def evaluate_functions(
    model: Any, documents: Sequence[Document], n: int = 200, max_tokens: int = 128,
    scopes: bool = True,
) -> tuple[float, list[FunctionResult]]:
    """Complete ``n`` held-out function bodies greedily and judge them.

    Args:
      model: a :class:`turbospark_jax.api.Model` (``tsj.load(...)``) with a tokenizer.
      documents: the held-out documents (``load_corpus(...).heldout``).
      n: how many functions.
      max_tokens: the most tokens a body may take.
      scopes: put the openings of each function's enclosing scopes before its header
        (``False``: the header alone, as the first measurements asked).

    Returns:
      The share of functions that pass, and every result.

    Raises:
      BadInputError: no function was found, or the model has no tokenizer.
    """
    from turbospark_jax.api import stream

    if model.tokenizer is None:
        raise BadInputError("evaluating function bodies needs a model with a tokenizer")
    functions = spaced_sample(function_prompts(documents), n)
    if not functions:
        raise BadInputError("the documents hold no function with a body to complete")
    results = []
    for function in functions:
        text = ""
        prompt = function.context + function.prompt if scopes else function.prompt
        with stream(model, prompt, max_tokens=max_tokens) as events:
            for event in events:
                text += event.text
                if cut_body(text, function.indent)[1]:
                    break  # the function has ended: the rest is not its body
        results.append(judge(function, cut_body(text, function.indent)[0]))
    return sum(r.passes for r in results) / len(results), results


def quality_section(report: dict[str, Any], samples: int = 4) -> str:
    """The model card's section on the bar: the shares, where the functions came from, and a
    few bodies (the first passing ones, then the first failing ones), from the report
    ``python -m turbospark_recipe evaluate`` writes."""

    def passes(s: dict[str, Any]) -> bool:  # as FunctionResult.passes
        return bool(s["body"].strip()) and s["parses"] and not s["loops"]

    asked = ("its header alone" if report.get("prompts", "header") == "header" else
             "the lines that open its enclosing scopes, then its header")
    lines = [
        f"Greedy body completions of {report['functions']} functions from held-out files of "
        f"{report['corpus']} (files whose path hash the training split left out), each asked "
        f"with {asked} (decorators, signature, docstring), at most "
        f"{report.get('max_tokens', 128)} tokens each: a body **passes** when the header plus "
        f"body parses with `ast` and no line of it repeats more than {MAX_REPEATS} times "
        "(`turbospark_recipe.code_eval`).", "",
        "| pass | parse | loop |", "| --- | --- | --- |",
        f"| **{report['passing']:.1%}** | {report['parsing']:.1%} | {report['looping']:.1%} |",
        "",
    ]
    picked = [s for s in report["samples"] if passes(s)][: samples // 2]
    picked += [s for s in report["samples"] if not passes(s)][: samples - len(picked)]
    for s in picked:
        verdict = "passes" if passes(s) else ("loops" if s["loops"] else (
            "does not parse" if not s["parses"] else "is empty"))
        text = (s.get("context", "") + s["prompt"] + s["body"]).replace("```", "` ` `")
        lines += [f"`{s['path']}` line {s['line']}, {verdict}:", "", "```python", text.rstrip(),
                  "```", ""]
    return "\n".join(lines)
