"""Review 18: ``fit(steps=N)`` counts the whole run, so a resume (or a second ``fit()``) with an
``N`` the run has reached trains nothing. Before, it returned without a word (``steps_this_run``
0), which reads as success to one who meant "N more steps"; now a warning names the limit."""

from __future__ import annotations

import logging

import torch

from autobatch import Runner
from runner_workloads import make_data, make_model, mse, weights


def test_a_fit_given_steps_the_run_has_reached_warns_and_trains_nothing(caplog):
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                    progress=False)
    runner.fit(make_data(48, 16), steps=3)
    before = weights(model)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        result = runner.fit(make_data(48, 16), steps=2)
    assert result.steps == 3 and result.steps_this_run == 0
    assert all(torch.equal(a, b) for a, b in zip(before, weights(model)))
    warned = [r.getMessage() for r in caplog.records if "trained no step" in r.getMessage()]
    assert len(warned) == 1 and "steps=2" in warned[0] and "3 steps" in warned[0]


def test_a_run_result_reads_back_the_command_lines_file_and_a_newer_versions_fields():
    """``RunResult.from_dict`` was ``cls(**data)``: the CLI's ``train_result.json`` (``samples_per_s``,
    ``notes``, ...) and a newer version's field (in a checkpoint it wrote) were a ``TypeError``."""
    import json

    import pytest

    from autobatch import RunResult

    written = {**RunResult(steps=3, samples=48).to_dict(), "samples_per_s": 1.5, "notes": [], "a_newer_field": 1}
    assert RunResult.from_dict(json.loads(json.dumps(written))) == RunResult(steps=3, samples=48)
    with pytest.raises(TypeError, match=r"pass json.loads\(text\)"):
        RunResult.from_dict(json.dumps(written))


def test_review32_a_loop_of_one_epoch_per_fit_is_told_the_epochs_to_pass(caplog):
    """``for e in range(3): runner.fit(data, epochs=1); validate()`` trains one epoch, then none: the
    warning names the per-epoch form, ``fit(data, epochs=runner.epoch + 1)``, which trains one more each call."""
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=16,
                    progress=False)
    data = make_data(32, 16)
    runner.fit(data, epochs=1)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(data, epochs=1)
    warned = [r.getMessage() for r in caplog.records if "trained no step" in r.getMessage()]
    assert len(warned) == 1 and "epochs=runner.epoch + 1" in warned[0] and "here epochs=2" in warned[0]
    for _ in range(2):
        runner.fit(data, epochs=runner.epoch + 1)
    assert runner.epoch == 3 and runner.step == 6
