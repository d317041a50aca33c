"""``fit(resume="latest")``: only the command line understood "latest"; the runner tried to open a
file named ``latest``. It is the checkpoint in the runner's own ``checkpoint_dir``, found by the
same code as ``train.resume=latest`` (:mod:`autobatch.training.checkpoints.resume_target`); with none, one
error as on the command line."""

from __future__ import annotations

import pytest
import torch

from autobatch import Runner


def _runner(checkpoint_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).sum(), global_batch=2,
                  device="cpu", checkpoint_dir=checkpoint_dir, progress=False)


def test_latest_continues_from_the_checkpoint_dir(tmp_path):
    data = [torch.ones(2, 2)] * 2
    _runner(tmp_path).fit(data, steps=1)
    trained = []
    result = _runner(tmp_path).fit(data, steps=2, resume="latest", on_step_end=lambda info: trained.append(info["step"]))
    assert result.steps == 2 and trained == [2]  # continued after step 1, not two steps from scratch


@pytest.mark.parametrize("where, message", [("none", r"resume='latest' resumes from the runner's checkpoint_dir, "
                                                      r"and it has none: pass Runner\(\.\.\., checkpoint_dir=\.\.\.\)"),
                                            ("empty", r"resume='latest': no checkpoint in .*; give the path of a "
                                                      r"last\.pt, or resume=None to start afresh")])
def test_latest_without_a_checkpoint_is_one_error(tmp_path, where, message):
    runner = _runner(None if where == "none" else tmp_path)
    with pytest.raises(ValueError, match=message):
        runner.fit([torch.ones(2, 2)], resume="latest")
    assert runner.step == 0
