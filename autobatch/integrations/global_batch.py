"""Keep a global batch with the largest batch that fits: the accumulation the integrations set."""

from __future__ import annotations

__all__ = ["accumulation_for"]


def accumulation_for(share: int, largest: int) -> tuple[int, int]:
    """``(k, b)``: the fewest micro-batches ``k`` with ``b <= largest`` and ``b * k == share``
    exactly (``share``: this rank's samples per optimizer step). ``b`` may be below ``largest``
    where ``share`` has no divisor closer to it; batch 1 always divides."""
    for name, value in (("share", share), ("largest", largest)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    k = -(-share // largest)
    while share % k:
        k += 1
    return k, share // k
