"""A model with a TorchScript submodule (``torch.jit.script``): the probe's undo of what forward
registered read each module's ``_parameters``/``_buffers``/``_modules`` as dicts, and TorchScript's
wrappers raised ``TypeError: contains(): incompatible function arguments`` at the first trial
(``autobatch.probe.snapshot.restore_places.layout_of`` now leaves TorchScript modules out: their forward
cannot register anything)."""

from __future__ import annotations

import torch
from torch import nn

import autobatch


def test_a_model_with_a_scripted_submodule_is_probed_and_left_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(torch.jit.script(nn.Linear(16, 32)), nn.ReLU(), torch.jit.script(nn.Linear(32, 32)), nn.Tanh(),
                          nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters())
    before = {name: value.clone() for name, value in model.state_dict().items()}
    step = autobatch.TrainStep(model, optimizer, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                               lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))))
    result = autobatch.find_max_batch(step, memory_limit="512KiB", device="cpu", strategy="binary", cache=False)
    assert 1 < result.batch_size and result.trials[-1].passed and result.smallest_failed == result.batch_size + 1
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert not optimizer.state
