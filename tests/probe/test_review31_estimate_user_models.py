"""Review 31: the estimate on steps users bring. A step that keeps its activations from call to call
(a leak) was estimated with nothing said, where a probe's trial notes it; a step that reads a value by
``.numpy()`` or formats its loss (to log it) was refused in torch's words of a "tensor subclass"; a model
given where a ``TrainStep`` goes was refused without saying what to pass."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autobatch import EstimateError, TrainStep, estimate_max_batch, estimate_memory, estimate_peak, find_max_batch


class _Keeps(nn.Module):
    """Appends each step's hidden activations (with their graph) to a list: memory held grows every step."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.kept = nn.Linear(8, 32), nn.Linear(32, 8), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x)
        self.kept.append(hidden)
        return self.b(hidden)


def _step(model: nn.Module, loss=None) -> TrainStep:
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     loss or (lambda m, x: F.mse_loss(m(x), x)), lambda n: torch.randn(n, 8))


def test_review31_estimate_notes_a_step_whose_held_memory_keeps_growing():
    """The trace ran four steps, growing each, and answered for the fourth: training at that size runs
    out of memory later. The answer says so (a warning from estimate_max_batch, and a note under
    strategy="estimate"); a step that does not grow gets none, and the model's list is put back."""
    model = _Keeps()
    result = find_max_batch(_step(model), strategy="estimate", memory_limit="256KiB", max_batch=8, cache=False)
    assert result.batch_size == 8 and model.kept == []
    assert any(note.startswith("memory held between steps grew by") and "keeps tensors alive from call to call" in note
               for note in result.notes)
    assert estimate_memory(_step(nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8))), 8).held_growth_bytes == 0


def test_review31_estimate_names_a_value_read_by_numpy_or_a_format_string():
    """torch said ".numpy() is not supported for tensor subclasses" / "unsupported format string passed to
    FakeTensor.__format__": the message now says the step reads a value, and to log outside the step."""
    for read in (lambda loss: np.asarray(loss.detach()).sum(), lambda loss: f"{loss:.3f}"):
        def loss_fn(model: nn.Module, x: torch.Tensor, read=read) -> torch.Tensor:
            loss = F.mse_loss(model(x), x)
            read(loss)
            return loss

        with pytest.raises(EstimateError, match=r"reads a tensor's value in Python.*log outside the loss_fn"):
            estimate_peak(_step(nn.Linear(8, 8), loss_fn), 2)


def test_review31_estimate_of_a_model_says_to_wrap_it_in_a_train_step():
    """``estimate_max_batch(model, ...)`` said only "not Linear"."""
    with pytest.raises(EstimateError, match=r"not Linear \(a model\): pass autobatch\.TrainStep\(model, optimizer"):
        estimate_max_batch(nn.Linear(8, 8), "1MiB")
