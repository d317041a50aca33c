"""What the command line shows a person: the result table, trial progress, the plot.

* :func:`print_result`: on a terminal, a compact ``rich`` table of the answer and how close
  to the edge it is (peak, capacity, headroom, the allocator's fragmentation gap); anywhere
  else (a pipe, a log file, the tests' captured output) the plain ``label  value`` lines of
  :meth:`~autobatch.ProbeResult.summary`, which read well without a terminal.
* :func:`trial_progress`: on a terminal, a live line on stderr saying which trial runs and
  how the last ones went; log records print above it instead of tearing it. Elsewhere it
  does nothing: the ``trial ...`` log lines already are the progress.
* :func:`write_probe_plot`: ``memory_curve.png`` next to ``result.json`` unless
  ``probe.plot=false``; a plot that cannot be drawn is a warning, never a failed probe.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

from ..dist import agreement as dist_sync
from ..planning.accumulation import micro_batch_sizes
from ..planning.plan_result import size_runs
from ..probe.result import ProbeResult
from ..probe.trial import TrialRecord, watch_trials
from ..memory.units import counted, format_bytes
from .errors import cli_keys

__all__ = ["print_result", "print_training", "render_table", "trial_progress", "write_probe_plot", "PLOT_FILE"]

log = logging.getLogger("autobatch")

PLOT_FILE = "memory_curve.png"


def _is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal; a closed one (a handler left on a stream since closed) is not."""
    try:
        return bool(getattr(stream, "isatty", lambda: False)())
    except ValueError:  # I/O operation on closed file
        return False


# -- the result table ------------------------------------------------------------------------
def _rows(result: ProbeResult) -> list[tuple[str, str]]:
    """(label, value) rows of the table: the answer first, then the memory figures."""
    how = result.strategy if result.strategy_used == result.strategy else f"{result.strategy} -> {result.strategy_used}"
    rows = [
        ("batch size", str(result.batch_size) + ("" if result.tested else "  (untested estimate)")),
        ("strategy", how),
        ("trials", f"{result.num_trials} ({result.num_ooms} OOM)"),
        ("peak memory", format_bytes(result.peak_bytes)),
        ("capacity", format_bytes(result.capacity_bytes)),
    ]
    if result.peak_bytes is not None and result.capacity_bytes:
        headroom = result.capacity_bytes - result.peak_bytes
        rows.append(("headroom", f"{format_bytes(headroom)} ({headroom / result.capacity_bytes:.1%} of capacity)"))
    diagnostics = result.diagnostics or {}
    if diagnostics.get("peak_fragmentation_gap_bytes"):
        rows.append(("reserved gap", f"{format_bytes(diagnostics['peak_fragmentation_gap_bytes'])} reserved but unallocated at the last peak"))
    if diagnostics.get("num_alloc_retries"):
        rows.append(("alloc retries", str(diagnostics["num_alloc_retries"])))
    if result.margin:
        rows.append(("margin", f"{result.margin:.0%} (boundary {result.largest_passed})"))
    rows += [("device", result.device), ("time", f"{result.elapsed_s:.2f} s")]
    if result.cached:
        rows.append(("cached", "from the probe cache; no trial ran"))
    if result.fallback_reason:
        rows.append(("fallback", result.fallback_reason))
    rows += [("note", cli_keys(note)) for note in result.notes]  # "pass memory_limit": probe.memory_limit here
    return rows


def render_table(result: ProbeResult, extra: Sequence[tuple[str, str]] = (), *, width: int = 100) -> str:
    """The rich table as text (what :func:`print_result` shows on a terminal), for tests and logs."""
    from rich.console import Console

    console = Console(width=width, file=_Discard(), record=True, color_system=None, force_terminal=False)
    console.print(_table(result, extra))
    return console.export_text()


def _table(result: ProbeResult, extra: Sequence[tuple[str, str]]):
    from rich.table import Table

    table = Table(title=f"autobatch: batch {result.batch_size}", show_header=False, box=None, padding=(0, 2), title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for label, value in [*_rows(result), *extra]:
        style = "green" if label == "batch size" else ("yellow" if label in ("note", "fallback", "reserved gap") else None)
        table.add_row(label, value, style=style)
    return table


class _Discard:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def print_result(result: ProbeResult, extra: Sequence[tuple[str, str]] = (), *, file: IO[str] | None = None) -> None:
    """Show ``result`` and the ``extra`` rows (e.g. where the files went) on ``file`` (stdout):
    a rich table on a terminal, plain ``label  value`` lines elsewhere."""
    stream = file if file is not None else sys.stdout
    if _is_terminal(stream):
        from rich.console import Console

        Console(file=stream).print(_table(result, extra))
        return
    lines = [cli_keys(result.summary()), *(f"{label:<16}{value}" for label, value in extra)]
    print("\n".join(lines), file=stream, flush=True)


# -- progress while trials run -----------------------------------------------------------------
class _ThroughConsole(logging.Filter):
    """On a terminal handler while the live line shows: print records above it via the rich
    console (the line would tear otherwise); the ``trial`` lines are shown by the display."""

    def __init__(self, console: Any, handler: logging.Handler) -> None:
        super().__init__()
        self.console = console
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.name == "autobatch" and str(record.msg).startswith("trial ")):
            self.console.print(self.handler.format(record), markup=False, highlight=False, soft_wrap=True)
        return False


