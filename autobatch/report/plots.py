"""Pictures of a probe and of a sweep: the memory curve, throughput, found batch per job.

A batch size alone does not say how close to the edge it is. :func:`plot_probe` draws every
trial's peak memory against its batch size (passes filled, OOMs as crosses at the peak they
reached before failing), the fitted memory line where the strategy made one, the capacity,
the chosen batch and the margin taken off the boundary; with a :class:`~autobatch.Plan`
whose candidates were timed, a second panel shows samples/s per micro-batch.
:func:`plot_sweep` draws the found batch and the time of every job of a sweep.

matplotlib is imported only inside these functions, and the figures are drawn without pyplot
(:class:`_Figures`), so ``import autobatch`` stays light, nothing needs a display, and the
session's matplotlib backend (a notebook's, a GUI's) is left as it was.

Both return exactly the file they wrote (:func:`plot_file`): ``~`` is expanded, a path without
a suffix gets ``.png`` (as matplotlib would add, so the returned path is the file), and an
existing directory gets the default file name inside it (``memory_curve.png`` for a probe,
``summary.png`` for a sweep: the names the CLI writes).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..memory.units import counted
from ..probe.result import ProbeResult
from .overrides import differing_overrides, shared_overrides
from .plot_path import plot_file

if TYPE_CHECKING:  # pragma: no cover
    from ..planning.planner import Plan

__all__ = ["plot_probe", "plot_sweep", "plot_file", "PROBE_PLOT_NAME", "SWEEP_PLOT_NAME"]

log = logging.getLogger("autobatch")

#: The file name written inside a directory given as the path (the CLI's names).
PROBE_PLOT_NAME = "memory_curve.png"
SWEEP_PLOT_NAME = "summary.png"

_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))
_PASS, _FAIL, _FIT, _CAP, _CHOSEN = "#1f77b4", "#d62728", "#555555", "#ff7f0e", "#2ca02c"
#: a sweep plot labels at most this many jobs (each bar and tick) and grows no wider: past it,
#: every k-th job is labelled (2000 jobs drew a 1800-inch figure for 26 s)
SWEEP_LABELLED = 60


class _Figures:
    """Figures made from :class:`matplotlib.figure.Figure` itself, not through pyplot: pyplot's
    figures go through the process's backend, which ``matplotlib.use("Agg", force=True)`` switched
    for the whole session (a notebook's inline or a Qt backend drew nothing after a plot was
    written). A bare ``Figure`` saves with the Agg renderer, needs no display, and leaves the
    user's backend and pyplot's open figures alone. ``subplots`` and ``close`` mirror pyplot's."""

    @staticmethod
    def subplots(nrows: int, ncols: int, *, figsize: tuple[float, float], **kwargs: Any) -> tuple[Any, Any]:
        from matplotlib.figure import Figure

        figure = Figure(figsize=figsize)
        return figure, figure.subplots(nrows, ncols, **kwargs)

    @staticmethod
    def close(figure: Any) -> None:
        """Nothing to release: no window, and pyplot never held the figure."""


_FIGURES = _Figures()


def _pyplot() -> _Figures:
    """What draws the figures (:class:`_Figures`), once matplotlib is known to be importable."""
    try:  # the module that draws, not the package alone: a broken install whose compiled parts
        import matplotlib.figure  # noqa: F401  fail to load there got a bare error from inside plot_probe
    except ImportError as exc:  # a dependency of autobatch, but an environment may lack it
        raise ImportError(
            f"plots need matplotlib ({exc}): pip install 'matplotlib>=3.7' (on the command line, "
            "probe.plot=false skips the plots)"
        ) from None  # the message names the cause: one traceback, not a second from inside
    return _FIGURES


def _unit_for(largest: float) -> tuple[str, int]:
    for name, size in _UNITS:
        if largest >= size:
            return name, size
    return "B", 1


