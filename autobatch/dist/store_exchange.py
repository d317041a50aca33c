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
        store.set(_key(sequence, me), ",".join(map(str, mine)))
        store.wait([_key(sequence, r) for r in range(world) if r != me], timedelta(seconds=limit))
        rows = [mine if r == me else [int(x) for x in store.get(_key(sequence, r)).decode().split(",")] for r in range(world)]
        _written.append(sequence)
        while len(_written) > 1:  # every rank read the previous vote's keys before writing this one's
            store.delete_key(_key(_written.pop(0), me))
    except Exception as exc:  # noqa: BLE001 - the deadline, or a store that went away with its rank
        late = time.monotonic() - began >= 0.95 * limit
        text = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        raise RankDisagreementError(
            me, f"#{sequence} {label}", agreement._peers_doing(),
            reason=f"the other ranks did not reach it within {limit:g} s" if late else f"the store failed ({text})",
        ) from exc
    return agreement._agreed_rows(rows, me, sequence, label)
