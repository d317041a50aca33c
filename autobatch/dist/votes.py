"""The vote that ends each phase of a data-parallel step: every rank says ok / OOM / error.

Both data-parallel steps (:mod:`autobatch.dist.step` on the local module,
:mod:`autobatch.dist.ddp_step` through DDP's reducer) end their gradient phase and their
optimizer phase with :func:`vote`, one sync point (:func:`~autobatch.distributed.exchange`)
carrying each rank's outcome, the phase it reached, its share of samples and any extra
integers (a loss travels as the bits of a float64, :func:`float_bits`). Any OOM: every rank
raises, the failing rank its own error, the others
:class:`~autobatch.errors.PeerOutOfMemoryError`, so the runner's retry loop replays the same
global batch on every rank alike. Any other error: the failing rank re-raises it, the others
raise :class:`~autobatch.errors.PeerFailedError`.
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

from ..errors import PeerFailedError, PeerOutOfMemoryError
from ..memory.oom import free_memory, is_oom_error
from ..training.phases import PHASES
from . import agreement as dist_sync
from .leaving import describe, publish

__all__ = ["keep", "vote", "float_bits", "bits_float"]

_OK, _OOM, _ERROR = 0, 1, 2


def keep(exc: Exception) -> Exception:
    """The error to vote on. An OOM's traceback is dropped now, so the failed frames (and the
    activations they hold) are freed before the sync point allocates anything."""
    if is_oom_error(exc):
        return exc.with_traceback(None)
    return exc


def float_bits(value: float) -> int:
    """``value`` as the int64 with the same bits (``-0.0`` as ``0.0``: the bits of ``-0.0``
    are the smallest int64, which the exchange uses for "no value")."""
    return struct.unpack("<q", struct.pack("<d", float(value) + 0.0))[0]


def bits_float(bits: int) -> float:
    """The inverse of :func:`float_bits`."""
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def vote(
    failure: BaseException | None,
    phase: str,
    local_size: int,
    label: str,
    *,
    extra: Sequence[int] = (),
    clear: Callable[[], None] | None = None,
    on_failure: Callable[[], None] | None = None,
) -> list[list[int]]:
    """The sync point: every rank's ``[code, phase index, share, *extra]``; raises on every
    rank if any rank failed. ``clear`` drops this rank's gradients before an OOM frees
    memory; ``on_failure`` runs on every rank when some rank failed, before the raise (the
    DDP step resets its reducer there, on every rank alike)."""
    code = _OK if failure is None else (_OOM if is_oom_error(failure) else _ERROR)
    if code == _OOM:
        if clear is not None:
            clear()
        free_memory()
    index = PHASES.index(phase) if phase in PHASES else -1
    if code == _ERROR:
        publish(failure)  # the peers' PeerFailedError names it
    rows = dist_sync.exchange([code, index, local_size, *extra], label)
    errors = [r for r, row in enumerate(rows) if row[0] == _ERROR]
    ooms = [r for r, row in enumerate(rows) if row[0] == _OOM]
    if (errors or ooms) and on_failure is not None:
        on_failure()
    if errors:
        if failure is not None and code == _ERROR:
            raise failure
        raise PeerFailedError(
            f"rank {', '.join(map(str, errors))} raised an error at {label!r} ({describe(errors)}; see that rank's log); "
            f"rank {dist_sync.rank()} stops too instead of waiting for it",
            errors,
        )
    if ooms:
        if failure is not None:
            raise failure
        where = PHASES[rows[ooms[0]][1]] if rows[ooms[0]][1] >= 0 else "an unknown phase"
        raise PeerOutOfMemoryError(
            f"rank {', '.join(map(str, ooms))} ran out of memory in {where} ({label}); "
            f"rank {dist_sync.rank()} replays the step with it",
            where,
            ooms,
        )
    return rows
