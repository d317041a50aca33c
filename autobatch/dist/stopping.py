"""A stop every rank agrees on: a request on any rank rides on the next sync point.

A signal (Ctrl-C, the SIGTERM a scheduler sends before it pre-empts a job) reaches the ranks
of a ``torch.distributed`` job at different moments, or only some of them. A rank that stopped
where it was would leave its peers inside a collective, and a checkpoint written then would mix
steps, so a distributed run used to stop with nothing saved since its last periodic checkpoint.

Instead a rank *requests* a stop (:func:`request`: a flag, safe to set from a signal handler
or another thread), and every sync point carries the flag: the header of each
:func:`~autobatch.dist.agreement.exchange` and of each FSDP store vote
(:func:`~autobatch.dist.store_exchange.exchange_via_store`) holds this rank's request, and
every rank notes whether any row held one (:func:`note`). The ranks go through the same sync
points in the same order, so after each of them they all hold the same :func:`agreed`; the
runner checks it after each step and ends after the same step on every rank, saves its
checkpoint (a collective every rank then joins) and returns
(:meth:`autobatch.Runner.request_stop`). It costs no collective of its own: a data-parallel
step already has its sync points (the votes that end its phases).

The state is the process's, as the sync points are. Without a process group of more than one
rank, :func:`agreed` is this rank's own request.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["request", "requested", "note", "agreed", "clear"]

_state = {"requested": False, "agreed": False}


def request() -> None:
    """Ask every rank to stop after the step in progress (carried by the next sync point)."""
    _state["requested"] = True


def requested() -> int:
    """This rank's request, as the integer a sync point's header carries (1: asked)."""
    return int(_state["requested"])


def note(flags: Iterable[int]) -> None:
    """Record the ranks' requests that one sync point carried (every rank sees the same ones)."""
    if any(flags):
        _state["agreed"] = True


def agreed() -> bool:
    """Whether some rank asked for a stop that a sync point has carried to every rank (without
    peers: whether this process asked)."""
    from .agreement import is_distributed

    return _state["agreed"] if is_distributed() else _state["requested"]


def clear() -> None:
    """Forget the request and the agreement (every rank, after the run it stopped)."""
    _state["requested"] = _state["agreed"] = False
