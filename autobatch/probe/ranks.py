"""How a probe agrees with the other ranks of a job: the seam :mod:`autobatch.dist` fills in.

The probe runs the same way in one process and under ``torch.distributed``; only a handful
of values must be agreed between ranks (each trial's outcome, the capacity, the estimated
prior, a cache hit, the final batch). This module holds the single-process behaviour (agree
with nobody) and the hook through which :mod:`autobatch.dist` installs the collective one,
so the probe never imports the distributed layer that sits after it in the pipeline.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["ProbeAgreement", "install", "current"]


class ProbeAgreement:
    """A single process: every value is already agreed. Subclassed by :mod:`autobatch.dist`."""

    def active(self) -> bool:
        """Whether other ranks take part (the probe then agrees every trial with them)."""
        return False

    def local_step(self, fn: Any) -> Any:
        """The step to run in trials (a distributed job runs them without collectives)."""
        return fn

    def left(self, fn: Any, failure: BaseException) -> None:
        """``fn``'s probe raised ``failure`` on this rank (not an OOM trial: an error that ends
        the probe), which is about to propagate: tell the other ranks, where no vote of ``fn``'s
        own did, so they stop at once instead of waiting for this rank at their next sync point."""

    def arguments(self, arguments: dict[str, Any]) -> None:
        """Check that every rank called the probe with the same search-shaping ``arguments``
        (one error naming those that differ): every rank must try the same sizes in order."""

    def trial_hook(self) -> Callable[[Any], Any] | None:
        """What the trial runner calls on each trial record to agree it; None: nothing."""
        return None

    def capacity(self, capacity: int | None) -> int | None:
        return capacity

    def prior(self, prior: Any) -> Any:
        return prior

    def cache_hit(self, hit: Any) -> Any:
        return hit

    def batch(self, result: Any) -> Any:
        return result

    def any_rank(self, value: bool, label: str) -> bool:
        """Whether ``value`` holds on any rank (``label`` names the decision at that sync point):
        a choice each rank measures for itself that decides which trials every rank runs."""
        return value

    def settle_more(self, fn: Any, more: bool) -> bool:
        """Whether a settling trial runs another step of ``fn`` (``more``: this rank's
        reserved memory still grows). Ranks whose steps run collectives in lockstep
        (``fn.lockstep``) must all run the same number of steps: they decide together."""
        return more


_SINGLE = ProbeAgreement()
_installed: ProbeAgreement = _SINGLE


def install(agreement: ProbeAgreement) -> None:
    """Make ``agreement`` the one the probe uses whenever it reports itself active."""
    global _installed
    _installed = agreement


def current() -> ProbeAgreement:
    """The installed agreement while it is active (a multi-rank job), else the single process."""
    return _installed if _installed.active() else _SINGLE
