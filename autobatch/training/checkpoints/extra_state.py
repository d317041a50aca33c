"""What a user trains beside the model, written into the runner's checkpoints and put back on resume.

An EMA or SWA model updated in ``on_step_end`` (``torch.optim.swa_utils.AveragedModel``), a
metric tracker, a curriculum's state: none of it is in the model's, optimizer's or scheduler's
state, so a checkpoint without it resumed it at its initial value, and the resumed run's EMA
weights (the ones deployed) were not the uninterrupted run's (measured: 0.023 apart after a
resume at step 2 of 6, decay 0.9). ``Runner(extra_state={"ema": ema})`` names such objects:
each one's ``state_dict()`` is written into every checkpoint, in the same atomic file as the
step it belongs to (a file of its own, written from the hook, could be a step ahead of or behind
``last.pt`` after a crash), and ``load_state_dict()`` puts it back on resume.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from ...errors import CheckpointError

__all__ = ["check_extra_state", "check_not_data", "saved_extra_state", "load_extra_state"]

log = logging.getLogger("autobatch")


def check_extra_state(extra_state: Any) -> dict[str, Any]:
    """``Runner(extra_state=)``: None or a mapping of names (strings) to objects with
    ``state_dict()`` and ``load_state_dict()``; returns it as a dict (empty for None)."""
    if extra_state is None:
        return {}
    if not isinstance(extra_state, Mapping):
        raise TypeError(f"extra_state must be a dict of name -> object with state_dict() and load_state_dict() (an "
                        f"EMA model, a metric tracker), got {type(extra_state).__name__}; e.g. extra_state={{'ema': ema}}")
    for name, value in extra_state.items():
        if not isinstance(name, str):
            raise TypeError(f"extra_state's keys name what the checkpoint holds and must be strings, got {name!r}")
        missing = [f"{method}()" for method in ("state_dict", "load_state_dict") if not callable(getattr(value, method, None))]
        if missing:
            raise TypeError(f"extra_state[{name!r}] is a {type(value).__name__}, which has no {' or '.join(missing)}; "
                            "pass an object that has both (an nn.Module, an optimizer, a scheduler, "
                            "torch.optim.swa_utils.AveragedModel), or wrap it in one")
    return dict(extra_state)


def check_not_data(extra_state: Mapping[str, Any], data: Any) -> None:
    """Refuse, at ``fit()``, an ``extra_state`` entry that is what picks the data's next samples:
    ``data`` itself (torchdata's ``StatefulDataLoader``), its ``IterableDataset`` (a Hugging Face
    ``datasets`` streaming set, whose ``state_dict()`` holds its position), its sampler or batch
    sampler. A resume puts its position back, then the runner skips the batches already trained
    by iterating the data as it does for any data (:func:`~autobatch.training.epochs.replayed`): a
    stream resumed 2 batches in trained from its 5th, skipping batches 3 and 4 without a word."""
    holders = {"data": data, "data.dataset": getattr(data, "dataset", None), "data.sampler": getattr(data, "sampler", None),
               "data.batch_sampler": getattr(data, "batch_sampler", None)}
    for name, value in extra_state.items():
        held = next((where for where, holder in holders.items() if holder is not None and holder is value), None)
        if held is None or (held == "data.dataset" and not isinstance(value, torch.utils.data.IterableDataset)):
            continue  # a map-style dataset's state picks no order: its sampler's does
        raise ValueError(
            f"extra_state[{name!r}] is the data fit() trains on ({held}): a resume would put its saved position "
            "back, and the runner then skips the batches already trained by iterating the data from there, skipping "
            f"them twice (samples lost without a word). Remove {name!r} from extra_state: a resume replays the "
            "data's position itself, from the epoch's start (docs/runner.md, Checkpoints and resume)")


def saved_extra_state(extra_state: Mapping[str, Any]) -> dict[str, Any]:
    """Each object's ``state_dict()``, by name, as the checkpoint holds them."""
    return {name: value.state_dict() for name, value in extra_state.items()}


def load_extra_state(path: Path, extra_state: Mapping[str, Any], saved: Mapping[str, Any] | None) -> None:
    """Put each object's saved state back. One the checkpoint lacks (it was written without it, or
    by an earlier version) keeps its current state, and one the checkpoint holds that this run
    does not name is not restored: each warned about. A state an object cannot take is a
    :class:`~autobatch.errors.CheckpointError` naming it."""
    saved = saved or {}
    absent = sorted(set(extra_state) - set(saved))
    if absent:
        log.warning("resume: %s has no saved state for extra_state %s, which keep their current state", path, absent)
    unnamed = sorted(set(saved) - set(extra_state))
    if unnamed:
        log.warning("resume: %s holds extra_state %s, which this run does not name (Runner(extra_state=...)): not "
                    "restored", path, unnamed)
    for name, value in extra_state.items():
        if name not in saved:
            continue
        try:
            value.load_state_dict(saved[name])
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            raise CheckpointError(path, f"its extra_state[{name!r}] does not load into this run's "
                                        f"{type(value).__name__} ({detail}); pass the object it was written "
                                        "from, or start afresh") from None
