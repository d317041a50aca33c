"""One global step across ranks that never leaves a rank waiting in a collective alone.

The :class:`~autobatch.Runner` calls :class:`CollectiveDataParallel` when it runs under
``torch.distributed``. A DDP model goes through DDP's own reducer
(:mod:`autobatch.dist.ddp_step`); everything else (a plain module, a DDP configuration that
path does not drive) through :func:`synced_step`, whose design is:

1. **Local phase, no collectives.** Every micro-batch of this rank's share runs forward and
   backward on the *local* module (DDP's ``model.module``; DDP's own hooks never run), so
   no rank can be inside a collective while another is still computing or has run out of
   memory. The gradients are then copied into one flat buffer per dtype (allocated here, so
   an OOM while allocating it is a local failure like any other; zeros for a parameter
   that got no gradient on this rank).
2. **Sync point "gradients ready".** Every rank votes ok / out of memory / other error, with
   the phase it reached and its sample count (:func:`~autobatch.distributed.exchange`).
   Any OOM: every rank raises (the failing rank its own error, the others
   :class:`~autobatch.errors.PeerOutOfMemoryError`), and the runner's retry loop halves the
   micro-batch on every rank alike and replays the same global batch. Any other error:
   the failing rank re-raises it, the others raise :class:`~autobatch.errors.PeerFailedError`.
3. **Gradient all-reduce**, entered only after every rank agreed to enter it. Each rank's
   gradient (mean over its share) is weighted by ``share / global`` and summed, which is the
   gradient of the mean over the whole global batch, also when shares differ. A parameter
   that got no gradient on any rank keeps ``grad = None``, as under DDP with
   ``find_unused_parameters=True`` (the vote carries each rank's count of missing gradients;
   only when one is missing somewhere is the presence of each all-reduced first).
4. **Optimizer step, locally**, under the runner's :class:`~autobatch.training.oom.step_guard.StepGuard`.
5. **Sync point "optimizer stepped".** If any rank ran out of memory inside its step, every
   rank (those whose step succeeded too) restores parameters and optimizer state from its
   guard and replays.

Each collective is therefore entered by every rank or by none, and each sync point is
bounded by :func:`~autobatch.distributed.timeout`: whatever disagreement remains (a rank
that crashed outside autobatch, user code that runs its own collectives) ends in a
:class:`~autobatch.errors.RankDisagreementError` that names each rank's last sync point.

Cost against DDP: the gradient all-reduce runs once after the backward pass instead of in
buckets overlapped with it, and the flat buffer costs one gradient-sized copy (DDP's
buckets cost about the same). Two small integer exchanges per step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

from ..planning.accumulation import accumulate_micro_batches
from ..probe.train_step import TrainStep
from ..training.ranks import DataParallel
from . import agreement as dist_sync
from . import stopping
from .ddp_step import check_whole_world, comm_hook_name, ddp_step, ddp_supported, ddp_wrapper, settle
from .forward_collectives import refuse_fsdp1, warn_compiled_wrapper, warn_forward_collectives, warn_unused_ddp_options
from .joining import check_same_world, remember_world
from .probe import agree_plan, unwrap
from .votes import keep as _keep
from .votes import vote

__all__ = ["CollectiveDataParallel", "synced_step", "forward_synced_buffers", "missing_grads", "flatten_grads",
           "reduce_grads"]


def synced_step(
    step: TrainStep,
    micro_batches: Iterable[Any],
    *,
    local_size: int,
    on_phase: Callable[[str], None],
    phase: Callable[[], str],
    label: str,
) -> tuple[float, int]:
    """One optimizer step over every rank's micro-batches; returns (mean loss over the global
    batch, global batch size), the same on every rank. ``step.model`` must be the local
    module. ``on_phase`` is the runner's phase hook (fault injection, step guard);
    ``phase()`` reads where the last phase hook left the runner."""
    step.optimizer.zero_grad(set_to_none=True)
    params = [p for p in step.model.parameters() if p.requires_grad]
    failure: BaseException | None = None
    loss = 0.0
    flats: dict[torch.dtype, torch.Tensor] = {}
    try:
        loss = accumulate_micro_batches(
            step.model, step.loss_fn, micro_batches, global_batch=local_size,
            autocast=step.autocast, grad_scaler=step.grad_scaler, on_phase=on_phase,
        )
        flats = flatten_grads(params)
    except Exception as exc:  # noqa: BLE001 - voted on below, then re-raised
        failure = _keep(exc)
    rows = vote(failure, phase(), local_size, f"{label}: gradients ready", extra=[missing_grads(params)],
                clear=step.clear_grads)
    global_size = sum(row[2] for row in rows)
    reduce_grads(params, flats, local_size / global_size, label, some_missing=any(row[3] for row in rows))
    total = torch.tensor([loss * local_size], dtype=torch.float64, device=dist_sync.sync_device())
    global_loss = float(dist_sync.all_reduce_sum_(total, f"{label}: loss").item()) / global_size

    try:
        on_phase("optimizer")
        step.optimizer_step()
    except Exception as exc:  # noqa: BLE001 - voted on below, then re-raised
        failure = _keep(exc)
    vote(failure, phase(), local_size, f"{label}: optimizer stepped", clear=step.clear_grads)
    step.optimizer.zero_grad(set_to_none=True)
    return global_loss, global_size


def forward_synced_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers the runner makes rank 0's (at each ``fit``'s start; after each step of a model
    trained through its local module): those a DDP wrapper broadcasts before its forward (none
    with ``broadcast_buffers=False``, none it was told to ignore), every buffer of any other
    module. Before, a DDP with ``find_unused_parameters=True, broadcast_buffers=False`` (a
    detection model keeping each rank's BatchNorm statistics) had its buffers overwritten with
    rank 0's at every step and every ``fit``."""
    wrapper = ddp_wrapper(model)
    if wrapper is None:
        return list(model.buffers())
    if not wrapper.broadcast_buffers:
        return []
    ignored = getattr(wrapper, "parameters_to_ignore", ())  # read now: a module may reassign its buffers
    return [buffer for name, buffer in wrapper.module.named_buffers() if name not in ignored]


