"""What an earlier run's directory records about itself: where its checkpoint went.

``train.resume=<run dir>`` looked for ``<run dir>/<train.checkpoint_dir>/last.pt`` with *this*
command's ``train.checkpoint_dir``; a run made with another one (``train.checkpoint_dir=ck``)
was "no checkpoint ...; give ... a run directory" although a run directory was given.
:func:`recorded_checkpoint_dirs` reads the run's own ``train.checkpoint_dir`` from the config
it recorded: Hydra's ``.hydra/config.yaml`` (also there for a run killed before it finished),
else the resolved config in its ``train_result.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["recorded_checkpoint_dirs"]


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
