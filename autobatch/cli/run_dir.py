"""Who owns a run directory: one training run at a time, and no probe over a training run.

Hydra names a run's directory after the second it started (``outputs/<command>/<date>/<time>``),
so two ``train`` commands started in the same second share one directory; each passed
:func:`~autobatch.cli.training.check_fresh_target` before the other wrote anything, both
reported success, and the directory kept one run's checkpoint and metrics with the other's
config. :func:`claim_run_dir` makes the first one the owner (a file created exclusively, with
its process id), and the second is one error. :func:`check_probe_target` keeps ``probe`` from
overwriting the ``result.json`` and config of a training run given as ``hydra.run.dir``, and
:func:`check_train_target` a fresh ``train`` from overwriting a probe's.
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path

from .training import FINAL_MODEL, METRICS, check_fresh_target

__all__ = ["CLAIM", "claim_run_dir", "check_probe_target", "check_train_target"]

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
    held = [name for name in ("train_result.json", METRICS, FINAL_MODEL, CLAIM) if (Path(run_dir) / name).exists()]
    if held:
        raise ValueError(
            f"{run_dir} holds a training run ({', '.join(held)}), whose result.json and config a probe would "
            "overwrite; give the probe its own hydra.run.dir"
        )


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
