"""Review 33: state a model carries between forwards on a module (a stateful GRU for truncated
BPTT, ``self.hidden`` ``[layers, B, H]``) belongs to the samples of the batch that made it. Split into
micro-batches each forward read another micro-batch's state, silently; an OOM replay's smaller
pieces raised torch's "Expected hidden size (2, 4, 4), got [2, 8, 4]" with a note blaming BatchNorm.
Now the first split step warns naming the attribute, and the error gets a note saying what to do
(:mod:`autobatch.training.carried_state`)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import autobatch

B = 8


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 4, num_layers=2, batch_first=True)
        self.head = nn.Linear(4, 1)
        self.hidden = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, hidden = self.rnn(x, self.hidden)
        self.hidden = hidden.detach()  # carried to the next step
        return self.head(out[:, -1])


def _runner(micro_batch: int) -> tuple[autobatch.Runner, list]:
    torch.manual_seed(0)
    model = Stateful()
    data = [(torch.randn(B, 5, 3), torch.randn(B, 1)) for _ in range(3)]
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), global_batch=B, micro_batch=micro_batch,
                              progress=False)
    return runner, data


def test_review33_carried_state_is_warned_at_the_first_split_step_and_noted_on_a_replays_error(caplog):
    runner, data = _runner(4)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(data)
    warned = [r.getMessage() for r in caplog.records if "kept on the module" in r.getMessage()]
    assert len(warned) == 1 and "model.hidden (2, 4, 4)" in warned[0] and "register_buffer" in warned[0]

    runner, data = _runner(B)
    autobatch.inject_oom(runner, at=[(1, "forward")], times=1)  # replayed in micro-batches of 4
    with pytest.raises(RuntimeError, match="Expected hidden size") as raised:
        runner.fit(data)
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "model.hidden (2, 8, 4)" in notes and "torch.arange(8)" in notes and "BatchNorm" not in notes
    assert runner.step == 1  # the failed step undone, the first one kept



class Cached(nn.Module):
    """Review 34: attention weights kept for plotting, sized by the micro-batch, never read back."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.last_attn = nn.Linear(3, 1), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = torch.softmax(self.proj(x).squeeze(-1), dim=-1)
        self.last_attn = attn.detach()  # [B, 5]: written only
        return (attn.unsqueeze(-1) * x).sum(1).sum(-1, keepdim=True)


class ReadsCache(Cached):
    def _previous(self, x: torch.Tensor) -> torch.Tensor:  # a helper forward calls: its read is followed
        return self.last_attn if self.last_attn is not None and len(self.last_attn) == len(x) else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = torch.softmax(self.proj(x).squeeze(-1) + self._previous(x), dim=-1)
        self.last_attn = attn.detach()
        return (attn.unsqueeze(-1) * x).sum(1).sum(-1, keepdim=True)


@pytest.mark.parametrize("read_back", [False, True])
def test_review34_write_only_cache_is_not_warned_as_carried_state(caplog, read_back):
    torch.manual_seed(0)
    model = ReadsCache() if read_back else Cached()
    data = [(torch.randn(B, 5, 3), torch.randn(B, 1)) for _ in range(2)]
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), global_batch=B, micro_batch=4,
                              progress=False)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(data)
    warned = [r.getMessage() for r in caplog.records if "kept on the module" in r.getMessage()]
    assert len(warned) == int(read_back) and all("model.last_attn (4, 5)" in w for w in warned)
