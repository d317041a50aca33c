"""Sizes given as NumPy integers (a config read with NumPy, a computed size) are taken as plain
ints: what the run stores (its result, its checkpoints) stays JSON."""

import json

import numpy as np
import pytest
import torch

from autobatch import Runner


def test_the_runner_takes_numpy_sizes_and_keeps_plain_ints():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                    global_batch=np.int64(8), micro_batch=np.int32(4), progress=False)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(2)]
    result = runner.fit(data, steps=np.int64(2))
    assert result.steps == 2 and type(runner.share) is int
    json.dumps(result.to_dict())  # no NumPy scalar inside


@pytest.mark.parametrize("bad", [True, 8.0, "8"])
def test_a_bool_float_or_string_size_is_still_refused(bad):
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="global_batch must be a positive integer"):
        Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(), global_batch=bad)
