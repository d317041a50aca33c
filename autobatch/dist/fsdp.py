"""FSDP2 (``fully_shard``) models in the probe and the runner, across ranks, without a hang.

Unlike DDP, an FSDP2 step cannot run "locally first": its forward and backward *are*
collectives (each block's parameters are all-gathered before it runs). So the trials and the
runner's steps run FSDP's collectives, each guarded by a vote (:mod:`.fsdp_guard`): a rank
that runs out of memory anywhere in the step leaves FSDP's state reset and casts one
"failed" vote; its peers see it at their next collective and leave the step too. Then every
rank takes the same recovery: the probe records a failed trial, the runner halves the
micro-batch and replays the global batch (undoing a half-applied optimizer step from its
:class:`~autobatch.training.oom.step_guard.StepGuard`, which keeps local shards).

* :func:`fsdp_step` - the runner's global step: a vote that exchanges the ranks' sample and
  micro-batch counts, forward/backward of every micro-batch (gradient sync off for all but
  the last, so one reduce-scatter per step; every rank runs as many passes as the rank with
  the most micro-batches, :mod:`.fsdp_passes`), the plain parameters' all-reduce of a model
  sharded only in parts, the optimizer step, a closing vote, the loss all-reduce.
* :class:`VotedTrainStep` - a :class:`~autobatch.TrainStep` whose call is one voted step (the
  probe's trials).
* :class:`FsdpDataParallel`, :class:`FsdpProbeAgreement` - the seams' implementations: FSDP
  models take the paths above, every other model the DDP ones (:mod:`.step`, :mod:`.probe`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .. import checks
from ..memory.oom import free_memory
from ..planning.accumulation import accumulate_loss_sum
from ..probe.snapshot.shards import check_optimizer_after_sharding as check_optimizer, is_dtensor
from ..probe.train_step import TrainStep
from ..training.ranks import DataParallel
from . import agreement as dist_sync
from .fsdp_guard import guard, is_fsdp, no_gradient_sync, reset, voting
from .fsdp_passes import check_clipping, check_mesh, equal_passes, micro_batch_count, sync_plain_grads
from .joining import check_same_world, remember_world
from .votes import keep as _keep
from .probe import CollectiveProbeAgreement
from .step import CollectiveDataParallel

__all__ = ["shard_model", "full_state_dict", "fsdp_step", "VotedTrainStep", "FsdpDataParallel", "FsdpProbeAgreement"]


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` each repeated block of ``model`` (the children of its ``nn.ModuleList`` s)
    and then ``model`` itself, over every rank (a 1-D mesh on the model's device type). Needs a
    process group of more than one rank (``torchrun``); returns ``model``, sharded in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist_sync.is_distributed():
        raise ValueError("train.fsdp=true shards the model over ranks: launch with torchrun --nproc-per-node N (N > 1)")
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist_sync.world_size(),))
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return guard(model)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded ``state_dict`` of an FSDP2 model, as plain CPU tensors on rank 0
    (empty elsewhere): what ``model.state_dict()`` of the unsharded model would hold, so it
    loads with ``torch.load(weights_only=True)`` into the model before ``fully_shard``. A
    collective: every rank must call it (PyTorch's ``get_model_state_dict`` with
    ``full_state_dict=True, cpu_offload=True`` all-gathers one tensor at a time)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _vote_before_clipping(step: TrainStep, ballot) -> None:
    """Clipping sharded gradients all-reduces their norms, a collective the guard does not
    vote on: every rank first says it has its gradients, so a rank that failed before the
    optimizer phase is seen here, not left waiting in the norm's all-reduce."""
    if step.max_grad_norm is not None:
        ballot.vote()


def _after_failure(step: TrainStep) -> None:
    """A step raised on this rank: FSDP back to idle, partial gradients dropped, memory freed."""
    reset(step.model)
    step.clear_grads()
    free_memory()


