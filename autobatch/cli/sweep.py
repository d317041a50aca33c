"""The sweep summary: a Hydra callback that writes ``summary.csv``, ``summary.md`` and
``summary.png`` (found batch and time per job; off with ``probe.plot=false``).

Each job of a multirun leaves ``summary_row.json`` in its own directory when it ends
(``on_job_end`` runs where the job runs: in-process with the basic launcher, in a worker
with joblib, on a cluster node with submitit). The summary is rebuilt from those rows after
every job and once more at the end of the sweep, so it is complete even when a failed job
stops the sweep early, and it never depends on jobs sharing a process. Failed jobs are rows
too, with their status and error.

A sweep directory given again (``hydra.sweep.dir=``) still holds the rows of the earlier
sweep's jobs. So each sweep writes a fresh id into ``.sweep_id`` when it starts, every row
carries the id of the sweep its job ran in, and the summary lists only the rows of the
sweep that wrote the current id (the other rows and their job directories are left as they are).
The earlier sweep's ``summary.csv``, ``summary.md`` and ``summary.png`` are renamed
``summary.earlier-<time>.*`` when the new one starts, and its ``summary.md`` names them
(:mod:`.sweep_dirs`, which also keeps two jobs of one sweep out of one directory).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ..dist.agreement import is_rank_zero
from ..report.overrides import differing_overrides, shared_overrides
from .atomic_write import write_atomic
from .errors import one_line
from .override_text import as_given
from .sweep_dirs import ROW_FILE, ROW_GLOB, SWEEP_ID_FILE, claim_job_dir, earlier_summary, row_path, set_aside_summary
from .sweep_dirs import config_sweep_dir, from_cwd, sweep_id
from .sweep_dirs import SWEEP_KEY as _SWEEP_KEY
from .user_config import given_overrides

__all__ = ["SweepSummary", "COLUMNS", "sweep_id", "collect_rows", "write_summary", "render_markdown", "last_sweep_dir",
           "forget_sweeps", "record_interrupted", "claim_sweep_job",
           "ROW_FILE", "SWEEP_ID_FILE"]

log = logging.getLogger("autobatch")

PLOT_FILE = "summary.png"
#: In the sweep directory while a sweep with ``probe.plot=false`` runs: an interrupted job draws no picture.
NO_PLOT_FILE = ".sweep_no_plot"
#: The files :func:`write_summary` writes into the sweep directory.
SUMMARY_FILES = ("summary.csv", "summary.md", PLOT_FILE)
COLUMNS = ("job", "overrides", "status", "batch_size", "trials", "peak", "time_s", "error")
#: The columns each command's jobs add (``hydra.job.name``), and a planning probe's
#: (``train.global_batch`` set). Every row of a sweep has them, a failed or interrupted job's
#: empty: before, a sweep whose jobs all failed wrote a ``summary.csv`` without them, and a script
#: reading ``row["final_loss"]`` back failed on it. ``train`` 's ``cached``: its probe came from the
#: probe cache (its ``trials`` and ``time_s`` are the stored probe's; empty where no probe ran).
COMMAND_COLUMNS = {"probe": ("cached",), "train": ("cached", "global_batch", "steps", "recoveries", "final_loss")}
PLAN_COLUMNS = ("global_batch", "micro_batch", "accumulation", "checkpointing")
_last_sweep: list[Path] = []


def last_sweep_dir() -> Path | None:
    """The sweep directory of the last multirun started in this process, if any."""
    return _last_sweep[-1] if _last_sweep else None


def forget_sweeps() -> None:
    """Start a command with no sweep recorded: :func:`last_sweep_dir` is then this command's
    sweep or None. Before, a second ``main()`` in one process (a script, a test) printed the
    earlier command's sweep table again after a single run or ``--info``."""
    _last_sweep.clear()


