"""How the runner trains across ranks: the seam :mod:`autobatch.dist` fills in.

The runner's loop is the same in one process and under ``torch.distributed``. What differs
(the world size, who writes checkpoints, the module actually trained, the step that agrees
and all-reduces gradients, the plan every rank must share) sits behind this interface. The
single-process behaviour lives here; :mod:`autobatch.dist` installs the collective one, so
the runner never imports the distributed layer that sits after it in the pipeline.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import Any, Callable, Iterable

import torch

__all__ = ["DataParallel", "BuiltAlone", "choose", "check_no_sync", "wrapper_ranks", "alone_with_wrapper", "launcher_world", "agree_fit", "agree_model", "differing", "runner_settings", "agree_resume", "exchange_bytes", "install", "installed",
           "current", "unwrap"]


class DataParallel:
    """One process: no peers. Subclassed by :mod:`autobatch.dist`."""

    def active(self) -> bool:
        """Whether a job of more than one rank is running."""
        return False

    def world_size(self) -> int:
        return 1

    def is_rank_zero(self) -> bool:
        return True

    def rank(self) -> int:
        return 0

    def local_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the runner's step runs forward and backward on: the data-parallel
        wrapper itself when its collectives are driven safely (DDP through
        :mod:`autobatch.dist.ddp_step`), else its local module."""
        return model

    def start(self, model: torch.nn.Module) -> None:
        """Make every rank start from the same weights (``model``: the runner's model as given,
        a data-parallel wrapper included)."""

    def step(
        self,
        train_step: Any,
        micro_batches: Iterable[Any],
        *,
        local_size: int,
        on_phase: Callable[[str], None],
        phase: Callable[[], str],
        label: str,
        global_batch: int | None = None,
    ) -> tuple[float, int]:
        """One optimizer step over every rank's micro-batches: (mean loss over the global
        batch, global batch size), the same on every rank.

        ``train_step`` holds the module from :meth:`local_module`, the optimizer, loss,
        autocast and grad scaler; ``micro_batches`` yields this rank's micro-batches, already
        on the device (lazily: a failed transfer raises out of the iteration); ``local_size``
        is this rank's share; ``global_batch`` the configured global batch (None: ``local_size``
        x world size), the one gradient reductions may weight by before the shares are known.
        ``on_phase(name)`` must be called at each phase boundary (``"forward"``,
        ``"backward"``, ``"optimizer"``, before the optimizer step; the runner's fault
        injection and step guard hang on it) and ``phase()`` reads the last one. Contract: an
        OOM on any rank, anywhere in the step, raises an OOM on *every* rank (the failing
        rank's own, the others :class:`~autobatch.errors.PeerOutOfMemoryError`) after every
        collective the step started has been completed on every rank, with the model's
        parameters untouched unless the optimizer phase ran (the runner's step guard restores
        them); the runner then replays the same global batch with a smaller micro-batch."""
        raise NotImplementedError("the single-process runner steps with accumulated_step")

    def after_step(self, model: torch.nn.Module, label: str) -> None:
        """After a step every rank completed: re-align what it changed outside the gradients
        (rank 0's buffers), so that nothing a forward does between steps is a collective
        (``model`` is the runner's, the data-parallel wrapper itself)."""

    def agree_plan(self, planned: Any) -> Any:
        return planned

    def check_world(self, model: torch.nn.Module) -> None:
        """At the start of ``fit()``, before any sync point, load or step: refuse a world this
        runner cannot train in (``model``: the runner's, as given). Here (one process, as
        ``distributed=False`` asks): a DDP or ``fully_shard`` model whose collectives span several
        ranks (:func:`wrapper_ranks`); see also :class:`BuiltAlone`, and :mod:`autobatch.dist`
        (the world a distributed runner was built in)."""
        spanned = wrapper_ranks(model)
        if spanned > 1:
            raise ValueError(alone_with_wrapper(type(model).__name__, spanned))

    def request_stop(self) -> None:
        """Ask the run to end after the step in progress (:meth:`autobatch.Runner.request_stop`)."""
        self._stop = True

    def stop_agreed(self) -> bool:
        """Whether the run ends after this step: in one process, whether a stop was asked for;
        under ``torch.distributed``, whether a sync point carried some rank's request to every rank."""
        return getattr(self, "_stop", False)

    def clear_stop(self) -> None:
        """Forget a stop request (after the run it ended, or one that came after the run's last step)."""
        self._stop = False

    def exchange(self, values: list[int], label: str) -> list[list[int]]:
        """A sync point: every rank's ``values`` (same length everywhere), indexed by rank
        (here: this process's alone)."""
        return [list(values)]

    def exchange_bytes(self, data: bytes, label: str) -> list[bytes]:
        """Every rank's ``data`` (any length), indexed by rank: :func:`exchange_bytes` over
        :meth:`exchange`."""
        return exchange_bytes(self.exchange, data, label)


