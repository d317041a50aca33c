"""Two messages of ``autobatch.checks`` that did not fit where they were raised (review 25).

* An optimizer whose step needs a closure (LBFGS) given to the ``Runner`` was told to probe a
  plain callable with ``find_max_batch(fn, ...)``, which does not train anything: the Runner's
  message now says what to change there, the probe's (``TrainStep``) keeps its own advice.
* A loss computed under ``torch.inference_mode()`` inside ``loss_fn`` (the step itself runs
  with gradients on) was said to be "computed under torch.no_grad()": now named as it is.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autobatch


def _parts():
    model = nn.Linear(4, 1)
    return model, lambda n: (torch.randn(n, 4), torch.randn(n, 1))


def test_lbfgs_is_refused_with_advice_that_fits_the_runner_and_the_probe():
    model, make = _parts()
    lbfgs = torch.optim.LBFGS(model.parameters())
    loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    with pytest.raises(ValueError, match=r"optimizer=LBFGS needs a closure") as runner:
        autobatch.Runner(model, lbfgs, loss, global_batch=4, progress=False)
    with pytest.raises(ValueError, match=r"optimizer=LBFGS needs a closure") as probe:
        autobatch.TrainStep(model, lbfgs, loss, make)
    assert "find_max_batch" not in str(runner.value)
    assert "Use a first-order optimizer (SGD, Adam, AdamW) in the Runner" in str(runner.value)
    assert "find_max_batch(fn" in str(probe.value)
    assert "\n" not in str(runner.value) + str(probe.value)


def _inference_loss(model, batch):
    with torch.inference_mode():
        return nn.functional.mse_loss(model(batch[0]), batch[1])


@pytest.mark.parametrize("where", ["loss_fn", "step"])
def test_a_loss_without_grad_names_inference_mode_where_that_is_the_cause(where):
    model, make = _parts()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    if where == "loss_fn":  # inside loss_fn: the step runs with gradients on
        step = autobatch.TrainStep(model, sgd, _inference_loss, make)
        with pytest.raises(ValueError, match=r"computed under torch\.inference_mode\(\) \(inside the loss function"):
            step(4)
    else:  # the whole step under inference_mode
        step = autobatch.TrainStep(model, sgd, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), make)
        with torch.inference_mode(), pytest.raises(ValueError, match=r"inside torch\.inference_mode\(\)\): call it"):
            step(4)