def collect_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """The rows of the jobs of the sweep that last started in ``sweep_dir`` (every row when no
    sweep id was recorded), in job order."""
    current = sweep_id(sweep_dir)
    rows = []
    for path in sweep_dir.rglob(ROW_GLOB):  # summary_row.json, or a refused job's beside another's
        try:
            row = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # a row being written right now
            continue
        if current is None or row.pop(_SWEEP_KEY, None) == current:
            rows.append(row)
    return sorted(rows, key=lambda row: row.get("job", 0))


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """The fixed columns, then any extra ones (``train`` adds steps and loss), errors last."""
    extra = [key for row in rows for key in row if key not in COLUMNS]
    return [*COLUMNS[:-1], *dict.fromkeys(extra), COLUMNS[-1]]


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def _short(text: str, limit: int = 120) -> str:
    """The first sentence of an error, at most ``limit`` characters (the CSV keeps it all)."""
    first = text.split(". ", 1)[0]
    return first if len(first) <= limit else first[: limit - 3] + "..."


def render_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table; errors shortened to their first sentence, except an
    interrupted job's, which is the command that continues it (cut, the printed table lost it).
    The overrides every job shares are named once above the table and left out of its rows (an
    ``lr`` sweep's ``model=mlp data.shape=[16] ...`` on every row hid the ``lr`` that differs);
    ``summary.csv`` keeps each job's own in full."""
    columns = _columns(rows)
    shared = shared_overrides(rows)
    lines = [f"overrides of every job: {' '.join(shared)}", ""] if shared else []
    lines += ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    for row in rows:
        cells = [_cell(row.get(column)) for column in columns]
        if shared:
            cells[columns.index("overrides")] = " ".join(differing_overrides(row, shared))
        if row.get("status") != "interrupted":
            cells[-1] = _short(cells[-1])
        cells = [cell.replace("|", "\\|") for cell in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_summary(sweep_dir: Path, *, plot: bool = True) -> list[dict[str, Any]]:
    """Rebuild ``summary.csv`` and ``summary.md`` (and with ``plot``, ``summary.png``) in
    ``sweep_dir``; return the rows."""
    rows = collect_rows(sweep_dir)
    if not rows:
        return rows
    columns = _columns(rows)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(sweep_dir / "summary.csv", buffer.getvalue())
    earlier = earlier_summary(sweep_dir)
    note = f"\nthe earlier sweep's summary in this directory: {', '.join(earlier)}\n" if earlier else ""
    write_atomic(sweep_dir / "summary.md", render_markdown(rows) + note)
    if plot:
        _write_plot(sweep_dir, rows)
    return rows


def _write_plot(sweep_dir: Path, rows: list[dict[str, Any]]) -> None:
    """``summary.png`` via a temporary file and rename; a plot that fails is only a warning."""
    from ..report.plots import plot_sweep

    temporary = sweep_dir / f".summary.{os.getpid()}.tmp.png"
    try:
        plot_sweep(rows, temporary)
        os.replace(temporary, sweep_dir / PLOT_FILE)
    except Exception as exc:  # noqa: BLE001 - the summary tables matter more than the picture
        log.warning("sweep plot not drawn (%s: %s)", type(exc).__name__, exc)
        temporary.unlink(missing_ok=True)


def _plot_wanted(config: DictConfig) -> bool:
    return bool(OmegaConf.select(config, "probe.plot", default=True))


def _empty_columns(command: str, config: DictConfig | None) -> dict[str, None]:
    """The columns ``command`` 's jobs add (:data:`COMMAND_COLUMNS`), each empty, with a planning
    probe's where ``config`` sets ``train.global_batch``."""
    columns = list(COMMAND_COLUMNS.get(command, ()))
    if command == "probe" and config is not None and OmegaConf.select(config, "train.global_batch") is not None:
        columns += PLAN_COLUMNS
    return dict.fromkeys(columns)


def _job_row(config: DictConfig, job_return: JobReturn) -> dict[str, Any]:
    hydra_cfg = config.hydra
    row: dict[str, Any] = {
        "job": hydra_cfg.job.num,
        "overrides": " ".join(as_given(job_return.overrides) if job_return.overrides else given_overrides(hydra=hydra_cfg)),
        **_empty_columns(str(OmegaConf.select(config, "hydra.job.name")), config),
    }
    if job_return.status == JobStatus.COMPLETED:
        value = job_return.return_value
        row["status"] = "ok"
        if isinstance(value, dict):
            row.update(value)
    else:
        # the job's exception, read without JobReturn.return_value, which writes Hydra's
        # "Error executing job with overrides" to stderr each time (the row says it)
        exc = getattr(job_return, "_return_value", None)
        if isinstance(exc, BaseException):  # a CLIError's message; else (AUTOBATCH_TRACEBACK=1) with its type
            error = getattr(exc, "message", None) or _with_type(exc)
        else:
            error = "unknown"
        row.update(status="failed", error=error)
    return row


def _with_type(exc: BaseException) -> str:
    """``Type: message`` on one line (a bare ``KeyError('lr')`` read ``'lr'`` in the summary)."""
    text, name = one_line(exc), type(exc).__name__
    return text if text == name else f"{name}: {text}"



def record_interrupted(error: str) -> None:
    """In a job of a sweep, write its row as ``interrupted`` with ``error`` (the line that names
    its checkpoint and the command that continues it) and rebuild the summary. A Ctrl-C or
    SIGTERM ends the job with ``SystemExit`` or ``KeyboardInterrupt``, which Hydra does not
    catch, so ``on_job_end`` never ran: the summary listed the jobs before it alone, "0 failed"."""
    if not HydraConfig.initialized() or not is_rank_zero():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    sweep_dir = from_cwd(hydra_cfg.sweep.dir, hydra_cfg.runtime.cwd)
    row = {"job": hydra_cfg.job.num, "overrides": " ".join(given_overrides()), "status": "interrupted",
           **_empty_columns(str(getattr(hydra_cfg.job, "name", None)), None), "error": error, _SWEEP_KEY: sweep_id(sweep_dir)}
    try:
        write_atomic(row_path(Path(hydra_cfg.runtime.output_dir), row), json.dumps(row, default=str) + "\n")
        # the picture too, unless the sweep wants none: left as it was, the summary.png the final line
        # names showed the jobs before this one alone (and a sweep's first job drew none)
        write_summary(sweep_dir, plot=not (sweep_dir / NO_PLOT_FILE).exists())
    except OSError as exc:  # the interrupt is what the command reports; the row is a courtesy
        log.warning("sweep row of the interrupted job not written (%s)", exc)


def claim_sweep_job(job_dir: Path) -> None:
    """In a job of a sweep, claim ``job_dir`` for it before it writes anything
    (:func:`~.sweep_dirs.claim_job_dir`): ``ValueError`` where another job of the sweep did."""
    if not HydraConfig.initialized() or not is_rank_zero():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    claim_job_dir(job_dir, sweep_id(from_cwd(hydra_cfg.sweep.dir, hydra_cfg.runtime.cwd)), int(hydra_cfg.job.num),
                  str(hydra_cfg.sweep.subdir))


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks.sweep_summary``) writing the sweep's summary files.

    Under ``torchrun`` every rank runs the sweep's jobs; only rank 0 writes rows and
    summaries (the other ranks' jobs hold the same, agreed results)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = config_sweep_dir(config)
        _last_sweep.append(Path(config.hydra.sweep.dir))  # as given: the final line names it so
        if is_rank_zero():  # a new id: rows left by an earlier sweep into this directory are not this one's
            sweep_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(sweep_dir / SWEEP_ID_FILE, uuid.uuid4().hex + "\n")
            (sweep_dir / NO_PLOT_FILE).unlink(missing_ok=True)
            if not _plot_wanted(config):
                (sweep_dir / NO_PLOT_FILE).touch()
            kept = set_aside_summary(sweep_dir, SUMMARY_FILES)  # the earlier sweep's summary is not this one's
            if kept:
                log.warning("%s holds an earlier sweep's summary: kept as %s", sweep_dir, ", ".join(kept))

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not is_rank_zero() or config.hydra.mode != RunMode.MULTIRUN:
            return
        output_dir = Path(HydraConfig.get().runtime.output_dir)
        row = {**_job_row(config, job_return), _SWEEP_KEY: sweep_id(config_sweep_dir(config))}
        write_atomic(row_path(output_dir, row), json.dumps(row, default=str) + "\n")
        write_summary(config_sweep_dir(config), plot=_plot_wanted(config))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if is_rank_zero():
            write_summary(config_sweep_dir(config), plot=_plot_wanted(config))