def _trial_throughput(result: ProbeResult) -> list[tuple[int, float]]:
    """Rough samples/s of each passing trial: ``batch x its steps / trial seconds`` (includes
    the first step's warm-up, so it understates steady-state speed). Search trials run fewer
    steps than full ones; a record without ``steps`` (written before they existed) ran
    ``steps_per_trial``."""
    points = {}
    for trial in result.trials:
        if trial.passed and trial.seconds > 0:
            points[trial.batch_size] = trial.batch_size * (trial.steps or result.steps_per_trial) / trial.seconds
    return sorted(points.items())


def plot_probe(
    result: ProbeResult,
    path: str | os.PathLike,
    *,
    plan: "Plan | None" = None,
    trial_throughput: bool = False,
    title: str | None = None,
) -> Path:
    """Draw ``result`` 's memory curve into a PNG at ``path``; return the file written
    (:func:`plot_file`: ``~`` expanded, ``.png`` added to a path without a suffix, an existing
    directory gets ``memory_curve.png`` inside it).

    The memory panel: each trial's allocated peak against its batch size (passed: filled
    dots; OOM: crosses at the peak reached before the failure), the reserved peak where it
    differs (hollow), the fitted line (``result.fit``; the refined local line dashed), the
    capacity, the chosen batch and the margin between it and the largest batch that passed.

    A throughput panel is added when ``plan`` has timed candidates (samples/s per
    micro-batch, the chosen plan marked), or with ``trial_throughput=True`` from the
    probe's own trial times (rough: they include each trial's first, warm-up step). Both
    panels share one x-range, wide enough for every trial and every timed candidate.
    """
    if not isinstance(result, ProbeResult):
        raise TypeError(f"result must be the ProbeResult find_max_batch returned, got {type(result).__name__}"
                        + ("; read a result.json back with ProbeResult.from_dict(json.load(open('.../result.json')))"
                           if isinstance(result, (dict, str, os.PathLike)) else ""))
    if plan is not None and not hasattr(plan, "candidates"):  # else "'str' object has no attribute 'candidates'"
        raise TypeError(f"plan must be the Plan autobatch.plan() returned, or None, got {type(plan).__name__} {plan!r:.40}"
                        + ("; read a plan.json back with Plan.from_dict(...)" if isinstance(plan, (dict, str, os.PathLike)) else ""))
    path = plot_file(path, PROBE_PLOT_NAME)  # checked before matplotlib loads
    plt = _pyplot()
    candidates = [c for c in (plan.candidates if plan is not None else []) if c.get("samples_per_s")]
    trial_speeds = _trial_throughput(result) if trial_throughput and not candidates else []
    panels = 2 if candidates or trial_speeds else 1
    figure, axes = plt.subplots(
        panels, 1, figsize=(8, 4.8 if panels == 1 else 7.6), squeeze=False,
        gridspec_kw={"height_ratios": [3, 2][:panels]},
    )
    memory_axis = axes[0][0]
    try:
        _draw_memory(memory_axis, result)
        if candidates:
            _draw_candidates(axes[1][0], candidates)
        elif trial_speeds:
            _draw_trial_speeds(axes[1][0], trial_speeds, result)
        if panels == 2:  # one x-range for both, covering every candidate (a checkpointed
            # candidate's micro-batch can lie past every trial of the plain probe)
            right = max([memory_axis.get_xlim()[1]] + [c["micro_batch"] * 1.08 + 1 for c in candidates])
            for axis in (memory_axis, axes[1][0]):
                axis.set_xlim(0, right)
        memory_axis.set_title(title or _title(result), fontsize=10)
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)
    log.info("memory curve written to %s", path)
    return path


def _title(result: ProbeResult) -> str:
    how = result.strategy if result.strategy_used == result.strategy else f"{result.strategy} -> {result.strategy_used}"
    state = "untested estimate" if not result.tested else f"{counted(result.num_trials, 'trial')}, {result.num_ooms} OOM"
    if result.cached:  # the stored probe's trials: none ran now, and the time is the look-up's
        state = f"from the probe cache ({state} stored)"
    return f"batch {result.batch_size} on {result.device}\n{how}; {state}; {result.elapsed_s:.2f} s"