def fsdp_step(
    step: TrainStep,
    micro_batches: Iterable[Any],
    *,
    local_size: int,
    on_phase: Callable[[str], None],
    phase: Callable[[], str],
    label: str,
) -> tuple[float | torch.Tensor, int]:
    """One optimizer step of an FSDP2 model over every rank's micro-batches; returns (mean loss
    over the global batch, global batch size), the same on every rank (on an accelerator the
    loss is a 0-dim tensor still being computed: ``float()`` reads it). Any rank's failure
    raises on every rank (its own error there, a peer error elsewhere), with FSDP reset."""
    model = guard(step.model)
    check_clipping(model, step.max_grad_norm)
    check_optimizer(model, step.optimizer)
    count = micro_batch_count(micro_batches)
    step.optimizer.zero_grad(set_to_none=True)
    with voting(label, phase) as ballot:
        rows = ballot.vote(payload=(local_size, count))  # every rank enters the step: the sizes and counts
        global_size, world = sum(row[0] for row in rows), len(rows)
        try:
            # FSDP averages gradients over the ranks; weighting each micro-batch by
            # n * world / global makes that the mean over the global batch, shares unequal or not
            # (and each micro-batch is a run of collectives: every rank runs as many passes as the
            # rank with the most, the extra ones weighted zero)
            micro_batches, loss_fn = equal_passes(model, step.loss_fn, micro_batches, count, max(row[1] for row in rows))
            loss_sum, _ = accumulate_loss_sum(
                model, loss_fn, micro_batches, global_batch=global_size / world,
                autocast=step.autocast, grad_scaler=step.grad_scaler,
                no_sync=lambda: no_gradient_sync(model), on_phase=on_phase,
            )
            sync_plain_grads(model, ballot)
            on_phase("optimizer")
            _vote_before_clipping(step, ballot)
            step.optimizer_step()
            ballot.vote()  # every rank stepped
        except Exception as exc:  # noqa: BLE001 - voted on, then re-raised
            failure = _keep(exc)
            del exc
            _after_failure(step)
            ballot.fail(failure)
    step.optimizer.zero_grad(set_to_none=True)
    total = loss_sum.detach().reshape(1).to(torch.float64)
    if total.device.type == "cpu":
        return float(dist_sync.all_reduce_sum_(total, f"{label}: loss").item()) / global_size, global_size
    # every rank passed the closing vote, so every rank enters this all-reduce; it is queued,
    # not waited for: the loss is read when reported, and the host never waits for the device
    torch.distributed.all_reduce(total, async_op=True).wait()
    return total[0] / global_size, global_size


class VotedTrainStep(TrainStep):
    """A :class:`~autobatch.TrainStep` on an FSDP2 model whose every call is one voted step, so
    a trial that runs out of memory on one rank fails on every rank instead of hanging."""

    lockstep = True  # every call runs collectives: ranks make the same calls (ProbeAgreement.settle_more)

    def __init__(self, inner: TrainStep) -> None:
        super().__init__(
            inner.model, inner.optimizer, inner.loss_fn, inner.make_batch, **inner.options()
        )
        guard(self.model)
        self._calls = 0

    def __call__(self, batch_size: int) -> None:
        self._calls += 1
        where = ["forward"]
        with voting(f"probe trial {self._calls} at batch {batch_size}", lambda: where[0]) as ballot:
            ballot.vote(payload=batch_size)
            batch = loss = None
            try:
                self.optimizer.zero_grad(set_to_none=True)
                batch = self.make_batch(batch_size)
                with self.autocast():
                    loss = checks.loss("loss_fn", self.loss_fn(self.model, batch))
                batch = None  # backward needs what autograd saved, not the inputs (as in training)
                where[0] = "backward"
                (self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss).backward()
                del loss
                sync_plain_grads(self.model, ballot)
                where[0] = "optimizer"
                _vote_before_clipping(self, ballot)
                self.optimizer_step()
                self.optimizer.zero_grad(set_to_none=True)
                ballot.vote()
            except Exception as exc:  # noqa: BLE001 - voted on, then re-raised
                failure = _keep(exc)
                del exc
                batch = loss = None  # the failed step's activations go now
                _after_failure(self)
                ballot.fail(failure)