class BuiltAlone(DataParallel):
    """One process because no group of several ranks was active at ``Runner(...)`` (``distributed=None``).

    Why :meth:`check_world` refuses a ``fit()`` once one is: a script that builds its ``Runner``
    and then calls ``init_process_group()`` (before ``fit()``) got a one-process runner on every
    rank, which trained each rank alone (no sync point, no all-reduce, each rank's share trained
    as a whole global batch with only a batch-size warning) and the ranks' weights came apart
    silently. The share, the plan and the wrapper (DDP, ``fully_shard``) the runner trains
    through are fixed at its construction, so it is built again rather than switched over."""

    def check_world(self, model: torch.nn.Module) -> None:
        world = installed()
        launched = launcher_world()
        if launched > 1 and not world.active():
            # torchrun started this script as one of several ranks and it never made the group: every rank
            # trained the whole global batch alone and each wrote the checkpoint files, silently
            raise ValueError(
                f"fit() runs as one of {launched} ranks (WORLD_SIZE={launched}, set by torchrun or another launcher) "
                "but no process group was made: every rank would train the whole global batch alone, with no "
                "all-reduce, and write the same checkpoint files. Call torch.distributed.init_process_group() (or "
                "autobatch.distributed.init_from_env()) before building the model's DDP or fully_shard wrapper and "
                "the Runner; or pass Runner(distributed=False) to train each rank alone on purpose"
            )
        if world.active():
            raise ValueError(
                "this Runner was built before torch.distributed.init_process_group() (no process group of several "
                f"ranks was active at Runner(...)) and fit() now runs in a job of {world.world_size()} ranks: it would "
                "train each rank alone, with no all-reduce, and the ranks' weights would come apart. Build the Runner "
                "after init_process_group() (wrapping the model in DDP or fully_shard there too), or pass "
                "Runner(distributed=False) to train each rank alone on purpose"
            )
        super().check_world(model)


def launcher_world() -> int:
    """The number of ranks a launcher such as ``torchrun`` started (``WORLD_SIZE``; 1 without one),
    whether or not the script has made its process group."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    except ValueError:  # not a launcher's value: no launcher to hold the script to
        return 1


def wrapper_ranks(model: torch.nn.Module) -> int:
    """How many ranks the collectives of ``model``'s data-parallel wrappers span: the largest
    process group of a ``DistributedDataParallel`` in it and device mesh of its sharded
    (``fully_shard``) parameters; 1 where it has none, or no process group is initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    spans = [dist.get_world_size(module.process_group) for module in model.modules()
             if isinstance(module, torch.nn.parallel.DistributedDataParallel)]
    spans += [param.device_mesh.size() for param in model.parameters() if hasattr(param, "device_mesh")]
    return max(spans, default=1)


def alone_with_wrapper(wrapper: str, spanned: int) -> str:
    """Why a one-process runner (``distributed=False``) refuses a model whose data-parallel
    collectives span ``spanned`` ranks, and what to pass instead."""
    return (
        f"Runner(distributed=False) trains each rank alone, but its model ({wrapper}, wrapped in DistributedDataParallel "
        f"or fully_shard) runs collectives over {spanned} ranks in every forward or backward: with no vote between the "
        "ranks, one rank's OOM (it replays the batch at a smaller micro-batch) or a micro-batch planned differently on "
        "another rank leaves its peers waiting in a collective until the process group's timeout. Pass distributed=None "
        "(or True) to train across the ranks, the runner voting on every OOM; or, to train each rank alone, pass the "
        "model unwrapped (ddp.module, or a model not sharded)"
    )


def choose(distributed: bool | None) -> tuple[DataParallel, bool]:
    """What a ``Runner(distributed=...)`` trains with, and whether it is distributed. None:
    distributed when a group of several ranks is active now, else :class:`BuiltAlone` (which
    refuses a ``fit()`` once a group of several ranks is active); False: one process on purpose."""
    if distributed is False:
        return DataParallel(), False
    if distributed is None and not current().active():
        return BuiltAlone(), False
    return installed(), True


