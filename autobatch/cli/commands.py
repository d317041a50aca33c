"""The two Hydra apps, ``probe`` and ``train``: a task function each and a runner.

A task builds the workload from its config, runs, writes its results into Hydra's run
directory (``result.json``, ``plan.json`` with ``train.global_batch``; ``train_result.json``,
``metrics.jsonl`` and ``final_model.pt`` for ``train``), prints a short
table, and returns a row for the sweep summary. Errors go through
:func:`~autobatch.cli.errors.reported`: one line and an exit code, never a traceback.

Under ``torchrun`` both commands join the process group first (:mod:`autobatch.cli.ranks`);
``train.global_batch`` is then global over the ranks: the plan is for each rank's share, and
every rank trains its share of each global batch (:mod:`autobatch.cli.sharding`). Rank 0
alone writes files and prints.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ..dist import agreement as dist_sync
from ..dist.probe import agree_plan
from ..planning.planner import Plan, plan
from ..probe.find import find_max_batch
from ..probe.result import ProbeResult
from ..memory.units import format_bytes
from .build import Workload, build_workload, device_kind, memory_limit, training_memory
from .conf import CONFIG_PATH, ensure_conf_module
from .display import print_result, print_training, trial_progress, write_probe_plot
from .config import register_configs
from . import ranks
from .errors import cli_keys, hydra_noise_filtered, reported
from .input_note import inputs_noted
from .log_advice import advice_in_logs
from .isolated import isolate_probe, probe_in_child
from .preflight import flags_first, hydra_help_args
from .sweep import claim_sweep_job, forget_sweeps
from .run_dir import check_probe_target, check_train_target, claim_run_dir
from .user_config import command_line, help_overrides, job_name_override, run_roots
from .sharding import per_rank_batch
from .atomic_write import write_atomic
from .resume_job import agreed_resume_target, on_every_rank
from .resume_state import (check_optimizer_kind, check_same_model, check_steps_left, kept_settings, loss_notes,
                           micro_batch_notes, read_checkpoint)
from .training import FINAL_MODEL, METRICS, earlier_probe, rank_fields, run_training, samples_in_all

__all__ = ["COMMANDS", "probe_task", "train_task", "run_app", "run_probe", "run_plan", "probe_kwargs"]

log = logging.getLogger("autobatch")


def _run_context(command: str) -> tuple[Path, str, bool, object]:
    """(run directory, the command line that reproduces this job, multirun?, verbose). The
    command is named by the subcommand, not ``hydra.job.name`` (a config of the user's own
    that sets none has Hydra's, the task's module name), with the user's config flags."""
    hydra_cfg = HydraConfig.get()
    line = command_line(command)
    return Path(hydra_cfg.runtime.output_dir), line, hydra_cfg.mode == RunMode.MULTIRUN, hydra_cfg.verbose


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """A run's record (``result.json``, ``plan.json``, ``train_result.json``), atomically: written
    in place, a write that failed part-way (a full disk, a kill) tore the record an earlier run
    left there, which a continued run and a continued sweep read."""
    if not ranks.is_rank_zero():
        return  # under torchrun, rank 0 writes the results
    write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def _resolved(cfg: DictConfig) -> Any:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def probe_kwargs(cfg: DictConfig, workload: Workload) -> dict[str, Any]:
    """:func:`find_max_batch` keyword arguments from the ``probe`` keys (also what
    :func:`autobatch.plan` passes on to it).

    A finite ``data.dataset`` caps ``max_batch`` at its length (its share of it under
    ``torchrun``): a larger batch would repeat samples, and training could never take it."""
    probe = cfg.probe
    cache: bool | str = bool(probe.cache)
    if cache and probe.cache_dir is not None:
        cache = str(_from_launch_dir(str(probe.cache_dir)))
    kwargs = dict(
        start=probe.start,
        max_batch=probe.max_batch,
        strategy=probe.strategy.name,
        margin=probe.margin,
        multiple_of=probe.multiple_of,
        steps_per_trial=probe.steps_per_trial,
        search_steps=probe.search_steps,
        memory_limit=memory_limit(cfg, workload.device),
        device=workload.device,
        cache=cache,
    )
    cap = dataset_cap(workload)
    if cap is not None and (probe.max_batch is None or probe.max_batch > cap):
        kwargs["max_batch"] = cap
    return kwargs


