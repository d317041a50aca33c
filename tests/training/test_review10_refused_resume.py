"""A resume refused for its loose parameters or its scheduler loads nothing either.

The model's keys and shapes, and the optimizer's groups, were checked before anything was
loaded, but the parameters the optimizer trains outside the model and the scheduler's state were
checked after ``load_state_dict`` had put the checkpoint's weights and optimizer state in: the
``CheckpointError`` said "start afresh", and a run started afresh after it trained the
checkpoint's weights with its Adam moments, at step 0.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import CheckpointError, Runner
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint, save_checkpoint
from runner_workloads import make_data, make_model, mse, weights


def test_loose_parameters_of_another_shape_load_nothing(tmp_path):
    model = make_model()
    scale = nn.Parameter(torch.zeros((), dtype=torch.float64))
    optimizer = torch.optim.Adam([{"params": list(model.parameters())}, {"params": [scale]}])
    Runner(model, optimizer, lambda m, b: mse(m, b) + scale, global_batch=16, micro_batch=8, progress=False,
           checkpoint_dir=tmp_path).fit(make_data(), steps=1)
    state = load_checkpoint(tmp_path)
    state["optimizer"]["state"].pop(max(state["optimizer"]["state"]))  # its Adam moments would refuse first
    save_checkpoint(state, tmp_path / "cut.pt")

    model2 = make_model(seed=5)
    wider = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    optimizer2 = torch.optim.Adam([{"params": list(model2.parameters())}, {"params": [wider]}])
    before = weights(model2)
    runner = Runner(model2, optimizer2, lambda m, b: mse(m, b) + wider.sum(), global_batch=16, micro_batch=8,
                    progress=False)
    with pytest.raises(CheckpointError, match=r"group.index 1.0 .* has shape"):
        runner.fit(make_data(), steps=2, resume=tmp_path / "cut.pt")
    assert all(torch.equal(now, then) for now, then in zip(weights(model2), before, strict=True))
    assert not optimizer2.state and runner.step == 0


class Picky(torch.optim.lr_scheduler.StepLR):
    """A scheduler whose state needs a key the checkpoint lacks."""

    def load_state_dict(self, state_dict):
        self.milestone = state_dict["milestone"]
        super().load_state_dict(state_dict)


def test_a_scheduler_state_that_does_not_load_loads_nothing(tmp_path):
    def runner(seed: int, **options) -> Runner:
        model = make_model(seed=seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        return Runner(model, optimizer, mse, global_batch=16, micro_batch=8, progress=False,
                      scheduler=Picky(optimizer, 3, 0.5), **options)

    runner(0, checkpoint_dir=tmp_path).fit(make_data(), steps=2)
    refused = runner(5)
    before = weights(refused.model)
    with pytest.raises(CheckpointError, match="scheduler state does not fit"):
        refused.fit(make_data(), steps=4, resume=tmp_path)
    assert all(torch.equal(now, then) for now, then in zip(weights(refused.model), before, strict=True))
    assert not refused.optimizer.state and refused.step == 0


def test_review37_a_global_batch_refused_on_resume_loads_nothing_and_a_fresh_start_keeps_the_checkpoint(tmp_path):
    """Another global batch that does not divide the samples trained was refused after the model, optimizer and
    step were loaded: the common ``except CheckpointError: runner.fit(data)`` then "started afresh" at the
    checkpoint's step and weights, and its first save replaced that run's ``last.pt`` instead of keeping it."""
    trained = make_model()
    Runner(trained, torch.optim.Adam(trained.parameters()), mse, global_batch=16, micro_batch=8, progress=False,
           checkpoint_dir=tmp_path).fit(make_data(), steps=1)
    model = make_model(seed=5)
    refused = Runner(model, torch.optim.Adam(model.parameters()), mse, global_batch=32, micro_batch=8,
                     progress=False, checkpoint_dir=tmp_path)
    before = weights(model)
    with pytest.raises(CheckpointError, match="no whole number of batches of global_batch=32"):
        refused.fit(make_data(96, 32), steps=1, resume="latest")
    assert all(torch.equal(now, then) for now, then in zip(weights(model), before, strict=True))
    assert not refused.optimizer.state and refused.step == 0
    refused.fit(make_data(96, 32), steps=1)  # started afresh: the first run's checkpoint is kept aside
    assert load_checkpoint(tmp_path / "last.earlier-1.pt")["global_batch"] == 16
