"""MkDocs hook: the docstrings' Sphinx roles read as plain code in the API reference.

The docstrings cross-reference with Sphinx roles (``:class:`~pkg.mod.Name```), which
mkdocstrings renders as the role's text beside the code. This drops the role and, for a ``~``
target, keeps the last name only, as Sphinx shows it.
"""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:mod|class|func|meth|data|attr|exc|obj|const):(?=<code>)")
TILDE = re.compile(r"<code>~(?:[\w]+\.)*([\w]+)</code>")


def on_page_content(html: str, **_: object) -> str:
    return TILDE.sub(r"<code>\1</code>", ROLE.sub("", html))