def check_no_sync(no_sync: Any, distributed: bool) -> None:
    """Refuse ``Runner(ddp, ..., no_sync=ddp.no_sync)`` on a one-process runner when ``ddp`` was
    built with ``static_graph=True``: torch's reducer cannot run a backward under ``no_sync()``
    with a static graph, and the step after the first accumulated micro-batch failed with
    "expect_autograd_hooks_ INTERNAL ASSERT FAILED" (a hand-written ``no_sync`` loop fails the
    same), naming nothing to change. A distributed runner drives DDP's synchronisation itself and
    never calls the ``no_sync`` given, so it is not refused there (``distributed``: the runner's)."""
    owner = getattr(no_sync, "__self__", None)
    if distributed or not isinstance(owner, torch.nn.parallel.DistributedDataParallel):
        return
    if getattr(owner, "static_graph", False):
        raise ValueError(
            "no_sync=model.no_sync cannot be used with a DistributedDataParallel built with static_graph=True: torch's "
            "reducer fails on the backward after one under no_sync() ('expect_autograd_hooks_ INTERNAL ASSERT FAILED'). "
            "Drop no_sync= (every micro-batch then all-reduces its gradients: the same update, more communication), or "
            "build the DDP with static_graph=False"
        )


def agree_fit(parallel: DataParallel, floats: Iterable[str] = (), **arguments: int | float | bool | None) -> None:
    """One ``ValueError`` on every rank where ``fit()``'s run-shaping arguments differ between
    ranks (one sync point, before anything is loaded or trained). A checkpoint is written by
    every rank together (each its random state, rank 0 the model), so ``checkpoint_dir`` given
    on rank 0 only (the habit of ``if rank == 0: save``) failed at the first save, or left rank 0
    waiting out the sync timeout at the run's end; a resume or a length on some ranks only
    trains them out of step; ``checkpoint_every`` on some ranks only left rank 0 alone in the
    first save's sync point until the deadline; a ``global_batch`` or ``max_grad_norm`` that
    differs weights or clips the one all-reduced gradient differently on each rank, and the
    ranks' weights silently came apart. ``arguments``: a flag (set or not) or a count (None:
    unset); those named in ``floats`` are positive numbers, compared exactly."""
    detail = differing(parallel.exchange, "fit(): every rank's arguments", arguments, floats)
    if detail is None:
        return
    raise ValueError(
        f"fit() was called with other arguments on other ranks ({detail}); pass the same on every rank: "
        "every rank trains each step and writes each checkpoint together (its own random state; rank 0 the "
        "model), so give checkpoint_dir, checkpoint_every, resume, epochs and steps to every rank's Runner and fit(), not to "
        "rank 0's alone, the same global_batch and max_grad_norm (every rank steps on one all-reduced gradient), and "
        "the same min_micro_batch, max_micro_batch, multiple_of, grow_after and checkpointing_fallback (every rank "
        "replays an out-of-memory step at one agreed micro-batch, and grows back or falls back to checkpointing with "
        "the others)"
    )


def agree_model(parallel: DataParallel, model: torch.nn.Module) -> None:
    """One ``ValueError`` on every rank where the ranks' models differ in their parameters' number,
    shapes or dtypes (one sync point at ``fit()``'s start, before the first broadcast). Every rank
    starts from rank 0's weights and all-reduces one gradient buffer laid out by its own parameters,
    so a plain module built otherwise on one rank (another width from a config read per rank) entered
    those collectives with other sizes: gloo aborted the process (``op.preamble.length <= op.nbytes``,
    SIGABRT) and its peer raised a ``RankDisagreementError`` naming no cause. A DDP model fails
    earlier, in DDP's own shape check; an FSDP2 parameter counts by its global shape."""
    params = list(model.parameters())
    layout = repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode()
    mine = [len(params), sum(p.numel() for p in params), zlib.crc32(layout)]
    rows = parallel.exchange(mine, "every rank's model (parameters, shapes, dtypes)")
    if all(row == rows[0] for row in rows):
        return
    shown = "; ".join(f"rank {r}: {row[0]} parameter tensors, {row[1]} values" for r, row in enumerate(rows))
    raise ValueError(
        f"the model differs between ranks ({shown}{'' if len({tuple(r[:2]) for r in rows}) > 1 else ', their shapes or dtypes differ'}): "
        "every rank trains one model (it starts from rank 0's weights and all-reduces one gradient over the same "
        "parameters), so build the same model, with the same architecture, configuration and dtype, on every rank "
        "before Runner(...)"
    )