class FsdpProbeAgreement(CollectiveProbeAgreement):
    """The probe's agreement: FSDP2 steps run voted (:class:`VotedTrainStep`); others as before."""

    def local_step(self, fn: Any) -> Any:
        if isinstance(fn, TrainStep) and not isinstance(fn, VotedTrainStep) and is_fsdp(fn.model):
            check_mesh(fn.model)
            check_clipping(fn.model, fn.max_grad_norm)
            check_optimizer(fn.model, fn.optimizer)
            from ..planning.accumulation import AccumulatingStep
            from .timing import LockstepAccumulatingStep

            if isinstance(fn, AccumulatingStep):  # the planner's accumulated probe: two voted micro-batches
                return fn if isinstance(fn, LockstepAccumulatingStep) else LockstepAccumulatingStep(fn)
            return VotedTrainStep(fn)
        return super().local_step(fn)


class FsdpDataParallel(DataParallel):
    """The runner's data parallelism: :func:`fsdp_step` for an FSDP2 model, else ``fallback``
    (:class:`~autobatch.dist.step.CollectiveDataParallel`, the DDP path)."""

    def __init__(self, fallback: DataParallel | None = None) -> None:
        self.fallback = fallback if fallback is not None else CollectiveDataParallel()

    def active(self) -> bool:
        return self.fallback.active()

    def world_size(self) -> int:
        return self.fallback.world_size()

    def is_rank_zero(self) -> bool:
        return self.fallback.is_rank_zero()

    def rank(self) -> int:
        return self.fallback.rank()

    def local_module(self, model: torch.nn.Module) -> torch.nn.Module:
        if not is_fsdp(model):
            return self.fallback.local_module(model)
        check_mesh(model)  # at the runner's start
        remember_world(model)  # fit() checks that it still runs there
        return model

    def check_world(self, model: torch.nn.Module) -> None:
        check_same_world(model)  # the world local_module() recorded, FSDP2 or not

    def start(self, model: torch.nn.Module) -> None:
        if not is_fsdp(model):
            return self.fallback.start(model)
        guard(model)
        # sharded parameters are each rank's own part of one model: nothing to broadcast;
        # plain (replicated) ones and buffers start as rank 0's
        plain = [t for t in [*model.parameters(), *model.buffers()] if not is_dtensor(t)]
        if plain:
            dist_sync.broadcast_(plain, "runner: initial replicated weights")

    def step(self, train_step, micro_batches, *, local_size, on_phase, phase, label, **extra):
        if not is_fsdp(train_step.model):
            return self.fallback.step(
                train_step, micro_batches, local_size=local_size, on_phase=on_phase, phase=phase, label=label, **extra
            )
        return fsdp_step(train_step, micro_batches, local_size=local_size, on_phase=on_phase, phase=phase, label=label)

    def after_step(self, model: torch.nn.Module, label: str) -> None:
        if not is_fsdp(model):
            return self.fallback.after_step(model, label)
        buffers = [b for b in model.buffers() if not is_dtensor(b)]
        if buffers:
            dist_sync.broadcast_(buffers, f"{label}: buffers")

    def agree_plan(self, planned: Any) -> Any:
        return self.fallback.agree_plan(planned)

    def exchange(self, values: list[int], label: str) -> list[list[int]]:
        return self.fallback.exchange(values, label)

    def request_stop(self) -> None:
        self.fallback.request_stop()

    def stop_agreed(self) -> bool:
        return self.fallback.stop_agreed()

    def clear_stop(self) -> None:
        self.fallback.clear_stop()

