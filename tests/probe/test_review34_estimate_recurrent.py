"""Review 34: the estimate on recurrent steps. A CPU ``nn.LSTM`` runs oneDNN's kernel, whose workspace fake
tensors do not see, so the model's is refused; one in the loss module (``loss_fn=criterion``, traced as the
model is) was not, and was estimated at 0.27 of the measured peak. An LSTM with ``proj_size``, which oneDNN
does not take, runs PyTorch's own kernel, which the trace counts exactly: it was refused all the same."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autobatch import EstimateError, TrainStep, estimate_memory, simulated_memory


class _SequenceCritic(nn.Module):
    """A loss module that reads the model's output with an LSTM and trains with it."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 32, batch_first=True)

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(model(x).unsqueeze(1).expand(-1, 6, -1))[0].square().mean()


def test_review34_estimate_refuses_an_lstm_in_the_loss_module():
    torch.manual_seed(0)
    model, critic = nn.Linear(16, 4), _SequenceCritic()
    step = TrainStep(model, torch.optim.Adam([*model.parameters(), *critic.parameters()]), critic,
                     lambda n: torch.randn(n, 16))
    with pytest.raises(EstimateError, match=r"loss_fn\.rnn is an LSTM on the CPU.*probe with real trials"):
        estimate_memory(step, 8)


class _Projected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(8, 32, batch_first=True, proj_size=16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def test_review34_estimate_counts_an_lstm_with_projections_exactly():
    def step() -> TrainStep:
        torch.manual_seed(0)
        model = _Projected()
        return TrainStep(model, torch.optim.Adam(model.parameters()), lambda m, b: F.mse_loss(m(b), b[:, -1, :1]),
                         lambda n: torch.randn(n, 3, 8))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "LSTM with projections is not supported with oneDNN")
        estimated = estimate_memory(step(), 16).step_peak_bytes
        measured = step()
        with simulated_memory("1GiB") as simulation:
            measured(16)
            measured(16)
    assert estimated == pytest.approx(simulation.peak_bytes, rel=0.005)
