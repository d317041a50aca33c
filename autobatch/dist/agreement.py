"""Ranks that agree: the collectives autobatch uses under ``torch.distributed``, with a timeout.

Every rank decides the same things in the same order (which batch size to try next, whether
a step replays, the micro-batch after an OOM) only if every decision that depends on one
rank's memory is *agreed*. This module is the one place where that happens: a **sync point**
is one call of :func:`exchange`, which every rank enters with a label saying what it is
deciding (``"runner step 3: gradients ready"``) and a few integers, and which returns every
rank's integers. :func:`agree`, :func:`agree_min` and :func:`agree_max` are built on it.

Why it cannot hang silently:

* one collective per sync point, ``all_reduce(MAX)`` of a ``world x k`` integer matrix in
  which each rank fills its own row (an all-gather that every backend supports), always on
  the CPU over a gloo group of its own (:func:`control_group`, made once while every rank is
  there; the CLI makes it when it joins). Not over the default group, even under gloo: DDP's
  bucket all-reduces run there, and a rank at a sync point while its peer is in a bucket
  would pair the two (gloo aborts the process on the size mismatch). Not over NCCL: the
  integers are tiny, a CPU collective needs no device synchronisation, and on 2 × H200 a
  rank that never reached a sync point left the other hanging inside the NCCL version of this
  wait instead of timing out. Gradients and weights still travel over the default group
  (:func:`all_reduce_sum_`, :func:`broadcast_`), entered only after a sync point agreed that
  every rank will enter it;
* the first matrix has the same width at every sync point (:data:`HEAD_VALUES` values after
  the header), so ranks at different sync points always pair like-sized collectives; a longer
  payload's rest travels in a second one, entered only once every rank's header matched;
* each row starts with the sync point's sequence number and a hash of its label, so ranks
  that reach *different* sync points (one rank took a branch the others did not) are
  detected at once and raise :class:`~autobatch.errors.RankDisagreementError` instead of
  pairing unrelated collectives (the header also carries this rank's stop request, so a stop
  asked for on any rank reaches every rank at the same sync point: :mod:`.stopping`);
* the collective runs asynchronously and is waited for with a deadline (:func:`timeout`,
  default 300 s, ``AUTOBATCH_SYNC_TIMEOUT`` or :func:`set_timeout`); a rank that never
  arrives turns into a ``RankDisagreementError`` that names what this rank was waiting for
  and, from the process group's store, the last sync point each other rank entered. A peer
  whose process died is reported the same way (the backend fails the collective).

Nothing here runs without an initialised process group of more than one rank: then
:func:`is_distributed` is False and every helper answers for one rank without communicating.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
import zlib
from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import RankDisagreementError
from . import stopping

__all__ = [
    "is_distributed",
    "rank",
    "world_size",
    "is_rank_zero",
    "timeout",
    "set_timeout",
    "sync_device",
    "control_group",
    "exchange",
    "agree",
    "agree_min",
    "agree_max",
    "all_reduce_sum_",
    "broadcast_",
    "wait_for",
    "collective_failed",
    "init_from_env",
]

log = logging.getLogger("autobatch")

#: Seconds a sync point waits for the other ranks before raising RankDisagreementError.
DEFAULT_TIMEOUT_S = 300.0
_INT64_MIN = -(2**63)
#: values every sync point's first collective carries after its header (:data:`HEADER`): the
#: same width everywhere, whatever the sync point
HEAD_VALUES = 12
#: a sync point's header: its sequence number, its label's hash, its length, and this rank's stop
#: request (:mod:`~autobatch.dist.stopping`; the first three must match on every rank)
HEADER = 4
_state: dict = {"timeout": None, "sequence": 0, "control": None}


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group of more than one rank is active."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_rank_zero() -> bool:
    """True on rank 0, and in a process with no process group: the rank that writes results.

    Before the process group exists (early in a ``torchrun`` job) the ``RANK`` environment
    variable decides.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0") or 0) == 0


def timeout() -> float:
    """Seconds a sync point waits: :func:`set_timeout`, else ``AUTOBATCH_SYNC_TIMEOUT``, else 300."""
    if _state["timeout"] is not None:
        return float(_state["timeout"])
    return float(os.environ.get("AUTOBATCH_SYNC_TIMEOUT", DEFAULT_TIMEOUT_S))


def set_timeout(seconds: float | None) -> None:
    """Set the sync-point timeout for this process (None: back to the default)."""
    if seconds is not None and seconds <= 0:
        raise ValueError(f"the sync timeout must be a positive number of seconds, got {seconds!r}")
    _state["timeout"] = seconds


