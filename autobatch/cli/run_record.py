"""What an earlier run's directory records about itself: where its checkpoint went.

``train.resume=<run dir>`` looked for ``<run dir>/<train.checkpoint_dir>/last.pt`` with *this*
command's ``train.checkpoint_dir``; a run made with another one (``train.checkpoint_dir=ck``)
was "no checkpoint ...; give ... a run directory" although a run directory was given.
:func:`recorded_checkpoint_dirs` reads the run's own ``train.checkpoint_dir`` from the config
it recorded: Hydra's ``.hydra/config.yaml`` (also there for a run killed before it finished),
else the resolved config in its ``train_result.json``.

A resumed run's ``train_result.json`` replaces the one its directory held: it had ``"probe":
null`` (no probe runs on resume, so the answer the run trained on was gone from its record) and
``samples`` of this command only beside ``steps`` of the whole run. :func:`earlier_probe` carries
the run's probe over from its directory, and :func:`samples_in_all` counts the whole run's
samples from ``metrics.jsonl``, so two runs' records compare.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["recorded_checkpoint_dirs", "checkpoint_owner", "earlier_probe", "samples_in_all", "recorded_config"]


def recorded_config(run: Path, names: tuple[str, ...]) -> dict[str, Any] | None:
    """The config the run in ``run`` recorded, from the first of ``names`` that holds one: a JSON
    record's ``config`` (``result.json``, ``train_result.json``) or Hydra's ``.hydra/config.yaml``
    whole; None where none is readable (absent, torn, or not a record of ours). The order is the
    caller's: the config a run started with is its probe's ``result.json`` (a resume leaves it),
    the one it last trained with its ``train_result.json``."""
    for name in names:
        try:
            text = (run / name).read_text(encoding="utf-8")
            config = yaml.safe_load(text) if name.endswith(".yaml") else json.loads(text).get("config")
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            continue
        if isinstance(config, dict):
            return config
    return None


def _from_hydra(run: Path) -> str | None:
    """``train.checkpoint_dir`` of the config Hydra saved for the run (None: none readable)."""
    path = run / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    try:
        value = OmegaConf.select(OmegaConf.load(path), "train.checkpoint_dir", throw_on_resolution_failure=False)
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException):  # torn or foreign: nothing usable
        return None
    return value if isinstance(value, str) and value else None


def _from_result(run: Path) -> str | None:
    """``train.checkpoint_dir`` of the resolved config in the run's ``train_result.json``."""
    try:
        config = json.loads((run / "train_result.json").read_text(encoding="utf-8")).get("config") or {}
        value = (config.get("train") or {}).get("checkpoint_dir")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def recorded_checkpoint_dirs(run: Path) -> list[str]:
    """The relative ``train.checkpoint_dir`` values the run in directory ``run`` recorded (none
    for a path that is not a run directory), first Hydra's copy of its config, then its result.
    An absolute one is left out: every run writes the same ``last.pt`` there, which may hold a
    later run's steps by now, not this run's."""
    if not Path(run).is_dir():
        return []
    found = (_from_hydra(Path(run)), _from_result(Path(run)))
    return list(dict.fromkeys(value for value in found if value and not Path(value).expanduser().is_absolute()))


def checkpoint_owner(checkpoint: Path, checkpoint_dir: str) -> Path | None:
    """The run directory whose relative ``train.checkpoint_dir`` holds ``checkpoint``
    (``<run>/<checkpoint_dir>/last.pt``); None for an absolute ``checkpoint_dir`` (shared by
    runs), or a path too short to lie in one."""
    relative = Path(checkpoint_dir).expanduser()
    if relative.is_absolute():
        return None
    parents, depth = Path(checkpoint).parents, len(relative.parts)
    return parents[depth] if depth < len(parents) else None


def _probe_of(run: Path) -> dict | None:
    """The probe answer a run directory records: its ``train_result.json`` 's ``probe`` (a
    resumed run's carries it on), else its ``result.json`` without the command and config."""
    for name, pick in (("train_result.json", lambda data: data.get("probe")),
                       ("result.json", lambda data: {k: v for k, v in data.items() if k not in ("command", "config")})):
        try:
            found = pick(json.loads((run / name).read_text(encoding="utf-8")))
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, dict) and "batch_size" in found:
            return found
    return None


def earlier_probe(checkpoint: Path | None, checkpoint_dir: str, run_dir: Path) -> dict | None:
    """On resume (``checkpoint`` the ``last.pt`` continued), the probe the run started from: the
    record in ``run_dir`` when it is the run's own directory, else in the checkpoint's run
    directory (``<run>/<checkpoint_dir>/last.pt``). None when no run was resumed, or none is found."""
    if checkpoint is None:
        return None
    owner = checkpoint_owner(Path(checkpoint), checkpoint_dir)
    for run in dict.fromkeys([Path(run_dir), *([owner] if owner is not None else [])]):
        found = _probe_of(run)
        if found is not None:
            return found
    return None


def samples_in_all(metrics: Path) -> int | None:
    """The samples of the whole run, over every command that trained it: the sum of
    ``metrics.jsonl`` 's ``samples`` when its lines are the steps 1, 2, ... N (a run continued in
    its own directory lists every update once); None when they do not start at step 1 (a
    checkpoint continued in a new run directory) or the file cannot be read."""
    total, expected = 0, 1
    try:
        with open(metrics, encoding="utf-8") as handle:
            for line in handle:
                record = json.loads(line)
                if record.get("step") != expected:
                    return None
                total, expected = total + int(record["samples"]), expected + 1
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return total if expected > 1 else None
