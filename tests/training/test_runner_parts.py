"""The runner's parts on their own: faults, step guard, grow-back, cache hygiene, progress."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from autobatch import FaultInjector, is_oom_error
from autobatch.planning.accumulation import accumulate_gradients
from autobatch.training.oom.growth import GrowBack
from autobatch.training.hygiene import CachePolicy
from autobatch.training.progress import Progress
from autobatch.training.oom.step_guard import StepGuard
from runner_workloads import make_data, make_model, mse


def test_fault_injector_times():
    once = FaultInjector([(2, "forward"), (3, "optimizer")])
    once(2, "backward")
    with pytest.raises(torch.OutOfMemoryError, match="injected by autobatch at step 2, phase forward") as info:
        once(2, "forward")
    assert is_oom_error(info.value)
    once(2, "forward")  # only once
    twice = FaultInjector((0, "transfer"), times=2)
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            twice(0, "transfer")
    twice(0, "transfer")
    always = FaultInjector((1, "backward"), times=None)
    for _ in range(5):
        with pytest.raises(torch.OutOfMemoryError):
            always(1, "backward")
    assert always.fired == [(1, "backward")] * 5
    with pytest.raises(ValueError, match="times"):
        FaultInjector((0, "forward"), times=0)


def test_accumulation_reports_phases_in_order():
    model = make_model()
    phases: list[str] = []
    x, y, _ = make_data()[0]
    accumulate_gradients(model, mse, (x, y), 8, on_phase=phases.append)
    assert phases == ["forward", "backward"] * 2


@pytest.mark.parametrize("optimizer_cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop])
def test_step_guard_restores_everything_a_step_changed(optimizer_cls):
    model = make_model()
    kwargs = {"momentum": 0.9} if optimizer_cls is torch.optim.SGD else {}
    optimizer = optimizer_cls(model.parameters(), lr=0.01, **kwargs)
    guard = StepGuard(optimizer)
    x, y, _ = make_data()[0]
    for _ in range(2):  # the first restore must also drop state created by the first step
        before_params = [p.detach().clone() for p in model.parameters()]
        before_state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                        for p, s in optimizer.state.items()}
        guard.capture()
        mse(model, (x, y)).backward()
        optimizer.param_groups[0]["lr"] = 123.0  # a step that also mutates its group
        optimizer.step()
        guard.restore()
        assert optimizer.param_groups[0]["lr"] == 0.01
        for before, param in zip(before_params, model.parameters()):
            assert torch.equal(before, param)
        assert {id(p) for p in optimizer.state} == set(before_state)
        for param, state in optimizer.state.items():
            assert set(state) == set(before_state[id(param)])
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(before_state[id(param)][key]))
        optimizer.zero_grad()
        mse(model, (x, y)).backward()
        optimizer.step()  # a real step, so the next round starts with state
        optimizer.zero_grad()


def test_grow_back_state_machine():
    growth = GrowBack(grow_after=2, ceiling=16)
    sizes = []
    micro = 4
    for step in range(12):
        micro = growth.propose(micro)
        sizes.append(micro)
        if micro == 16:  # 16 always fails
            micro = growth.on_oom()
        growth.on_step_done()
    # grow to 8 holds; 16 fails at step 5, then is tried again only after a doubled wait
    assert sizes == [4, 4, 8, 8, 8, 16, 8, 8, 8, 8, 16, 8]
    assert growth.wait == 8
    assert GrowBack(None, 16).propose(4) == 4 and GrowBack(0, 16).propose(4) == 4
    with pytest.raises(ValueError):
        GrowBack(-1, 8)


def test_cache_policy_threshold_and_schedule():
    memory = {"reserved": 0, "allocated": 0}
    policy = CachePolicy(slack_threshold="1MiB", memory=lambda: (memory["reserved"], memory["allocated"]))
    assert not policy.after_step(1)
    memory.update(reserved=3 * 2**20, allocated=1 * 2**20)
    assert policy.after_step(2) and policy.fires == 1 and policy.reasons["slack_threshold"] == 1
    every = CachePolicy(every_n_steps=3)
    assert [every.after_step(step) for step in range(1, 7)] == [False, False, True, False, False, True]
    assert not CachePolicy().enabled and not CachePolicy().after_step(1)


def test_progress_bar_on_a_terminal_and_log_lines_elsewhere(caplog):
    stream = io.StringIO()
    bar = Progress(10, bar=True, file=stream)
    bar.update(1, 16, micro_batch=4, accumulation=4, recoveries=2, loss=0.5)
    bar.close()
    text = stream.getvalue()
    assert "micro=4x4" in text and "oom=2" in text and "samples/s" in text
    with caplog.at_level(logging.INFO, logger="autobatch"):
        quiet = Progress(4, bar=None, file=io.StringIO(), log_every=2)  # StringIO is not a TTY
        assert quiet.bar is None
        for step in range(1, 5):
            quiet.update(step, 16, 8, 2, 0, 1.0)
    assert [r.getMessage().split()[1] for r in caplog.records] == ["2/4", "4/4"]


def test_review36_a_notebook_shows_the_bar():
    """A Jupyter kernel's stderr (ipykernel's OutStream) answers ``isatty()`` False: the bar was off
    and the progress went to log lines at INFO, which a notebook that configures no logging never
    shows, so a first run in a notebook showed nothing until it ended."""
    OutStream = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})
    notebook = Progress(3, bar=None, file=OutStream())
    assert notebook.bar is not None
    notebook.close()
    assert Progress(3, bar=None, file=io.StringIO()).bar is None  # a log file or pipe: log lines
