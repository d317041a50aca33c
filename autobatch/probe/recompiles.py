"""How near ``torch._dynamo``'s recompile limit a probe's trials brought a compiled model, told in ``result.notes``.

On an accelerator a ``torch.compile``d model's trials run compiled (on the CPU's simulated device they run
uncompiled: :mod:`autobatch.memory.uncompiled`), and with ``dynamic=False`` every trial size the model's
graphs do not cover compiles one more, and a probe tries several. Past ``torch._dynamo.config.recompile_limit``
(``cache_size_limit`` in older torch; 8 by default) dynamo runs each new size uncompiled with one log line
(or raises ``FailOnRecompileLimitHit`` with ``fullgraph=True``): the probe's later trials then measured the
eager step, and in training every size not compiled yet (an out-of-memory replay's smaller one, a short
last batch) runs eagerly too. Nothing said so. Dropping the probe's own graphs is no way out: dynamo keeps a
code object's graphs together, and the user's would go with them.

So the probe counts the graphs on the model's compiled frames before and after its trials
(:func:`compile_count`: the cache entries of each compiled entry point and module ``forward``, the most
on one, which is what the limit counts for a frame without identity guards; and dynamo's own count of
frames that met a limit) and :func:`recompile_note` says where the trials reached the limit or left
fewer than :data:`NEAR` sizes before it, naming ``dynamic=None``, ``torch._dynamo.mark_dynamic`` and the
limit. Read only: nothing here compiles, resets or imports the compiler.

Measured on the CPU (torch 2.13, ``backend="eager"``, outside the simulated device): a wrapped model whose
``forward`` is its own class's keeps its graphs on that ``forward``; one whose ``forward`` is torch's
(``torch.compile(nn.Linear(...))``) keeps them on dynamo's wrapper frame, which every such model in the process
shares, so its limit is theirs together. ``dynamic=None`` over sizes 1-11: 3 graphs (static, dynamic, size 1).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["CompileCount", "RecompileWatch", "compile_count", "recompile_limit", "recompile_note", "recompile_limit_hit",
           "NEAR"]

#: sizes left before the limit at or under which the note speaks: training's own new sizes (an
#: out-of-memory replay's smaller micro-batch, a short last batch, a grow-back try) take about that many
NEAR = 2


@dataclass(frozen=True)
class CompileCount:
    """What dynamo holds at one moment: ``graphs``, the most cache entries on one of the model's compiled
    frames (None where they could not be read), and ``limit_hits``, the times a frame met a recompile
    limit in this process (``torch._dynamo.utils.counters``)."""

    graphs: int | None
    limit_hits: int


def recompile_limit() -> int | None:
    """``torch._dynamo.config.recompile_limit`` (``cache_size_limit`` before torch 2.6); None where
    the compiler was not imported or has neither."""
    config = getattr(sys.modules.get("torch._dynamo"), "config", None)
    limit = getattr(config, "recompile_limit", getattr(config, "cache_size_limit", None))
    return limit if isinstance(limit, int) else None


def compile_count(model: torch.nn.Module | None) -> CompileCount | None:
    """The count now, or None where nothing in this process imported the compiler."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.utils import counters

    hits = sum(count for reasons in counters.values() for reason, count in reasons.items()
               if _is_limit_reason(str(reason)))
    return CompileCount(_graphs(model) if model is not None else None, hits)


def _is_limit_reason(reason: str) -> bool:
    """Whether a counter's key is dynamo's for a frame past a recompile limit ("Dynamo recompile limit
    exceeded ..." in torch 2.13, "cache_size_limit reached" before)."""
    said = reason.lower().replace("_", " ")
    return ("recompile limit" in said or "cache size limit" in said) and ("exceed" in said or "reached" in said)


