"""The reference a split run is checked against: the same model trained one whole batch per step."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


def assert_trains_as_one_batch(model: torch.nn.Module, reference: torch.nn.Module, loader: Iterable[Any],
                               loss: Callable[[torch.nn.Module, Any], torch.Tensor], lr: float = 0.1) -> None:
    """Train ``reference`` (a copy of ``model`` before its run) with SGD at ``lr``, one optimizer step
    per batch of ``loader`` on ``loss``, and assert ``model``'s parameters (trained split) equal its."""
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for batch in loader:
        optimizer.zero_grad()
        loss(reference, batch).backward()
        optimizer.step()
    for trained, one_batch in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(trained, one_batch, rtol=1e-5, atol=1e-6)
