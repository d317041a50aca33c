"""A parameter the optimizer does not hold, written by forward, while the snapshot copies in a thread."""

import time

import torch

import autobatch.probe.snapshot.restore as restore_module
from autobatch import TrainStep, find_max_batch, simulated_memory


class Momentum(torch.nn.Module):
    """MoCo-style: a key encoder (a plain Linear, outside the optimizer) moved towards the query
    encoder in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.query = torch.nn.Linear(16, 16)
        self.key = torch.nn.Linear(16, 16).requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            for k, q in zip(self.key.parameters(), self.query.parameters()):
                k.mul_(0.9).add_(q, alpha=0.1)
        return self.query(x) + self.key(x)


def test_a_parameter_forward_writes_outside_the_optimizer_is_copied_before_the_first_forward(monkeypatch):
    """The snapshot copies weights in a thread beside the first trial (an optimizer that has state
    takes the copy, not learning rate 0); forward must not move the key encoder before its copy is
    made, or the probe leaves it changed (1 run in 8 with a Runner that planned; forced here by a
    slow copy)."""
    real = restore_module._copy_local

    def slow(tensor):
        time.sleep(0.02)
        return real(tensor)

    monkeypatch.setattr(restore_module, "_copy_local", slow)
    torch.manual_seed(0)
    model = Momentum()
    optimizer = torch.optim.AdamW(model.query.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()  # state exists: the snapshot copies (in a thread) instead of stepping at lr 0
    optimizer.zero_grad()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    step = TrainStep(model, optimizer, lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 16))
    with simulated_memory("2MiB"):
        find_max_batch(step, strategy="binary", max_batch=32, cache=False)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
