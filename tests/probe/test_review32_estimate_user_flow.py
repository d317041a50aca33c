"""Review 32: the estimate on steps users bring (tiny GPT-2, BERT, T5 and Llama, a torchvision detector, a
model branching on its data). A ``loss_fn`` returning a tuple was refused as a limit of fake tensors (its
message shows the tuple, whose fake tensors' repr says "FakeTensor"), telling the user to probe with trials,
which raise the same ``TypeError``; and a step reading a value raised its ``EstimateError`` under some 90
lines of PyTorch's dispatch and fake-tensor frames, the cause's traceback now ends at the user's line."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autobatch import EstimateError, TrainStep, estimate_max_batch


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x)
        if hidden.sum() > 0:  # reads a value: fake tensors have none
            hidden = hidden * 2
        return self.b(hidden)


def _step(model: nn.Module, loss) -> TrainStep:
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, lambda n: torch.randn(n, 8))


def test_review32_estimate_raises_a_tuple_loss_as_the_steps_own_type_error():
    model = nn.Linear(8, 8)
    with pytest.raises(TypeError, match="must return the loss as a scalar tensor") as info:
        estimate_max_batch(_step(model, lambda m, x: (F.mse_loss(m(x), x), m(x))), "1MiB", max_batch=64)
    assert not isinstance(info.value, EstimateError)
    assert any("raised by the training step while autobatch traced it" in note for note in info.value.__notes__)


def test_review32_estimate_cause_ends_at_the_users_line():
    with pytest.raises(EstimateError, match=r"if tensor:.*in forward") as info:
        estimate_max_batch(_step(_Branches(), lambda m, x: F.mse_loss(m(x), x)), "1MiB", max_batch=64)
    tb, frames = info.value.__cause__.__traceback__, []
    while tb is not None:
        frames.append((tb.tb_frame.f_globals.get("__name__"), tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    assert frames[-1] == (__name__, "forward")
    assert not any(module.startswith(("torch._", "autobatch.memory")) for module, _ in frames)
