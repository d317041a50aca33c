"""ProbeResult: what a probe found and every trial it ran to find it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import checks
from .trial import TrialRecord
from ..memory.units import counted, format_bytes

__all__ = ["ProbeResult"]


def labelled(label: str, text: object) -> str:
    """One ``label  value`` line of a summary, a multi-line value's further lines indented under
    the value (a note or reason with a newline broke the column at the left margin)."""
    return f"{label:<16}" + str(text).replace("\n", "\n" + " " * 16)


#: how a cache hit marks the notes of the probe that stored it (:meth:`ProbeCache.get <autobatch.probe.caching.cache.ProbeCache.get>`)
STORED_NOTE = "stored probe: "

@dataclass
class ProbeResult:
    """The outcome of :func:`~autobatch.find_max_batch`.

    ``batch_size`` passed every step of a real trial (after ``margin`` and ``multiple_of``
    were applied). ``largest_passed`` is the boundary before the margin; ``smallest_failed``
    the smallest size that ran out of memory (None if none did, e.g. when ``max_batch``
    passed, or when the memory line settled the size above the answer untried on an
    accelerator: ``fit["settled_above"]`` and a note then say so). ``strategy`` is what was
    asked for, ``strategy_used`` what ran (``auto`` resolves to a concrete strategy;
    ``fallback_reason`` says why when it had to change course).
    ``fit`` holds a fitted memory curve when a strategy made one. ``notes`` explain choices
    made for the user, such as the default CPU budget.

    ``tested`` is False for ``strategy="estimate"``: ``batch_size`` is a prediction from a
    fake-tensor trace that never ran (``trials`` is empty, ``estimate`` holds the traces).
    ``cached`` is True when the answer came from the probe cache; ``trials`` are then those of
    the probe that stored it.

    ``diagnostics`` is the device's memory at the end of the probe (allocated, reserved and
    peak bytes, the fragmentation gap, allocator retry counts, the memory summary text; see
    :func:`~autobatch.memory.diagnostics.memory_diagnostics`), None where none was taken.
    ``promise``: the figures behind the answer (its confirming trial's steps, peaks,
    fragmentation, autotuning; :mod:`autobatch.probe.promise`), also said in ``notes``.
    """

    batch_size: int
    strategy: str
    strategy_used: str
    trials: list[TrialRecord]
    capacity_bytes: int | None
    elapsed_s: float
    margin: float
    multiple_of: int = 1
    max_batch: int | None = None
    largest_passed: int | None = None
    smallest_failed: int | None = None
    device: str = ""
    memory_limit_bytes: int | None = None
    steps_per_trial: int = 1
    fit: dict[str, Any] | None = None
    fallback_reason: str | None = None
    notes: list[str] = field(default_factory=list)
    tested: bool = True
    cached: bool = False
    estimate: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    promise: dict[str, Any] | None = None

    @property
    def num_trials(self) -> int:
        return len(self.trials)

    @property
    def num_ooms(self) -> int:
        return sum(not trial.passed for trial in self.trials)

    @property
    def peak_bytes(self) -> int | None:
        """Peak memory of the last passing trial at the chosen batch size."""
        for trial in reversed(self.trials):
            if trial.passed and trial.batch_size == self.batch_size:
                return trial.peak_bytes
        return None

    @property
    def hit_max_batch(self) -> bool:
        return self.max_batch is not None and self.largest_passed == self.max_batch

    def __repr__(self) -> str:
        """One line: the answer and why (the boundary, the first OOM, the trials); every trial and
        note is in :meth:`to_dict`, the readable lines in :meth:`summary` (``print(result)``)."""
        how = self.strategy if self.strategy_used == self.strategy else f"{self.strategy}->{self.strategy_used}"
        state = "untested estimate" if not self.tested else f"{counted(self.num_trials, 'trial')}, {self.num_ooms} OOM"
        return (f"ProbeResult(batch_size={self.batch_size}, largest_passed={self.largest_passed}, "
                f"smallest_failed={self.smallest_failed}, strategy={how!r}, {state}"
                + (", cached" if self.cached else "") + f", device={self.device!r})")

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(num_trials=self.num_trials, num_ooms=self.num_ooms, peak_bytes=self.peak_bytes)
        return checks.strict_json(data)  # strict JSON: a NaN or infinite figure is None

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ProbeResult":
        """The result :meth:`to_dict` wrote, read back in another process or by another version.

        Keys that are not fields are left out, of the result and of each trial, as
        :meth:`~autobatch.Plan.from_dict` leaves them: the derived counts, what the command
        line's ``result.json`` adds (``command``, ``config``), and a field a newer autobatch
        added (a trial's failed with a ``TypeError``). A field an older one lacked takes its
        default. Anything else is one error naming what to pass: text instead of a dict, or a
        dict or trial without the required fields (a bare ``KeyError: 'trials'`` before)."""
        source = "a CLI probe's result.json, json.loads of to_json()"
        values = checks.record_fields(cls, data, "ProbeResult", is_not="not a probe result", source=source)
        trials = values["trials"]
        if not isinstance(trials, list) or not all(isinstance(trial, Mapping) for trial in trials):
            raise ValueError("ProbeResult.from_dict: trials is not a list of objects; pass the dict "
                             "ProbeResult.to_dict() wrote")
        values["trials"] = [TrialRecord(**checks.record_fields(TrialRecord, trial, "ProbeResult", what="a trial",
                                                               is_not="not a trial record", source=source))
                            for trial in trials]
        return cls(**values)

    def summary(self) -> str:
        """A few readable lines: the answer, how it was found, and on what."""
        trials = f"{counted(self.num_trials, 'trial')} ({self.num_ooms} OOM)"
        lines = [
            labelled("batch size", self.batch_size),
            labelled("strategy", self.strategy + (f" -> {self.strategy_used}" if self.strategy_used != self.strategy else "")),
            labelled("trials", trials + (", the stored probe's" if self.cached else "")),
            labelled("peak memory", format_bytes(self.peak_bytes)),
            labelled("capacity", format_bytes(self.capacity_bytes)),
            labelled("device", self.device),
            labelled("time", f"{self.elapsed_s:.2f} s"),
        ]
        if not self.tested:
            lines.append(labelled("untested", "an estimate from a fake-tensor trace; no trial ran"))
        if self.cached:
            lines.append(labelled("cached", "from the probe cache; no trial ran"))
        if self.hit_max_batch:  # the answer is the cap, not the memory boundary: it was never reached
            lines.append(labelled("capped", f"at max_batch={self.max_batch}: no trial up to it ran out of memory"))
        if self.margin:
            boundary = "" if self.largest_passed is None else f" (boundary {self.largest_passed})"
            lines.append(labelled("margin", f"{self.margin:.0%}{boundary}"))
        if self.fallback_reason:
            lines.append(labelled("fallback", self.fallback_reason))
        lines.extend(labelled("note", note) for note in self.notes)
        return "\n".join(lines)

