"""The runner's count of the steps an fp16 ``GradScaler`` skipped (inf/NaN gradients).

A mixin of :class:`~autobatch.training.oom.recovery.OomRecovery` (so of :class:`~autobatch.Runner`):
the scaler's scale is taken before each step and compared after it; where it fell, the scaler
backed off and skipped the optimizer step. On an accelerator the comparison stays on the device
and is read when reported, so no step waits for it. On the CPU there is nothing to wait for, and
a tensor kept through the step or into the next is memory the probe's trial never held (on the
simulated device, whose answers fill the budget to the byte, the scale's copy and the pending
count were 12 bytes over the trial's peak): there the scale is read as a number and the count
added at once.
"""

from __future__ import annotations

import torch

__all__ = ["CountsSkips"]


class CountsSkips:
    """``_scale()`` before a step, ``_note_skip(before)`` after it, ``_count_skips()`` when reported."""

    def _scale(self) -> torch.Tensor | float | None:
        """The ``GradScaler``'s scale before a step, without the host waiting for the device
        (``get_scale()`` reads it with ``.item()``): its scale tensor copied on the device, a number
        where that device is the CPU, or its initial scale before its first step; None without an
        enabled scaler."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        scale = getattr(scaler, "_scale", None)
        if scale is None:
            return scaler.get_scale()
        return float(scale) if scale.device.type == "cpu" else scale.detach().clone()

    def _note_skip(self, before: torch.Tensor | float) -> None:
        """Count the step just applied as skipped where the scaler's scale fell below ``before``
        (it backs off on inf/NaN gradients and skips the optimizer step): on the device, added to
        ``result.skipped_steps`` when reported (:meth:`_count_skips`), so no step waits for it; on
        the CPU at once, so no tensor is kept into the next step."""
        after = getattr(self.grad_scaler, "_scale", None)
        if after is None:
            return
        if after.device.type == "cpu":
            self.result.skipped_steps += int(float(after) < float(before))
            return
        fell = (after < before).to(torch.int64).sum()
        pending = getattr(self, "_pending_skips", None)
        self._pending_skips = fell if pending is None else pending + fell

    def _count_skips(self) -> None:
        """Add the skipped steps counted on the device to ``result.skipped_steps`` (one read)."""
        pending = getattr(self, "_pending_skips", None)
        if pending is not None:
            self.result.skipped_steps += int(pending.item())
            self._pending_skips = None