def sync_device() -> torch.device:
    """Where tensors for the default group's collectives (gradients, loss totals, weights)
    live: the current CUDA device for NCCL, else the CPU. Sync points always use the CPU."""
    backend = str(dist.get_backend()).lower() if is_distributed() else "gloo"
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def control_group():
    """The gloo group sync points run on: a group of every rank beside the default one (under
    gloo too: the default group carries DDP's bucket all-reduces, which a sync point must
    never pair with), made on the first call and kept while the default group lives.

    Making it is a collective of its own (gloo connects every pair of ranks: about 1.4 ms for
    2 CPU ranks, once): every rank must call this at the same point (the first sync point
    does, as does :func:`init_from_env`). A rank that does not come within :func:`timeout`
    makes it raise :class:`~autobatch.errors.RankDisagreementError`. Only weak references are
    kept, so a group the user destroys is freed then, not at the interpreter's teardown.
    """
    world = dist.distributed_c10d._get_default_group()
    cached = _state["control"]
    if cached is not None and cached[0]() is world and cached[1]() is not None:
        return cached[1]()
    from datetime import timedelta

    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout()))
    except Exception as exc:  # noqa: BLE001 - a rank that never came, or a dead peer
        raise RankDisagreementError(
            rank(), "setting up the gloo group for sync points", _peers_doing(),
            reason=f"the other ranks did not join it ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})",
        ) from exc
    _state["control"] = (weakref.ref(world), weakref.ref(group))
    return group


def _tag(label: str) -> int:
    return zlib.crc32(label.encode("utf-8")) & 0x7FFFFFFF


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - the store only improves error messages
        return None


def _announce(sequence: int, label: str) -> None:
    """Publish this rank's current sync point in the process group's store (best effort)."""
    store = _store()
    if store is None:
        return
    try:
        store.set(f"autobatch/sync/{rank()}", f"#{sequence} {label}")
    except Exception:  # noqa: BLE001
        pass


def _peers_doing() -> dict[int, str]:
    """The last sync point each rank announced ("never reached a sync point" when none)."""
    store = _store()
    doing: dict[int, str] = {}
    for other in range(world_size()):
        key = f"autobatch/sync/{other}"
        try:
            doing[other] = store.get(key).decode("utf-8") if store is not None and store.check([key]) else "never reached a sync point"
        except Exception:  # noqa: BLE001
            doing[other] = "unknown (the store did not answer)"
    return doing


def _wait(work, label: str, sequence: int, *, on_host: bool = False) -> None:
    """Wait for an async collective; a deadline or a failed peer becomes RankDisagreementError.

    ``on_host``: a CPU (gloo) collective, waited for in one blocking call with the deadline as
    its timeout (it wakes the moment the peers' data is in: a sync point costs the collective's
    own latency, tens of microseconds, which matters where FSDP votes before every collective).
    A device collective (NCCL) is polled instead: its ``wait`` would only order streams."""
    limit = timeout()
    deadline = time.monotonic() + limit
    late = f"the other ranks did not reach it within {limit:g} s"
    pause = 1e-4
    try:
        if on_host:
            from datetime import timedelta

            work.wait(timedelta(seconds=limit))
            return
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise RankDisagreementError(rank(), f"#{sequence} {label}", _peers_doing(), reason=late)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        work.wait()
    except RankDisagreementError:
        raise
    except Exception as exc:  # noqa: BLE001 - a backend error (a peer died or left), or gloo's deadline
        text = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        timed_out = on_host and time.monotonic() >= deadline - 0.05 * limit
        raise RankDisagreementError(
            rank(), f"#{sequence} {label}", _peers_doing(), reason=late if timed_out else f"the collective failed ({text})",
        ) from exc


def exchange(values: Sequence[int], label: str) -> list[list[int]]:
    """A sync point: every rank's ``values`` (same length everywhere), indexed by rank.

    All ranks must call it in the same order with the same ``label``; a rank at a different
    sync point, one that does not arrive within :func:`timeout`, or one that died raises
    :class:`~autobatch.errors.RankDisagreementError` on the others. Without a process group it
    returns ``[list(values)]``. One collective of a fixed width (the header and the first
    :data:`HEAD_VALUES` values), then, for a longer ``values``, one more for the rest, whose
    length every rank's header agreed on.
    """
    values = [int(v) for v in values]
    if not is_distributed():
        return [values]
    group = control_group()
    _state["sequence"] += 1
    sequence = _state["sequence"]
    _announce(sequence, label)
    me = rank()
    head = _gather([sequence, _tag(label), len(values), stopping.requested(), *values[:HEAD_VALUES]], HEADER + HEAD_VALUES,
                   group, label, sequence)
    rows = [row[: HEADER + min(len(values), HEAD_VALUES)] for row in _agreed_rows(head, me, sequence, label, header=True)]
    if len(values) > HEAD_VALUES:  # every rank's header said this length: the same collective everywhere
        rest = _gather(values[HEAD_VALUES:], len(values) - HEAD_VALUES, group, label, sequence)
        rows = [row + more for row, more in zip(rows, rest)]
    return [row[HEADER:] for row in rows]


def _gather(mine: list[int], width: int, group, label: str, sequence: int) -> list[list[int]]:
    """Every rank's row of ``width`` integers (``mine``, padded), over the sync points' group."""
    table = torch.full((world_size(), width), _INT64_MIN, dtype=torch.int64)
    table[rank(), : len(mine)] = torch.tensor(mine, dtype=torch.int64)
    work = dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group, async_op=True)
    _wait(work, label, sequence, on_host=True)
    return table.tolist()


