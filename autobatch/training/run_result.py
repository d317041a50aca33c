"""RunResult: what a training run did, JSON-serialisable."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import checks
from ..memory.units import counted

__all__ = ["RunResult", "Recovery"]


@dataclass
class Recovery:
    """One OOM the runner recovered from.

    ``step``: global step index (from 0); ``phase``: transfer, forward, backward or
    optimizer; ``micro_batch_before`` / ``micro_batch``: the failed and the new micro-batch;
    ``action``: ``"measured"`` (sized from the runner's measured memory line and the failed
    attempt, :mod:`autobatch.training.oom.step_memory`), ``"halve"`` (nothing better was known), ``"back"`` (a
    grow-back try failed: back to the size that trained), ``"same"`` (an OOM inside ``optimizer.step()``, which the
    micro-batch does not size: replayed at the same one), ``"foreach"`` (a second one: the same again, the
    optimizer's groups switched to ``foreach=False``), or ``"checkpointing"`` when micro-batch 1 failed and activation checkpointing was turned on instead; ``grow``: the failed attempt was a grow-back try.
    """

    step: int
    phase: str
    micro_batch_before: int
    micro_batch: int
    action: str = "halve"
    grow: bool = False
    error: str = ""


@dataclass
class RunResult:
    """The outcome of :meth:`autobatch.Runner.fit`.

    ``steps``: global steps done over the whole run (including those before a resume);
    ``steps_this_run`` and ``samples`` (this process); ``epochs``: completed epochs;
    ``oom_recoveries``: every :class:`Recovery` (as dicts); ``grow_attempts``: the steps
    where a larger micro-batch was tried, with the size and whether it held;
    ``empty_cache_fires`` / ``empty_cache_seconds``: cache hygiene; ``checkpoints_saved``
    and ``checkpoint_path``; ``resumed_from``: the checkpoint and its step, if any;
    ``skipped_steps``: fp16 steps the ``GradScaler`` skipped (inf/NaN gradients);
    ``nonfinite_loss_steps``: steps without a grad scaler whose loss was NaN or infinite, applied
    all the same (a warning names the first);
    ``stopped``: the run ended early, after a whole step, on :meth:`~autobatch.Runner.request_stop`;
    ``stop_reason``: why (the ``reason`` given to it, ``"request_stop()"`` without one, ``"SIGTERM"``),
    else None.
    """

    steps: int = 0
    steps_this_run: int = 0
    samples: int = 0
    epochs: int = 0
    elapsed_s: float = 0.0
    micro_batch: int = 0
    initial_micro_batch: int = 0
    global_batch: int = 0
    checkpointing: bool = False
    last_loss: float | None = None
    oom_recoveries: list[dict[str, Any]] = field(default_factory=list)
    grow_attempts: list[dict[str, Any]] = field(default_factory=list)
    empty_cache_fires: int = 0
    empty_cache_seconds: float = 0.0
    checkpoints_saved: int = 0
    checkpoint_path: str | None = None
    resumed_from: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None
    skipped_steps: int = 0
    nonfinite_loss_steps: int = 0
    stopped: bool = False
    stop_reason: str | None = None

    @property
    def samples_per_s(self) -> float:
        """This run's samples over its whole ``fit()`` (``elapsed_s``: loading a checkpoint, a
        first plan, every step and hook): lower than a step's own rate (``metrics.jsonl``)."""
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def __repr__(self) -> str:
        """One line: how far the run got, at which micro-batch, and what it recovered from; the
        recoveries, grow-back tries and plan are in :meth:`to_dict`."""
        recovered = len(self.oom_recoveries)
        return (f"RunResult(steps={self.steps}, epochs={self.epochs}, samples={self.samples}, "
                f"micro_batch={self.micro_batch} (from {self.initial_micro_batch}), global_batch={self.global_batch}, "
                f"last_loss={self.last_loss!r}, {counted(recovered, 'OOM recovery', 'OOM recoveries')}"
                + (", stopped" if self.stopped else "") + f", {self.elapsed_s:.2f} s)")

    def snapshot(self) -> "RunResult":
        """A deep copy: what :meth:`~autobatch.Runner.fit` returns, so that a later ``fit()`` of the
        same runner, which updates ``runner.result``, does not rewrite a result already returned
        (each stage's ``results.append(runner.fit(...))`` read the last stage's steps and samples)."""
        return copy.deepcopy(self)

    def to_dict(self) -> dict[str, Any]:
        """The fields, exact (a checkpoint holds them: :meth:`from_dict` gives back an equal
        result), and ``samples_per_s`` rounded to 2 places as the command line's ``metrics.jsonl``
        rounds its own (read back by nothing: :meth:`from_dict` leaves it out). Rounded figures
        for a file a person reads: :meth:`rounded`. A diverged ``last_loss`` (NaN or infinite) is
        the text ``"nan"``, ``"inf"`` or ``"-inf"``, which :meth:`from_dict` reads back: as a float
        it made ``to_json`` write ``NaN``, which is no JSON (``jq``, ``JSON.parse`` refuse the file)."""
        data = {**asdict(self), "samples_per_s": round(self.samples_per_s, 2)}
        if self.last_loss is not None and not math.isfinite(self.last_loss):
            data["last_loss"] = str(float(self.last_loss))
        return data

    def rounded(self) -> dict[str, Any]:
        """:meth:`to_dict` with its seconds rounded to 6 places (a microsecond), as ``metrics.jsonl``
        rounds a step's: the command line's ``train_result.json``, where ``elapsed_s`` had every digit."""
        data = self.to_dict()
        data["elapsed_s"], data["empty_cache_seconds"] = round(self.elapsed_s, 6), round(self.empty_cache_seconds, 6)
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunResult":
        """The result :meth:`to_dict` wrote, read back: keys that are not fields are left out (what
        the command line's ``train_result.json`` adds, ``samples_per_s``, ``notes``, ``config``; a
        field a newer autobatch added, in a checkpoint it wrote), as ``ProbeResult.from_dict`` does;
        a field an older one lacked takes its default. Before, any such key was a ``TypeError``, on
        reading the CLI's file and on resuming a newer version's checkpoint."""
        values = checks.record_fields(cls, data, "RunResult")
        if isinstance(values.get("last_loss"), str):  # a diverged loss, as to_dict writes it
            try:
                values["last_loss"] = float(values["last_loss"])
            except ValueError:
                raise ValueError(f"RunResult.from_dict: last_loss {values['last_loss']!r} is no number; pass the "
                                 "dict RunResult.to_dict() wrote") from None
        return cls(**values)
