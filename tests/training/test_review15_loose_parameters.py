"""Parameters the optimizer does not train but forward changes (a MoCo-style momentum encoder)
are put back on a replay, as buffers are: the failed attempt's update is not applied twice. An
EMA copy updated in ``on_step_end`` (between steps) is no change of the step: neither copied
nor warned about; a frozen backbone is never copied."""

from __future__ import annotations

import logging

import torch
from torch import nn

from autobatch import FaultInjector, Runner

GLOBAL = 16


class Momentum(nn.Module):
    """A query encoder trained by the optimizer; a key encoder moved towards it in forward;
    a frozen layer nothing changes; an EMA copy of the query encoder (updated by the caller)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query, self.key, self.frozen, self.ema = (nn.Linear(6, 4).double() for _ in range(4))
        for parameter in [*self.key.parameters(), *self.frozen.parameters(), *self.ema.parameters()]:
            parameter.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for key, query in zip(self.key.parameters(), self.query.parameters()):
                key.mul_(0.9).add_(query, alpha=0.1)
        return (self.query(x) * self.key(self.frozen(x)[:, :0].sum(1, keepdim=True) + x)).sum(1, keepdim=True)


def run(fault):
    model = Momentum()
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(GLOBAL, 6, generator=generator, dtype=torch.float64),
             torch.randn(GLOBAL, 1, generator=generator, dtype=torch.float64)) for _ in range(3)]
    runner = Runner(model, torch.optim.SGD(model.query.parameters(), lr=0.1),
                    lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch=GLOBAL, micro_batch=8,
                    progress=False, grow_after=None, faults=FaultInjector([fault], times=1))

    def ema(info):
        with torch.no_grad():
            for average, query in zip(model.ema.parameters(), model.query.parameters()):
                average.mul_(0.5).add_(query, alpha=0.5)

    runner.fit(data, on_step_end=ema)
    return model, runner


def test_a_replay_does_not_apply_a_momentum_update_twice(caplog):
    # an OOM before any forward of the step (transfer) against one after the first micro-batch's forward
    reference, _ = run((1, "transfer"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        model, runner = run((1, "backward"))
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)
    told = [r.getMessage() for r in caplog.records if "outside the optimizer" in r.getMessage()]
    assert len(told) == 1 and "key.weight, key.bias" in told[0] and "ema" not in told[0]
    copied = {name for (module, name) in runner.buffers._saved if isinstance(module, nn.Linear)}
    assert copied == {"weight", "bias"} and all(module is model.key for module, _ in runner.buffers._saved)
