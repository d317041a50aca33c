"""``on_step_end`` raising in one process: unchanged by the distributed carry (``autobatch.training.step_end``).

Under ``torch.distributed`` a hook's error is kept and raised at the next point every rank
passes (``tests/distributed/test_review11_dist_errors.py``). In one process there are no peers
to tell: the error propagates from the hook at once, as itself and without autobatch's note,
the step whose hook raised counted and no later step trained; a run it ends writes no final
checkpoint, and the next ``fit()`` of that runner does not raise it again.
"""

from __future__ import annotations

import torch

from autobatch import Runner
from runner_workloads import make_data, make_model, mse


def test_an_on_step_end_error_propagates_at_once_in_one_process(tmp_path):
    model = make_model(width=8)
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                    checkpoint_dir=tmp_path, progress=False, log_every=None)
    calls = []

    def hook(info):
        calls.append(info["step"])
        if info["step"] == 2:
            raise ValueError("tracker down")

    data = make_data(64, 16)
    try:
        runner.fit(data, on_step_end=hook)
    except ValueError as exc:
        assert str(exc) == "tracker down" and not getattr(exc, "__notes__", None)
    else:
        raise AssertionError("fit() returned")
    assert calls == [1, 2] and runner.step == 2 and runner.result.steps_this_run == 2
    assert not (tmp_path / "last.pt").exists()
    assert runner.fit(data).steps == 4  # goes on after step 2: the hook's error is not raised again
