"""What a plan's split changes beyond memory: batch statistics (BatchNorm in training), spectral norm.

Gradient accumulation is exact for a loss that is a mean over samples of per-sample terms
(:mod:`autobatch.planning.accumulation`). BatchNorm in training mode breaks that: it
normalises each forward's samples with their own mean and variance, so a plan of several
micro-batches trains otherwise than one batch of the global size would (gradients, and the
running statistics it tracks; GroupNorm and LayerNorm do not depend on the batch). A plan
that splits such a model says so (a note and a warning) instead of passing for exact.
Spectral norm in training mode is alike: every forward runs a power iteration that moves its
estimate of the weight's largest singular value, so each micro-batch trains another normalised
weight (a tiny MLP's accumulated gradient was 0.3 % off one batch's, where the plan passed for
exact); :func:`power_iteration_note` says so.
"""

from __future__ import annotations

import torch

from .recompute_state import spectral_norm_layers

__all__ = ["batch_statistics_note", "batch_norm_layers", "power_iteration_note", "power_iteration_layers", "BATCH_STATISTICS", "POWER_ITERATION"]

#: how the note begins (the runner that planned does not warn a second time)
BATCH_STATISTICS = "BatchNorm in training mode ("
#: how the spectral-norm note begins
POWER_ITERATION = "Spectral norm in training mode ("


def batch_statistics_note(model: torch.nn.Module, sizes: list[int]) -> str | None:
    """A note for a plan whose micro-batches (``sizes``, more than one) meet BatchNorm layers of
    ``model`` in training mode; None where the split changes no batch statistics."""
    shown = batch_norm_layers(model) if len(sizes) >= 2 else None
    if shown is None:
        return None
    smallest = min(sizes)
    return (
        f"{BATCH_STATISTICS}{shown}) normalises each micro-batch with its own statistics: micro-batches "
        f"of {max(sizes)}{'' if smallest == max(sizes) else f' to {smallest}'} train otherwise than one batch of "
        f"{sum(sizes)} would (gradients and running statistics), unlike the rest of the plan's accumulation, which "
        "is exact. Where that matters: more memory (larger micro-batches), multiple_of=N (no micro-batch below N "
        "samples), or GroupNorm / LayerNorm (they do not depend on the batch)"
    )


def batch_norm_layers(model: torch.nn.Module) -> str | None:
    """``model``'s BatchNorm layers in training mode, named (the first three and a count); None
    where it has none."""
    return _shown([f"{name or 'the model'}: {type(module).__name__}" for name, module in model.named_modules()
                   if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training])


def power_iteration_layers(model: torch.nn.Module) -> str | None:
    """``model``'s layers whose forward runs a spectral-norm power iteration now (training mode),
    named (the first three and a count); None where it has none."""
    return _shown(spectral_norm_layers(model))


def _shown(names: list[str]) -> str | None:
    """The first three of ``names`` and a count of the rest; None for none."""
    if not names:
        return None
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def power_iteration_note(model: torch.nn.Module, sizes: list[int]) -> str | None:
    """A note for a plan whose micro-batches (``sizes``, more than one) meet spectral-norm layers
    in training mode: each forward runs a power iteration that updates ``sigma``'s estimate, so
    ``len(sizes)`` micro-batches train ``len(sizes)`` slightly different normalised weights (and
    run as many iterations) where one batch trains one. None where there is none."""
    shown = power_iteration_layers(model) if len(sizes) >= 2 else None
    if shown is None:
        return None
    return (
        f"{POWER_ITERATION}{shown}) runs a power iteration in every forward: the plan's {len(sizes)} micro-batches "
        f"per step divide the weight by {len(sizes)} successive estimates of its largest singular value where one batch "
        f"of {sum(sizes)} would use one, so their accumulated gradient differs slightly from that batch's (and the "
        "estimate advances faster). Where that matters: more memory (one step), or n_power_iterations large enough "
        "that the estimate has converged"
    )