def _terminal_handlers() -> list[logging.Handler]:
    handlers = [*logging.getLogger().handlers, *log.handlers]
    return [
        h for h in handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
        and _is_terminal(getattr(h, "stream", None))
    ]


@contextmanager
def trial_progress(enabled: bool | None = None, *, file: IO[str] | None = None) -> Iterator[None]:
    """While open, show a live line per running trial on ``file`` (stderr) and one printed
    line per finished trial. ``enabled``: None means "when ``file`` is a terminal"."""
    stream = file if file is not None else sys.stderr
    if not (enabled if enabled is not None else _is_terminal(stream)):
        yield
        return
    from rich.console import Console

    console = Console(file=stream)
    counts = {"trials": 0, "ooms": 0}

    def show(batch_size: int, purpose: str, record: TrialRecord | None) -> None:
        if record is None:
            status.update(
                f"trial {counts['trials'] + 1}: batch {batch_size} ({purpose})  "
                f"[dim]{counts['trials']} done, {counts['ooms']} OOM[/dim]"
            )
            return
        counts["trials"] += 1
        counts["ooms"] += not record.passed
        mark = "[green]passed[/green]" if record.passed else "[red]OOM   [/red]"
        console.print(
            f"  trial {counts['trials']:>3}  batch {batch_size:>7}  {purpose:<8} {mark} "
            f"peak {format_bytes(record.peak_bytes):>11}  {record.seconds:.2f} s",
            highlight=False,
        )

    handlers = _terminal_handlers()
    with console.status("probing...", spinner="dots") as status:
        filters = [(h, _ThroughConsole(console, h)) for h in handlers]
        for handler, through in filters:
            handler.addFilter(through)
        try:
            with watch_trials(show):
                yield
        finally:
            for handler, through in filters:
                handler.removeFilter(through)


# -- the plot ----------------------------------------------------------------------------------
def write_probe_plot(cfg: Any, result: ProbeResult, out_dir: Path) -> Path | None:
    """``memory_curve.png`` in ``out_dir`` unless ``probe.plot`` is false; None when not drawn."""
    if not _plot_wanted(cfg):
        return None
    try:
        from ..report.plots import plot_probe

        return plot_probe(result, out_dir / PLOT_FILE)
    except Exception as exc:  # noqa: BLE001 - the probe's answer matters more than its picture
        log.warning("memory curve not drawn (%s: %s)", type(exc).__name__, exc)
        return None


def _plot_wanted(cfg: Any) -> bool:
    probe = cfg.get("probe") if hasattr(cfg, "get") else None
    return bool(probe.get("plot", True)) if probe is not None else True


# -- the training summary -------------------------------------------------------------------
def _sizes_text(sizes: Sequence[int]) -> str:
    """``7, 7, 6``; a longer list by runs of one size, ``171 x 20, 170 x 3``, so the odd one shows."""
    if len(sizes) <= 4:
        return ", ".join(map(str, sizes))
    return ", ".join(f"{size} x {count}" if count > 1 else str(size) for size, count in size_runs(sizes))


def print_training(run: Any, notes: Sequence[str], sizes: Sequence[int] | None = None) -> None:
    """The summary of a training run (a :class:`~autobatch.RunResult`) and its notes. ``sizes``:
    the micro-batches the runner cuts a rank's share of the global batch into at the end (its
    split: balanced, kept to ``probe.multiple_of``); where they are not all the micro-batch, as
    when it does not divide the global batch, they are listed, the product ``M x K`` alone
    claiming samples the step does not have (``20 = 7 x 3``)."""
    world = dist_sync.world_size()
    share = run.global_batch // world
    if sizes is None:
        sizes = micro_batch_sizes(share, run.micro_batch) if run.micro_batch else [share]
    ranks = f"{world} ranks x " if world > 1 else ""
    if any(size != run.micro_batch for size in sizes):  # "12 x 2" for a balanced 8, 8 read as 24 samples
        split = f"{ranks}{counted(len(sizes), 'micro-batch', 'micro-batches')} of at most {run.micro_batch} (sizes {_sizes_text(sizes)})"
    else:
        split = f"{ranks}micro-batch {run.micro_batch} x {len(sizes)}"
    print(
        f"trained         {counted(run.steps_this_run, 'step')} ({run.steps} in all) of global batch {run.global_batch} = "
        f"{split} in {run.elapsed_s:.2f} s ({run.samples_per_s:.1f} samples/s)"
    )
    if run.last_loss is not None:
        print(f"loss            {run.last_loss:.4f} (last step)")
    print(f"oom recoveries  {len(run.oom_recoveries)}" + ("; activation checkpointing on" if run.checkpointing else ""))
    if run.checkpoint_path:
        print(f"checkpoint      {run.checkpoint_path}")
    for note in notes:
        print(f"note            {note}")