# -- the gradient all-reduce ------------------------------------------------------------------
def missing_grads(params: list[torch.Tensor]) -> int:
    """How many of ``params`` have no gradient on this rank (0 in a dense model): the ranks
    compare it in their vote, and only when some rank misses one do they learn which."""
    return sum(1 for param in params if param.grad is None)


def flatten_grads(params: list[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """One flat gradient buffer per dtype (zeros for a parameter with no gradient here), made
    before the vote: an OOM while allocating it is a local failure like any other."""
    groups: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for param in params:
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        groups[param.dtype].append(grad.reshape(-1))
    return {dtype: torch.cat(grads) for dtype, grads in groups.items()}


def reduce_grads(params: list[torch.Tensor], flats: dict[torch.dtype, torch.Tensor], weight: float, label: str, *,
                 some_missing: bool) -> None:
    """After a vote every rank passed: ``param.grad`` = the sum over the ranks of ``weight``
    times each rank's gradient. As DDP (``find_unused_parameters``) does it, a parameter
    without a gradient on some ranks counts zero there, and one without a gradient on
    *every* rank keeps ``grad = None`` (the optimizer then leaves it alone: no weight decay,
    no momentum, no state). ``some_missing``: some rank lacks a gradient (the vote said so,
    the same on every rank); only then is the presence of each one all-reduced."""
    keep = None
    if some_missing:
        present = torch.tensor([float(p.grad is not None) for p in params], device=dist_sync.sync_device())
        keep = (dist_sync.all_reduce_sum_(present, f"{label}: which gradients exist") > 0).tolist()
    for dtype, flat in flats.items():
        flat.mul_(weight)
        dist_sync.all_reduce_sum_(flat, f"{label}: gradient all-reduce ({dtype})")
    _unflatten(params, flats, keep)
    flats.clear()


def _unflatten(params: list[torch.Tensor], flats: dict[torch.dtype, torch.Tensor], keep: list[bool] | None) -> None:
    """Copy the summed gradients back into ``param.grad`` (only where ``keep`` says so)."""
    offsets: dict[torch.dtype, int] = defaultdict(int)
    for index, param in enumerate(params):
        flat = flats[param.dtype]
        start = offsets[param.dtype]
        piece = flat[start : start + param.numel()].view_as(param)
        offsets[param.dtype] = start + param.numel()
        if keep is not None and not keep[index]:
            continue  # no rank had a gradient for it: it stays None, as under DDP
        if param.grad is None:
            param.grad = piece.clone()
        else:
            param.grad.copy_(piece)


class CollectiveDataParallel(DataParallel):
    """The runner's step under ``torch.distributed`` (installed by :mod:`autobatch.dist`).

    A DDP model that :func:`~autobatch.dist.ddp_step.ddp_supported` accepts trains through
    DDP itself (:func:`~autobatch.dist.ddp_step.ddp_step`: bucketed all-reduce overlapped
    with the last backward, buffers broadcast as DDP does). Anything else (a plain module, a
    DDP with ``find_unused_parameters``, a comm hook of the user's) trains its local module
    with :func:`synced_step`, and rank 0's buffers are broadcast after each step (those DDP
    broadcasts: :func:`forward_synced_buffers`)."""

    def exchange(self, values: list[int], label: str) -> list[list[int]]:
        return dist_sync.exchange(values, label)

    def request_stop(self) -> None:
        stopping.request()  # rides on the next sync point to every rank

    def stop_agreed(self) -> bool:
        return stopping.agreed()

    def clear_stop(self) -> None:
        stopping.clear()

    def active(self) -> bool:
        return dist_sync.is_distributed()

    def world_size(self) -> int:
        return dist_sync.world_size()

    def is_rank_zero(self) -> bool:
        return dist_sync.is_rank_zero()

    def rank(self) -> int:
        return dist_sync.rank()

    def local_module(self, model: torch.nn.Module) -> torch.nn.Module:
        check_whole_world(model)  # at the runner's start: a DDP over a sub-group is refused
        refuse_fsdp1(model)  # taken for a DDP-like wrapper, its inner module failed in autograd
        remember_world(model)  # fit() checks that it still runs there
        warn_compiled_wrapper(model)
        warn_forward_collectives(model)
        if ddp_supported(model):
            return model
        wrapper = ddp_wrapper(model)
        if wrapper is not None:
            warn_unused_ddp_options(wrapper, comm_hook_name(wrapper))
        return unwrap(model)

    def check_world(self, model: torch.nn.Module) -> None:
        check_same_world(model)  # not after destroy_process_group(): no rank would vote or all-reduce

    def start(self, model: torch.nn.Module) -> None:
        # the runner's model as given: a DDP wrapper's parameters are its local module's, and its
        # buffers are those it broadcasts itself
        dist_sync.broadcast_([*model.parameters(), *forward_synced_buffers(model)], "runner: initial weights")

    def step(self, train_step, micro_batches, *, local_size, on_phase, phase, label, global_batch=None):
        if ddp_supported(train_step.model):
            return ddp_step(
                train_step, micro_batches, local_size=local_size, on_phase=on_phase, phase=phase, label=label,
                global_batch=global_batch or local_size * dist_sync.world_size(),
            )
        return synced_step(train_step, micro_batches, local_size=local_size, on_phase=on_phase, phase=phase, label=label)

    def after_step(self, model: torch.nn.Module, label: str) -> None:
        if not ddp_supported(model):
            buffers = forward_synced_buffers(model)
            if buffers:
                dist_sync.broadcast_(buffers, f"{label}: buffers")
        settle(model, label)  # DDP's buffers sent now, and no DDP forward between steps sends them

    def agree_plan(self, planned):
        return agree_plan(planned)