def _draw_memory(axis: Any, result: ProbeResult) -> None:
    passed = [t for t in result.trials if t.passed and t.peak_bytes is not None]
    failed = [t for t in result.trials if not t.passed and t.peak_bytes is not None]
    sizes = [t.batch_size for t in result.trials] + [result.batch_size]
    if result.largest_passed:
        sizes.append(result.largest_passed)
    right = max(sizes) * 1.08 + 1
    figures = [t.peak_bytes for t in result.trials if t.peak_bytes] + [
        t.reserved_bytes for t in result.trials if t.reserved_bytes
    ]
    if result.capacity_bytes:
        figures.append(result.capacity_bytes)
    unit, scale = _unit_for(max(figures, default=1))

    if passed:
        axis.scatter(
            [t.batch_size for t in passed], [t.peak_bytes / scale for t in passed],
            color=_PASS, s=28, zorder=3, label="passed (allocated peak)",
        )
        reserved = [t for t in passed if t.reserved_bytes is not None and t.reserved_bytes != t.peak_bytes]
        if reserved:
            axis.scatter(
                [t.batch_size for t in reserved], [t.reserved_bytes / scale for t in reserved],
                facecolors="none", edgecolors=_PASS, s=28, zorder=3, label="passed (reserved peak)",
            )
    if failed:
        axis.scatter(
            [t.batch_size for t in failed], [t.peak_bytes / scale for t in failed],
            color=_FAIL, marker="x", s=40, zorder=3, label="OOM (peak before the failure)",
        )
    _draw_fit(axis, result.fit, right, scale)
    if result.capacity_bytes:
        axis.axhline(result.capacity_bytes / scale, color=_CAP, linewidth=1.2,
                     label=f"capacity {result.capacity_bytes / scale:.2f} {unit}")
    axis.axvline(result.batch_size, color=_CHOSEN, linewidth=1.5, linestyle="-",
                 label=f"chosen batch {result.batch_size}" + ("" if result.tested else " (untested)"))
    if result.largest_passed and result.largest_passed != result.batch_size:
        axis.axvspan(result.batch_size, result.largest_passed, color=_CHOSEN, alpha=0.15,
                     label=f"margin {result.margin:.0%} (boundary {result.largest_passed})")
    axis.set_xlim(0, right)
    _finish_axis(axis, "batch size", f"peak memory ({unit})")


def _draw_fit(axis: Any, fit: dict[str, Any] | None, right: float, scale: int) -> None:
    """The fitted line(s) of ``ProbeResult.fit`` over the batch-size axis."""
    if not fit or fit.get("slope_bytes_per_sample") is None or fit.get("intercept_bytes") is None:
        return
    for line, style, label in ((fit, "--", "fitted memory line"), (fit.get("refined"), ":", "refined local line")):
        if not line or line.get("slope_bytes_per_sample") is None:
            continue
        xs = [0.0, right]
        ys = [(line["intercept_bytes"] + line["slope_bytes_per_sample"] * x) / scale for x in xs]
        per_sample = line["slope_bytes_per_sample"]
        axis.plot(xs, ys, style, color=_FIT, linewidth=1.2,
                  label=f"{label} ({per_sample / 1024**2:.3g} MiB/sample)" if per_sample >= 1024**2 / 100
                  else f"{label} ({per_sample / 1024:.3g} KiB/sample)")


