"""A second ``fit()`` on one runner does not rewrite the ``RunResult`` the first returned: a user
who keeps each stage's result (``results.append(runner.fit(...))``) read the last stage's steps and
samples in every entry, the first stage's record lost. ``runner.result`` stays the live record."""

import torch

import autobatch


def test_second_fit_keeps_first_result():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda m, b: m(b[0]).pow(2).mean(), global_batch=8, progress=False)
    data = [(torch.randn(8, 8),) for _ in range(3)]
    first = runner.fit(data, steps=2)
    first_record = first.to_dict()
    second = runner.fit(data, steps=5)
    assert first.to_dict() == first_record  # untouched by the second fit
    assert (first.steps, first.steps_this_run, first.samples) == (2, 2, 16)
    assert (second.steps, second.steps_this_run, second.samples) == (5, 3, 24)
    assert runner.result.to_dict() == second.to_dict()
