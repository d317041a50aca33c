"""Plan: the planner's answer, how to train the global batch on this device, as data.

Serialisable (``to_dict``/``to_json``/``from_dict``) so that the CLI writes it, the cache of
a sweep summarises it and a later run reads it; :func:`candidates_table` renders the
throughput objective's timed candidates.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping, Sequence

import torch
from .. import checks
from ..memory.units import counted
from ..probe.result import ProbeResult, labelled
from .accumulation import cut_batch, micro_batch_sizes
from .checkpointing import CheckpointHandle, enable_checkpointing, module_names_for

__all__ = ["Plan", "candidates_table", "short_list", "size_runs", "sizes_text"]


@dataclass
class Plan:
    """How to train ``global_batch`` samples per optimizer step on this device.

    ``micro_batch`` samples per forward/backward, ``accumulation_steps`` of them per optimizer
    step; ``micro_batch_sizes`` are their exact sizes (they sum to ``global_batch``;
    ``balanced`` says which split policy made them). ``checkpointing`` and
    ``checkpointed_modules`` say whether and where activation checkpointing is on. ``probes``
    holds every probe run (``checkpointing``, ``fits``, and the ``ProbeResult`` dict as
    ``result``, or the error's figures); ``candidates`` the timed candidates of the
    throughput objective (:class:`~autobatch.planning.throughput.Candidate` as dicts) and ``timing``
    how they were timed (``warmup_steps``, ``timed_steps``, ``retime_rounds``,
    ``retime_within``, and ``retimed``: how many leaders were re-timed). ``reason`` says why
    this plan won. JSON-serialisable (``to_json`` / ``from_dict``); the live checkpoint
    handle is not serialised.
    """

    global_batch: int
    micro_batch: int
    accumulation_steps: int
    micro_batch_sizes: list[int]
    checkpointing: bool
    checkpointed_modules: list[str] = field(default_factory=list)
    balanced: bool = True
    objective: str = "max_batch"
    reason: str = ""
    probes: list[dict[str, Any]] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    timing: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    handle: CheckpointHandle | None = field(default=None, repr=False, compare=False)
    applied: list[CheckpointHandle] = field(default_factory=list, repr=False, compare=False)

    # -- using the plan -------------------------------------------------------------------
    def split(self, batch: Any) -> list[Any]:
        """Split a global batch into this plan's micro-batches. A batch of fewer samples than
        ``global_batch`` (a DataLoader's short last batch, ``drop_last=False``) is cut the same
        way into fewer micro-batches; one of more samples is one ``ValueError``: it was cut into
        more micro-batches of the plan's size than ``accumulation_steps`` without a word, so a loop
        dividing by the plan's steps or ``global_batch`` weighted it wrongly, or trained a global
        batch other than the one planned. A plan whose checkpointing is on
        nowhere (loaded from JSON and never :meth:`apply`-ed, or :meth:`undo`-ne) warns once: its
        micro-batch was measured with those blocks checkpointed, and without them it may not fit."""
        on = any(handle is not None and handle.active for handle in [self.handle, *self.applied])
        if self.checkpointing and not on and not getattr(self, "_told", False):
            self._told = True
            warnings.warn(
                f"this plan's micro-batch {self.micro_batch} was planned with activation checkpointing on "
                f"{counted(len(self.checkpointed_modules), 'module')} ({short_list(self.checkpointed_modules)}), which is not on: "
                "call plan.apply(model) before training (a plan loaded from JSON does not apply itself), or the "
                "micro-batch may run out of memory", RuntimeWarning, stacklevel=2)
        return cut_batch(batch, self._sizes_of)

    def _sizes_of(self, samples: int) -> list[int]:
        """The micro-batch sizes :meth:`split` cuts a batch of ``samples`` into: at most the plan's
        ``global_batch`` (per rank where the plan was made for one rank's share of it)."""
        if samples > self.global_batch:
            raise ValueError(
                f"Plan.split: the batch has {samples} samples, more than this plan's global_batch={self.global_batch} "
                f"(micro_batch={self.micro_batch} x {self.accumulation_steps} accumulation steps): pass batches of at most "
                f"{self.global_batch} samples (a DataLoader's batch_size={self.global_batch}; under DDP each rank's share), "
                f"or plan anew with global_batch={samples}")
        return micro_batch_sizes(samples, self.micro_batch, balanced=self.balanced)

    def apply(self, model: Any) -> CheckpointHandle | None:
        """Turn this plan's checkpointing on for ``model`` (e.g. a plan loaded from JSON, or
        another copy of the planned model); :meth:`undo` removes it with the rest. The plan's
        module names are matched across wrappers (a plan made on a DDP- or ``torch.compile``-
        wrapped model applies to the bare model, and the other way round); names the model does
        not have are one ``ValueError``. ``model`` may be a :class:`~autobatch.TrainStep` (or any
        object holding the module as ``.model``, a ``Runner``): its model is wrapped; anything
        else is one ``TypeError``."""
        model = _model_of(model)
        if not self.checkpointing:
            return None
        handle = enable_checkpointing(model, modules=module_names_for(model, self.checkpointed_modules))
        self.applied.append(handle)
        return handle

    def undo(self) -> None:
        """Remove the activation checkpointing this plan turned on: on the planned model and on
        every model :meth:`apply` wrapped (a no-op without it). The handles are let go: a plan kept
        for its numbers kept the planned model, and its weights, alive after the user dropped it (review 38)."""
        for handle in [self.handle, *reversed(self.applied)]:
            if handle is not None:
                handle.undo()
        self.handle = None
        self.applied.clear()

    @property
    def probe_results(self) -> list[ProbeResult]:
        """The successful probes as :class:`ProbeResult` objects."""
        return [ProbeResult.from_dict(p["result"]) for p in self.probes if p.get("result")]

    @property
    def samples_per_s(self) -> float | None:
        """The chosen candidate's samples/s at its median step time (throughput objective only)."""
        for candidate in self.candidates:
            if candidate.get("chosen"):
                return candidate.get("samples_per_s")
        return None

    # -- serialisation ----------------------------------------------------------------------
    def __repr__(self) -> str:
        """One line: the split and why it won; the probes and candidates are in :meth:`to_dict`,
        the readable lines in :meth:`summary` (``print(plan)``)."""
        return (f"Plan(global_batch={self.global_batch}, micro_batch={self.micro_batch} x {self.accumulation_steps}, "
                f"checkpointing={self.checkpointing}, objective={self.objective!r}, reason={self.reason[:80]!r})")

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON data (not the live checkpoint handles); a figure that is not
        finite is None (a candidate's ``samples_per_s`` whose median step measured 0 s was
        ``Infinity`` in the JSON, which ``jq`` and ``JSON.parse`` refuse)."""
        return {f.name: checks.strict_json(getattr(self, f.name)) for f in fields(self) if f.name not in ("handle", "applied")}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """The plan :meth:`to_dict` wrote (keys that are not its fields, a report's own, are left
        out). One error naming what to pass for anything else: a JSON string or a file's text (it
        failed as ``'str' object has no attribute 'items'``), a dict without the plan's fields
        (``Plan.__init__() missing ...``), or micro-batch sizes and steps other than those
        :meth:`split` cuts (an edited plan that would train another global batch, or report
        another split than it runs: ``[4, 4, 2]`` balanced was cut 4, 3, 3, and ``[10, 0]`` passed
        as two steps of one)."""
        plan = cls(**checks.record_fields(cls, data, "Plan", is_not="no plan", exclude=("handle", "applied"),
                                          source="a CLI run's plan.json, json.loads of Plan.to_json()"))
        sizes = list(plan.micro_batch_sizes)
        try:  # what split() cuts: the sizes are a report of it, and must not claim another split
            cut = micro_batch_sizes(plan.global_batch, plan.micro_batch, balanced=plan.balanced)
        except (TypeError, ValueError) as exc:  # a size that is no positive integer
            raise ValueError(f"Plan.from_dict: {exc}") from None
        if sizes != cut or len(sizes) != plan.accumulation_steps:
            raise ValueError(f"Plan.from_dict: micro_batch_sizes [{short_list(sizes)}] (sum {sum(sizes)}) do not make "
                             f"global_batch={plan.global_batch} in accumulation_steps={plan.accumulation_steps} as split() "
                             f"cuts it with micro_batch={plan.micro_batch}, balanced={plan.balanced}: [{short_list(cut)}] "
                             f"({len(cut)} steps); an edited plan must change them together (plan anew for another "
                             "global batch)")
        return plan

    def summary(self) -> str:
        """A few readable lines; for the throughput objective, a table of the candidates."""
        lines = [
            labelled("global batch", self.global_batch),
            labelled("micro-batch", f"{self.micro_batch} x {self.accumulation_steps} accumulation steps"
                     + (f" (sizes {sizes_text(self.micro_batch_sizes)})" if self.accumulation_steps > 1 else "")),
            labelled("checkpointing", f"on, {counted(len(self.checkpointed_modules), 'module')} "
                     f"({short_list(self.checkpointed_modules)})" if self.checkpointing else "off"),
            labelled("objective", self.objective),
            labelled("reason", self.reason),
        ]
        lines.extend(labelled("note", note) for note in self.notes)
        if self.candidates:
            lines.append("")
            lines.append(candidates_table(self.candidates))
        return "\n".join(lines)


def speed_text(samples_per_s: float | None, unit: str = " samples/s") -> str:
    """A timed candidate's speed for a reason, a log line or a table: ``"123.4 samples/s"`` (a
    table's column names the unit: ``unit=""``); one whose median step the clock measured as 0 s
    (``inf`` in memory, ``null`` in JSON) is too fast to time, not "inf samples/s"."""
    if samples_per_s is not None and math.isfinite(samples_per_s):
        return f"{samples_per_s:.1f}{unit}"
    return "too fast to time (a median step of 0 s on this clock)"


def candidates_table(candidates: Iterable[dict[str, Any]]) -> str:
    """A markdown table of timed candidates: samples/s at the median step, the median step,
    how many steps were timed (in how many rounds), allocator retries ("-": not measured);
    the chosen one marked, one with allocator retries flagged."""
    rows = [
        "| micro-batch | accumulation | checkpointing | samples/s | median s/step | timed steps | alloc retries | |",
        "| ---: | ---: | :---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in candidates:
        untimed = c.get("samples_per_s") is None and c.get("seconds_per_step") is None
        speed = "OOM" if c.get("error") else "-" if untimed else speed_text(c.get("samples_per_s"), unit="")
        per_step = "-" if c.get("seconds_per_step") is None else f"{c['seconds_per_step']:.4f}"
        steps = len(c.get("step_seconds") or [])
        timed = f"{steps} ({c.get('rounds', 1)} rounds)" if c.get("rounds", 1) > 1 else (str(steps) if steps else "-")
        retries = "-" if c.get("alloc_retries") is None else str(c["alloc_retries"])
        marks = (["**chosen**"] if c.get("chosen") else []) + (["allocator retries"] if c.get("alloc_retries") else [])
        marks += ["its first steps were each too slow to lead: timed no further"] if c.get("pruned") else []
        rows.append(
            f"| {c['micro_batch']} | {c['accumulation_steps']} | {'yes' if c['checkpointing'] else 'no'} "
            f"| {speed} | {per_step} | {timed} | {retries} | {', '.join(marks)} |"
        )
    return "\n".join(rows)


# -- planning -------------------------------------------------------------------------------
def _model_of(target: Any) -> torch.nn.Module:
    """The module :meth:`Plan.apply` wraps: ``target`` itself, or the ``.model`` of a
    ``TrainStep`` or ``Runner``; anything else (the optimizer, the plan's dict) is one
    ``TypeError`` (before, ``'SGD' object has no attribute 'named_children'``)."""
    if isinstance(target, torch.nn.Module):
        return target
    inner = getattr(target, "model", None)
    if isinstance(inner, torch.nn.Module):
        return inner
    raise TypeError(f"Plan.apply takes the model to checkpoint (a torch.nn.Module, or a TrainStep holding one), "
                    f"got {type(target).__name__}: call plan.apply(model) with the model you train")


def short_list(items: list[Any], limit: int = 4) -> str:
    shown = ", ".join(str(item) for item in items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def size_runs(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``(size, count)`` of each run of one micro-batch size: ``[(5, 17), (4, 3)]``."""
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return [(size, count) for size, count in runs]


def sizes_text(sizes: Sequence[int]) -> str:
    """Micro-batch sizes as runs of ``size x count`` and their sum: ``"5 x 17 + 4 x 3 = 97"`` for a
    global batch of 97 in 20 micro-batches. The first few sizes (``5, 5, 5, 5, ... (20 in all)``) hid
    the smaller ones, so a plan of "5 x 20" read as 100 samples where it trains exactly 97."""
    return " + ".join(f"{size} x {count}" for size, count in size_runs(sizes)) + f" = {sum(sizes)}"
