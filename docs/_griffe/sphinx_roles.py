"""Griffe extension for the API reference: Sphinx roles in docstrings become inline code.

The docstrings cross-reference with reST roles (``:func:`~autobatch.plan```), which Markdown
would show verbatim. This turns each into inline code with the name a reader would type:
``~a.b.C`` gives ``C``, ``a.b.C`` stays whole, ``title <target>`` gives ``title``. Nothing is
linked, so a reference to a module that is being moved cannot break the strict build.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc|const):`([^`]+)`")


def _name(target: str) -> str:
    titled = re.match(r"^(.*?)\s*<[^>]+>$", target)
    if titled:
        return titled.group(1)
    if target.startswith("~"):
        return target[1:].rsplit(".", 1)[-1]
    return target


def plain_roles(text: str) -> str:
    """Replace every Sphinx role in ``text`` with inline code."""
    return _ROLE.sub(lambda m: f"`{_name(m.group(1))}`", text)


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring as the object is created."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)
