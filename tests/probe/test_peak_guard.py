"""A trial whose step passes the peak limit stops in its backward pass (autobatch.probe.peak_guard):
it fails as a full step over the limit would, costs what an OOM costs, and leaves nothing held."""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch.memory.devices import SimulatedDeviceMemory
from autobatch.memory.simulated import simulated_memory
from autobatch.probe.peak_guard import EVERY, PeakGuard, PeakPassed, peak_guard_for
from autobatch.probe.trial import TrialRunner

MiB = 2**20
LIMIT = 20 * MiB


def _step(layers: int = 20) -> autobatch.TrainStep:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return autobatch.TrainStep(model, optimizer, lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 256))


def _runner(step, memory, guarded: bool) -> TrialRunner:
    guard = peak_guard_for(step.model, memory.peak, LIMIT, agreed=False) if guarded else None
    return TrialRunner(step, memory, steps=2, peak_limit=LIMIT, after_oom=step.clear_grads, guard=guard)


def test_a_step_over_the_limit_stops_part_way_and_fails_as_it_would_have():
    sizes = (256, 1024, 2048, 4096, 16384, 512)
    outcomes = {}
    for guarded in (False, True):
        step = _step()
        with simulated_memory("64MiB") as device:
            memory = SimulatedDeviceMemory(device)
            runner = _runner(step, memory, guarded)
            records = [runner.run(size) for size in sizes]
            # the stopped step's activations were let go: the calling thread's autograd queue kept the
            # nodes the stopped backward had not run, until the trial's clean-up ran an empty backward
            assert memory.allocated() == runner._baseline
        outcomes[guarded] = [(r.batch_size, r.passed) for r in records]
        over = records[2]  # 2048: fits the 64 MiB budget, passes the 20 MiB limit
        assert not over.passed and over.error.startswith("too close to the capacity")
        assert over.over_bytes > 0 and over.peak_bytes > LIMIT
        if guarded:
            assert "stopped there, part-way" in over.error
            assert over.steps == 1
        assert all(p.grad is None for p in step.model.parameters())
    assert outcomes[True] == outcomes[False]


def test_the_stopped_step_never_reaches_the_optimizer():
    step = _step()
    stepped = []
    step.optimizer.register_step_pre_hook(lambda *_: stepped.append(True))
    with simulated_memory("64MiB") as device:
        memory = SimulatedDeviceMemory(device)
        record = _runner(step, memory, guarded=True).run(2048)
    assert not record.passed and not stepped and not step.optimizer.state


def test_a_callable_that_wraps_the_guards_exception_is_stopped_all_the_same():
    step = _step()

    def wrapping(batch: int) -> None:
        try:
            step(batch)
        except Exception as exc:
            raise RuntimeError("my training loop failed") from exc

    with simulated_memory("64MiB") as device:
        memory = SimulatedDeviceMemory(device)
        runner = TrialRunner(wrapping, memory, steps=2, peak_limit=LIMIT, after_oom=step.clear_grads,
                             guard=peak_guard_for(step.model, memory.peak, LIMIT, agreed=False))
        record = runner.run(2048)
        assert memory.allocated() == runner._baseline
    assert not record.passed and "stopped there, part-way" in record.error


def test_hooks_are_removed_after_each_trial_and_only_every_few_parameters_are_hooked():
    step = _step()
    params = list(step.model.parameters())
    guard = PeakGuard(params, lambda: 0, LIMIT)
    assert guard.params[0] is params[-1] and len(guard.params) == -(-len(params) // EVERY)
    with guard:
        assert all(p._post_accumulate_grad_hooks for p in guard.params)
    assert not any(p._post_accumulate_grad_hooks for p in params)


def test_a_guard_raises_from_the_backward_pass():
    step = _step(layers=3)
    with pytest.raises(PeakPassed), PeakGuard(list(step.model.parameters()), lambda: LIMIT + 1, LIMIT):
        step(8)


@pytest.mark.parametrize("case", ["no-model", "no-limit", "agreed", "no-params"])
def test_no_guard_where_it_does_not_apply(case):
    model = {"no-model": None, "no-params": torch.nn.ReLU()}.get(case, torch.nn.Linear(2, 2))
    limit = None if case == "no-limit" else LIMIT
    assert peak_guard_for(model, lambda: 0, limit, agreed=case == "agreed") is None


def test_the_probe_guards_the_model_a_plain_callable_names_in_restore(monkeypatch):
    from autobatch.probe import find

    step, guarded = _step(), []
    monkeypatch.setattr(find, "peak_guard_for", lambda model, *a, **k: guarded.append(model))
    monkeypatch.setattr(find, "peak_limit", lambda memory, capacity: LIMIT)
    plain = lambda batch: step(batch)  # noqa: E731
    autobatch.find_max_batch(plain, memory_limit="64MiB", restore=(step.model, step.optimizer), cache=False)
    autobatch.find_max_batch(plain, memory_limit="64MiB", cache=False)
    autobatch.find_max_batch(step, memory_limit="64MiB", cache=False)
    assert guarded[0] is step.model and guarded[1] is None and guarded[2] is step.model


class _BackwardSpike(torch.autograd.Function):
    """Identity whose backward allocates 32 KiB per sample: the step runs out of memory there,
    with the layers before it still waiting in the backward queue."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        spike = torch.ones(grad.shape[0], 8192)
        return grad + spike.sum() * 0


class _Spiked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(10)])
        self.last = torch.nn.Linear(256, 256)

    def forward(self, x):
        return self.last(_BackwardSpike.apply(self.first(x)))


def test_an_oom_in_the_backward_pass_leaves_nothing_held_on_the_cpu():
    # a failed backward's graph (the layers before the spike, their saved activations) is let go
    # before the next trial measures its baseline
    torch.manual_seed(0)
    model = _Spiked()
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 256))
    with simulated_memory("32MiB") as device:
        memory = SimulatedDeviceMemory(device)
        runner = TrialRunner(step, memory, steps=1, after_oom=step.clear_grads)
        record = runner.run(1024)
        assert not record.passed and "aten.ones" in record.error  # in the spike's backward
        assert memory.allocated() == runner._baseline


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_an_inference_probe_inside_inference_or_no_grad_mode_cleans_up_after_its_ooms(mode):
    model = torch.nn.Linear(256, 256)

    def forward_only(batch: int) -> None:
        model(torch.randn(batch, 256))

    with mode():
        result = autobatch.find_max_batch(forward_only, memory_limit="8MiB", cache=False)
    assert result.batch_size > 0 and any(not t.passed for t in result.trials)
