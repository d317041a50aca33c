"""What one probe trial measured (:class:`TrialRecord`), and who watches trials as they run."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

__all__ = ["TrialRecord", "watch_trials", "notify"]

log = logging.getLogger("autobatch")

#: ``callback(batch_size, purpose, record)`` of every :func:`watch_trials` context: record is
#: None when a trial starts, the :class:`TrialRecord` when it ended.
_watchers: list[Callable[[int, str, "TrialRecord | None"], None]] = []


@contextmanager
def watch_trials(callback: Callable[[int, str, "TrialRecord | None"], None]) -> Iterator[None]:
    """Call ``callback(batch_size, purpose, None)`` as each trial starts and
    ``callback(batch_size, purpose, record)`` as it ends, while the context is open (how the
    CLI shows progress without threading a callback through every strategy)."""
    _watchers.append(callback)
    try:
        yield
    finally:
        _watchers.remove(callback)


def notify(batch_size: int, purpose: str, record: "TrialRecord | None") -> None:
    """Tell every :func:`watch_trials` callback; a callback that fails is logged, never raised."""
    for callback in list(_watchers):
        try:
            callback(batch_size, purpose, record)
        except Exception as exc:  # noqa: BLE001 - a display must never break a probe
            log.debug("trial watcher failed: %s: %s", type(exc).__name__, exc)


@dataclass
class TrialRecord:
    """The outcome of one trial.

    ``peak_bytes`` is the device's allocated-memory peak during the trial (for a failed
    trial, the peak reached before the failure); ``reserved_bytes`` the allocator's reserved
    peak (what a per-process cap limits; equal to ``peak_bytes`` on the simulated device);
    ``purpose`` says why the strategy ran it (``search``, ``fit``, ``estimate``, ``verify``,
    ``bisect``, ``margin``, ``confirm``, ``wall``: a size tried below the allocator's wall, run
    full; ``edge``: the line's boundary tried before the size above it, run full, where the
    line may settle that size); ``steps`` how many times it called the step (a
    trial that ran out of memory stopped during one of them). A passing trial also records
    its last step alone: ``step_peak_bytes``, that step's allocated peak, and
    ``resident_bytes``, what was allocated as it began (weights, optimizer state). By the
    last step, state the first step created lazily (Adam's moments) already exists, so these
    are the figures of a training step in steady state.

    What the caching allocator did (on an accelerator; 0 on the simulated device):
    ``fragmentation_bytes`` is the last step's reserved peak less its allocated peak (memory the
    allocator held but no tensor used at the worst moment), ``inactive_split_bytes`` the bytes
    of split blocks the allocator could not hand out whole at the end of the trial. A
    ``settle`` trial (the answer's confirmation) may run more than its ``steps`` while these
    still grow. ``autotuned``: cuDNN autotuning was on (None: the user had it off, or not CUDA).
    ``over_bytes``: for a trial that ran its steps but came too close to the capacity (above the
    allocator's headroom, or at its wall: :meth:`TrialRunner._wall_excess`), how many bytes its steady step would
    have to save (what a smaller size has to save); for one that ran out of memory, what was
    allocated when it failed plus the allocation that failed, less the peak limit (a lower
    bound), else the step's reserved peak plus that allocation, less the capacity (the
    allocator's wall; an estimate); None when the message names no allocation or both leave room.
    ``wall_bytes``: for a trial that ran out of memory although what was allocated plus the
    allocation that failed stayed under the peak limit, the failing step's reserved peak less its
    allocated peak: free pieces the allocator held but could not hand out. A size fits only
    where its allocated peak leaves about that much of the capacity free (the predictive
    search aims there).
    ``flushes``: how many of the trial's steps after its first made the caching allocator
    return its cache to the driver to serve a request (``num_alloc_retries`` rose; None where
    the device does not count it). Under cuDNN autotuning a settle trial fails while its last
    step still does (:mod:`~autobatch.probe.settling`). ``flushed_out``: a settle trial that
    failed for that (on some rank, under rank agreement).
    """

    batch_size: int
    passed: bool
    peak_bytes: int | None
    seconds: float
    purpose: str = "search"
    error: str | None = None
    reserved_bytes: int | None = None
    steps: int | None = None
    step_peak_bytes: int | None = None
    resident_bytes: int | None = None
    fragmentation_bytes: int | None = None
    inactive_split_bytes: int | None = None
    autotuned: bool | None = None
    over_bytes: int | None = None
    wall_bytes: int | None = None
    flushes: int | None = None
    flushed_out: bool = False

    def to_dict(self) -> dict:
        return asdict(self)
