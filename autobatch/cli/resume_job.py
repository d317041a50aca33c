"""Which checkpoint ``train.resume`` continues, judged on every rank before any rank writes.

Moved out of :mod:`autobatch.cli.commands` (the apps) with the check a sweep needs:
``train.resume=latest`` in a sweep (``-m``) continues job N from job N's own directory, and
Hydra numbers a sweep's jobs by the order of its values. A sweep continued with its values in
another order, or with one added before the others (``optimizer.lr=0.1,0.01,0.001`` after
``optimizer.lr=0.01,0.001``), resumed each job from another job's checkpoint: the runs kept the
checkpoint's learning rate (a note), the summary named the new one, and the jobs' records were
crossed from then on. :func:`check_same_job` compares the values the sweep varies with the
ones the job directory's run was started with (its ``result.json``, written by the probe that
began it and left as it is by a resume; else its ``train_result.json``) and refuses a job whose
values differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..dist import agreement as dist_sync
from .interpolations import raw_value
from .run_record import recorded_config
from .training import check_resume_target, find_resume

__all__ = ["agreed_resume_target", "on_every_rank", "check_same_job", "swept_keys"]

#: Keys a continued sweep may change for every job: how far to train, and what to resume.
_CONTINUING = ("train.steps", "train.epochs", "train.resume")


def agreed_resume_target(value: str, checkpoint_dir: str, base: Path, out_dir: Path, sweep: bool = False,
                         roots: list[Path] | None = None, cfg: DictConfig | None = None,
                         sweep_dir: Path | None = None) -> tuple[Path, bool]:
    """The checkpoint to resume and whether it is the run directory's own, judged by every rank
    before any rank writes into the shared run directory (one sync point under ``torchrun``):
    without it, rank 0 went on and made ``metrics.jsonl`` while a later rank still looked, and
    took it for another run's. In a ``sweep``, ``latest`` is only a job's own checkpoint: the
    newest elsewhere may be an earlier job's of the same sweep (each job then resumed the last),
    and the job's own must be this job's (:func:`check_same_job`, given ``cfg`` and ``sweep_dir``)."""
    def judge() -> tuple[Path, bool]:
        path = find_resume(value, checkpoint_dir, base, run_dir=out_dir, roots=roots)
        own = check_resume_target(path, out_dir, checkpoint_dir, value)  # never another run's files
        if sweep and value == "latest" and not own:
            raise ValueError(
                f"train.resume=latest in a sweep (-m) resumes each job from its own run directory (continue a sweep "
                f"with its hydra.sweep.dir), and {out_dir} holds no checkpoint; the newest elsewhere, {path}, may be "
                "an earlier job's of this sweep: give train.resume=PATH to start every job from one checkpoint"
            )
        if sweep and own and cfg is not None and sweep_dir is not None:
            check_same_job(cfg, out_dir, swept_keys(sweep_dir))
        return path, own

    return on_every_rank(judge, "cli: resume target", f"train.resume={value}")


def on_every_rank(judge: Callable[[], Any], label: str, what: str) -> Any:
    """``judge()`` on every rank, then one sync point: a ``ValueError`` on any rank stops every
    rank (the others say which rank refused), and no rank goes on while another still judges."""
    try:
        answer, error = judge(), None
    except ValueError as exc:
        answer, error = None, exc
    if dist_sync.is_distributed():
        refused = [index for index, row in enumerate(dist_sync.exchange([int(error is not None)], label)) if row[0]]
        if refused and error is None:
            raise ValueError(f"{what}: rank {refused[0]} refused it (its message says why)")
    if error is not None:
        raise error
    return answer


def swept_keys(sweep_dir: Path) -> list[str]:
    """The keys (or config groups) the sweep in ``sweep_dir`` varies, from the overrides Hydra
    saved in its ``multirun.yaml`` (and ``hydra.sweeper.params``); none where it is unreadable."""
    try:
        saved = OmegaConf.load(sweep_dir / "multirun.yaml")
        task = list(OmegaConf.select(saved, "hydra.overrides.task", default=None) or [])
        params = OmegaConf.select(saved, "hydra.sweeper.params", default=None) or {}
        words = [*task, *(f"{key}={value}" for key, value in params.items())]
    except (OSError, yaml.YAMLError, OmegaConfBaseException):
        return []
    keys = []
    for word in words:
        try:
            override = OverridesParser.create().parse_override(str(word))
        except OverrideParseException:  # Hydra ran the sweep, so this is not expected; nothing to compare
            continue
        if override.is_sweep_override() and override.key_or_group not in _CONTINUING:
            keys.append(override.key_or_group)
    return list(dict.fromkeys(keys))


def _started_with(out_dir: Path) -> dict[str, Any] | None:
    """The resolved config the run in ``out_dir`` was started with (None: none recorded): its
    probe's ``result.json`` (a resume leaves it), else, where no probe ran (``train.micro_batch``),
    its ``train_result.json``."""
    return recorded_config(out_dir, ("result.json", "train_result.json"))


def check_same_job(cfg: DictConfig, out_dir: Path, keys: list[str]) -> None:
    """``ValueError`` when the run in this sweep job's directory was started with other values
    of the swept ``keys`` than this job has (the sweep's values come in another order now)."""
    earlier = _started_with(out_dir)
    if earlier is None or not keys:
        return
    differ = []
    for key in keys:
        now = OmegaConf.select(cfg, key, default=None)
        now = OmegaConf.to_container(now, resolve=True, enum_to_str=True) if OmegaConf.is_config(now) else now
        then = raw_value(earlier, key, None)
        if now != then:
            differ.append((key, then, now))
    if differ:
        then_text = " ".join(f"{key}={_text(value)}" for key, value, _ in differ)
        now_text = " ".join(f"{key}={_text(value)}" for key, _, value in differ)
        raise ValueError(
            f"the checkpoint in this job's run directory is another job's: {then_text}, not {now_text} "
            f"(train.resume=latest in a sweep resumes job N from {out_dir}, job N's run directory, and the sweep's "
            "values come in another order now); give them in the order the sweep first had them, or a new "
            "hydra.sweep.dir to start afresh"
        )


def _text(value: Any) -> str:
    """A value as the command line writes it (a config group's node by its ``_target_``)."""
    if isinstance(value, dict):
        return str(value.get("_target_", value))
    if value is None:
        return "null"
    return str(value)
