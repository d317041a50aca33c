"""A recommender's ``sparse=True`` embedding on the Runner and the probe (review 33).

* ``torch.optim.SGD(momentum=...)`` keeps a sparse gradient's momentum as a sparse COO tensor; the
  runner's step guard copied it with ``empty_like(memory_format=...)``, which sparse tensors refuse,
  so every such run died at its second step with "memory format option is only supported by strided
  tensors" (an error no OOM caused);
* that momentum is never coalesced and grows by every step's rows without bound: neither the probe
  nor the runner said so, and the runner's give-up advice after its replays was to use SGD;
* a list ``[SparseAdam, Adam]`` was told to join the parts as param groups of one AdamW, which
  cannot take the embedding's sparse gradient.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import autobatch
from autobatch import FaultInjector


class _Recommender(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = torch.nn.EmbeddingBag(40, 4, sparse=True, mode="mean", dtype=torch.float64)
        self.head = torch.nn.Linear(4, 1, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.items(ids)).squeeze(-1)


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _made():
    torch.manual_seed(0)
    model = _Recommender()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _data():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 40, (16, 3), generator=generator), torch.randn(16, dtype=torch.float64, generator=generator))
            for _ in range(3)]


def test_review33_sparse_momentum_replay_matches_one_batch():
    data = _data()
    reference, optimizer = _made()
    for batch in data:  # the unsplit float64 loop
        optimizer.zero_grad()
        _loss(reference, batch).backward()
        optimizer.step()
    model, optimizer = _made()
    runner = autobatch.Runner(model, optimizer, _loss, global_batch=16, micro_batch=8, progress=False, grow_after=None,
                              faults=FaultInjector([(1, "optimizer"), (2, "backward")], times=1))
    result = runner.fit(data, epochs=1)
    assert result.steps == 3 and len(result.oom_recoveries) == 2
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-10)


def test_review33_sparse_momentum_is_named(caplog):
    model, optimizer = _made()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        autobatch.Runner(model, optimizer, _loss, global_batch=16, micro_batch=8, progress=False)
    assert "momentum=0.9 trains 'items', a sparse=True embedding" in caplog.text
    step = autobatch.TrainStep(model, optimizer, _loss,
                               lambda n: (torch.randint(0, 40, (n, 3)), torch.randn(n, dtype=torch.float64)))
    with autobatch.simulated_memory("64KiB"):
        result = autobatch.find_max_batch(step, strategy="binary", cache=False, max_batch=64)
    assert any("never coalesces" in note for note in result.notes)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: nothing grows
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        autobatch.Runner(model, plain, _loss, global_batch=16, micro_batch=8, progress=False)
    assert "coalesces" not in caplog.text


def test_review33_sparse_adam_list_names_one_optimizer():
    model, _ = _made()
    parts = [torch.optim.SparseAdam(model.items.parameters()), torch.optim.Adam(model.head.parameters())]
    with pytest.raises(TypeError, match="SparseAdam takes sparse gradients only.*torch.optim.SGD or torch.optim.Adagrad"):
        autobatch.Runner(model, parts, _loss, global_batch=16)
    with pytest.raises(TypeError, match="a TrainStep steps one optimizer.*SparseAdam takes sparse gradients only"):
        autobatch.TrainStep(model, parts, _loss, lambda n: (torch.randint(0, 40, (n, 3)), torch.randn(n)))


def test_review33_sparse_gradients_clip_as_dense_ones():
    data = _data()
    torch.manual_seed(0)
    reference = _Recommender()
    dense = torch.nn.EmbeddingBag(40, 4, mode="mean", dtype=torch.float64)  # the same table, dense gradients
    dense.load_state_dict(reference.items.state_dict())
    reference.items = dense
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for batch in data:
        optimizer.zero_grad()
        _loss(reference, batch).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        optimizer.step()
    torch.manual_seed(0)
    model = _Recommender()
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.5), _loss, global_batch=16, micro_batch=8,
                              progress=False, grow_after=None, max_grad_norm=0.05,
                              faults=FaultInjector([(1, "optimizer")], times=1))
    assert runner.fit(data, epochs=1).steps == 3
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-10)


class _SparseCritic(torch.nn.Module):
    """A loss module adding a per-item bias looked up in a ``sparse=True`` table the optimizer trains."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Embedding(40, 1, sparse=True, dtype=torch.float64)

    def forward(self, model, batch):
        return F.mse_loss(model(batch[0].double()).squeeze(-1) + self.bias(batch[0][:, 0]).squeeze(-1), batch[1])


def test_review35_runner_warns_of_sparse_momentum_in_the_loss_module(caplog):
    """The runner's warning looked at the model alone: an embedding of its ``loss_fn=criterion`` module,
    whose SGD momentum grows every step as the model's does, went unnamed."""
    model, critic = torch.nn.Linear(3, 1, dtype=torch.float64), _SparseCritic()
    optimizer = torch.optim.SGD([*model.parameters(), *critic.parameters()], lr=0.1, momentum=0.9)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        autobatch.Runner(model, optimizer, critic, global_batch=16, micro_batch=8, progress=False)
    assert "momentum=0.9 trains 'loss_fn.bias', a sparse=True embedding" in caplog.text
