"""The random generators a data loader draws its order from, which the global state does not cover.

A checkpoint holds the global generators (torch's, Python's ``random``, NumPy's); a loader may
draw its order from generators of its own: ``DataLoader(generator=...)``, a sampler's
``generator``, and a custom sampler's or batch sampler's own, under any attribute name
(``self.rng = torch.Generator()``, ``random.Random(seed)``, ``numpy.random.default_rng(seed)``:
a bucketing batch sampler). A resume replays its epoch's start from these generators' states at
that start; one it did not know of started afresh there, so a run resumed in a later epoch
trained the first epoch's order again (some samples twice, others not at all) without a word.
:func:`data_generators` finds them, each once, in a fixed order; those that are not a
``torch.Generator`` are wrapped with the ``get_state`` / ``set_state`` that
:func:`~autobatch.probe.snapshot.rng.rng_state` calls, giving plain values a ``weights_only`` load reads.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["data_generators"]


class _Generator:
    """A ``random.Random`` or NumPy generator read and set as a ``torch.Generator`` is, in plain
    values: a checkpoint holds its state."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def get_state(self) -> Any:
        generator = self.generator
        if isinstance(generator, random.Random):
            version, keys, gauss = generator.getstate()
            return [version, list(keys), gauss]
        # a NumPy Generator's bit generator state (PCG64: ints; Philox, MT19937: arrays), or RandomState's
        return _plain(generator.bit_generator.state if hasattr(generator, "bit_generator") else generator.get_state(legacy=False))

    def set_state(self, state: Any) -> None:
        generator = self.generator
        if isinstance(generator, random.Random):
            version, keys, gauss = state
            generator.setstate((version, tuple(keys), gauss))
        elif hasattr(generator, "bit_generator"):
            generator.bit_generator.state = _arrays(state)
        else:
            generator.set_state(_arrays(state))


def _plain(value: Any) -> Any:
    """``value`` with every NumPy array a ``{"ndarray": list, "dtype": name}``: a weights-only load reads it."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # an array, or a NumPy scalar
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)} if getattr(value, "ndim", 0) else value.item()
    return value


def _arrays(value: Any) -> Any:
    """What :func:`_plain` made, with its arrays back."""
    if isinstance(value, dict) and set(value) == {"ndarray", "dtype"}:
        import numpy

        return numpy.asarray(value["ndarray"], dtype=value["dtype"])
    if isinstance(value, dict):
        return {key: _arrays(item) for key, item in value.items()}
    return value


def _kind(value: Any) -> str | None:
    """Which generator ``value`` is, or None: a ``torch.Generator``, a seeded ``random.Random``
    (not ``SystemRandom``, which has no state), a NumPy ``Generator`` or ``RandomState``."""
    if isinstance(value, torch.Generator):
        return "torch"
    if isinstance(value, random.Random) and not isinstance(value, random.SystemRandom):
        return "python"
    module = type(value).__module__ or ""
    if module.startswith("numpy.random") and type(value).__name__ in ("Generator", "RandomState"):
        return "numpy"
    return None


def data_generators(data: Any) -> list[Any]:
    """The generators ``data`` draws from besides the global ones: held by the loader, its
    sampler, its batch sampler, the batch sampler's sampler or its dataset, as attributes of any
    name (``DataLoader(generator=...)``, a ``RandomSampler``'s, a custom batch sampler's
    ``self.rng``). Each once, in a fixed order: a ``torch.Generator`` itself, any other wrapped
    (``get_state`` / ``set_state`` of plain values)."""
    sampler = getattr(data, "sampler", None)
    batch_sampler = getattr(data, "batch_sampler", None)
    owners = (data, sampler, batch_sampler, getattr(batch_sampler, "sampler", None), getattr(data, "dataset", None))
    found: list[Any] = []
    seen: list[Any] = []
    for owner in owners:
        values = getattr(owner, "__dict__", None)
        if owner is None or not isinstance(values, dict):
            continue
        generator = getattr(owner, "generator", None)  # first, as before: a checkpoint's order
        for value in (generator, *values.values()):
            kind = _kind(value)
            if kind is None or any(value is other for other in seen):
                continue
            seen.append(value)
            found.append(value if kind == "torch" else _Generator(value))
    return found
