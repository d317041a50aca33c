"""Shared by the probe's garbage-collection tests: a reference cycle that holds a tensor, and a
recorder of the collections ``autobatch.free_memory`` makes."""

from __future__ import annotations

import gc

import torch


class Cycle:
    """A reference cycle holding a tensor: freed only by the garbage collector."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.me, self.tensor = self, tensor


def collections(monkeypatch) -> list[int]:
    """Record the generation of every collection free_memory makes."""
    import autobatch.memory.oom as oom

    made: list[int] = []
    real = gc.collect

    class Recording:
        def __getattr__(self, name):
            return getattr(gc, name)

        @staticmethod
        def collect(generation: int = 2) -> int:
            made.append(generation)
            return real(generation)

    monkeypatch.setattr(oom, "gc", Recording())
    return made
