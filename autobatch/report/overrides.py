"""A sweep's overrides per job, and the ones every job shares.

A sweep's rows (``summary.csv``) each hold the job's overrides joined by spaces. Read together,
the overrides every job shares (``model=mlp data.shape=[16]`` in an ``lr`` sweep) repeat on each
row and bury the one that differs: ``summary.png`` labels each job by the others alone, and
``summary.md`` (the table the CLI prints) names the shared ones once above its rows.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

__all__ = ["split_overrides", "shared_overrides", "differing_overrides"]


def split_overrides(text: Any) -> list[str]:
    """The overrides in ``text`` (joined by spaces), split where a space is outside brackets and
    quotes (``'data.dataset={_target_: x}'`` is one); an empty or NaN cell has none."""
    text = "" if text is None or (isinstance(text, float) and math.isnan(text)) else str(text)
    parts, current, depth, quote = [], "", 0, ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth = max(0, depth - 1)
        elif char == " " and depth == 0:
            parts, current = parts + [current] * bool(current), ""
            continue
        current += char
    return parts + [current] * bool(current)


def shared_overrides(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The overrides of every row (their ``overrides``), in the first row's order; none for
    fewer than two rows (one job's overrides are all its own)."""
    split = [split_overrides(row.get("overrides")) for row in rows]
    if len(split) < 2:
        return []
    common = set.intersection(*map(set, split))
    return [override for override in dict.fromkeys(split[0]) if override in common]


def differing_overrides(row: dict[str, Any], shared: Iterable[str]) -> list[str]:
    """The row's overrides but the ``shared`` ones."""
    left_out = set(shared)
    return [override for override in split_overrides(row.get("overrides")) if override not in left_out]
