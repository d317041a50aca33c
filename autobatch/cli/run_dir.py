"""Who owns a run directory: one training run at a time, and no probe over a training run.

Hydra names a run's directory after the second it started (``outputs/<command>/<date>/<time>``),
so two ``train`` commands started in the same second share one directory; each passed
:func:`~autobatch.cli.training.check_fresh_target` before the other wrote anything, both
reported success, and the directory kept one run's checkpoint and metrics with the other's
config. :func:`claim_run_dir` makes the first one the owner (a file created exclusively, with
its process id), and the second is one error. :func:`check_probe_target` keeps ``probe`` from
overwriting the ``result.json`` and config of a training run given as ``hydra.run.dir``, and
:func:`check_train_target` a fresh ``train`` from overwriting a probe's.

Hydra writes its copy of a command's config (``.hydra/config.yaml``, ``hydra.yaml``,
``overrides.yaml``) into the run directory *before* the command runs, so a command refused
there (``hydra.run.dir`` of an earlier run, or of a run still going) had already replaced the
record of how that run was made with its own. :class:`KeepRunConfig` (a Hydra callback) turns
that copy off for a directory that already holds a training run (or, for ``train``, a probe's
answer): its ``.hydra/`` keeps describing the command that made it, also when the run is
continued in place with ``train.resume``; a command that will be refused there (a probe, a
``train`` without ``train.resume``, any over a live run) also writes no line to its log file.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from .sweep_dirs import config_sweep_dir, job_dir_owner, sweep_id
from .training import FINAL_MODEL, METRICS, check_fresh_target, run_files

__all__ = ["CLAIM", "claim_run_dir", "check_probe_target", "check_train_target", "holds_run", "KeepRunConfig"]

#: the claim's file in the run directory, holding the owning process's id
CLAIM = ".autobatch-train.pid"


def dir_key() -> str:
    """The key that names this job's directory, for an error to tell what to change: a sweep's
    job runs in ``hydra.sweep.dir`` (its numbered subdirectory), where a new ``hydra.run.dir``,
    which the refusals named, changes nothing (a sweep run again into its directory was refused
    job by job with the same advice)."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return "hydra.sweep.dir"
    return "hydra.run.dir"


def claim_run_dir(run_dir: Path, rank: int = 0) -> None:
    """Claim ``run_dir`` for this process's training run (rank 0 claims for all ranks); the
    claim is given up when the process exits. A claim whose process is gone (a run killed
    outright) is taken over. ``ValueError`` when a live process holds it."""
    if rank != 0:
        return
    path = Path(run_dir) / CLAIM
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        owner = _owner(path)
        if owner is not None and owner != os.getpid() and _alive(owner):
            raise ValueError(
                f"{run_dir} is in use by another training run (process {owner}, still running; two runs started in "
                f"the same second share Hydra's default directory, named to the second); give this run its own "
                f"{dir_key()}, or, to continue that run, stop it (Ctrl-C saves its checkpoint) or let it end, then give "
                "train.resume=latest"
            ) from None
        path.unlink(missing_ok=True)  # its owner is gone, or it is this process's own
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:  # another run took the stale claim first
            raise ValueError(f"{run_dir} is in use by another training run; give this run its own {dir_key()}") from None
    with os.fdopen(handle, "w") as file:
        file.write(f"{os.getpid()}\n")
    atexit.register(_release, path, os.getpid())


def _owner(path: Path) -> int | None:
    try:
        return int(path.read_text().strip() or "x")
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _release(path: Path, pid: int) -> None:
    if _owner(path) == pid:
        path.unlink(missing_ok=True)


def check_probe_target(run_dir: Path) -> None:
    """``probe`` writes ``result.json``, its config and plot into ``run_dir``: refused where a
    training run already lives there (its ``train_result.json``, metrics, final model or claim),
    whose probe record and config it would overwrite."""
    held = _training_files(run_dir)
    if held:
        raise ValueError(
            f"{run_dir} holds a training run ({', '.join(held)}), whose result.json and config a probe would "
            f"overwrite; give the probe its own {dir_key()}"
        )


def _training_files(run_dir: Path) -> list[str]:
    """The files of a training run in ``run_dir``: its record, metrics, final model or claim."""
    return [name for name in ("train_result.json", METRICS, FINAL_MODEL, CLAIM) if (Path(run_dir) / name).exists()]


def check_train_target(run_dir: Path, checkpoint_dir: str) -> None:
    """A fresh ``train`` (no ``train.resume``) writes ``result.json``, ``plan.json`` and its config
    into ``run_dir``: refused over an earlier run's files
    (:func:`~autobatch.cli.training.check_fresh_target`) and, as :func:`check_probe_target`
    refuses a probe over a training run, over a probe's answer (a ``result.json`` that
    ``python -m autobatch probe`` wrote: ``hydra.run.dir`` of a probe), which it overwrote with
    another model's and left the probe's ``plan.json`` beside it."""
    check_fresh_target(run_dir, checkpoint_dir, dir_key())
    try:
        command = json.loads((Path(run_dir) / "result.json").read_text(encoding="utf-8")).get("command")
    except (OSError, ValueError, AttributeError):
        return  # none, or not a probe's: a train run that failed before its first update may run again
    if isinstance(command, str) and command.startswith("python -m autobatch probe"):
        raise ValueError(
            f"{run_dir} holds a probe's result ({Path(run_dir) / 'result.json'}, of {command}), which training would "
            f"overwrite; give the training run its own {dir_key()}"
        )


