"""The training run behind ``python -m autobatch train``: the workload on autobatch's Runner.

:func:`run_training` maps the ``train`` config onto :class:`~autobatch.Runner` (OOM recovery,
gradient accumulation, grow-back, step guard, cache hygiene, atomic checkpoints, exact
resume, progress, fault injection), feeds it the global batches of
:mod:`autobatch.cli.data`, and writes under the run directory:

* ``metrics.jsonl``: one line per applied update (step, epoch, loss, lr, micro_batch,
  accumulation, ranks, samples, seconds, samples_per_s, recoveries); ``lr`` is the rate the
  step was applied at (:mod:`autobatch.cli.lr_record`);
* ``<train.checkpoint_dir>/last.pt``: the runner's checkpoint;
* ``final_model.pt``: the final ``model.state_dict()`` (what a resumed run is compared by),
  unsharded and on the CPU, loadable with ``torch.load(..., weights_only=True)`` into the
  model as it was before sharding.

Under ``torchrun`` every rank trains its share of each global batch (:mod:`autobatch.cli.data`)
and only rank 0 writes these files (and the runner's checkpoints). With ``train.fsdp=true``
each rank also writes its shards of each checkpoint (``last.rank<r>-of-<world>.pt``, in rank
0's run directory); ``final_model.pt`` is gathered from them (a collective) by rank 0. A
metrics line is the whole step: ``loss``, ``samples`` and ``samples_per_s`` over all ranks,
``micro_batch`` and ``accumulation`` per rank, ``ranks`` the number of ranks.

The runner writes the ``train.checkpoint_every`` checkpoints *after* the step hook that writes
the step's metrics line (an epoch's last step as the next epoch's start, and the run's last step
once, not again at the end: before, the hook saved itself and the last step was written twice;
the signals are held during every write), so a run killed
at any instant has a metrics line for every step in its checkpoint; on resume, lines after
the checkpoint (steps that will run again) are dropped, so the file lists every applied
update exactly once. A run stopped by Ctrl-C, SIGTERM, an out-of-memory error it cannot
recover from or any other error mid-run saves its checkpoint first and names the command that continues it
(:mod:`autobatch.cli.interrupt`).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from ..dist import agreement as dist_sync
from .ranks import unwrapped
from ..probe.snapshot.shards import has_dtensors
from ..training.checkpoints.checkpoint_io import CHECKPOINT_NAME, resolve_checkpoint, save_checkpoint
from ..training.checkpoints.sharded_files import base_path
from ..training.oom.faults import FaultInjector
from ..training.checkpoints.resume_target import checkpoint_written as _exists, latest_checkpoint, written_at as _written_at
from ..training.run_result import RunResult
from ..training.weak_calls import weakly
from ..training.runner import Runner
from .atomic_write import write_atomic
from .build import Workload
from .data import training_data
from .interrupt import Interrupts, gave_up_together, stopped, stopped_together
from .lr_record import StepLearningRates
from .resume_state import check_steps_left, read_checkpoint
from .schedulers import build_scheduler
from .run_record import checkpoint_owner, earlier_probe, recorded_checkpoint_dirs, samples_in_all

__all__ = ["METRICS", "FINAL_MODEL", "checkpoint_in", "find_resume", "check_resume_target", "check_fresh_target", "run_files", "records_updates", "read_checkpoint", "check_steps_left", "runner_options", "run_training", "rank_fields", "earlier_probe", "samples_in_all"]

log = logging.getLogger("autobatch")

METRICS = "metrics.jsonl"
FINAL_MODEL = "final_model.pt"


def checkpoint_in(run_dir: Path, checkpoint_dir: str) -> Path:
    """The ``last.pt`` a run in ``run_dir`` writes: ``<run_dir>/<train.checkpoint_dir>/last.pt``;
    an absolute ``train.checkpoint_dir`` is used as it is, whatever the run directory."""
    return Path(run_dir) / Path(checkpoint_dir).expanduser() / CHECKPOINT_NAME


def find_resume(value: str, checkpoint_dir: str, base: Path, run_dir: Path | None = None,
                roots: list[Path] | None = None) -> Path:
    """The checkpoint file ``train.resume=value`` names: a ``last.pt``, its directory, a run
    directory (``<run>/<checkpoint_dir>/last.pt``, or the ``train.checkpoint_dir`` the run
    recorded), or ``latest``: the checkpoint of this run's own directory ``run_dir`` when it has
    one (``hydra.run.dir`` of a run to continue), else the newest under ``roots`` (where the
    config's runs go), ``base/outputs/train`` and ``base/multirun/train``, at any depth
    (``outputs/train/runA`` too); with an absolute ``checkpoint_dir`` the one there. A sharded
    (FSDP2) checkpoint is named by its ``last.pt`` although only its ``last.rank<r>-of-<world>.pt``
    files exist. ``latest`` is refused when a run newer than the newest checkpoint recorded
    updates but wrote no checkpoint (killed outright): the newest is then an older run's; so is
    ``latest`` into a ``run_dir`` that recorded updates but holds no checkpoint (its ``last.pt`` deleted
    or moved): the newest elsewhere is another run's, which that directory's files cannot continue."""
    if value == "latest":
        own = None if run_dir is None else latest_checkpoint(Path(run_dir) / Path(checkpoint_dir).expanduser())
        if own is not None:  # the runner's own "latest": the checkpoint its checkpoint_dir holds
            return own
        if run_dir is not None and records_updates(Path(run_dir) / METRICS):
            raise ValueError(  # not another run's newest: the continue command of this one names this directory
                f"train.resume=latest: {run_dir} holds a run (its {METRICS}) but not its checkpoint "
                f"{checkpoint_in(run_dir, checkpoint_dir)} (killed before writing one, or deleted or moved); put that "
                "last.pt back, or continue from another checkpoint with train.resume=PATH in a new hydra.run.dir"
            )
        if Path(checkpoint_dir).expanduser().is_absolute():
            found = [checkpoint_in(base, checkpoint_dir)]
            where = str(found[0].parent)
        else:
            roots = list(dict.fromkeys([*(roots or []), base / "outputs" / "train", base / "multirun" / "train"]))
            patterns = [f"**/{checkpoint_dir}/{name}" for name in (CHECKPOINT_NAME, "last.rank0-of-*.pt")]
            found = list(dict.fromkeys(base_path(p) for root in roots for pattern in patterns for p in root.glob(pattern)))
            where = " or ".join(map(str, roots))
        found = [p for p in found if _exists(p)]
        if not found:
            raise ValueError(
                f"train.resume=latest: no checkpoint under {where}; give the path of a last.pt or of a run directory"
            )
        newest = max(found, key=_written_at)
        if not Path(checkpoint_dir).expanduser().is_absolute():
            _check_no_newer_run(newest, checkpoint_dir, roots or [], run_dir)
        return newest
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base / path
    own = [checkpoint_in(path, recorded) for recorded in recorded_checkpoint_dirs(path)]
    tried = list(dict.fromkeys([base_path(path), checkpoint_in(path, checkpoint_dir), *own]))
    for candidate in (candidate for candidate in tried if _exists(candidate)):
        return candidate
    shown = [resolve_checkpoint(base_path(path)), *(tried[1:] if path.is_dir() else [])]  # a file: only itself
    where = " or ".join(map(str, dict.fromkeys(shown)))
    near = " (did you mean train.resume=latest?)" if difflib.get_close_matches(value.lower(), ["latest"], cutoff=0.6) else ""
    raise ValueError(f"train.resume={value!r}: no checkpoint at {where}{near}; give a last.pt, its directory or a run directory")


def _check_no_newer_run(newest: Path, checkpoint_dir: str, roots: list[Path], run_dir: Path | None) -> None:
    """``ValueError`` when a run under ``roots`` recorded updates after the checkpoint ``newest``
    was written and has no checkpoint of its own: ``latest`` would continue an older run."""
    owner = checkpoint_owner(newest, checkpoint_dir)  # found by its checkpoint_dir: never None here
    written = _written_at(newest)
    for metrics in (m for root in roots for m in root.glob(f"**/{METRICS}")):
        run = metrics.parent
        if run in (owner, run_dir) or metrics.stat().st_mtime <= written or _exists(checkpoint_in(run, checkpoint_dir)):
            continue
        if records_updates(metrics):
            raise ValueError(
                f"train.resume=latest: the newest run, {run}, has no checkpoint (it stopped before writing one), and "
                f"the newest checkpoint is an older run's, {owner}; to continue that one give "
                f"train.resume={newest}, or start afresh without train.resume"
            )


def check_resume_target(path: Path, run_dir: Path, checkpoint_dir: str, value: str) -> bool:
    """Whether the checkpoint ``path`` is ``run_dir`` 's own (its metrics are then continued).
    Resuming another run's checkpoint into a directory that already holds a run (a
    ``metrics.jsonl`` that records an update, or a checkpoint) would overwrite that run's
    files: ``ValueError`` naming the key to change."""
    own = checkpoint_in(run_dir, checkpoint_dir)
    if path.resolve() == own.resolve():
        return True
    held = run_files(run_dir, checkpoint_dir)
    if _shared_checkpoint(checkpoint_dir) and _exists(own):
        raise ValueError(
            f"train.resume={value} continues {path}, but train.checkpoint_dir={checkpoint_dir} already holds another "
            f"run's checkpoint ({own}), which resuming would overwrite; give another train.checkpoint_dir (a relative "
            "one is under each run directory)"
        )
    if held:
        owner = checkpoint_owner(path, checkpoint_dir)  # None for a shared (absolute) checkpoint_dir
        in_place = "" if owner is None else f", or hydra.run.dir={owner} to continue that run in place"
        raise ValueError(
            f"train.resume={value} continues {path}, but the run directory {run_dir} holds another run "
            f"({' and '.join(held)}), which resuming would overwrite; give a new hydra.run.dir (or none){in_place}"
        )
    return False


def _shared_checkpoint(checkpoint_dir: str) -> bool:
    """An absolute ``train.checkpoint_dir``: the same ``last.pt`` whatever the run directory."""
    return Path(checkpoint_dir).expanduser().is_absolute()


def records_updates(metrics: Path) -> bool:
    """Whether ``metrics.jsonl`` records at least one applied update (a line with its ``step``).
    A run that failed before its first update leaves an empty file: nothing to keep."""
    try:
        with open(metrics, encoding="utf-8") as handle:
            for line in handle:
                try:
                    if isinstance(json.loads(line).get("step"), int):
                        return True
                except (ValueError, AttributeError):
                    continue  # a torn line of a killed run
    except OSError:
        return False
    return False


def run_files(run_dir: Path, checkpoint_dir: str) -> list[str]:
    """The files of a run that ``run_dir`` already holds: its ``metrics.jsonl`` when it records
    an update (not the empty one a run that failed before its first update leaves) and its
    checkpoint."""
    metrics, checkpoint = Path(run_dir) / METRICS, checkpoint_in(run_dir, checkpoint_dir)
    held = ((metrics, records_updates(metrics)), (checkpoint, _exists(checkpoint)))
    return [str(path) for path, there in held if there]


def check_fresh_target(run_dir: Path, checkpoint_dir: str, dir_key: str = "hydra.run.dir") -> None:
    """A run started afresh (no ``train.resume``) must not overwrite the files of a run the
    directory already holds (``hydra.run.dir`` of an earlier run) or the checkpoint in a shared
    absolute ``train.checkpoint_dir``: ``ValueError`` naming how to continue it or what to
    change (``dir_key``: the key that sets the directory, ``hydra.sweep.dir`` for a sweep's job).
    A run directory whose run failed before its first update (an empty ``metrics.jsonl``, no
    checkpoint) is no obstacle: the rerun starts it again."""
    checkpoint = checkpoint_in(run_dir, checkpoint_dir)
    if _shared_checkpoint(checkpoint_dir) and _exists(checkpoint):
        raise ValueError(
            f"train.checkpoint_dir={checkpoint_dir} already holds a checkpoint ({checkpoint}), which training afresh "
            "would overwrite; continue that run with train.resume=latest, or give another train.checkpoint_dir "
            "(a relative one, such as the default checkpoints, is under each run directory)"
        )
    held = run_files(run_dir, checkpoint_dir)
    if held:
        how = "continue it with train.resume=latest, or give" if _exists(checkpoint) else "it has no checkpoint to continue from; give"
        raise ValueError(
            f"{run_dir} already holds a run ({' and '.join(held)}), which training afresh would overwrite; "
            f"{how} a new {dir_key} (remove that run's files to start over)"
        )


def runner_options(cfg: DictConfig, workload: Workload, out_dir: Path, global_batch: int) -> dict[str, Any]:
    """:class:`~autobatch.Runner` keyword arguments from the ``train``, ``plan`` and ``probe`` keys:
    ``probe.multiple_of`` kept through recoveries and grow-back (a batch that is none: one step, as planned)."""
    train, multiple = cfg.train, int(cfg.probe.multiple_of)
    faults = None
    if train.inject_oom and (not train.inject_oom_ranks or dist_sync.rank() in train.inject_oom_ranks):
        faults = FaultInjector([(int(step), str(phase)) for step, phase in train.inject_oom], times=train.inject_oom_times)
    return dict(
        device=workload.device,
        balanced=bool(cfg.plan.balanced),
        max_micro_batch=train.max_micro_batch,
        min_micro_batch=int(train.min_micro_batch),
        grow_after=int(train.grow_after) or None,
        step_guard=train.step_guard.name,
        checkpointing_fallback=bool(train.checkpointing_fallback),
        checkpoint_targets=list(cfg.plan.checkpoint_modules) or None,
        empty_cache_every=train.empty_cache_every,
        empty_cache_threshold=train.empty_cache_threshold,
        checkpoint_dir=checkpoint_in(out_dir, train.checkpoint_dir).parent,
        checkpoint_every=int(train.checkpoint_every) or None,  # after the step hook (its metrics line)
        progress=train.progress,
        log_every=int(train.log_every) or None,
        autocast_dtype=workload.autocast_dtype,
        # a scaler of its own: the probe's trials stepped the workload's, training starts afresh
        grad_scaler=None if workload.grad_scaler is None else torch.amp.GradScaler(workload.device.type),
        max_grad_norm=workload.probe_step.max_grad_norm,
        faults=faults,
        multiple_of=multiple if (global_batch // dist_sync.world_size()) % multiple == 0 else 1,
    )


def _metrics_file(path: Path, resumed_step: int | None):
    """Open ``metrics.jsonl`` for this run: new, or on resume kept up to the checkpoint's step
    (the lines kept are written to a temporary file that replaces it, then it is appended to: it
    was truncated and then written, so a write that failed, on the full disk that stopped the
    run, lost every line of the run). On ranks other than 0 (under ``torchrun``) a sink that
    writes nowhere."""
    if not dist_sync.is_rank_zero():
        return open(os.devnull, "w", encoding="utf-8")
    if resumed_step is None or not path.exists():
        return open(path, "w", encoding="utf-8")
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= resumed_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line of a killed run
    write_atomic(path, "".join(line + "\n" for line in kept), fsync=True)
    return open(path, "a", encoding="utf-8")


def run_training(
    cfg: DictConfig,
    workload: Workload,
    *,
    global_batch: int,
    micro_batch: int | None,
    out_dir: Path,
    max_micro_batch: int | None = None,
    plan: Any = None,
    resume: Path | None = None,
    resumed_step: int | None = None,
) -> tuple[RunResult, Runner]:
    """Train ``workload`` on the Runner; ``micro_batch`` None only with ``resume`` (it comes
    from the checkpoint). Writes metrics, checkpoints and the final weights under ``out_dir``
    (rank 0 only under ``torchrun``, where ``global_batch`` is over all ranks and
    ``micro_batch`` per rank)."""
    train, options = cfg.train, runner_options(cfg, workload, out_dir, global_batch)
    if max_micro_batch is not None and options["max_micro_batch"] is None:
        options["max_micro_batch"] = max_micro_batch
    model, optimizer = workload.model, workload.optimizer
    model.train()
    data = training_data(cfg, workload, global_batch)
    run_steps = int(train.steps) if train.epochs is None else int(train.epochs) * len(data)  # type: ignore[arg-type]
    runner = Runner(model, optimizer, workload.probe_step.loss_fn, global_batch=global_batch, micro_batch=micro_batch,
                    scheduler=build_scheduler(cfg, optimizer, run_steps), **options)  # stepped once per update
    if plan is not None:
        runner.result.plan = {**plan.to_dict(), **rank_fields(global_batch)}
        if plan.checkpointing:
            runner.checkpoint_handle = plan.handle  # so checkpoints record the wrap
    delay = float(train.inject_delay)
    if resume is None:
        torch.manual_seed(cfg.seed)  # training draws the same numbers whether or not a probe ran
    clock = [time.perf_counter()]
    ranks = dist_sync.world_size()

    logged: list[int | None] = [None]  # the last step whose line this run wrote
    # under torchrun a signal asks every rank to stop after the same step (autobatch.cli.interrupt)
    interrupts = Interrupts(defer=weakly(runner.request_stop) if dist_sync.is_distributed() else None)
    # a signal waits for a checkpoint being written; weakly, as the runner holds it (training.weak_calls)
    runner.save = interrupts.holding(weakly(runner.save))
    rates = StepLearningRates(optimizer)
    with rates, _metrics_file(out_dir / METRICS, resumed_step if resume is not None else None) as metrics, interrupts:

        def on_step_end(info: dict[str, Any]) -> None:
            with interrupts.atomic():  # a signal waits for the line to be whole
                _record(info)
            if delay:  # testing: time to kill the run mid-way; not counted in the next step
                time.sleep(delay)
                clock[0] = time.perf_counter()

        def _record(info: dict[str, Any]) -> None:
            now = time.perf_counter()
            seconds, clock[0] = now - clock[0], now
            samples = info["samples"]
            record = {
                "step": info["step"],
                "epoch": info["epoch"],
                "loss": info["loss"],
                "lr": rates.taken(),
                "micro_batch": info["micro_batch"],
                "accumulation": info["accumulation"],
                "ranks": ranks,
                "samples": samples,
                "seconds": round(seconds, 6),
                "samples_per_s": round(samples / seconds, 2) if seconds > 0 else None,
                "recoveries": len(runner.result.oom_recoveries),
            }
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            logged[0] = info["step"]

        steps = None if train.epochs is not None else int(train.steps)
        try:
            result = runner.fit(data, epochs=train.epochs, steps=steps, resume=resume, on_step_end=on_step_end)
        except (KeyboardInterrupt, Exception) as exc:  # the steps applied are saved (autobatch.cli.interrupt)
            if not interrupts.enabled or (interrupts.defer is not None and not gave_up_together(exc)):
                raise  # under torchrun, an OOM given up on every rank is saved (a collective) as in one process
            with interrupts.atomic():  # a second Ctrl-C waits for the save
                stopped(exc, runner, interrupts, out_dir=out_dir, logged=logged[0], metrics=metrics, resume=resume,
                        lr=rates.pending())
            raise  # not reached: stopped() exits or raises
        if result.stopped:  # a signal under torchrun: every rank ended after the same step, saved
            stopped_together(runner, interrupts, out_dir=out_dir)
    optimizer.zero_grad(set_to_none=True)
    save_final_model(model, out_dir)
    return result, runner


def save_final_model(model: torch.nn.Module, out_dir: Path) -> None:
    """The trained weights as ``out_dir / FINAL_MODEL`` (every rank calls it; rank 0 writes),
    atomically (:func:`~autobatch.training.checkpoints.checkpoint_io.save_checkpoint`: a temporary
    file, then ``os.replace``). Why: a plain ``torch.save`` truncated the file first, so a run
    continued in its directory and killed, or out of disk space, while writing left neither the
    earlier run's final weights nor its own, and a full disk said only "unexpected pos"."""
    if has_dtensors(model):  # FSDP2: gathered from every rank's shards (a collective), rank 0 writes
        from ..dist.fsdp import full_state_dict

        state = full_state_dict(model)
    else:  # every rank holds the same weights
        state = unwrapped(model).state_dict() if dist_sync.is_rank_zero() else None
    if dist_sync.is_rank_zero():
        save_checkpoint(state, out_dir / FINAL_MODEL)


def rank_fields(global_batch: int) -> dict[str, int]:
    """What a plan or summary adds under ``torchrun``: the number of ranks, the global batch
    over all of them and each rank's share (nothing with one process)."""
    world = dist_sync.world_size()
    if world == 1:
        return {}
    return {"ranks": world, "global_batch_all_ranks": global_batch, "per_rank_batch": global_batch // world}