def _draw_candidates(axis: Any, candidates: list[dict[str, Any]]) -> None:
    for checkpointing, marker, label in ((False, "o", "plain"), (True, "s", "activation checkpointing")):
        group = sorted((c for c in candidates if bool(c.get("checkpointing")) == checkpointing), key=lambda c: c["micro_batch"])
        if group:
            axis.plot([c["micro_batch"] for c in group], [c["samples_per_s"] for c in group],
                      marker=marker, color=_PASS if not checkpointing else "#9467bd", label=label)
    for c in candidates:
        if c.get("chosen"):
            axis.scatter([c["micro_batch"]], [c["samples_per_s"]], s=140, facecolors="none",
                         edgecolors=_CHOSEN, linewidths=2, zorder=4,
                         label=f"chosen: {c['micro_batch']} x {c['accumulation_steps']}")
    _finish_axis(axis, "micro-batch", "samples/s", "throughput of the timed plans")


def _draw_trial_speeds(axis: Any, speeds: list[tuple[int, float]], result: ProbeResult) -> None:
    axis.plot([b for b, _ in speeds], [s for _, s in speeds], marker="o", color=_PASS,
              label="passing trials (samples x steps / seconds, warm-up included)")
    axis.axvline(result.batch_size, color=_CHOSEN, linewidth=1.5)
    _finish_axis(axis, "batch size", "samples/s (rough)", "throughput measured by the probe's trials")


def _finish_axis(axis: Any, xlabel: str, ylabel: str, title: str | None = None) -> None:
    """The look every probe panel shares: labels, y from 0, a light grid, the legend (and a
    small title for the lower panels)."""
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_ylim(bottom=0)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8, loc="best")  # "lower right" hid the answer where its peak is low (a probe
    # capped by max_batch, a plan's probe capped at its global batch): the chosen batch sits at the right
    if title is not None:
        axis.set_title(title, fontsize=9)


def plot_sweep(
    rows: "Iterable[dict[str, Any]] | str | os.PathLike", path: str | os.PathLike, *, title: str | None = None
) -> Path:
    """Draw a sweep's rows (``batch_size``, ``time_s``, ``status``, ``overrides`` per job, as
    in ``summary.csv``; or a DataFrame of them, or the path of a ``summary.csv`` or of its sweep
    directory) into a PNG at ``path``: the found batch per job (bars; failed and interrupted
    jobs marked) above the probe's time (``time_s``), or, for a ``train`` sweep's rows (a
    ``final_loss``), the micro-batch trained at above the final loss; past :data:`SWEEP_LABELLED` jobs every k-th is
    labelled and the figure grows no wider. Returns the file written (:func:`plot_file`: ``~``
    expanded, ``.png`` added to a path without a suffix, an existing directory gets
    ``summary.png`` inside it)."""
    rows = _sweep_rows(rows)
    path = plot_file(path, SWEEP_PLOT_NAME)  # checked before matplotlib draws
    plt = _pyplot()
    labels = _job_labels(rows)
    positions = list(range(len(rows)))
    height = 5.0 + 0.06 * max((len(label) for label in labels), default=0)
    every = max(1, math.ceil(len(rows) / SWEEP_LABELLED))  # label every job, or every k-th of a large sweep
    figure, (batch_axis, time_axis) = plt.subplots(
        2, 1, figsize=(max(7.0, 0.9 * min(len(rows), SWEEP_LABELLED) + 2), min(height, 10)), sharex=True,
        gridspec_kw={"height_ratios": [3, 2]},
    )
    try:
        batches = [_number(row.get("batch_size")) for row in rows]
        # a train sweep's rows (a final_loss column) compare the losses: an lr sweep's answer, where probe time
        # is the same for every job, or empty for all with train.micro_batch (no probe ran)
        trained = any(_number(row.get("final_loss")) is not None for row in rows)
        times = [_number(row.get("final_loss" if trained else "time_s")) for row in rows]
        states = [_state(row) for row in rows]  # None: ok; else "failed" or "interrupted"
        bars = batch_axis.bar(positions, [b or 0 for b in batches],
                              color=[_FAIL if state else _PASS for state in states])
        for bar, batch, state in list(zip(bars, batches, states))[::every]:
            text = state or ("-" if batch is None else f"{batch:g}")
            batch_axis.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=8, color=_FAIL if state else "black")
        batch_axis.set_ylabel("micro-batch" if trained else "found batch")
        batch_axis.set_ylim(bottom=0, top=max([b or 0 for b in batches] + [1]) * 1.15)
        batch_axis.grid(True, axis="y", alpha=0.3)
        stopped = states.count("interrupted")  # counted as the CLI's last line counts them
        counts = f"{counted(len(rows), 'job')}, {sum(bool(s) for s in states) - stopped} failed" + (f", {stopped} interrupted" if stopped else "")
        batch_axis.set_title(title or f"sweep: {counts}", fontsize=10)
        time_axis.bar(positions, [t or 0 for t in times], color="#7f7f7f")
        time_axis.set_ylabel("final loss" if trained else "probe time (s)")  # time_s: 0 from the probe cache
        time_axis.set_ylim(bottom=0)
        time_axis.grid(True, axis="y", alpha=0.3)
        time_axis.set_xticks(positions[::every])
        time_axis.set_xticklabels(labels[::every], rotation=30, ha="right", fontsize=8)
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)
    return path