def _graphs(model: torch.nn.Module) -> int | None:
    """The most cache entries on one of ``model``'s compiled frames, or None where unreadable."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries
    except ImportError:
        return None
    try:
        return max((len(entries(code)) for code in _codes(model)), default=0)
    except Exception:  # noqa: BLE001 - a private API of dynamo's that changed: the limit counter still speaks
        return None


def _codes(model: torch.nn.Module) -> Iterator[object]:
    """The code objects dynamo may compile for ``model``: each wrapper level of an ``OptimizedModule``'s
    ``forward`` (torch 2.13 compiles its inner frame for a model whose own ``forward`` is torch's) and
    every module's ``forward`` (where the frame compiled is the user's class's, in place or wrapped, and at graph breaks)."""
    seen: set[int] = set()
    for module in model.modules():
        level, chain = module.__dict__.get("forward"), [type(module).forward]
        while level is not None and len(chain) < 8:  # the wrapper dynamo made, and what it wraps
            chain.append(level)
            level = getattr(level, "__wrapped__", None)
        for code in (getattr(function, "__code__", None) for function in chain):
            if code is not None and id(code) not in seen:
                seen.add(id(code))
                yield code


def recompile_note(before: CompileCount | None, after: CompileCount | None, limit: int | None) -> str | None:
    """The note where the trials (between ``before`` and ``after``) met dynamo's recompile ``limit`` or left
    at most :data:`NEAR` sizes before it; else None (nothing compiled in the trials, or room to spare)."""
    if before is None or after is None or limit is None:
        return None
    hit = after.limit_hits > before.limit_hits
    new = None if after.graphs is None or before.graphs is None else max(after.graphs - before.graphs, 0)
    if not hit and not (new and after.graphs >= limit - NEAR):
        return None
    held = f"{after.graphs} graphs on its forward now, " if after.graphs is not None else ""
    compiled = f"compiled {new} more batch size{'s' if new != 1 else ''} ({held}of " if new else f"compiled the model ({held}of "
    if hit or after.graphs >= limit:
        what = ("dynamo ran each size past it uncompiled (or raised, with fullgraph=True): the later trials measured "
                "the eager step, whose peak the compiled graph's may differ from, and in training every size not "
                "compiled yet (an out-of-memory replay's smaller one, a short last batch) runs uncompiled too")
        said = "reached it"
    else:
        left = limit - after.graphs
        what = (f"{left} more size{'s' if left != 1 else ''} (an out-of-memory replay's smaller one, a short last "
                "batch) and training runs the next ones uncompiled, or raises with fullgraph=True")
        said = "came near it"
    return (f"the probe's trials {compiled}torch._dynamo.config.recompile_limit={limit}) and {said}: {what}. With "
            "dynamic=False every new size compiles a graph: compile with dynamic=None (the default: the second size "
            "compiles one graph for all sizes), mark the batch dimension dynamic (torch._dynamo.mark_dynamic(batch, 0)), "
            "or raise torch._dynamo.config.recompile_limit before the probe")


class RecompileWatch:
    """The count before a probe's trials on a real device, and the note after them (:func:`recompile_note`).
    Counts nothing where the trials run on the CPU's simulated device (``simulated``): they run uncompiled."""

    def __init__(self, model: torch.nn.Module | None, simulated: bool) -> None:
        self.model = model
        self.before = None if simulated else compile_count(model)

    def note(self) -> str | None:
        """The note for the trials since the watch began, or None."""
        if self.before is None:
            return None
        return recompile_note(self.before, compile_count(self.model), recompile_limit())

    def explain(self, exc: BaseException) -> None:
        """Add to ``exc``, dynamo's ``FailOnRecompileLimitHit`` raised in a trial (``fullgraph=True``), what
        the trials had to do with it (torch's own message names neither the probe nor its sizes)."""
        from ..errors import add_note

        if self.before is not None and recompile_limit_hit(exc):
            add_note(exc, "autobatch: " + (self.note() or "the probe's trials met torch._dynamo's recompile limit: "
                                           "compile with dynamic=None, or raise torch._dynamo.config.recompile_limit"))


def recompile_limit_hit(exc: BaseException) -> bool:
    """Whether ``exc`` is ``torch._dynamo``'s error for a compiled frame past its recompile limit
    (read by name: this never imports the compiler). The probe's and the Runner's
    (:mod:`autobatch.training.oom.abandon_notes`) one test."""
    return any(cls.__name__ == "FailOnRecompileLimitHit" and cls.__module__.startswith("torch._dynamo")
               for cls in type(exc).__mro__)
