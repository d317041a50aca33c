"""The two Hydra apps, ``probe`` and ``train``: a task function each and a runner.

A task builds the workload from its config, runs, writes its results into Hydra's run
directory (``result.json``; ``train_result.json`` and ``metrics.jsonl``), prints a short
table, and returns a row for the sweep summary. Errors go through
:func:`~autobatch.cli.errors.reported`: one line and an exit code, never a traceback.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ..probe import find_max_batch
from ..result import ProbeResult
from ..units import format_bytes
from .build import Workload, build_workload, memory_limit
from .conf import CONFIG_PATH, ensure_conf_module
from .config import register_configs
from . import ranks
from .errors import reported
from .training import run_training

__all__ = ["COMMANDS", "probe_task", "train_task", "run_app", "run_probe"]

log = logging.getLogger("autobatch")


def _run_context() -> tuple[Path, str, bool, object]:
    """(run directory, the command that reproduces this job, multirun?, verbose)."""
    hydra_cfg = HydraConfig.get()
    command = " ".join(["python -m autobatch", hydra_cfg.job.name, *hydra_cfg.overrides.task])
    return Path(hydra_cfg.runtime.output_dir), command, hydra_cfg.mode == RunMode.MULTIRUN, hydra_cfg.verbose


def _write_json(path: Path, data: dict[str, Any]) -> None:
    if not ranks.is_rank_zero():
        return  # under torchrun, rank 0 writes the results
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def _resolved(cfg: DictConfig) -> Any:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def run_probe(cfg: DictConfig, workload: Workload) -> ProbeResult:
    """Run :func:`find_max_batch` on the workload with the config's ``probe`` arguments."""
    probe = cfg.probe
    return find_max_batch(
        workload.probe_step,
        start=probe.start,
        max_batch=probe.max_batch,
        strategy=probe.strategy.name,
        margin=probe.margin,
        multiple_of=probe.multiple_of,
        steps_per_trial=probe.steps_per_trial,
        memory_limit=memory_limit(cfg, workload.device),
        device=workload.device,
    )


def _row(result: ProbeResult | None, **extra: Any) -> dict[str, Any]:
    """What a job hands the sweep summary."""
    row: dict[str, Any] = {"batch_size": None, "trials": None, "peak": None, "time_s": None}
    if result is not None:
        row.update(
            batch_size=result.batch_size,
            trials=result.num_trials,
            peak=format_bytes(result.peak_bytes),
            time_s=round(result.elapsed_s, 2),
        )
    row.update(extra)
    return row


def probe_task(cfg: DictConfig) -> dict[str, Any]:
    """``python -m autobatch probe``: find the largest batch, write ``result.json``."""
    out_dir, command, multirun, verbose = _run_context()
    with reported(multirun=multirun, verbose=verbose):
        ranks.join(cfg)
        workload = build_workload(cfg)
        result = run_probe(cfg, workload)
        _write_json(out_dir / "result.json", {**result.to_dict(), "command": command, "config": _resolved(cfg)})
        print(result.summary())
        print(f"result          {out_dir / 'result.json'}")
        return _row(result)
    raise AssertionError("unreachable")  # reported() exits or raises


def train_task(cfg: DictConfig) -> dict[str, Any]:
    """``python -m autobatch train``: probe (unless ``train.micro_batch``), then train."""
    out_dir, command, multirun, verbose = _run_context()
    with reported(multirun=multirun, verbose=verbose):
        ranks.join(cfg)
        workload = build_workload(cfg)
        notes: list[str] = []
        result = None
        if cfg.train.micro_batch is not None:
            batch_size = int(cfg.train.micro_batch)
            notes.append(f"no probe: train.micro_batch={batch_size}")
        else:
            result = run_probe(cfg, workload)
            _write_json(out_dir / "result.json", {**result.to_dict(), "command": command, "config": _resolved(cfg)})
            print(result.summary())
            batch_size = result.batch_size
        wanted = cfg.train.global_batch
        if wanted is not None and wanted <= batch_size:
            batch_size = int(wanted)
        elif wanted is not None:
            notes.append(
                f"train.global_batch={wanted} does not fit; training at batch {batch_size} without "
                "gradient accumulation (not implemented yet), so each step sees fewer samples"
            )
        for note in notes:
            log.info(note)
        summary = run_training(cfg, workload, batch_size, out_dir)
        summary.update(notes=notes, probe=None if result is None else result.to_dict(), command=command)
        summary["config"] = _resolved(cfg)
        _write_json(out_dir / "train_result.json", summary)
        print(f"trained         {summary['steps']} steps at batch {batch_size} in {summary['elapsed_s']:.2f} s")
        print(f"loss            {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}")
        for note in notes:
            print(f"note            {note}")
        print(f"result          {out_dir / 'train_result.json'}")
        return _row(result, batch_size=batch_size, steps=summary["steps"], final_loss=round(summary["final_loss"], 4))
    raise AssertionError("unreachable")


#: subcommand -> (task function, primary config name, one-line description)
COMMANDS: dict[str, tuple[Callable[[DictConfig], Any], str, str]] = {
    "probe": (probe_task, "probe", "find the largest batch size that trains; writes result.json"),
    "train": (train_task, "train", "probe (or take train.micro_batch), then train; writes metrics.jsonl"),
}


def run_app(command: str) -> None:
    """Run ``command`` 's Hydra app on ``sys.argv[1:]`` (the dispatcher has set ``sys.argv``)."""
    ensure_conf_module()
    register_configs()
    task, config_name, _ = COMMANDS[command]
    hydra.main(config_path=CONFIG_PATH, config_name=config_name, version_base="1.3")(task)()
