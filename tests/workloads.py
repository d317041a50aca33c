"""Workloads with known answers for the tests: step functions and small real models."""

from __future__ import annotations

import torch

import autobatch


class ThresholdStep:
    """``fn(batch)`` that raises a real ``torch.OutOfMemoryError`` above a hidden threshold.

    Counts calls so tests can assert how many steps each trial ran.
    """

    def __init__(self, threshold: int, message: str = "CUDA out of memory. Tried to allocate 2.00 GiB"):
        self.threshold = threshold
        self.message = message
        self.calls: list[int] = []

    def __call__(self, batch_size: int) -> None:
        self.calls.append(batch_size)
        if batch_size > self.threshold:
            raise torch.OutOfMemoryError(self.message)


def make_mlp_step(width: int = 512, depth: int = 2, in_features: int = 64, classes: int = 10, seed: int = 0,
                  optimizer: str = "adam") -> autobatch.TrainStep:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    features = in_features
    for _ in range(depth):
        layers += [torch.nn.Linear(features, width), torch.nn.ReLU()]
        features = width
    layers.append(torch.nn.Linear(features, classes))
    model = torch.nn.Sequential(*layers)
    if optimizer in ("adam", "adamw"):
        opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW)(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(model, batch):
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(model(inputs), targets)

    def make_batch(size: int):
        return torch.randn(size, in_features), torch.randint(0, classes, (size,))

    return autobatch.TrainStep(model, opt, loss_fn, make_batch)


class MemoryCurveStep:
    """A step whose peak memory is exactly ``curve(batch_size)`` bytes, allocated for real.

    Under :func:`autobatch.simulated_memory` the allocation counts against the budget, so a
    probe sees a memory curve of our choosing: linear, curved, stepped.
    """

    def __init__(self, curve):
        self.curve = curve
        self.calls: list[int] = []

    def __call__(self, batch_size: int) -> None:
        self.calls.append(batch_size)
        block = torch.empty(int(self.curve(batch_size)), dtype=torch.uint8)
        del block


#: the planner tests' sample: 128 tokens of width 16, so activations dominate memory
PLAN_WIDTH, PLAN_TOKENS = 16, 128


def stacked_mlp(depth: int = 2) -> torch.nn.Module:
    """``depth`` blocks of three Linear + GELU pairs: repeated blocks for checkpointing to wrap."""
    torch.manual_seed(0)
    nn = torch.nn
    layers = lambda: (nn.Linear(PLAN_WIDTH, PLAN_WIDTH), nn.GELU())  # noqa: E731
    return nn.Sequential(*(nn.Sequential(*layers(), *layers(), *layers()) for _ in range(depth)))


def plan_step(model: torch.nn.Module) -> autobatch.TrainStep:
    """A ``TrainStep`` of ``model`` (SGD) on batches of ``PLAN_TOKENS`` x ``PLAN_WIDTH`` samples."""
    return autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                               loss_fn=lambda m, x: m(x).pow(2).mean(),
                               make_batch=lambda b: torch.randn(b, PLAN_TOKENS, PLAN_WIDTH))


class Block(torch.nn.Module):
    """A residual MLP block, ``x + b(tanh(a(x)))``: the repeated unit the planner's checkpointing
    tests wrap; hints name it by its class (``checkpoint_targets=['Block']``)."""

    def __init__(self, d: int = 8, h: int = 64) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))