def _probe_answer(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds the ``result.json`` that ``python -m autobatch probe`` wrote."""
    try:
        command = json.loads((Path(run_dir) / "result.json").read_text(encoding="utf-8")).get("command")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(command, str) and command.startswith("python -m autobatch probe")


def holds_run(run_dir: Path, checkpoint_dir: str, command: str) -> bool:
    """Whether ``run_dir`` holds a run whose config record a ``command`` run there must not
    replace: for ``probe``, a training run (:func:`check_probe_target` refuses it); for
    ``train``, a run's metrics line or checkpoint, a probe's answer (:func:`check_train_target`
    refuses a fresh run there; ``train.resume`` continues it) or a live run's claim. A run that
    failed before its first update holds none: the corrected command starts it again, config and all."""
    path = Path(run_dir)
    if command == "probe":
        return bool(_training_files(path))
    return bool(run_files(path, checkpoint_dir)) or _claimed(path) or _probe_answer(path)


class KeepRunConfig(Callback):
    """Hydra callback (``hydra.callbacks.keep_run_config``): no ``.hydra/`` config copy into a
    run directory that already holds a run (:func:`holds_run`), where it would replace the copy
    of the command that made that run (a refused command's too, written before it was refused).

    A sweep's job has no ``on_run_start``, and Hydra writes its copy and opens its log file
    before ``on_job_start``: there ``hydra.output_subdir`` (``${autobatch.record_dir:.hydra}`` in
    the packaged configs, :func:`record_dir`) is None for such a directory, and
    :meth:`on_job_start` closes the job's log file where the job will be refused. Before, a
    sweep run again into its ``hydra.sweep.dir`` replaced each earlier job's ``.hydra/`` with the
    refused job's config and appended its error line to that job's ``train.log``."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.output_subdir is None:
            return
        try:
            run_dir = Path(str(config.hydra.run.dir))
            held = _held(config, run_dir)
        except OmegaConfBaseException:  # a directory named by a resolver that needs the running job: Hydra's way
            return
        if not held:
            return
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.output_subdir = None
            if _refused(config, run_dir):
                _no_log_file(config.hydra.get("job_logging"))  # refused there: its error line is not the run's

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        run_dir = Path(str(config.hydra.runtime.output_dir))
        if _held(config, run_dir) and _refused(config, run_dir):
            _close_log_files(run_dir)


def _held(config: DictConfig, run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run that a ``config`` 's command must not replace the record of."""
    checkpoint_dir = str(OmegaConf.select(config, "train.checkpoint_dir", default=None) or "checkpoints")
    command = str(config.hydra.job.name)
    return run_dir.is_dir() and (holds_run(run_dir, checkpoint_dir, command) or _sweep_mates(config, run_dir))


def _refused(config: DictConfig, run_dir: Path) -> bool:
    """Whether ``config`` 's command will be refused in ``run_dir``, which holds a run (:func:`_held`)."""
    command = str(config.hydra.job.name)
    return (command == "probe" or OmegaConf.select(config, "train.resume", default=None) is None or _claimed(run_dir)
            or _sweep_mates(config, run_dir))


def _sweep_mates(config: DictConfig, run_dir: Path) -> bool:
    """Whether another job of this sweep claimed ``run_dir`` (a fixed ``hydra.sweep.subdir``): this
    job is refused there (:func:`~.sweep_dirs.claim_job_dir`), so the first one's record stays."""
    if OmegaConf.select(config, "hydra.mode", default=None) != RunMode.MULTIRUN:
        return False
    return job_dir_owner(run_dir, sweep_id(config_sweep_dir(config)), int(config.hydra.job.num)) is not None


def record_dir(subdir: Any, *, _root_: DictConfig) -> Any:
    """The ``autobatch.record_dir`` resolver: ``subdir`` (``.hydra``), or None where the job's
    directory (``hydra.runtime.output_dir``, set by Hydra before it writes the copy) holds a run."""
    try:
        output_dir = OmegaConf.select(_root_, "hydra.runtime.output_dir", default=None, throw_on_missing=False)
        held = output_dir is not None and _held(_root_, Path(str(output_dir)))
    except OmegaConfBaseException:  # not set yet (before a run starts): Hydra's way
        return subdir
    return None if held else subdir


OmegaConf.register_new_resolver("autobatch.record_dir", record_dir, replace=True)


def _close_log_files(run_dir: Path) -> None:
    """Close the log files Hydra opened in ``run_dir`` for this job (the console stays)."""
    for logger in [logging.getLogger(), *map(logging.getLogger, list(logging.root.manager.loggerDict))]:
        for handler in list(getattr(logger, "handlers", ())):
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir.resolve():
                logger.removeHandler(handler)
                handler.close()


def _claimed(run_dir: Path) -> bool:
    """Whether another live process claims ``run_dir`` (a training run still going there)."""
    owner = _owner(Path(run_dir) / CLAIM)
    return owner is not None and owner != os.getpid() and _alive(owner)


def _no_log_file(logging_config: Any) -> None:
    """Leave the log files out of Hydra's job logging (the console stays): a command refused in
    a run's directory appended its ``autobatch: error:`` line to that run's ``train.log``, which
    then read as the end of a run that failed."""
    if not logging_config:  # hydra/job_logging=none, or a config of its own without one
        return
    handlers = logging_config.get("handlers") or {}
    files = [name for name, handler in handlers.items() if "FileHandler" in str((handler or {}).get("class", ""))]
    for node in [logging_config.get("root") or {}, *((logging_config.get("loggers") or {}).values())]:
        if node.get("handlers") is not None:
            node.handlers = [name for name in node.handlers if name not in files]
    for name in files:
        del handlers[name]

