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
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.parsing import lightning_getattr

from ..probe.find import find_max_batch
from ..probe.result import ProbeResult
from ..probe.snapshot.unrestored import caller_restores
from ..training.checkpoints.checkpoint_io import rng_state, set_rng_state
from .lightning_state import SavedState, parked_checkpoint, probing
from .lightning_step import LightningStep, first_batch

__all__ = ["kept_fits", "probe_trials"]


@contextmanager
def probe_trials(trainer: Trainer, module: LightningModule, first: Any, options: Mapping[str, Any], *,
                 accumulating: bool, prefetch: bool, loaders: int, own: Any,
                 name: str) -> Iterator[tuple[ProbeResult, SavedState]]:
    """The probe's result on the module's step built from the ``first`` batch, and the saved state
    (reset already; ``state.reset`` puts all back again after a confirmation's loop runs). Everything
    is put back on the way out, on error too."""
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
              accumulating: bool, name: str) -> int:
    """The largest batch up to ``size`` (a checkpoint's, at most the probe ``options``' ``max_batch``,
    a multiple of ``multiple_of``) that trains on this machine: ``size`` where one trial there passes
    (the resume then trains as before), else the search's answer below it (module docstring).
    ``margin`` is not taken off a checkpoint's size that passes (it had it), but is taken off the
    size the search steps down to, as ``find_max_batch`` takes it off its boundary (before, that
    size filled this machine's memory: none of the room asked for); with no further trial, for it
    is smaller than one that passed. A ``NoBatchFitsError`` (not even the smallest batch fits) goes
    to the caller."""
    multiple = options["multiple_of"]
    top = min(size, options["max_batch"] or size) // multiple * multiple
    if top < multiple:
        return size  # no size of multiple_of below it: resumed_split says what to change
    own, saved = lightning_getattr(module, name), rng_state()  # a DataLoader's iterator draws its seed: fit must draw the same
    first, sized, _, loaders, _, _ = first_batch(trainer, module, world)
    set_rng_state(saved)
    checked = {**options, "start": top, "max_batch": top, "margin": 0.0}
    with probe_trials(trainer, module, first, checked, accumulating=accumulating, prefetch=not sized,
                      loaders=loaders, own=own, name=name) as (result, _):
        del first
    set_rng_state(saved)
    if result.batch_size >= top or not options["margin"]:
        return result.batch_size
    return max(multiple, math.floor(result.batch_size * (1.0 - options["margin"])) // multiple * multiple)
