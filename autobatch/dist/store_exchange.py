"""A sync point through the process group's key-value store: for votes on a hot path.

:func:`~autobatch.distributed.exchange` runs one gloo all-reduce per sync point, about a
millisecond on 2 x H200's host (measured: FSDP's 64 votes per step of a 20-block decoder cost
54-82 ms of host time per step, which made the step host-bound). FSDP's votes
(:mod:`.fsdp_guard`) come before every collective, so they use :func:`exchange_via_store`
instead: the same contract (every rank's integers, the same sync-point sequence numbers and
labels, the same errors), over the store that every ``torch.distributed`` job already has.

Each rank pushes its row onto one queue per peer in the store (``queue_push``, which does not
wait for an answer), waits for its own queues from every peer and pops their rows. A vote is
then about two round trips to the store per peer and leaves nothing behind: every row pushed
is popped. (Keys written and deleted per vote took five round trips: measured on the CPU,
374 us a vote against 140-160 us this way.)

A vote a rank gave up on never reads as agreement to a peer that comes later. The rank whose
deadline passed takes its own row back from each late peer's queue (a pop is atomic in the
store) and pushes a "gave up" mark in its place; the late peer pops the mark, takes back the
row it pushed to the rank that left (nothing stays queued), and raises
:class:`~autobatch.errors.RankDisagreementError` at once, naming the rank that gave up. Where
the row is already gone, the peer came just in time: it pushed its own row before taking
this one, so the vote completes as usual, on both ranks.
"""

from __future__ import annotations

from datetime import timedelta
import time
from typing import Sequence

from ..errors import RankDisagreementError
from . import agreement, stopping

__all__ = ["exchange_via_store"]


def _queue(to: int, sender: int) -> str:
    """The store queue that carries ``sender``'s rows to rank ``to``."""
    return f"autobatch/votes/{to}/{sender}"


def exchange_via_store(values: Sequence[int], label: str) -> list[list[int]]:
    """:func:`~autobatch.distributed.exchange` over the store (falls back to it without one,
    or on a store without queues)."""
    values = [int(v) for v in values]
    if not agreement.is_distributed():
        return [values]
    store = agreement._store()
    if store is None or not hasattr(store, "queue_push"):
        return agreement.exchange(values, label)
    agreement._state["sequence"] += 1
    sequence = agreement._state["sequence"]
    me, world = agreement.rank(), agreement.world_size()
    mine = [sequence, agreement._tag(label), len(values), stopping.requested(), *values]
    limit = agreement.timeout()
    began = time.monotonic()
    try:
        agreement._announce(sequence, label)
        row = ",".join(map(str, mine))
        others = [r for r in range(world) if r != me]
        for other in others:
            store.queue_push(_queue(other, me), row)
        texts: dict[int, str] = {}
        try:
            store.wait([_queue(me, r) for r in others], timedelta(seconds=limit))
        except Exception:  # noqa: BLE001 - the deadline (or a dead store: taking the rows back fails too)
            if time.monotonic() - began < 0.95 * limit:
                raise
            texts = _give_up(store, me, others)  # the peers' rows where they came just in time
        for other in others:
            if other not in texts:
                texts[other] = _pop(store, _queue(me, other)) or _vanished(other)
        gone = {other: text for other, text in texts.items() if text.startswith(_GAVE_UP)}
        if gone:
            for other, text in gone.items():
                if text != f"{_GAVE_UP}{me}":  # that peer left: this rank's row to it would stay queued
                    _pop(store, _queue(other, me))
            raise _gave_up(me, sequence, label, next(iter(gone.values())), limit)
        rows = [mine if r == me else [int(x) for x in texts[r].split(",")] for r in range(world)]
    except RankDisagreementError:
        raise
    except Exception as exc:  # noqa: BLE001 - a store that went away with its rank
        text = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        raise RankDisagreementError(
            me, f"#{sequence} {label}", agreement._peers_doing(), reason=f"the store failed ({text})",
        ) from exc
    return agreement._agreed_rows(rows, me, sequence, label)


def _pop(store, queue: str) -> str | None:
    """The row at the head of ``queue``, or None when it is empty (never waits)."""
    try:
        return store.queue_pop(queue, block=False).decode()
    except Exception as exc:  # noqa: BLE001 - torch's QueueEmptyError (a DistStoreError) is "nothing there"
        if type(exc).__name__ == "QueueEmptyError":
            return None
        raise


def _vanished(other: int) -> str:
    raise RuntimeError(f"rank {other}'s row left its queue between the wait and the read")


_GAVE_UP = "gave up:"  # the mark a rank whose deadline passed leaves in a late peer's queue


def _give_up(store, me: int, others: list[int]) -> dict[int, str]:
    """This rank's deadline passed: take its row back from every peer that has not come (a pop
    is atomic) and leave a "gave up" mark there instead, which that peer pops when it comes.
    Returns each peer's row where it came (it took this rank's row, so its own is here) and
    this rank's mark for the others."""
    texts: dict[int, str] = {}
    mark = f"{_GAVE_UP}{me}"
    for other in others:
        arrived = _pop(store, _queue(me, other))
        if arrived is not None:
            texts[other] = arrived
            continue
        if _pop(store, _queue(other, me)) is not None:  # it never took this rank's row
            store.queue_push(_queue(other, me), mark)
            texts[other] = mark
        else:  # it took the row just now: its own was pushed before
            texts[other] = _pop(store, _queue(me, other)) or mark
    return texts


def _gave_up(me: int, sequence: int, label: str, mark: str, limit: float) -> RankDisagreementError:
    """The error for a vote some rank gave up on (``mark``: its slot mark): on every rank, the
    late ones included, instead of a late rank going on alone."""
    who = mark[len(_GAVE_UP):] if mark.startswith(_GAVE_UP) else "?"
    reason = (f"the other ranks did not reach it within {limit:g} s" if who == str(me) else
              f"rank {who} gave up waiting for it (its {limit:g} s deadline passed) before this rank came")
    return RankDisagreementError(me, f"#{sequence} {label}", agreement._peers_doing(), reason=reason)
