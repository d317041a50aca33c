"""Every public entry point checks its arguments before any work: one error naming the
argument, what it got and what it accepts."""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch import TrainStep, find_max_batch


def _step():
    model = torch.nn.Linear(4, 1)
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).mean(), lambda n: torch.randn(n, 4))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s: find_max_batch(42), TypeError, "fn must be a callable"),
        (lambda s: find_max_batch(s, device="tpu9"), ValueError, "device='tpu9' is not a torch device"),
        (lambda s: find_max_batch(s, device="meta"), ValueError, "device='meta' holds no memory"),
        (lambda s: find_max_batch(TrainStep(s.model, s.optimizer, s.loss_fn, None)), ValueError,
         "this TrainStep has no make_batch"),
        (lambda s: find_max_batch(s, restore=5), TypeError, r"restore must be a \(model, optimizer\) pair"),
        (lambda s: find_max_batch(s, restore=(s.model, "sgd")), TypeError, r"restore\[1\] must be a torch.optim.Optimizer"),
        (lambda s: find_max_batch(s, cache=3), TypeError, "cache must be True, False, None or a directory"),
        (lambda s: find_max_batch(s, memory_limit="lots"), ValueError, "memory_limit='lots' is not a byte quantity"),
        (lambda s: find_max_batch(s, max_batch=0), ValueError, "max_batch must be a positive integer or None"),
        (lambda s: find_max_batch(s, strategy="guess"), ValueError, "strategy must be one of"),
        (lambda s: find_max_batch(lambda b: None, strategy="estimate"), ValueError, "strategy='estimate' traces a TrainStep"),
        (lambda s: TrainStep("model", s.optimizer, s.loss_fn, s.make_batch), TypeError, "model must be a torch.nn.Module"),
        (lambda s: TrainStep(s.model, None, s.loss_fn, s.make_batch), TypeError, "optimizer must be a torch.optim.Optimizer"),
        (lambda s: TrainStep(s.model, s.optimizer, "mse", s.make_batch), TypeError, "loss_fn must be a callable"),
        (lambda s: TrainStep(s.model, s.optimizer, s.loss_fn, 64), TypeError, "make_batch must be a callable"),
        (lambda s: autobatch.plan(s, global_batch=0), ValueError, "global_batch must be a positive integer"),
        (lambda s: autobatch.plan(s, global_batch=8, objective="speed"), ValueError, "objective must be one of"),
        (lambda s: autobatch.estimate_memory(s, 0), ValueError, "batch_size must be a positive integer"),
        (lambda s: autobatch.estimate_max_batch(s, "big"), ValueError, "capacity='big' is not a byte quantity"),
        (lambda s: autobatch.enable_checkpointing(42), TypeError, "model must be a torch.nn.Module"),
        (lambda s: autobatch.split_batch(torch.zeros(4), 0), ValueError, "micro_batch must be a positive integer"),
        (lambda s: autobatch.simulated_memory(-1).__enter__(), ValueError, "limit must be positive"),
        (lambda s: autobatch.FaultInjector([(1, "lunch")]), ValueError, "fault phase must be one of"),
        (lambda s: autobatch.plot_probe(42, "x.png"), TypeError, "result must be the ProbeResult"),
    ],
)
def test_bad_arguments_are_one_error_naming_them(call, error, match):
    with pytest.raises(error, match=match) as caught:
        call(_step())
    assert "\n" not in str(caught.value)


def test_a_step_that_never_runs_out_of_memory_stops_at_the_ceiling():
    result = find_max_batch(lambda batch_size: None, memory_limit="1MiB")
    assert result.batch_size == autobatch.probe.SEARCH_CEILING
    assert any("search ceiling" in note for note in result.notes)
    capped = find_max_batch(lambda batch_size: None, memory_limit="1MiB", max_batch=1000)
    assert capped.batch_size == 1000 and not any("search ceiling" in note for note in capped.notes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_an_accelerator_this_machine_lacks_is_one_error_before_any_trial(device):
    with pytest.raises(ValueError, match=f"device='{device}': this machine has no cuda device"):
        find_max_batch(_step(), device=device)


def test_a_model_with_uninitialized_lazy_parameters_is_one_error():
    """A LazyLinear before its first forward has no shape: the probe's snapshot failed deep in
    torch ("Attempted to use an uninitialized parameter"); now one error says what to run."""
    import torch

    from autobatch import TrainStep

    model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"uninitialized lazy parameters \(0.weight, 0.bias\).*model\(make_batch\(1\)\)"):
        TrainStep(model, optimizer, lambda m, b: m(b).sum(), lambda n: torch.randn(n, 4))
    model(torch.randn(1, 4))  # initialized: accepted
    TrainStep(model, optimizer, lambda m, b: m(b).sum(), lambda n: torch.randn(n, 4))


def test_review37_restore_as_a_list_says_to_pass_a_tuple():
    """Before: ``restore=[model, optimizer]`` was told restore must be a (model, optimizer) pair,
    which it looked like; now the message says a list is not taken and gives the tuple to write."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"a list is not taken: pass the same items as a tuple, restore=\(model, optimizer"):
        find_max_batch(lambda n: None, restore=[model, optimizer])


def test_review37_a_step_on_another_device_than_device_is_one_error(monkeypatch):
    """A ``TrainStep`` whose model is on the CPU, probed with ``device="cuda"``, ran its trials on
    the CPU while reading the GPU's memory: every trial passed at no memory, up to the search
    ceiling. Now one error before any trial, from ``find_max_batch`` and from ``plan``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine, as seen by the checks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for call in (lambda d: find_max_batch(_step(), device=d, cache=False),
                 lambda d: autobatch.plan(_step(), global_batch=8, device=d, cache=False)):
        for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
            with pytest.raises(ValueError, match=r"but the TrainStep's model is on cpu.*model\.to\('cuda"):
                call(device)
    assert find_max_batch(_step(), device="cpu:0", memory_limit="64KiB", max_batch=8, cache=False).batch_size == 8


def test_review38_a_bare_cuda_is_the_current_device_not_any(monkeypatch):
    """``device="cuda"`` passed a step whose model is on ``cuda:1`` while ``cuda:0`` was current, whose
    memory the probe read: a bare accelerator is the current device, compared by index."""
    from autobatch.probe.arguments import _step_on_device

    step = _step()

    class OnCuda1(torch.nn.Parameter):  # the check reads each tensor's device: this one says cuda:1
        device = torch.device("cuda", 1)

    step.model.parameters = lambda: iter([OnCuda1(torch.zeros(1))])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(ValueError, match=r"model is on cuda:1, .*model\.to\('cuda:0'\)\), or pass device='cuda:1'"):
            _step_on_device(step, device)
    _step_on_device(step, "cuda:1")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    _step_on_device(step, "cuda")


def test_review37_a_cpu_budget_past_the_hosts_memory_is_one_error(monkeypatch):
    """A ``memory_limit`` on the CPU above the host memory available was never reached: the host's
    allocator failed first (read as the budget's OOM) or the kernel killed the process."""
    monkeypatch.setattr("autobatch.memory.host_room.available_host_bytes", lambda: 2**30)
    with pytest.raises(ValueError, match=r"memory_limit=2.00 GiB on the CPU .* 1.00 GiB available"):
        find_max_batch(_step(), memory_limit="2GiB", cache=False)
    assert find_max_batch(_step(), memory_limit="2GiB", max_batch=8, cache=False).batch_size == 8  # capped: taken
