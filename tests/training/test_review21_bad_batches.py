"""A batch the runner cannot train, yielded by the data: ``None`` (a collate_fn that returns None
for samples it filters out) or one of 0 samples. Its error named no place in the data (found at step
40,000, no use), and a run that plans its micro-batch (``micro_batch=None``) on an empty first batch
crashed with ``ZeroDivisionError: integer division or modulo by zero`` from inside the probe."""

from __future__ import annotations

import pytest
import torch

from autobatch import Runner

X, Y = torch.randn(8, 3), torch.randn(8, 1)
EMPTY = (X[:0], Y[:0])


@pytest.mark.parametrize("micro_batch", [2, None])
@pytest.mark.parametrize("bad, place, says", [(None, 2, "yielded None"), (EMPTY, 1, "0 samples")])
def test_a_batch_without_samples_is_one_error_naming_its_place(micro_batch, bad, place, says):
    data = [(X[:4], Y[:4]), bad] if place == 2 else [bad, (X[:4], Y[:4])]
    model = torch.nn.Linear(3, 1)
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
                    global_batch=4, micro_batch=micro_batch, progress=False, log_every=None)
    with pytest.raises(ValueError) as error:
        runner.fit(data)
    text = " ".join([str(error.value), *getattr(error.value, "__notes__", [])])
    assert says in text and f"batch {place} of epoch 1 (step {place - 1})" in text