def _sweep_rows(rows: Any) -> list[dict[str, Any]]:
    """The rows as a list of mappings, from an iterable of them, a pandas DataFrame (as
    ``pd.read_csv("summary.csv")`` gives), or the path of a ``summary.csv`` or of the sweep
    directory holding one (a DataFrame or a path was iterated as column names or characters and
    failed with ``'str' object has no attribute 'get'``)."""
    if isinstance(rows, (str, os.PathLike)):
        import csv

        source = Path(rows).expanduser()
        source = source / "summary.csv" if source.is_dir() else source
        if not source.is_file():
            raise FileNotFoundError(f"plot_sweep: {source} is not a file; give the rows, a summary.csv or the sweep directory")
        with open(source, newline="", encoding="utf-8") as handle:
            return list(csv.DictReader(handle))
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):  # a pandas DataFrame
        return list(rows.to_dict("records"))
    if not isinstance(rows, Iterable) or getattr(rows, "ndim", None) == 0:  # was "'int' object is not iterable"
        raise TypeError(f"plot_sweep takes the sweep's rows (mappings, as in summary.csv), a DataFrame of them or the path "
                        f"of a summary.csv, got {type(rows).__name__} {rows!r:.40}")
    rows = list(rows)
    wrong = next((row for row in rows if not hasattr(row, "get")), None)
    if wrong is not None:
        raise TypeError(
            f"plot_sweep takes the sweep's rows (mappings, as in summary.csv), a DataFrame of them or the path of "
            f"a summary.csv; got a {type(wrong).__name__} among the rows"
        )
    return rows


def _state(row: dict[str, Any]) -> str | None:
    """None for a job that finished, else ``failed`` or ``interrupted`` (its ``status``)."""
    status = row.get("status")
    if status in (None, "ok") or (isinstance(status, float) and math.isnan(status)):
        return None
    return "interrupted" if status == "interrupted" else "failed"


def _job_labels(rows: list[dict[str, Any]]) -> list[str]:
    """``#<job> <overrides>`` for each job, without the overrides every job shares (a sweep's
    fixed ``model=mlp data.shape=[16] ...`` filled the 48 characters, so every label read the
    same), each cut to 48 characters, its ``$`` escaped: matplotlib draws the text between two
    of them as math (``tag=$HOME/run_$`` failed the plot, ``${a}_${b}`` was mangled)."""
    shared = shared_overrides(rows)
    labels = []
    for row in rows:
        label = " ".join([f"#{row.get('job', '?')}", *differing_overrides(row, shared)])
        label = label if len(label) <= 48 else label[:45] + "..."
        labels.append(label.replace("$", r"\$"))
    return labels


def _number(value: Any) -> float | None:
    """A CSV cell or JSON value as a number (None when empty, not a number, or not finite: rows
    read back with pandas hold NaN in a failed job's empty cells, which no axis can scale to)."""
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
