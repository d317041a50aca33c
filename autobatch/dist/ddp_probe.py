"""A probe trial step through DDP itself, so the measured peak is DDP training's.

DDP adds memory the local module does not show: its gradient buckets (as large as the
gradients, with ``gradient_as_bucket_view=False``), the bucket rebuild after the first
backward (new buckets allocated before the old are freed), the communication buffers of the
all-reduce. Probing the local module leaves them out of the measured step (the buckets are
resident once DDP is built, the rest is not), so :func:`~autobatch.find_max_batch` runs this
step instead: one forward and backward through DDP with the runner's protocol
(:mod:`autobatch.dist.ddp_step`), then the optimizer step, each phase ended by a vote.
``strategy="auto"``'s estimate (fake tensors, nothing runs) traces the local module instead:
it is only the prior the measured trials correct.
"""

from __future__ import annotations

import copy

import torch

from .. import checks
from ..memory.oom import free_memory
from ..probe.train_step import TrainStep
from . import agreement as dist_sync
from .ddp_step import check_reduced, complete_buckets, ledger_for, reset_after_failure, run_prologue
from .votes import keep, vote

__all__ = ["DDPProbeStep"]


def _tracing_fakes() -> bool:
    """Whether a fake-tensor trace (the estimator's) is running. Not any dispatch mode: the CPU's
    simulated device is one too, and under it the trials must run DDP itself (the test of
    "is any mode active" ran every simulated trial on the local module, so DDP's buckets and
    their rebuild were never measured: the answer then ran out of memory in DDP training)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


class DDPProbeStep(TrainStep):
    """``step`` (a :class:`~autobatch.TrainStep` on a DDP model) run through DDP: every rank
    fails a step together (an OOM on one rank is a
    :class:`~autobatch.errors.PeerOutOfMemoryError` on the others), none waits alone."""

    lockstep = True  # every call runs collectives: ranks make the same calls (ProbeAgreement.settle_more)

    def __init__(self, step: TrainStep) -> None:
        super().__init__(
            step.model, step.optimizer, step.loss_fn, step.make_batch, **step.options()
        )

    def __call__(self, batch_size: int) -> None:
        if _tracing_fakes():  # the estimator's fake tracing: no collective can run
            local = copy.copy(self)
            local.model = self.model.module
            TrainStep.__call__(local, batch_size)
            return
        model = self.model
        ledger = ledger_for(model)
        label = f"probe step at batch {batch_size}"
        self.optimizer.zero_grad(set_to_none=True)
        forward_sync = run_prologue(model, label)
        failure = None
        ledger.begin(1.0 / dist_sync.world_size())
        try:  # the hook is DDP's default again afterwards, whatever happens (BucketLedger.end)
            try:
                batch = self.make_batch(batch_size)
                with self.autocast():
                    loss = checks.loss("loss_fn", self.loss_fn(model, batch))
                batch = None  # backward needs what autograd saved, not the inputs (as in training)
                (self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss).backward()
                del loss
                check_reduced(model, label)
            except Exception as exc:  # noqa: BLE001 - completed, voted on, re-raised
                failure = keep(exc)
            if failure is not None:
                batch = loss = None  # the failed step's graph (its activations): freed before the buckets' zeros
                self.clear_grads()
                free_memory(generation=1)  # the failure's objects are young (see free_memory)
                complete_buckets(model, ledger, f"{label}: completing DDP's gradient buckets")
        finally:
            ledger.end()
        vote(failure, "backward", batch_size, f"{label}: gradients ready", clear=self.clear_grads,
             on_failure=lambda: reset_after_failure(model, forward_sync))
        try:
            self.optimizer_step()
        except Exception as exc:  # noqa: BLE001 - voted on, re-raised
            failure = keep(exc)
        vote(failure, "optimizer", batch_size, f"{label}: optimizer stepped", clear=self.clear_grads)
        self.optimizer.zero_grad(set_to_none=True)
