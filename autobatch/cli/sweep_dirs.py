"""Whose files a sweep directory holds: which sweep, which of its jobs, and the earlier summary.

A sweep directory given again (``hydra.sweep.dir``) holds an earlier sweep's files, and a fixed
``hydra.sweep.subdir`` (``.``, or ``${optimizer}`` while sweeping something else) gives several jobs
of one sweep one directory. Nothing a user made there is lost:

* :func:`set_aside_summary`: the earlier sweep's ``summary.csv``, ``.md`` and ``.png`` are renamed
  ``summary.earlier-<time it was written>.*`` when a sweep starts (before, they were deleted, and a
  sweep whose jobs were all refused left a table of refusals alone), and the new ``summary.md``
  names them (:func:`earlier_summary`).
* :func:`claim_job_dir`: each job claims its directory for its sweep (``.sweep_job.<sweep id>``,
  created exclusively, holding the job number); a second job of the same sweep there is refused
  with the fix, before it writes anything (a probe overwrote the first one's ``result.json``, and
  the summary counted one job of two).
* :func:`row_path`: a job's row never replaces another job's row of its sweep, nor a completed
  row of an earlier sweep with a refusal (``summary_row.job<N>.json`` beside it instead).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["ROW_FILE", "SWEEP_ID_FILE", "from_cwd", "config_sweep_dir", "sweep_id", "row_path", "set_aside_summary", "earlier_summary",
           "claim_job_dir", "job_dir_owner"]

ROW_FILE = "summary_row.json"
#: Every row file :func:`row_path` may name (``summary_row.json``, ``summary_row.job<N>.json``).
ROW_GLOB = "summary_row*.json"
SWEEP_ID_FILE = ".sweep_id"
#: The key of a row's sweep id in its file (not a column of the summary).
SWEEP_KEY = "_sweep"
#: In the sweep directory: the names the earlier sweep's summary files were given by :func:`set_aside_summary`.
EARLIER_NOTE = ".earlier_summary"
#: In a job directory: ``.sweep_job.<sweep id>``, holding the number of the job that claimed it.
JOB_CLAIM = ".sweep_job."


def from_cwd(sweep_dir: str, cwd: str | None) -> Path:
    """``sweep_dir``, a relative one against the directory the command ran in (``cwd``)."""
    path = Path(sweep_dir)
    return path if path.is_absolute() or not cwd else Path(cwd) / path


def config_sweep_dir(config: Any) -> Path:
    """A job config's ``hydra.sweep.dir``, a relative one against the directory the command ran in: under
    ``hydra.job.chdir=true`` a job (and ``on_job_end``) runs in its own directory, where the
    rows were looked for in ``<job>/multirun/...`` and the sweep's summary was never written."""
    from omegaconf import OmegaConf

    return from_cwd(str(config.hydra.sweep.dir), OmegaConf.select(config, "hydra.runtime.cwd", default=None))


def sweep_id(sweep_dir: Path) -> str | None:
    """The id of the sweep that last started in ``sweep_dir`` (None: none recorded)."""
    try:
        return (sweep_dir / SWEEP_ID_FILE).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def row_path(job_dir: Path, row: dict[str, Any]) -> Path:
    """Where ``row`` (with its sweep id) goes in ``job_dir``: ``summary_row.json``, unless that holds
    another job's row of the same sweep, or an earlier sweep's completed row and ``row`` is no
    success (that job's files are still there: its row stays with them)."""
    path = job_dir / ROW_FILE
    try:
        there = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return path
    if not isinstance(there, dict):
        return path
    if there.get(SWEEP_KEY) == row.get(SWEEP_KEY):
        keep = there.get("job") != row.get("job")
    else:
        keep = there.get("status") == "ok" and row.get("status") != "ok"
    return job_dir / f"summary_row.job{row.get('job')}.json" if keep else path


def set_aside_summary(sweep_dir: Path, names: tuple[str, ...]) -> list[str]:
    """Rename the summary files ``names`` an earlier sweep left in ``sweep_dir`` to
    ``summary.earlier-<when they were written>.<suffix>`` and note the new names for this sweep's
    ``summary.md``; return them (none: nothing to keep)."""
    present = [sweep_dir / name for name in names if (sweep_dir / name).is_file()]
    if not present:
        (sweep_dir / EARLIER_NOTE).unlink(missing_ok=True)
        return []
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(max(path.stat().st_mtime for path in present)))
    base, count = f"summary.earlier-{stamp}", 1
    while any((sweep_dir / f"{base}{path.suffix}").exists() for path in present):
        base, count = f"summary.earlier-{stamp}-{count}", count + 1
    kept = []
    for path in present:
        os.replace(path, sweep_dir / f"{base}{path.suffix}")
        kept.append(f"{base}{path.suffix}")
    (sweep_dir / EARLIER_NOTE).write_text(" ".join(kept) + "\n", encoding="utf-8")
    return kept


def earlier_summary(sweep_dir: Path) -> list[str]:
    """The names :func:`set_aside_summary` gave the earlier sweep's summary files when this sweep started."""
    try:
        return (sweep_dir / EARLIER_NOTE).read_text(encoding="utf-8").split()
    except OSError:
        return []


def job_dir_owner(job_dir: Path, sweep: str | None, job: int) -> int | None:
    """The number of another job of sweep ``sweep`` that claimed ``job_dir`` (None: none did)."""
    if sweep is None:
        return None
    try:
        owner = int((job_dir / f"{JOB_CLAIM}{sweep}").read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None
    return None if owner == job else owner


def claim_job_dir(job_dir: Path, sweep: str | None, job: int, subdir: str) -> None:
    """Claim ``job_dir`` for job ``job`` of sweep ``sweep`` (rank 0's call; no id recorded: no
    claim). ``ValueError`` naming the fix where another job of this sweep claimed it first
    (``subdir``: the resolved ``hydra.sweep.subdir`` the jobs share)."""
    if sweep is None:
        return
    job_dir.mkdir(parents=True, exist_ok=True)
    try:
        handle = os.open(job_dir / f"{JOB_CLAIM}{sweep}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        owner = job_dir_owner(job_dir, sweep, job)
        if owner is None:
            return  # this job's own claim (a job run again in the same sweep)
        raise ValueError(
            f"job {owner} of this sweep already wrote its files into {job_dir}, this job's directory too "
            f"(hydra.sweep.subdir='{subdir}' gives several jobs one directory); give each job its own, such as "
            f"Hydra's default hydra.sweep.subdir='${{hydra.job.num}}' (job {owner}'s files are kept)"
        ) from None
    with os.fdopen(handle, "w") as file:
        file.write(f"{job}\n")
    for stale in job_dir.glob(f"{JOB_CLAIM}*"):  # earlier sweeps' claims: not this one's
        if stale.name != f"{JOB_CLAIM}{sweep}":
            stale.unlink(missing_ok=True)
