"""What an FSDP2 step needs beyond FSDP's own collectives: equal passes, plain parameters, one mesh.

* :func:`equal_passes` - every rank runs the same number of forward/backward passes. Each
  pass of an FSDP2 model is a run of collectives (every block all-gathered in forward and
  again in backward, the last pass's gradients reduce-scattered), so a rank whose share
  splits into fewer micro-batches than a peer's (a global batch of 16 cut 10 / 6 with
  micro-batch 4: 3 passes against 2) left the peer waiting in an all-gather that never came.
  The rank with fewer runs the difference first, as passes over its first micro-batch whose
  loss is multiplied by zero: the same collectives, no gradient, no loss. The step's
  weighting (each micro-batch's loss times ``n * world / global``, then FSDP's mean over the
  ranks) is untouched, so the gradient stays the mean over the global batch. Buffers that
  those passes' forward changed (BatchNorm statistics) are put back before the real passes.
* :func:`sync_plain_grads` - a model of which only some submodules are ``fully_shard`` -ed
  (its blocks, not its root) keeps its other parameters plain and replicated; FSDP never
  reduces their gradients, so the ranks' copies trained apart. After a vote, their gradients
  are all-reduced (the mean over the ranks, as FSDP's); one without a gradient on every rank
  keeps ``None``.
* :func:`check_mesh` - the step weights, votes and averages over every rank of the job: an
  FSDP mesh of fewer ranks, or of more than one dimension (HSDP, whose gradient all-reduce no
  vote guards), is one clear error at the start. :func:`check_clipping` -
  ``max_grad_norm`` on a model sharded in parts is one too (torch's ``clip_grad_norm_``
  cannot take sharded and plain gradients together; it failed mid-step on every rank).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from .. import checks
from ..memory.units import counted
from ..probe.snapshot.shards import is_dtensor
from . import agreement as dist_sync
from .step import flatten_grads, missing_grads, reduce_grads

__all__ = ["micro_batch_count", "equal_passes", "sync_plain_grads", "check_mesh", "check_clipping"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def micro_batch_count(micro_batches: Iterable[Any]) -> int:
    """How many micro-batches this rank has (the ranks compare it before the first pass).
    ``TypeError`` (on every rank alike) for an iterable without a length."""
    if not hasattr(micro_batches, "__len__"):
        raise TypeError(
            "an FSDP2 step needs its micro-batches' count before the first one runs (the ranks must run the same "
            f"number of passes); got {type(micro_batches).__name__} without a length: pass a list or LazyMicroBatches"
        )
    return len(micro_batches)  # type: ignore[arg-type]


def equal_passes(
    model: torch.nn.Module, loss_fn: LossFn, micro_batches: Any, count: int, passes: int
) -> tuple[Any, LossFn]:
    """``(micro_batches, loss_fn)`` to accumulate over, ``passes`` of them where this rank has
    ``count`` micro-batches: unchanged when they are equal, else led by ``passes - count``
    zero-weighted passes over the first micro-batch (see the module)."""
    if passes == count:
        return micro_batches, loss_fn
    if count == 0:
        raise ValueError("this rank has no samples in a step where other ranks have some: give every rank a share")
    return _Padded(micro_batches, passes - count), _PaddingLoss(loss_fn, passes - count, model)


class _Padded:
    """``micro_batches`` led by ``padding`` more passes over its first one (held meanwhile;
    let go before its own pass, so the real passes hold their inputs as they did)."""

    def __init__(self, micro_batches: Any, padding: int) -> None:
        self.micro_batches = micro_batches
        self.padding = padding

    def __len__(self) -> int:
        return len(self.micro_batches) + self.padding

    def __iter__(self) -> Iterator[Any]:
        items = iter(self.micro_batches)
        held = [next(items)]
        for _ in range(self.padding):
            yield held[0]
        yield held.pop()
        yield from items


class _PaddingLoss:
    """``loss_fn`` whose first ``padding`` calls return the loss times zero (a pass that runs
    every collective of a real one and adds nothing); at the first real call, the buffers the
    padding forwards changed are put back as they were."""

    def __init__(self, loss_fn: LossFn, padding: int, model: torch.nn.Module) -> None:
        self.loss_fn = loss_fn
        self.left = padding
        self.buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]

    def __call__(self, model: torch.nn.Module, micro: Any) -> torch.Tensor:
        if self.left:
            self.left -= 1
            return checks.loss("loss_fn", self.loss_fn(model, micro)) * 0.0
        if self.buffers:  # the padding passes' backward is done: nothing holds these any more
            with torch.no_grad():
                for buffer, saved in self.buffers:
                    buffer.copy_(saved)
            self.buffers = []
        return self.loss_fn(model, micro)


def _plain_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [param for param in model.parameters() if param.requires_grad and not is_dtensor(param)]


def sync_plain_grads(model: torch.nn.Module, ballot: Any) -> None:
    """The gradients of ``model`` 's plain (not sharded) trainable parameters, averaged over
    the ranks; nothing for a model sharded as a whole. The flat buffer is allocated before a
    vote of ``ballot`` (an OOM there is this rank's failure, voted on), and the all-reduce runs
    only after every rank voted that it has its gradients."""
    params = _plain_params(model)
    if not params:
        return
    flats = flatten_grads(params)
    rows = ballot.vote(payload=missing_grads(params))
    reduce_grads(params, flats, 1.0 / len(rows), f"{ballot.label}: plain parameters",
                 some_missing=any(row[0] for row in rows))


def check_mesh(model: torch.nn.Module) -> None:
    """``ValueError`` unless every sharded parameter of ``model`` lives on a 1-D mesh of all the
    job's ranks: the step weights by, votes over and averages over every rank of the job, and
    only FSDP's all-gathers and reduce-scatters are voted on. A mesh of more dimensions (HSDP's
    ``(replicate, shard)``, a tensor-parallel one) adds collectives no vote guards (HSDP's
    gradient all-reduce): a one-rank OOM left the other ranks in it until the sync deadline."""
    world = dist_sync.world_size()
    for name, param in model.named_parameters():
        if is_dtensor(param) and param.device_mesh.ndim != 1:
            raise ValueError(
                f"{name} is sharded over a {param.device_mesh.ndim}-D mesh {tuple(param.device_mesh.shape)}; autobatch "
                "votes on FSDP2's all-gathers and reduce-scatters only, and the all-reduce over a replicate (HSDP) or "
                "tensor-parallel dimension would leave the other ranks waiting in it after one rank's OOM: "
                "fully_shard over a 1-D mesh of all ranks (init_device_mesh(device, (world_size,)))"
            )
        if is_dtensor(param) and param.device_mesh.size() != world:
            raise ValueError(
                f"{name} is sharded over a mesh of {counted(param.device_mesh.size(), 'rank')} and the job has {world}; autobatch "
                "splits each global batch over every rank of the job: fully_shard over a mesh of all ranks "
                "(init_device_mesh(device, (world_size,))), or launch each group as its own torchrun job"
            )


def check_clipping(model: torch.nn.Module, max_grad_norm: float | None) -> None:
    """``ValueError`` when ``max_grad_norm`` is set on a model with sharded *and* plain
    trainable parameters (raised on every rank alike, before the step's first vote)."""
    if max_grad_norm is not None and _plain_params(model):
        raise ValueError(
            "max_grad_norm on a model of which only some submodules are fully_shard-ed: torch's clip_grad_norm_ "
            "cannot mix sharded (DTensor) and plain gradients; fully_shard the root module too "
            "(fully_shard(model, mesh=mesh) after its blocks), or leave max_grad_norm unset"
        )