def runner_settings(runner: Any) -> dict[str, int | float | bool | None]:
    """The ``Runner`` settings :func:`agree_fit` checks are the same on every rank before any step:
    where and how often checkpoints are written (every rank saves together), the global batch and
    clipping of the one all-reduced gradient, and the bounds each rank applies to the recovery vote's
    answer and to grow-back (floor, ceiling, multiple, wait, fallback), so every rank replays alike."""
    return {"checkpoint_dir": runner.checkpoint_dir is not None, "global_batch": runner.global_batch,
            "checkpoint_every": runner.checkpoint_every, "max_grad_norm": runner._train_step.max_grad_norm,
            "min_micro_batch": runner.min_micro_batch, "max_micro_batch": runner.max_micro_batch,
            "multiple_of": runner.multiple_of, "grow_after": runner.growth.grow_after,
            "checkpointing_fallback": bool(runner.checkpointing_fallback)}


def differing(exchange: Callable[[list[int], str], list[list[int]]], label: str,
              arguments: dict[str, int | float | bool | str | None], floats: Iterable[str] = ()) -> str | None:
    """Exchange ``arguments`` with the other ranks (one sync point, ``label``) and say which
    differ (``max_grad_norm: rank 0 None, rank 1 0.5``), or None where every rank passed the same.
    A value is a flag (set or not), a count (None: unset), a short name (its first 7 bytes are
    compared and shown), or, named in ``floats``, a number >= 0 compared exactly."""
    names, floats = list(arguments), set(floats)

    def code(name: str, value: int | float | bool | str | None) -> int:
        if value is None:
            return -1
        if isinstance(value, str):
            return int.from_bytes(value.encode()[:7], "little")
        return struct.unpack("<q", struct.pack("<d", float(value)))[0] if name in floats else int(value)

    rows = exchange([code(name, value) for name, value in arguments.items()], label)
    differ = [i for i in range(len(names)) if len({row[i] for row in rows}) > 1]
    if not differ:
        return None

    def shown(i: int, value: int) -> str:
        mine = arguments[names[i]]
        if isinstance(mine, bool):
            return "set" if value else "not set"
        if value < 0:
            return "None"
        if isinstance(mine, str):
            return repr(value.to_bytes(7, "little").rstrip(b"\0").decode(errors="replace"))
        return repr(struct.unpack("<d", struct.pack("<q", value))[0]) if names[i] in floats else str(value)

    return "; ".join(f"{names[i]}: " + ", ".join(f"rank {r} {shown(i, row[i])}" for r, row in enumerate(rows))
                     for i in differ)


def agree_resume(parallel: DataParallel, path: Any, failure: BaseException | None, label: str, failed_to: str) -> None:
    """A step of a resume that failed on some rank (``failure``: this rank's, a
    :class:`~autobatch.errors.CheckpointError`, or None) fails on every rank (one sync point,
    ``label``): that rank's own error there, a ``CheckpointError`` on the others: "rank N" and
    ``failed_to`` (what it could not do, and what to change). Used where each rank reads its checkpoint file, and where it loads
    it into the model and optimizer: a sharded model's rank reads a file of its own that no other
    rank reads, and one whose shard did not fit raised on that rank alone while its peers went on
    into training and waited out the sync timeout at their first step."""
    if parallel.world_size() > 1:
        rows = parallel.exchange([int(failure is not None)], label)
        failed = [rank for rank, row in enumerate(rows) if row[0]]
        if failed and failure is None:
            from ..errors import CheckpointError

            raise CheckpointError(path, f"rank {', '.join(map(str, failed))} {failed_to}")
    if failure is not None:
        raise failure


def exchange_bytes(exchange: Callable[[list[int], str], list[list[int]]], data: bytes, label: str) -> list[bytes]:
    """Every rank's ``data`` through an ``exchange`` of equal-length integer lists: the lengths
    first, then the bytes padded to the longest (two sync points)."""
    lengths = [row[0] for row in exchange([len(data)], f"{label} (sizes)")]
    rows = exchange(list(data.ljust(max(lengths), b"\0")), label)
    return [bytes(row[:length]) for row, length in zip(rows, lengths)]


_SINGLE = DataParallel()
_installed: DataParallel = _SINGLE


def install(parallel: DataParallel) -> None:
    """Make ``parallel`` the one the runner uses whenever it reports itself active."""
    global _installed
    _installed = parallel


def installed() -> DataParallel:
    """The installed implementation, active or not (a runner told ``distributed=True``)."""
    return _installed


def current() -> DataParallel:
    """The installed implementation while a multi-rank job runs, else the single process."""
    return _installed if _installed.active() else _SINGLE


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The local module inside a data-parallel wrapper (DDP: ``model.module``), else ``model``:
    what the runner trains locally and what a checkpoint's keys name, with or without torchrun."""
    inner = getattr(model, "module", None)
    if isinstance(inner, torch.nn.Module) and hasattr(model, "no_sync"):
        return inner
    return model
