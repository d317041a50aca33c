"""Which of an optimizer's param groups run torch's foreach step, and the planner's note on it.

Kept in the probe layer because both the probe's step (:class:`~autobatch.probe.train_step.TrainStep`
records a trial whose OOM struck inside ``optimizer.step()``), the planner's error
(:mod:`autobatch.planning.plan_errors`) and the runner's recovery
(:mod:`autobatch.training.oom.optimizer_phase`, which switches such groups to ``foreach=False``)
ask it, and the pipeline's layers import one way. The foreach step allocates temporaries over a
whole param group (2.0 MiB for 2.0 MiB of AdamW parameters on the CPU's simulated device, 0.5 MiB
per tensor without it), which no smaller batch shrinks: a plan whose every size ran out of memory
there walked down to batch 1 and advised activation checkpointing, which cannot help either.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["FOREACH_ADVICE", "FOREACH_LOG_ADVICE", "drop_foreach", "foreach_groups", "foreach_note"]

#: the words of :func:`foreach_note` that say what to change (the command line names its override instead)
FOREACH_ADVICE = "Build it with foreach=False"
#: the words of the switch's warnings that say what to change (the command line rewrites them as its override:
#: :mod:`autobatch.cli.log_advice`)
FOREACH_LOG_ADVICE = "build the optimizer with foreach=False to start so"

log = logging.getLogger("autobatch")


def foreach_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The param groups of ``optimizer`` whose step runs torch's foreach implementation: ``foreach=True``,
    or left ``None`` where torch picks it (every parameter on a device it has foreach kernels for,
    not differentiable), and not ``fused``. Empty for an optimizer without a ``foreach`` option."""
    if "foreach" not in optimizer.defaults:
        return []
    chosen = []
    for group in optimizer.param_groups:
        foreach = group.get("foreach")
        if group.get("fused") or foreach is False:
            continue
        if foreach is None:
            try:
                from torch.optim.optimizer import _default_to_fused_or_foreach

                _, foreach = _default_to_fused_or_foreach(list(group["params"]), bool(group.get("differentiable")), False)
            except (ImportError, TypeError):  # a torch without it: its default, foreach on CUDA tensors
                foreach = all(p.is_cuda for p in group["params"])
        if foreach:
            chosen.append(group)
    return chosen


def drop_foreach(optimizer: torch.optim.Optimizer, cause: str, then: str = "") -> None:
    """Switch ``optimizer``'s foreach param groups to ``foreach=False``, and its default (a param group
    added later steps per tensor too), with the one warning that says so after ``cause`` (and
    ``then``, what the caller does next): the runner's answer to a foreach step that does not fit,
    both where it plans its micro-batch and where it recovers a step."""
    for group in foreach_groups(optimizer):
        group["foreach"] = False
    optimizer.defaults["foreach"] = False
    log.warning("%s: the optimizer's param groups now step with foreach=False for the rest of the run (torch's "
                "per-tensor step, whose temporaries are one parameter's, not a whole group's; the same update, to "
                "float rounding)%s; %s", cause, then, FOREACH_LOG_ADVICE)


def foreach_note(optimizer: torch.optim.Optimizer, batch_size: int) -> str:
    """The first words of a plan's ``NoBatchFitsError`` whose smallest batch (``batch_size``) ran out of
    memory inside ``optimizer.step()``: what the batch does not size and what to change ("" where no
    group runs the foreach step: the optimizer's state itself does not fit, as the rest of the hint says)."""
    if not foreach_groups(optimizer):
        return ""
    return (f"Batch {batch_size} ran out of memory inside optimizer.step(), after its backward, and no batch size "
            f"shrinks that step: {type(optimizer).__name__} runs torch's foreach step (foreach=True, or torch's "
            f"default on this device), whose temporaries span a whole param group. {FOREACH_ADVICE} "
            "(per-tensor temporaries, the same update; the Runner switches to it itself, when it plans its micro-batch "
            "or after a second OOM there) and plan again; if that does not fit either, the optimizer's state does not. ")
