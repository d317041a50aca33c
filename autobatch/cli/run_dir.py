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
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from .training import FINAL_MODEL, METRICS, check_fresh_target, run_files

__all__ = ["CLAIM", "claim_run_dir", "check_probe_target", "check_train_target", "holds_run", "KeepRunConfig"]

#: the claim's file in the run directory, holding the owning process's id
CLAIM = ".autobatch-train.pid"


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
                f"{run_dir} is in use by another training run (process {owner}; two runs started in the same "
                "second share Hydra's default directory, named to the second); give this run its own hydra.run.dir"
            ) from None
        path.unlink(missing_ok=True)  # its owner is gone, or it is this process's own
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:  # another run took the stale claim first
            raise ValueError(f"{run_dir} is in use by another training run; give this run its own hydra.run.dir") from None
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
            "overwrite; give the probe its own hydra.run.dir"
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
    check_fresh_target(run_dir, checkpoint_dir)
    try:
        command = json.loads((Path(run_dir) / "result.json").read_text(encoding="utf-8")).get("command")
    except (OSError, ValueError, AttributeError):
        return  # none, or not a probe's: a train run that failed before its first update may run again
    if isinstance(command, str) and command.startswith("python -m autobatch probe"):
        raise ValueError(
            f"{run_dir} holds a probe's result ({Path(run_dir) / 'result.json'}, of {command}), which training would "
            "overwrite; give the training run its own hydra.run.dir"
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
    of the command that made that run (a refused command's too, written before it was refused)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.output_subdir is None:
            return
        try:
            run_dir = Path(str(config.hydra.run.dir))
            checkpoint_dir = str(OmegaConf.select(config, "train.checkpoint_dir", default=None) or "checkpoints")
        except OmegaConfBaseException:  # a directory named by a resolver that needs the running job: Hydra's way
            return
        command = str(config.hydra.job.name)
        if not (run_dir.is_dir() and holds_run(run_dir, checkpoint_dir, command)):
            return
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.output_subdir = None
            if command == "probe" or OmegaConf.select(config, "train.resume", default=None) is None or _claimed(run_dir):
                _no_log_file(config.hydra.get("job_logging"))  # refused there: its error line is not the run's


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

