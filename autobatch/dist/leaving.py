"""A rank whose own error no vote sees tells its peers at their next sync point.

The data-parallel steps vote on every error (:mod:`.votes`, :mod:`.fsdp_guard`): a rank whose
step raised says so at the step's sync point, and its peers raise
:class:`~autobatch.errors.PeerFailedError` there. Some steps have no vote of their own: a probe
trial of a plain module or of a plain callable runs on each rank without any collective, and the
ranks agree only after the trial (:func:`~autobatch.dist.probe.agree_trial`). A rank whose trial
raised an error that is not an OOM used to re-raise it at once, and its peers waited at that
agreement for a rank that was not coming: the whole sync deadline (``AUTOBATCH_SYNC_TIMEOUT``,
300 s by default) and then a :class:`~autobatch.errors.RankDisagreementError` that did not say
what happened, or, once that rank's process had exited, "connection closed by peer".

:func:`leave` is that rank's last sync point: one :func:`~autobatch.distributed.exchange` of the
fixed header width whose label tag is :data:`LEFT` (no label hashes to it: tags are never
negative). It pairs with whatever exchange its peers reach next, whatever its label or payload
length, as FSDP's one "failed" vote pairs with whatever vote its peers reach next; they raise
:class:`~autobatch.errors.PeerFailedError` naming the rank and its error (:func:`describe`, from
the process group's store), and the failing rank re-raises its own error. Only for errors where
the peers' next sync point is an exchange (the probe's trials): a peer waiting in a store vote or
a collective would not pair with it, and the failing rank would wait a deadline for nothing.
"""

from __future__ import annotations

import logging

from ..errors import PeerFailedError, PeerOutOfMemoryError, RankDisagreementError
from ..memory.oom import is_oom_error
from . import agreement, stopping

__all__ = ["LEFT", "leave", "publish", "describe", "peers_left"]

log = logging.getLogger("autobatch")

#: the label tag of a rank's last sync point (:func:`leave`)
LEFT = -1


def _error_key(rank: int) -> str:
    return f"autobatch/error/{rank}"


def publish(failure: BaseException) -> None:
    """Put this rank's error (its type and first line) in the process group's store, where its
    peers' :func:`describe` reads it (best effort: it only improves their message)."""
    store = agreement._store()
    if store is None:
        return
    first = str(failure).strip().splitlines()[0][:300] if str(failure).strip() else ""
    key = _error_key(agreement.rank())
    try:
        store.set(key, f"{type(failure).__name__}: {first}" if first else type(failure).__name__)
        # a TCPStore client sends a set without waiting for the server; a query on the same
        # connection returns only once the server has applied it. Without it a peer released
        # by this rank's next sync point (a gloo collective, another connection) could read
        # the store first and name no error (seen on a loaded 2-core machine)
        store.check([key])
    except Exception:  # noqa: BLE001 - best effort
        pass


def describe(ranks: list[int]) -> str:
    """What each of ``ranks`` raised, as it published it: ``rank 1 (ValueError: ...)``."""
    store = agreement._store()
    parts = []
    for rank in ranks:
        text = None
        try:
            key = _error_key(rank)
            text = store.get(key).decode("utf-8") if store is not None and store.check([key]) else None
        except Exception:  # noqa: BLE001 - best effort
            pass
        parts.append(f"rank {rank} ({text})" if text else f"rank {rank}")
    return ", ".join(parts)


def leave(failure: BaseException, where: str) -> None:
    """This rank raised ``failure`` where no vote sees it, and is about to re-raise it: tell the
    peers at their next sync point (see the module). Never raises: the caller's error is the one
    to report. Nothing for an OOM (the probe agrees on it as a failed trial), for autobatch's own
    errors between ranks (the peers know already, or the ranks are out of step), or without peers."""
    if not agreement.is_distributed() or is_oom_error(failure):
        return
    if isinstance(failure, (RankDisagreementError, PeerFailedError, PeerOutOfMemoryError)):
        return
    publish(failure)
    agreement._state["sequence"] += 1
    sequence = agreement._state["sequence"]
    label = f"{where}: left with {type(failure).__name__}"
    try:
        agreement._announce(sequence, label)
        header = [sequence, LEFT, 0, stopping.requested()]
        agreement._gather(header, agreement.HEADER + agreement.HEAD_VALUES, agreement.control_group(), label, sequence)
    except Exception as exc:  # noqa: BLE001 - its own error is raised anyway
        log.warning("rank %d could not tell the other ranks of its error: %s", agreement.rank(), exc)


def peers_left(rows: list[list[int]], me: int, sequence: int, label: str) -> PeerFailedError | None:
    """The error for a sync point at which some peer :func:`leave` -s (None: none does)."""
    left = [rank for rank, row in enumerate(rows) if row[1] == LEFT and rank != me]
    if not left:
        return None
    return PeerFailedError(
        f"{describe(left)} raised an error and left before sync point '#{sequence} {label}' (see that rank's log "
        f"for the traceback); rank {me} stops too instead of waiting for it", left,
    )
