"""A sync point through the process group's key-value store: for votes on a hot path.

:func:`~autobatch.distributed.exchange` runs one gloo all-reduce per sync point, about a
millisecond on 2 x H200's host (measured: FSDP's 64 votes per step of a 20-block decoder cost
54-82 ms of host time per step, which made the step host-bound). FSDP's votes
(:mod:`.fsdp_guard`) come before every collective, so they use :func:`exchange_via_store`
instead: the same contract (every rank's integers, the same sync-point sequence numbers and
labels, the same errors), over the store that every ``torch.distributed`` job already has.
Each rank writes its row under a key named by the sync point's sequence number, waits for
the other ranks' keys (the store blocks server-side, with the sync deadline as timeout) and
reads them; a few round trips to the store instead of a collective.

Keys do not pile up: once a rank has read every rank's key of a store vote, it deletes its
own key of its *previous* store vote. That is safe: every rank wrote its key of this vote only
after it had read every key of the previous one. "Previous" is counted in store votes, not in
sync-point numbers: those are shared with :func:`~autobatch.distributed.exchange` and the
other collectives, which write no key, so deleting "the key of ``n - 2``" (as an earlier
version did) missed every key whose successor was not a store vote (two keys per FSDP step
stayed). Each rank keeps one key in the store between votes (two while one runs).

A vote a rank gave up on never reads as agreement to a peer that comes later. Before, the rank
whose deadline passed raised, but its "ok" key stayed, and a peer arriving after that read it
and went on alone into the collective the vote guards (an FSDP all-gather), to wait there for a
rank that had left. Now every slot is claimed atomically (the store's ``compare_set``): a rank
writes its own key only into an empty slot, and a rank whose deadline passed fills each slot
still empty with a "gave up" mark. Whichever comes first wins: a peer that finds its slot marked
raises :class:`~autobatch.errors.RankDisagreementError` at once, naming the rank that gave up;
a rank that finds every slot already filled by its peers' rows (they came just at the deadline)
completes the vote as usual, as the peers do.
"""

from __future__ import annotations

from datetime import timedelta
import time
from typing import Sequence

from ..errors import RankDisagreementError
from . import agreement, stopping

__all__ = ["exchange_via_store"]

_written: list[int] = []  # this rank's store votes whose keys are still in the store


def _key(sequence: int, rank: int) -> str:
    return f"autobatch/vote/{sequence}/{rank}"


def exchange_via_store(values: Sequence[int], label: str) -> list[list[int]]:
    """:func:`~autobatch.distributed.exchange` over the store (falls back to it without one)."""
    values = [int(v) for v in values]
    if not agreement.is_distributed():
        return [values]
    store = agreement._store()
    if store is None:
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
        claimed = store.compare_set(_key(sequence, me), "", row).decode()  # the slot, unless a peer gave up on it
        if claimed.startswith(_GAVE_UP):
            raise _gave_up(me, sequence, label, claimed, limit)
        if claimed != row:  # a stale key of this name (not a mark): overwritten, as a plain set did
            store.set(_key(sequence, me), row)
        others = [r for r in range(world) if r != me]
        try:
            store.wait([_key(sequence, r) for r in others], timedelta(seconds=limit))
            texts = {r: store.get(_key(sequence, r)).decode() for r in others}
        except Exception:  # noqa: BLE001 - the deadline (or a dead store: the marking fails too)
            if time.monotonic() - began < 0.95 * limit:
                raise
            texts = _give_up(store, sequence, me, others)  # the peers' rows where they came just in time
        gone = next((text for text in texts.values() if text.startswith(_GAVE_UP)), None)
        if gone is not None:
            raise _gave_up(me, sequence, label, gone, limit)
        rows = [mine if r == me else [int(x) for x in texts[r].split(",")] for r in range(world)]
        _written.append(sequence)
        while len(_written) > 1:  # every rank read the previous vote's keys before writing this one's
            store.delete_key(_key(_written.pop(0), me))
    except RankDisagreementError:
        raise
    except Exception as exc:  # noqa: BLE001 - a store that went away with its rank
        text = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        raise RankDisagreementError(
            me, f"#{sequence} {label}", agreement._peers_doing(), reason=f"the store failed ({text})",
        ) from exc
    return agreement._agreed_rows(rows, me, sequence, label)


_GAVE_UP = "gave up:"  # a slot's mark by a rank whose deadline passed before that slot's rank came


def _give_up(store, sequence: int, me: int, others: list[int]) -> dict[int, str]:
    """This rank's deadline passed: mark every peer's slot still empty (atomically, so a peer
    that comes now finds the mark instead of reading this rank's key as agreement). Returns each
    peer's slot as it is now: its row where it came in the meantime, else a mark."""
    return {r: store.compare_set(_key(sequence, r), "", f"{_GAVE_UP}{me}").decode() for r in others}


def _gave_up(me: int, sequence: int, label: str, mark: str, limit: float) -> RankDisagreementError:
    """The error for a vote some rank gave up on (``mark``: its slot mark): on every rank, the
    late ones included, instead of a late rank going on alone."""
    who = mark[len(_GAVE_UP):] if mark.startswith(_GAVE_UP) else "?"
    reason = (f"the other ranks did not reach it within {limit:g} s" if who == str(me) else
              f"rank {who} gave up waiting for it (its {limit:g} s deadline passed) before this rank came")
    return RankDisagreementError(me, f"#{sequence} {label}", agreement._peers_doing(), reason=reason)
