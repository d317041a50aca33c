"""Data with no batch at all is named as empty, not as a used-up generator."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from autobatch import Runner
from runner_workloads import make_model, mse


@pytest.mark.parametrize("micro_batch", [8, None])
@pytest.mark.parametrize("data", [[], DataLoader(TensorDataset(torch.randn(5, 8), torch.randn(5, 1)), batch_size=16,
                                                  drop_last=True)], ids=["list", "loader"])
def test_empty_data_is_one_error_saying_it_is_empty(micro_batch, data):
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=micro_batch,
                    progress=False, log_every=None)
    words = r"in epoch 1: it is empty" if micro_batch else "the runner plans its micro-batch on the first global batch"
    with pytest.raises(ValueError, match=f"data yielded no batches.*{words}") as caught:
        runner.fit(data, epochs=1)
    assert "generator" not in str(caught.value)


def test_a_used_up_generator_is_still_named_as_one():
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                    progress=False, log_every=None)
    with pytest.raises(ValueError, match="a generator or other one-shot iterator is used up"):
        runner.fit(iter([]), epochs=1)