def _agreed_rows(rows: list[list[int]], me: int, sequence: int, label: str, *, header: bool = False) -> list[list[int]]:
    """Each rank's values, once every row names the same sync point (else the error); with
    ``header`` the rows whole, header included. Notes the stop requests the rows carried
    (:mod:`~autobatch.dist.stopping`). A peer that left with its own error is that error here."""
    from .leaving import peers_left

    left = peers_left(rows, me, sequence, label)
    if left is not None:
        raise left
    if any(row[:3] != rows[me][:3] for row in rows):
        doing = {
            other: f"#{row[0]} {label}" if row[:3] == rows[me][:3] else f"#{row[0]} a different sync point"
            for other, row in enumerate(rows)
        }
        doing.update({other: text for other, text in _peers_doing().items() if not rows[other][:3] == rows[me][:3]})
        raise RankDisagreementError(me, f"#{sequence} {label}", doing, reason="the ranks reached different sync points")
    stopping.note(row[3] for row in rows)
    return rows if header else [row[HEADER:] for row in rows]


def agree(flag: bool, label: str = "agree", op: str = "all") -> bool:
    """The ranks' common answer: ``op="all"`` true when every rank's ``flag`` is true (a MIN),
    ``op="any"`` true when some rank's is (a MAX)."""
    if op not in ("all", "any"):
        raise ValueError(f"op must be 'all' or 'any', got {op!r}")
    flags = [bool(row[0]) for row in exchange([int(bool(flag))], label)]
    return all(flags) if op == "all" else any(flags)


def agree_min(value: int, label: str = "agree_min") -> int:
    """The smallest ``value`` over the ranks."""
    return min(row[0] for row in exchange([value], label))


def agree_max(value: int, label: str = "agree_max") -> int:
    """The largest ``value`` over the ranks."""
    return max(row[0] for row in exchange([value], label))


def all_reduce_sum_(tensor: torch.Tensor, label: str) -> torch.Tensor:
    """Sum ``tensor`` over the ranks in place, under the same deadline as :func:`exchange`.

    Call it only right after a sync point that agreed every rank will call it too.
    """
    if not is_distributed():
        return tensor
    _state["sequence"] += 1
    sequence = _state["sequence"]
    _announce(sequence, label)
    _wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True), label, sequence)
    return tensor


_BROADCAST_BUCKET = 64 * 2**20  # bytes per collective when broadcasting many small tensors


def broadcast_(tensors: Sequence[torch.Tensor], label: str, source: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with ``source`` 's, under the sync deadline.

    Tensors of one device and dtype travel together, flattened into buckets of up to 64 MiB
    (a model's hundreds of parameters in a few collectives, as DDP syncs them at
    construction, rather than one sync point each); a larger tensor travels alone, in place.
    """
    if not is_distributed():
        return
    for bucket in _buckets([t.data for t in tensors]):
        _state["sequence"] += 1
        sequence = _state["sequence"]
        _announce(sequence, label)
        if len(bucket) == 1:
            _wait(dist.broadcast(bucket[0], src=source, async_op=True), label, sequence)
            continue
        flat = torch.cat([t.reshape(-1) for t in bucket])
        _wait(dist.broadcast(flat, src=source, async_op=True), label, sequence)
        offset = 0
        for tensor in bucket:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in order, grouped by (device, dtype) into runs of at most 64 MiB."""
    groups: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}
    for tensor in tensors:
        key = (tensor.device, tensor.dtype)
        runs = groups.setdefault(key, [[]])
        size = tensor.numel() * tensor.element_size()
        if not tensor.is_contiguous() or size >= _BROADCAST_BUCKET:
            runs += [[tensor], []]
            filled[key] = 0
            continue
        if runs[-1] and filled.get(key, 0) + size > _BROADCAST_BUCKET:
            runs.append([])
            filled[key] = 0
        runs[-1].append(tensor)
        filled[key] = filled.get(key, 0) + size
    return [run for runs in groups.values() for run in runs if run]


def wait_for(work, label: str) -> None:
    """Wait for a collective another layer launched (DDP's buckets), under the sync deadline.

    Unlike :func:`all_reduce_sum_` it does not count as a sync point of its own (the sequence
    numbers that pair sync points stay the same on a rank that completes a failed step's
    buckets and on one that did not need to)."""
    if is_distributed():
        _wait(work, label, _state["sequence"])


def collective_failed(label: str, exc: BaseException) -> RankDisagreementError:
    """The error for a collective another layer ran (DDP's) that failed or timed out: a
    :class:`~autobatch.errors.RankDisagreementError` naming each rank's last sync point."""
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return RankDisagreementError(
        rank(), f"#{_state['sequence']} {label}", _peers_doing(),
        reason=f"the collective failed or timed out ({type(exc).__name__}: {text})",
    )


def init_from_env(device_type: str = "auto") -> bool:
    """Join the process group a launcher such as ``torchrun`` describes in the environment, and
    leave it at exit (:func:`autobatch.dist.joining.init_from_env`). Returns whether this process
    is now distributed."""
    from .joining import init_from_env as join

    return join(device_type)
