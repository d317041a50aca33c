"""What a resume checks and converts before it continues a run: one clear error, or a warning.

Kept apart from :mod:`autobatch.training.checkpoints.resume` (which saves and loads): a checkpoint of
another optimizer or scheduler class (or of other schedulers inside a ``SequentialLR``) is refused before anything is loaded (one
:class:`~autobatch.errors.CheckpointError` naming both classes, not a bare ``KeyError`` a step
later, nor a scheduler silently running on another one's attributes); a scheduler state that
does not load is the same error; the checkpoint's place in its epoch is converted to batches of
this run's global batch; settings the checkpoint replaces (the optimizer's, the scheduler's),
and a data loader whose workers' random state no checkpoint holds, are warned about.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from pathlib import Path
from typing import Any, Iterable

import torch

from ...errors import CheckpointError
from ...memory.units import counted
from ...probe.foreach import FOREACH_LOG_ADVICE
from ...probe.snapshot.shards import local
from ..precision import precision_of, warn_changed_precision  # re-exported: kept importable from here
from ..ranks import unwrap
from ..schedule_length import held_schedulers

__all__ = ["precision_of", "warn_changed_precision", "check_fits", "check_kinds", "kind", "inner_kinds", "load_scheduler", "position_for", "warn_persistent_workers", "warn_replaced_settings",
           "without_wrapper_prefix", "local_module_names",
           "saved_module", "bare_keys", "keys_as_in", "SETTINGS_LOG_ADVICE",
           "SCHEDULE_LOG_ADVICE", "warn_replaced_schedule"]

log = logging.getLogger("autobatch")

#: the advice of the warning that a checkpoint's optimizer settings replace the run's, for Python code;
#: the command line, which cannot set them after resuming, says it in its own words (autobatch.cli.log_advice)
SETTINGS_LOG_ADVICE = "set them after resuming to change them"
#: the same for the scheduler's settings (the attributes its state holds)
SCHEDULE_LOG_ADVICE = ("to change them, set them on runner.scheduler in on_step_end (the schedule goes on from its "
                       "current rate), or start afresh")


def kind(value: Any) -> str | None:
    """The class name a checkpoint stores for an optimizer or scheduler (None: none)."""
    return None if value is None else type(value).__qualname__


def _held(scheduler: Any, where: str) -> list[tuple[str, Any]]:
    """``(place, scheduler)`` of each scheduler a ``SequentialLR`` or ``ChainedScheduler`` holds (its
    ``_schedulers``, whose states its ``load_state_dict`` loads one by one), ``where``: the path to
    it ('' at the top), the place ``{where}_schedulers[1]``; [] for any other scheduler. The one walk
    of :func:`inner_kinds` and :func:`_replaced_settings` (:func:`~..schedule_length.held_schedulers`'s, placed)."""
    return [(f"{where}_schedulers[{index}]", child) for index, child in enumerate(held_schedulers(scheduler))]


def inner_kinds(scheduler: Any, where: str = "") -> dict[str, list[str]]:
    """The classes of the schedulers a ``SequentialLR`` or ``ChainedScheduler`` holds, nested ones
    too, by the place of the scheduler holding them ('' at the top, ``_schedulers[1].`` inside):
    what a checkpoint stores beside ``scheduler_type`` (its state names no class), so
    :func:`check_kinds` refuses another one inside (a ``StepLR`` state loaded into a ``OneCycleLR``
    raised ``KeyError: 'max_lr'`` at its first step after the milestone)."""
    held = _held(scheduler, where)
    kinds = {where: [kind(child) for _, child in held]} if held else {}
    for place, child in held:
        kinds |= inner_kinds(child, f"{place}.")
    return kinds


def check_kinds(path: Path, state: dict[str, Any], optimizer: Any, scheduler: Any) -> None:
    """Refuse a checkpoint written with another optimizer or scheduler class (checkpoints of
    earlier versions name neither, or no scheduler), or another class or number of schedulers
    inside a ``SequentialLR`` or ``ChainedScheduler`` (:func:`inner_kinds`; where it stores them);
    warn where one run has a scheduler and the other none (the schedule then stops, or starts
    afresh, at the resumed step)."""
    for what, saved, mine in (("optimizer", state.get("optimizer_type"), kind(optimizer)),
                              ("scheduler", state.get("scheduler_type"), kind(scheduler))):
        if saved is not None and mine is not None and saved != mine:
            raise CheckpointError(
                path, f"it was written with {what} {saved} and this run's is {mine}; resume with {saved}, or start afresh",
            )
    mine_inner = inner_kinds(scheduler)
    # the holders come first (as inner_kinds stored them): a place below one that differs is never reached
    for where, saved in ((state.get("scheduler_kinds") or {}) if scheduler is not None else {}).items():
        mine = mine_inner.get(where, [])
        if len(saved) != len(mine):
            holder = functools.reduce(lambda outer, index: outer._schedulers[int(index)],
                                      re.findall(r"\[(\d+)\]", where), scheduler)
            raise CheckpointError(
                path, f"its {kind(holder)}{f' at {where[:-1]}' if where else ''} holds {len(saved)} schedulers "
                f"({', '.join(saved)}) and this run's {len(mine)} ({', '.join(mine)}); resume with the same schedulers, or start afresh",
            )
        for index, (theirs, ours) in enumerate(zip(saved, mine)):
            if theirs != ours:
                raise CheckpointError(
                    path, f"it was written with scheduler {theirs} at {where}_schedulers[{index}] (inside "
                    f"{kind(scheduler)}) and this run's is {ours}; resume with {theirs} there, or start afresh",
                )
    if "scheduler_type" not in state:
        return
    saved = state["scheduler_type"]
    if saved is None and scheduler is not None:
        log.warning("resume: the checkpoint's run had no scheduler and this run has %s: its schedule starts afresh "
                    "at the resumed step", kind(scheduler))
    elif saved is not None and scheduler is None:
        log.warning("resume: the checkpoint's run had scheduler %s and this run has none: the learning rate stays "
                    "as the checkpoint left it", saved)


def check_fits(model: torch.nn.Module, saved_model: dict[str, Any], optimizer: torch.optim.Optimizer,
               saved_optimizer: dict[str, Any], *, sharded: bool = False) -> None:
    """A ``ValueError`` naming the first mismatches where the checkpoint's model state (its keys,
    its tensors' shapes) or its optimizer's parameter groups (their number, their sizes) do not
    fit this run's, checked before anything is loaded: ``load_state_dict`` copies every entry
    that fits before it raises on the rest, so a refused resume left the model part the
    checkpoint's, and a run started afresh after the error trained that mix. ``sharded``: a
    per-rank FSDP2 file, whose tensors are this rank's local shards (compared with ``local``)."""
    mine = {key: local(value) if isinstance(value, torch.Tensor) else value for key, value in model.state_dict().items()}
    missing, unexpected = sorted(set(mine) - set(saved_model)), sorted(set(saved_model) - set(mine))
    lacks, extra, holder = (("this model has parameter(s) the checkpoint lacks: ", "the checkpoint has parameter(s) this "
                             "model lacks: ", "this rank's shard") if sharded else ("missing key(s) ", "unexpected key(s) ", "this model"))
    problems = [f"{lacks}{', '.join(missing[:4])}" if missing else "", f"{extra}{', '.join(unexpected[:4])}" if unexpected else ""]
    shapes = [f"{key} {tuple(saved_model[key].shape)} ({holder}: {tuple(value.shape)})" for key, value in mine.items()
              if isinstance(value, torch.Tensor) and isinstance(saved_model.get(key), torch.Tensor)
              and saved_model[key].shape != value.shape]
    problems.append(f"size mismatch for {', '.join(shapes[:4])}" if shapes else "")
    groups = [len(group["params"]) for group in optimizer.param_groups]
    saved_groups = [len(group.get("params", ())) for group in saved_optimizer.get("param_groups", [])]
    if saved_groups != groups:
        problems.append(f"optimizer parameter groups of {saved_groups} parameters (this optimizer: {groups})")
    problems = [problem for problem in problems if problem]
    if problems:
        raise ValueError("; ".join(problems))


def load_scheduler(path: Path, scheduler: Any, saved: dict[str, Any] | None) -> None:
    """``scheduler.load_state_dict(saved)``; a state it cannot take is a :class:`CheckpointError`, and
    settings of this run's that it replaced are warned about (:func:`warn_replaced_schedule`)."""
    if scheduler is None or saved is None:
        return
    mine = scheduler.state_dict()  # before the load replaces its settings: compared once it loaded
    try:
        scheduler.load_state_dict(saved)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise CheckpointError(
            path, f"its scheduler state does not fit this run's {kind(scheduler)} ({detail}); resume with the scheduler "
            "it was written with, or start afresh",
        ) from None
    warn_replaced_schedule(scheduler, saved, mine)


#: what a scheduler's state holds that moves as it steps, never compared with the resumed run's
_SCHEDULE_COUNTERS = frozenset({"last_epoch", "_step_count", "_last_lr", "base_lrs", "_get_lr_called_within_step",
                                "_is_initial", "T_cur", "T_i", "best", "num_bad_epochs", "cooldown_counter"})


def warn_replaced_schedule(scheduler: Any, saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """Warn, once, where the checkpoint's scheduler settings replace this run's: torch's
    ``load_state_dict`` sets every attribute its state holds, so a ``CosineAnnealingLR(T_max=...)``
    or ``StepLR(step_size=...)`` given another value for the resumed run ran the checkpoint's
    without a word. What is loaded is unchanged. Compared (``mine``: the scheduler's state as this
    run built it, before the load): :func:`_replaced_settings`, inside a ``SequentialLR`` or
    ``ChainedScheduler`` too (their ``load_state_dict`` loads each of their schedulers', and a
    ``SequentialLR`` its ``milestones``), each named with the scheduler that holds it. A scheduler
    whose ``load_state_dict`` is not torch's (the command line's schedules, which name what they
    replace themselves) is left to it."""
    changed = _replaced_settings(scheduler, saved, mine, "")
    if changed:
        log.warning("resume: the checkpoint's scheduler settings replace this run's (%s.load_state_dict sets them), "
                    "and the run goes on with the checkpoint's: %s; %s", kind(scheduler), ", ".join(changed),
                    SCHEDULE_LOG_ADVICE)


def _replaced_settings(scheduler: Any, saved: Any, mine: Any, where: str) -> list[str]:
    """The settings of ``scheduler`` (and of the schedulers it holds, ``where``: the path to it,
    '' at the top) that ``saved`` replaces: plain values (a number, a string, a bool, None) of both
    states, named as a parameter of the scheduler's constructor (of its class or a base class),
    which a counter that moves as it steps (:data:`_SCHEDULE_COUNTERS`, a subclass's own) is not;
    a ``SequentialLR``'s ``milestones``; each scheduler of a ``SequentialLR`` or ``ChainedScheduler``
    (``_schedulers`` of both states, as many) compared as one of its own."""
    if not (isinstance(saved, dict) and isinstance(mine, dict)
            and getattr(type(scheduler).load_state_dict, "__module__", "").startswith("torch.")):
        return []
    settings: set[str] = set()
    for cls in type(scheduler).__mro__:
        try:
            settings |= set(inspect.signature(cls.__dict__["__init__"]).parameters)
        except (KeyError, TypeError, ValueError):  # no __init__ of its own, or a built-in one
            continue
    plain = (int, float, str, bool, type(None))
    changed = [f"{where}{key} {saved[key]!r} (this run: {value!r})" for key, value in mine.items()
               if key in settings and key not in _SCHEDULE_COUNTERS and key in saved
               and isinstance(value, plain) and isinstance(saved[key], plain) and value != saved[key]]
    if isinstance(scheduler, torch.optim.lr_scheduler.SequentialLR) and "_milestones" in saved \
            and list(saved["_milestones"]) != list(mine.get("_milestones", [])):
        changed.append(f"{where}milestones {list(saved['_milestones'])} (this run: {list(mine.get('_milestones', []))})")
    held, theirs, ours = _held(scheduler, where), saved.get("_schedulers"), mine.get("_schedulers")
    if held and all(isinstance(x, (list, tuple)) for x in (theirs, ours)) and len(held) == len(theirs) == len(ours):
        for (place, child), saved_child, mine_child in zip(held, theirs, ours):
            changed += _replaced_settings(child, saved_child, mine_child, f"{place} ({kind(child)}) ")
    return changed


def position_for(path: Path, state: dict[str, Any], global_batch: int) -> int:
    """The checkpoint's position in its epoch (batches trained) in batches of this run's
    ``global_batch``: the same samples (``epoch_samples``, a short batch counted as it is),
    counted again, so a resumed run neither repeats nor skips one. A position that is no whole
    number of the new batches is one clear error. (A checkpoint at an epoch's last step is one
    of the next epoch's start: position 0, whatever the batches.)"""
    position, saved = state["position"], state.get("global_batch")
    if saved is None or saved == global_batch or position == 0:
        return position
    samples = state.get("epoch_samples", position * saved)  # checkpoints of earlier versions: whole batches
    if samples % global_batch:
        raise CheckpointError(
            path, f"it stopped {counted(position, 'batch', 'batches')} of {saved} into its epoch ({counted(samples, 'sample')}), which is no whole "
            f"number of batches of global_batch={global_batch}; resume with global_batch={saved} (or a divisor of "
            f"{samples}), or from a checkpoint at an epoch's end",
        )
    log.warning("resume: the checkpoint trained batches of %d and this run's are of %d: %d samples into the epoch, "
                "batch %d of this run's", saved, global_batch, samples, samples // global_batch)
    return samples // global_batch


def warn_persistent_workers(data: Iterable[Any], position: int = 0, epoch: int | None = None) -> None:
    """Warn that a ``DataLoader(persistent_workers=True)`` resumes with other random numbers in
    its workers: they are started once and keep their generators across epochs, and no checkpoint
    holds those, so a resumed (or continued) run's new workers draw other augmentations than the
    uninterrupted run's kept ones did. A map-style dataset's order is drawn by its sampler, in this
    process, and is the same; an ``IterableDataset``'s is drawn in the workers (a shuffle in its
    ``__iter__``): resumed at ``position`` > 0 batches into an epoch, the rest of the epoch came in
    another order, and trained some of the epoch's samples twice and others not at all (17 of 48).

    Not in the first epoch (``epoch`` 0) of a loader that has started no workers yet (a resumed
    process's): the replay starts them as the uninterrupted run did, from the same base seed, and
    they draw the same numbers to the run's end (the warning said otherwise of an exact resume).
    A second ``fit()`` on the same loader there resets the workers the first one started, whose
    generators went on: warned."""
    if not (getattr(data, "persistent_workers", False) and (getattr(data, "num_workers", 0) or 0) > 0):
        return
    if epoch == 0 and getattr(data, "_iterator", None) is None:
        return
    if isinstance(getattr(data, "dataset", None), torch.utils.data.IterableDataset):
        effect = ("its IterableDataset yields its samples from the workers, so an order it draws there (a shuffle in "
                  "__iter__) is another one" + (": the rest of this epoch may train some of its samples twice and "
                                                "others not at all" if position else ""))
    else:
        effect = "random augmentation in them draws other numbers than the uninterrupted run (the batches' order is the same)"
    log.warning(
        "resume: the DataLoader keeps its workers across epochs (persistent_workers=True), and their random state is in "
        "no checkpoint: %s. For an exact resume use persistent_workers=False, or seed each sample's augmentation from "
        "its index and the epoch (and an IterableDataset's shuffle from the epoch), the epoch kept in shared memory and "
        "changed in place by set_epoch (a plain self.epoch never reaches persistent workers)", effect,
    )


def warn_replaced_settings(optimizer: torch.optim.Optimizer, saved: dict[str, Any], extra: Iterable[Any] = (),
                           result: dict[str, Any] | None = None) -> None:
    """Warn where the checkpoint's optimizer settings replace this run's (a learning rate set
    anew for the resumed run is overwritten by ``load_state_dict``, as PyTorch resumes). The
    learning rate is compared at its schedule's start (``initial_lr``) where a scheduler set one,
    not at all where one of the ``extra`` state objects schedules ``optimizer`` (a
    ``ReduceLROnPlateau`` stepped in ``on_step_end``, as the runner advises: it sets no
    ``initial_lr``, and its lowered rate was warned about as a setting replaced), and the momentum
    not at all where one cycles it (``OneCycleLR``, ``CyclicLR``: ``base_momentum``).

    ``foreach=False`` that the run writing the checkpoint switched to itself (its saved ``result``
    records the recovery, :mod:`~autobatch.training.oom.optimizer_phase`, or its plan ``foreach_dropped``) is kept, the optimizer's
    default too (a group added later steps per tensor, as in the run without the stop), and warned
    with its cause: "set them after resuming" sent the user back to the step that did not fit."""
    def plain(value: Any) -> Any:
        return list(value) if isinstance(value, tuple) else value

    changed = set()
    switched = next((r.get("step") for r in (result or {}).get("oom_recoveries", []) if r.get("action") == "foreach"), None)
    if switched is None and ((result or {}).get("plan") or {}).get("foreach_dropped"):  # when it planned its micro-batch
        switched = 0
    scheduled = any(getattr(value, "optimizer", None) is optimizer for value in extra)
    for group, old in zip(optimizer.param_groups, saved.get("param_groups", [])):
        skip = {"params", "lr"} if scheduled or "initial_lr" in group else {"params"}  # a schedule moves lr itself
        if "base_momentum" in group:  # and a cycling one momentum (SGD's) or beta1 (Adam's)
            skip |= {"momentum", "betas"}
        for key, value in group.items():
            if key in skip or key not in old or not isinstance(value, (int, float, str, bool, tuple, type(None))):
                continue
            if plain(old[key]) != plain(value) and not (key == "foreach" and switched is not None):
                changed.add(f"{key} {old[key]!r} (this run: {value!r})")
    if switched is not None and "foreach" in optimizer.defaults and optimizer.defaults["foreach"] is not False:
        optimizer.defaults["foreach"] = False
        log.warning("resume: the optimizer steps with foreach=False, as the run that wrote the checkpoint did from "
                    "global step %s on, where optimizer.step() ran out of memory with torch's foreach step (this "
                    "run built it with foreach=%s); %s", switched,
                    next((g.get("foreach") for g in optimizer.param_groups), None), FOREACH_LOG_ADVICE)
    if changed:
        log.warning("resume: the checkpoint's optimizer settings replace this run's: %s; %s", ", ".join(sorted(changed)),
                    SETTINGS_LOG_ADVICE)


#: the names under which a wrapper holds the model in its state dict: DDP's ``module``, torch.compile's ``_orig_mod``
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def without_wrapper_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """Keys of a checkpoint written from a wrapper by an older version, without the wrapper's
    names: a DDP wrapper's ``module.``, a ``torch.compile``d model's ``_orig_mod.`` (both, nested)."""
    while state and (prefix := next((p for p in WRAPPER_PREFIXES if all(key.startswith(p) for key in state)), None)):
        state = {key[len(prefix):]: value for key, value in state.items()}
    return state


def _bare(name: str) -> str:
    """``name`` without ``torch.compile``'s ``_orig_mod`` anywhere in it (``enc._orig_mod.0.weight``: ``enc.0.weight``)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def bare_keys(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a model's state dict) keyed as the uncompiled model has it: a submodule compiled on its own
    (``self.enc = torch.compile(enc)``, a compiled backbone) puts ``_orig_mod.`` inside its keys, which
    :func:`saved_module` does not reach, and its checkpoint was refused by the same model uncompiled."""
    return {_bare(key): value for key, value in state.items()}


def keys_as_in(here: Iterable[str], saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` (a checkpoint's model state, or module names as dict keys) keyed as ``here`` names them, where the
    two differ by ``torch.compile``'s ``_orig_mod.`` inside the names: a checkpoint of a model with a compiled
    submodule (or one written before :func:`bare_keys`) resumes into the model uncompiled, and the other way round.
    Keys ``here`` already has, or that match none of its names, are kept (the load then names them)."""
    here = set(here)
    bare = {_bare(name): name for name in here}
    return {(key if key in here else bare.get(_bare(key), key)): value for key, value in saved.items()}


def saved_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose state a checkpoint holds: ``model`` inside its data-parallel wrapper
    (:func:`~autobatch.training.ranks.unwrap`) and inside ``torch.compile``'s ``OptimizedModule``
    (its ``_orig_mod``), so the checkpoint's keys name the bare model's parameters. Before, a
    compiled run wrote ``_orig_mod.``-prefixed keys, and its resume without ``torch.compile``
    (or a bare run's resume with it) was refused as "written for another model"."""
    while True:
        inner = unwrap(model)
        compiled = inner._modules.get("_orig_mod") if type(inner).__name__ == "OptimizedModule" else None
        if not isinstance(compiled, torch.nn.Module):
            return inner
        model = compiled


def local_module_names(names: list[str], local: torch.nn.Module) -> list[str]:
    """Module names as ``local`` (the model inside any DDP or ``torch.compile`` wrapper) has them. The checkpointing
    fallback names modules from the model it was given, the wrapper under torchrun
    (``module.blocks.0``), so a checkpoint keeps them relative to the local model and one
    written before (with the wrapper's ``module.``) still resumes, with or without the wrapper; so do the names
    inside a compiled submodule (``enc._orig_mod.0``: ``enc.0``), with or without its ``torch.compile``."""
    known = dict(local.named_modules())
    if all(name in known for name in names):
        return list(names)
    return list(keys_as_in(known, without_wrapper_prefix(dict.fromkeys(names))))

