"""A TrainStep whose model was left in eval mode (after a validation pass) is probed as it is,
Dropout off: its answer was larger than training mode's, with no word of why. Now a note says
so; the mode itself is the user's and is kept."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autobatch import TrainStep, find_max_batch


def _step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.2), torch.nn.Linear(64, 4))
    return TrainStep(model, torch.optim.AdamW(model.parameters()), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                     lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))))


def test_a_model_in_eval_mode_is_noted_and_kept_in_it():
    step = _step()
    trained = find_max_batch(step, memory_limit="1MiB", cache=False)
    assert not any("eval mode" in note for note in trained.notes)
    step.model.eval()
    evaluated = find_max_batch(step, memory_limit="1MiB", cache=False)
    assert any("the model is in eval mode" in note and "model.train()" in note for note in evaluated.notes)
    assert evaluated.batch_size > trained.batch_size  # why it matters: no dropout masks kept for backward
    assert not any(module.training for module in step.model.modules())