def _from_launch_dir(path: str) -> Path:
    """A relative ``path`` from the command line, against the directory the command ran in:
    under ``hydra.job.chdir=true`` the job runs in its run directory, where a relative
    ``probe.cache_dir`` was a new, empty cache each run."""
    resolved = Path(path).expanduser()
    if resolved.is_absolute() or not HydraConfig.initialized():
        return resolved
    return Path(HydraConfig.get().runtime.cwd) / resolved


def dataset_cap(workload: Workload) -> int | None:
    """The largest batch (per rank) a finite ``data.dataset`` holds; None for synthetic data."""
    if workload.dataset is None:
        return None
    return max(1, len(workload.dataset) // dist_sync.world_size())


def run_probe(cfg: DictConfig, workload: Workload) -> ProbeResult:
    """Run :func:`find_max_batch` on the workload with the config's ``probe`` arguments."""
    kwargs = probe_kwargs(cfg, workload)
    result = find_max_batch(workload.probe_step, **kwargs)
    if kwargs["max_batch"] != cfg.probe.max_batch:
        result.notes.append(f"largest batch tried capped at {kwargs['max_batch']}, the samples in data.dataset")
    return result


def run_plan(cfg: DictConfig, workload: Workload, global_batch: int) -> Plan:
    """Run :func:`autobatch.plan` for ``global_batch`` with the ``plan`` and ``probe`` keys.

    Under a process group of ``W`` ranks ``global_batch`` is over all of them: the plan is for
    one rank's share, ``global_batch / W`` (a ``ValueError`` naming ``train.global_batch`` when
    it does not split evenly), and the same on every rank."""
    world = dist_sync.world_size()
    share = per_rank_batch(global_batch, world)
    options = cfg.plan
    planned = plan(
        workload.probe_step,
        global_batch=share,
        objective=options.objective.name,
        allow_accumulation=bool(options.allow_accumulation),
        allow_checkpointing=bool(options.allow_checkpointing),
        checkpoint_targets=list(options.checkpoint_modules) or None,
        balanced=bool(options.balanced),
        min_micro_batch=options.min_micro_batch,
        exhaustive=bool(options.exhaustive),
        warmup_steps=int(options.warmup_steps),
        timed_steps=int(options.timed_steps),
        retime_rounds=int(options.retime_rounds),
        retime_within=float(options.retime_within),
        **probe_kwargs(cfg, workload),
    )
    if dist_sync.is_distributed():
        agree_plan(planned)
        planned.notes.append(f"{world} ranks: global batch {global_batch} = {world} x {share}; the plan is per rank")
    return planned


def plan_probe(planned: Plan) -> ProbeResult:
    """The probe the plan rests on: the last one that fitted with the plan's checkpointing."""
    fitted = [p for p in planned.probes if p.get("result")]
    matching = [p for p in fitted if p["checkpointing"] == planned.checkpointing] or fitted
    return ProbeResult.from_dict(matching[-1]["result"])


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


def _write_probe(out_dir: Path, result: ProbeResult, command: str, cfg: DictConfig) -> None:
    """result.json, memory_curve.png (unless probe.plot=false) and the result table."""
    _write_json(out_dir / "result.json", {**result.to_dict(), "command": command, "config": _resolved(cfg)})
    plot = write_probe_plot(cfg, result, out_dir) if ranks.is_rank_zero() else None
    print_result(result, [("result", str(out_dir / "result.json"))] + ([("plot", str(plot))] if plot else []))


def _write_plan(out_dir: Path, planned: Plan, command: str, global_batch: int) -> None:
    _write_json(out_dir / "plan.json", {**planned.to_dict(), **rank_fields(global_batch), "command": command})
    summary = cli_keys(planned.summary())  # the library's argument names as the command line's keys
    if dist_sync.world_size() > 1:  # the plan's own global batch is one rank's share
        world = dist_sync.world_size()
        summary = f"global batch    {global_batch} over {world} ranks, {planned.global_batch} per rank\n" + summary.split("\n", 1)[1]
    print()
    print(summary)


def probe_task(cfg: DictConfig) -> dict[str, Any]:
    """``python -m autobatch probe``: find the largest batch, write ``result.json``; with
    ``train.global_batch`` plan that global batch too and write ``plan.json``."""
    out_dir, command, multirun, verbose = _run_context("probe")
    with reported(multirun=multirun, verbose=verbose), inputs_noted(cfg) as watch:
        ranks.join(cfg)
        out_dir = ranks.shared_run_dir(out_dir)
        on_every_rank(lambda: claim_sweep_job(out_dir), "cli: sweep job directory", f"job directory {out_dir}")
        on_every_rank(lambda: check_probe_target(out_dir), "cli: probe directory", f"hydra.run.dir={out_dir}")
        workload = watch(build_workload(cfg))  # an own model's first forward: inputs named
        global_batch = cfg.train.global_batch
        if global_batch is None:
            with trial_progress():  # a live line per trial on a terminal
                result = run_probe(cfg, workload)
            _write_probe(out_dir, result, command, cfg)
            return _row(result, cached=result.cached)
        with trial_progress():
            planned = run_plan(cfg, workload, int(global_batch))
        planned.undo()  # probe only reports; the model is not trained here
        result = plan_probe(planned)
        _write_probe(out_dir, result, command, cfg)
        _write_plan(out_dir, planned, command, int(global_batch))
        print(f"plan            {out_dir / 'plan.json'}")
        return _row(
            result, cached=result.cached, global_batch=int(global_batch), micro_batch=planned.micro_batch,
            accumulation=planned.accumulation_steps, checkpointing=planned.checkpointing,
        )  # fmt: skip
    raise AssertionError("unreachable")  # reported() exits or raises


def _prepare(cfg: DictConfig, workload: Workload, out_dir: Path, command: str,
             child_result: ProbeResult | None = None) -> dict[str, Any]:
    """Decide the batches of a fresh run: ``train.micro_batch`` as given (no probe), else a
    plan for ``train.global_batch``, else the probed batch as both global and micro-batch
    (``child_result``: the answer of a probe that ran in a child process, :mod:`.isolated`).

    Under ``W`` ranks the micro-batch is per rank and an unset ``train.global_batch`` is ``W``
    times the per-rank batch (each rank trains one micro-batch a step)."""
    train = cfg.train
    world = dist_sync.world_size()
    notes: list[str] = []
    result, planned, ceiling = None, None, None
    if train.micro_batch is not None:
        micro = int(train.micro_batch)
        global_batch = int(train.global_batch or micro * world)
        notes.append(f"no probe: train.micro_batch={micro}")
    elif train.global_batch is not None:
        global_batch = int(train.global_batch)
        with trial_progress():
            planned = run_plan(cfg, workload, global_batch)
        result = plan_probe(planned)
        _write_probe(out_dir, result, command, cfg)
        _write_plan(out_dir, planned, command, global_batch)
        micro = planned.micro_batch
        probed = [p.batch_size for p in planned.probe_results]
        ceiling = min(global_batch // world, max(probed + [micro]))
    elif child_result is not None:
        result = child_result
        _write_json(out_dir / "result.json", {**result.to_dict(), "command": command, "config": _resolved(cfg)})
        notes.append(f"probed in a child process (probe.isolate; its run: {out_dir / 'probe'}), so training starts "
                     "in a process no trial ran in")
        micro = result.batch_size
        global_batch = micro * world
    else:
        with trial_progress():
            result = run_probe(cfg, workload)
        _write_probe(out_dir, result, command, cfg)
        micro = result.batch_size
        global_batch = micro * world
    if train.micro_batch is None and train.max_micro_batch is not None and micro > train.max_micro_batch:
        notes.append(f"micro-batch {micro} (probed) capped at train.max_micro_batch={train.max_micro_batch}")
        micro = int(train.max_micro_batch)  # the user's ceiling wins; the Runner refuses a micro_batch above it
    return dict(global_batch=global_batch, micro_batch=micro, max_micro_batch=ceiling, plan=planned, probe=result, notes=notes)


def _resume_from(cfg: DictConfig, out_dir: Path, workload: Any) -> dict[str, Any]:
    """Resume: the checkpoint's global batch (no probe, no plan; the runner restores the
    micro-batch, the checkpointing wrap, the RNG and the optimizer's settings, noted)."""
    hydra_cfg = HydraConfig.get()
    base, value, sweep = Path(hydra_cfg.runtime.cwd), str(cfg.train.resume), hydra_cfg.mode == RunMode.MULTIRUN
    path, own = agreed_resume_target(value, cfg.train.checkpoint_dir, base, out_dir, sweep=sweep, roots=run_roots(base),
                                     cfg=cfg, sweep_dir=base / hydra_cfg.sweep.dir if sweep else None)
    state = read_checkpoint(path, sharded=bool(cfg.train.get("fsdp")))
    check_steps_left(cfg.train, state, path)
    optimizer = workload.optimizer
    check_same_model(cfg, state, ranks.unwrapped(workload.model), path, None if not own else out_dir)  # model.* named
    check_optimizer_kind(state, optimizer, path, cfg)  # and the scheduler's
    global_batch, wanted = int(state["result"]["global_batch"]), cfg.train.global_batch
    if wanted is not None and wanted != global_batch:
        raise ValueError(f"train.global_batch={wanted} differs from the checkpoint's {global_batch} ({path}); drop it to resume")
    per_rank_batch(global_batch, dist_sync.world_size(), key=f"the checkpoint's train.global_batch ({path})", resumed=True)
    notes = [f"resumed from {path} at step {state['step']}" + ("" if own else f" into a new run directory, {out_dir}")]
    notes += micro_batch_notes(cfg.train, state) + kept_settings(state, optimizer, cfg)
    notes += loss_notes(cfg, path, out_dir if own else None)  # the loss is no state of the checkpoint
    return dict(
        global_batch=global_batch, micro_batch=None, max_micro_batch=None, plan=None, probe=None, notes=notes,
        path=path, step=state["step"] if own else None,  # metrics.jsonl is continued only in the run's own directory
    )  # fmt: skip


def train_task(cfg: DictConfig) -> dict[str, Any]:
    """``python -m autobatch train``: probe or plan (unless ``train.micro_batch``), then
    train on the runner; or continue a run with ``train.resume``."""
    out_dir, command, multirun, verbose = _run_context("train")
    with reported(multirun=multirun, verbose=verbose), inputs_noted(cfg) as watch, advice_in_logs(cfg):
        ranks.join(cfg)
        out_dir = ranks.shared_run_dir(out_dir)  # rank 0's, where every rank's checkpoint shards go
        if cfg.train.global_batch is not None:  # before any probe: a config error, at once
            per_rank_batch(int(cfg.train.global_batch), dist_sync.world_size())
        child_result = None  # one run a directory: two started in the same second share Hydra's
        on_every_rank(lambda: claim_sweep_job(out_dir), "cli: sweep job directory", f"job directory {out_dir}")
        on_every_rank(lambda: claim_run_dir(out_dir, dist_sync.rank()), "cli: run directory claimed", f"hydra.run.dir={out_dir}")
        if cfg.train.resume is None:  # before any probe: never over an earlier run's files
            on_every_rank(lambda: check_train_target(out_dir, cfg.train.checkpoint_dir), "cli: run directory free",
                           f"hydra.run.dir={out_dir}")
        if cfg.train.resume is None and cfg.train.micro_batch is None and isolate_probe(cfg, device_kind(cfg)):
            child_result = probe_in_child(out_dir / "probe")  # before this process makes a CUDA context
        workload = watch(build_workload(cfg))
        if cfg.train.resume is not None:
            setup = _resume_from(cfg, out_dir, workload)
        else:
            setup = _prepare(cfg, workload, out_dir, command, child_result)
        probed = setup["probe"] is not None or setup["plan"] is not None
        with training_memory(cfg, workload.device, probed=probed) as capped:
            if capped:
                setup["notes"].append(capped)
            for note in setup["notes"]:
                log.info(note)
            run, runner = run_training(
                cfg, workload, global_batch=setup["global_batch"], micro_batch=setup["micro_batch"], out_dir=out_dir,
                max_micro_batch=setup["max_micro_batch"], plan=setup["plan"], resume=setup.get("path"),
                resumed_step=setup.get("step"),
            )  # fmt: skip
        probe = setup["probe"]
        summary = {
            **run.rounded(),  # seconds and samples/s rounded as metrics.jsonl's
            **rank_fields(run.global_batch),
            "notes": setup["notes"],
            "samples_in_all": samples_in_all(out_dir / METRICS),
            "probe": earlier_probe(setup.get("path"), cfg.train.checkpoint_dir, out_dir) if probe is None else probe.to_dict(),
            "metrics": str(out_dir / METRICS),
            "final_model": str(out_dir / FINAL_MODEL),
            "command": command,
            "config": _resolved(cfg),
        }
        _write_json(out_dir / "train_result.json", summary)
        print_training(run, setup["notes"], runner.piece_sizes(run.global_batch // dist_sync.world_size()))
        print(f"final model     {out_dir / FINAL_MODEL}\nresult          {out_dir / 'train_result.json'}")
        return _row(  # batch_size: the (final) micro-batch it trained at
            probe, batch_size=run.micro_batch, cached=None if probe is None else probe.cached,
            global_batch=run.global_batch, steps=run.steps, recoveries=len(run.oom_recoveries),
            final_loss=None if run.last_loss is None else round(run.last_loss, 4),
        )  # fmt: skip
    raise AssertionError("unreachable")


#: subcommand -> (task function, primary config name, one-line description)
COMMANDS: dict[str, tuple[Callable[[DictConfig], Any], str, str]] = {
    "probe": (probe_task, "probe", "find the largest batch size that trains (with train.global_batch: and the plan)"),
    "train": (train_task, "train", "probe or plan, then train on the OOM-surviving runner; train.resume continues"),
}


def run_app(command: str) -> None:
    """Run ``command`` 's Hydra app on ``sys.argv[1:]`` (the dispatcher has set ``sys.argv``)."""
    ensure_conf_module()
    register_configs()
    forget_sweeps()  # an earlier command's sweep in this process (main() called again) is not this one's to report
    task, config_name, _ = COMMANDS[command]
    args = [*sys.argv[1:], *job_name_override(command, sys.argv[1:]),  # probe.log, a probe's summary, for a train config
            *help_overrides(command, sys.argv[1:])]  # and probe's help header
    sys.argv = [sys.argv[0], *flags_first(hydra_help_args(command, args))]  # Hydra's parser wants its flags first
    verbose = [arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.startswith(("hydra.verbose=", "++hydra.verbose="))]
    with hydra_noise_filtered(verbose=bool(verbose) and verbose[-1].strip() not in ("", "false", "False", "null", "[]")):
        hydra.main(config_path=CONFIG_PATH, config_name=config_name, version_base="1.3")(task)()
