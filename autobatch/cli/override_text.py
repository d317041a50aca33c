"""A sweep job's overrides in the words the user gave them, not Hydra's re-rendering.

Hydra's basic sweeper hands each job its overrides re-rendered from their parsed values, with
the grammar's special characters backslash-escaped: ``'probe.memory_limit=${oc.env:MEM}'``
became ``probe.memory_limit=$\\{oc.env\\:MEM\\}`` in the sweep summary's "overrides of every
job" line, its ``summary.csv`` and each job's recorded command, where one run records the
interpolation as given. :func:`as_given` drops the escapes where the override means the same
without them (Hydra parses both to the same value), and keeps them where they matter
(``key=a\\,b``, a string with a comma, would become a list).
"""

from __future__ import annotations

import re
from typing import Sequence

__all__ = ["as_given"]

#: Hydra's escape: a backslash before one of the grammar's special characters.
_ESCAPED = re.compile(r"\\([\\()\[\]{}:=, \t])")


def _same(first: str, second: str) -> bool:
    """Whether Hydra parses two overrides to the same key and value (False: either unparsable)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    try:
        a, b = parser.parse_override(first), parser.parse_override(second)
    except Exception:  # noqa: BLE001 - an override the grammar cannot read: keep the escaped form
        return False
    return (a.key_or_group, a.package, a.type, a.value()) == (b.key_or_group, b.package, b.type, b.value()) and \
        not b.is_sweep_override()


def as_given(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with Hydra's escapes removed from each one that means the same without them."""
    given = []
    for override in overrides:
        plain = _ESCAPED.sub(r"\1", override)
        given.append(plain if plain != override and _same(override, plain) else override)
    return given
