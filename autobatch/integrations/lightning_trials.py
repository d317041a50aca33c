"""Running :class:`~autobatch.integrations.lightning.AutoBatchSize`'s trials, and checking a resumed size.

:func:`probe_trials` runs :func:`~autobatch.find_max_batch` on the module's real training step
(:class:`~.lightning_step.LightningStep`) with everything put back after it: the module, its
optimizers, the scaler, the schedulers and the random states (:class:`~.lightning_state.SavedState`),
the loaded checkpoint parked in host memory meanwhile (:func:`~.lightning_state.parked_checkpoint`),
no user callback called (:func:`~.lightning_state.probing`). Split from :mod:`.lightning` so that
the fit-start probe and :func:`kept_fits` run the trials the same way.

:func:`kept_fits`: a fit resumed with ``fit(ckpt_path=...)`` keeps its checkpoint's batch size
(:mod:`.lightning_resume`). Why it is checked: on a machine (or under a memory cap) with less
memory than the run that wrote the checkpoint, the first step ran out of memory with torch's bare
error. Measured on the CPU's simulated device (``Tiny`` of tests/integrations, 512 found under
8 MiB, resumed under 2 MiB): ``OutOfMemoryError`` at the first step before; now one trial at 512
fails, the search steps down from it, and the checkpoint's samples per optimizer step are split
into micro-batches that fit (:func:`~.lightning_resume.resumed_split`, one warning). Where it fits,
the resume is as before plus that one trial of ``steps_per_trial`` steps (``Tiny`` resumed at 256
under 2 MiB: 0.22-0.28 s for the trial, the resume 0.41-0.56 s against 0.20-0.31 s unchecked).
A trial that passes is logged as what it was (``confirmed the checkpoint's batch_size=512 in 1
trial``, :func:`_tell_checked`), not as the search ``find_max_batch`` names in its closing line.

The trial keeps ``margin`` (:func:`with_room`), and with ``confirm`` the size then runs in Lightning's
own fit loop (:func:`~.lightning_loop.confirm_in_loop`), as a fresh fit's answer does. Why: the
probe's step is not the loop, which also validates, runs the module's hooks and keeps what they
keep: a module whose validation batch needs four times a training sample's memory passed its trial
at 64 under 2 MiB and ran out of memory at its first validation (review 35), where a fresh fit
under the same memory stepped down in its confirmation and trained.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr

from ..memory.oom import free_memory
from ..probe.find import find_max_batch
from ..probe.result import ProbeResult
from ..probe.snapshot.unrestored import caller_restores
from ..training.checkpoints.checkpoint_io import rng_state, set_rng_state
from .lightning_loop import LoopConfirmation, confirm_under_cap
from .lightning_state import SavedState, parked_checkpoint, probing
from .lightning_step import LightningStep, first_batch

__all__ = ["kept_fits", "probe_trials", "with_room"]

log = logging.getLogger("autobatch")

#: how find_max_batch's closing INFO line begins (held back by :func:`_found_line`)
_FOUND = "probe found batch "


@contextmanager
def probe_trials(trainer: Trainer, module: LightningModule, first: Any, options: Mapping[str, Any], *,
                 accumulating: bool, prefetch: bool, loaders: int, own: Any,
                 name: str) -> Iterator[tuple[ProbeResult, SavedState]]:
    """The probe's result on the module's step built from the ``first`` batch, and the saved state
    (reset already; ``state.reset`` puts all back again after a confirmation's loop runs). Everything
    is put back on the way out, on error too. A full collection first: an earlier ``fit``'s Trainer is garbage in
    reference cycles that holds its module's weights, gradients and optimizer state until one runs (a sweep of
    new module, callback and Trainer a trial under 2 MiB: ``NoBatchFitsError`` at batch 1 in its second trial,
    where each trains 304; a second fit on a new Trainer: 223 where 367 trains). One collection a fit (0.1-0.3 s
    in a large heap, as after each OOM of :func:`~autobatch.memory.oom.free_memory`'s callers)."""
    free_memory()
    with parked_checkpoint(trainer), SavedState.kept(trainer, module) as state:
        step = LightningStep(trainer, module, first, accumulating=accumulating, prefetch=prefetch,
                             restore=lambda: state.attributes.restore(drop_new=False), loaders=loaders, own=own,
                             name=name)  # set to each trial's size: a training_step may read it
        with probing(trainer, module), caller_restores():  # state.reset puts all back: no "trained for real" note
            result = find_max_batch(step, device=module.device, **options)
        del step
        state.reset()
        yield result, state


def kept_fits(trainer: Trainer, module: LightningModule, size: int, options: Mapping[str, Any], *, world: int,
              accumulating: bool, name: str, memory_limit: int | None = None,
              confirm_steps: int = 0) -> tuple[int, LoopConfirmation | None]:
    """The largest batch up to ``size`` (a checkpoint's, at most the probe ``options``' ``max_batch``,
    a multiple of ``multiple_of``) that trains on this machine with ``margin`` kept, and the loop's
    confirmation of it (None without ``confirm_steps``): ``size`` where one trial at
    :func:`with_room` passes (the resume then trains as before), else the search's answer below it
    with ``margin`` taken off, as ``find_max_batch`` takes it off its boundary (module docstring).
    With ``confirm_steps``, that size is then run in Lightning's own fit loop
    (:func:`~.lightning_loop.confirm_in_loop`, as a fresh fit's answer), which steps down where the loop
    needs more (its validation batch, module hooks, what it keeps batch after batch). A
    ``NoBatchFitsError`` (not even the smallest batch fits) goes to the caller."""
    multiple, margin = options["multiple_of"], options["margin"]
    top = min(size, options["max_batch"] or size) // multiple * multiple
    if top < multiple:
        return size, None  # no size of multiple_of below it: resumed_split says what to change
    room = with_room(top, margin, multiple)
    own, saved = lightning_getattr(module, name), rng_state()  # a DataLoader's iterator draws its seed: fit must draw the same
    first, sized, _, loaders, _, _ = first_batch(trainer, module, world)
    set_rng_state(saved)
    checked, confirmation = {**options, "start": room, "max_batch": room, "margin": 0.0}, None
    with _found_line() as held, probe_trials(trainer, module, first, checked, accumulating=accumulating,
                                             prefetch=not sized, loaders=loaders, own=own, name=name) as (result, state):
        del first
        _tell_checked(held, result, room, top, size, name, margin)
        fits = min(top, max(multiple, math.floor(result.batch_size * (1.0 - margin)) // multiple * multiple))
        if confirm_steps:
            confirmation = _in_loop(trainer, module, result, fits, state.reset, memory_limit=memory_limit,
                                    steps=confirm_steps, margin=margin, name=name, multiple=multiple)
            fits = confirmation.batch_size
    set_rng_state(saved)
    return fits, confirmation


@contextmanager
def _found_line() -> Iterator[list[logging.LogRecord]]:
    """Hold back :func:`~autobatch.find_max_batch`'s closing INFO line (``probe found batch N with
    STRATEGY in K trials``) for :func:`_tell_checked` to pass on or replace."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if not held and isinstance(record.msg, str) and record.msg.startswith(_FOUND):  # the trial's only
            held.append(record)
            return False
        return True

    log.addFilter(hold)
    try:
        yield held
    finally:
        log.removeFilter(hold)


def _tell_checked(held: list[logging.LogRecord], result: ProbeResult, room: int, top: int, size: int,
                  name: str, margin: float) -> None:
    """The closing line of :func:`kept_fits`' trial: where it passed at ``room``, what happened
    (``confirmed the checkpoint's batch_size=512 in 1 trial``); where it failed, the search below it
    ran and its own line (``held``) is true, so it is passed on. Why: a resume logged ``probe found
    batch 512 with predict in 1 trials``, naming a search that never ran."""
    if result.cached or result.batch_size < room:  # a cache hit, or the search ran below room
        for record in held:
            log.callHandlers(record)  # past the filter still holding it
        return
    what = f"the checkpoint's {name}={size}" if top == size else f"{name}={top} (max_batch, below the checkpoint's {size})"
    trials = f"{result.num_trials} trial{'' if result.num_trials == 1 else 's'}"
    log.info("AutoBatchSize: confirmed %s in %s (%.2fs)%s", what, trials, result.elapsed_s,
             f", tried at {room} to keep margin={margin}" if room > top else "")


def with_room(top: int, margin: float, multiple: int) -> int:
    """The smallest boundary (a multiple of ``multiple``) from which a probe keeping ``margin``
    answers ``top``: the size :func:`kept_fits` tries. Why: the margin is room on the machine that
    trains; a checkpoint's size had it where it was found, but on a machine with less memory it
    passed one trial at the edge (``margin=0.25``: 64 kept under 2 MiB, where 74 is the boundary
    and 86 would keep the room). On the machine that found it, that boundary passed. Not capped at
    ``max_batch``: that caps the size trained (a lowered one splits the checkpoint's samples), and
    the trial above it only measures the room."""
    if top <= multiple:
        return top  # the smallest size: find_max_batch answers it from itself, margin or not
    room = math.ceil(top / (1.0 - margin) / multiple) * multiple
    while math.floor(room * (1.0 - margin)) // multiple * multiple < top:  # float rounding
        room += multiple
    return room


def _in_loop(trainer: Trainer, module: LightningModule, result: ProbeResult, size: int, reset: Callable[[], None], *,
             memory_limit: int | None, steps: int, margin: float, name: str, multiple: int) -> LoopConfirmation:
    """``size`` confirmed in Lightning's fit loop, stepping down from the trials' memory line."""
    def apply(largest: int) -> tuple[int, int]:
        micro = min(size, largest) // multiple * multiple
        if micro >= 1:
            lightning_setattr(module, name, micro)
        return micro, trainer.accumulate_grad_batches

    return confirm_under_cap(trainer, size, probed=size, result=result, device=module.device, memory_limit=memory_limit,
                             apply=apply, reset=reset, steps=steps, margin=margin)
