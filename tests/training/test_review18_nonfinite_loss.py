"""Review 18: a NaN or infinite loss is neither an OOM nor silent. Before, a run whose loss
turned NaN at one step (no grad scaler) applied the NaN gradients and went on to its end
without a word, weights NaN; now such steps are counted in ``result.nonfinite_loss_steps`` (on
the device, read where the loss is read anyway) and one warning names the first."""

from __future__ import annotations

import logging

import pytest
import torch

import autobatch
from autobatch import Runner
from runner_workloads import make_data, make_model, mse


def _nan_on_sample_16(model, batch):
    """``mse``, NaN for a micro-batch holding sample 16 (step 1's first, every attempt)."""
    loss = mse(model, batch)
    return loss * float("nan") if bool((batch[2] == 16).any()) else loss


@pytest.mark.parametrize("hook", [False, True])
def test_a_nan_loss_is_counted_and_named_once_not_replayed(caplog, hook):
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), _nan_on_sample_16, global_batch=16,
                    micro_batch=8, progress=False, log_every=None)
    seen = []
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        result = runner.fit(make_data(48, 16), epochs=2, on_step_end=(lambda info: seen.append(info["loss"])) if hook else None)
    assert result.steps == 6 and not result.oom_recoveries  # applied, not replayed as an OOM
    assert result.nonfinite_loss_steps == 5  # step 1 and, the weights NaN from then on, every later one
    warned = [r.getMessage() for r in caplog.records if "NaN or infinite" in r.getMessage()]
    assert len(warned) == 1 and "at step 1 " in warned[0]
    assert autobatch.RunResult.from_dict(result.to_dict()).nonfinite_loss_steps == 5


def test_an_oom_at_the_nan_step_replays_it_and_counts_it_once(tmp_path):
    """The OOM replays the step (the NaN comes again in the replay's loss, as its samples do): one recovery, one
    non-finite step; the count is carried by the checkpoint into a resumed run."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = Runner(model, optimizer, _nan_on_sample_16, global_batch=16, micro_batch=8, progress=False,
                    checkpoint_dir=tmp_path)
    autobatch.inject_oom(runner, at=(1, "backward"))
    result = runner.fit(make_data(48, 16), steps=2)
    assert len(result.oom_recoveries) == 1 and result.nonfinite_loss_steps == 1
    model = make_model()
    resumed = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                     progress=False).fit(make_data(48, 16), steps=3, resume=tmp_path)
    assert resumed.nonfinite_loss_steps == 2  # the checkpoint's one, and step 2 on NaN weights
