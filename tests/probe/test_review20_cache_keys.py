"""The probe cache key: how a model is compiled, CUDA's kernel switches, and the settings a
user changes between runs (a frozen layer, amsgrad, momentum) against those that must not
miss (a seed, trained weights, the order of keyword arguments)."""

import pytest
import torch
from torch import nn

import autobatch
from autobatch import cache as probe_cache
from autobatch.probe.caching.cache_key import key_of, step_components


def _step(width=32, frozen=False, seed=0, compile_as=None, **optimizer):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))
    if frozen:
        model[0].requires_grad_(False)
    if compile_as == "in place":
        model.compile()
    elif compile_as is not None:
        model = torch.compile(model, **compile_as)
    opt = (torch.optim.SGD if "momentum" in optimizer else torch.optim.Adam)(model.parameters(), lr=0.1, **optimizer)
    return autobatch.TrainStep(model, opt, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                               lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))))


def _key(step, device="cpu (simulated 32.00 MiB)", capacity=2**25) -> str:
    return key_of(probe_cache.key_components(step, device=device, capacity=capacity, memory_limit=capacity,
                                             probe={"hand_loop": True}))


def test_how_a_model_is_compiled_is_in_the_key():
    """``model.compile()`` in place leaves the module tree as it was, and ``torch.compile``'s mode,
    backend and ``dynamic`` lived where the key did not look (a dict of 622 settings keyed by its
    length): a model compiled with ``mode="reduce-overhead"`` (CUDA graphs, their own memory pool)
    was served the default mode's answer, and a model compiled in place (with ``hand_loop=False``)
    the eager one's."""
    ways = [None, "in place", {}, {"mode": "reduce-overhead"}, {"mode": "max-autotune"}, {"backend": "eager"},
            {"dynamic": True}, {"fullgraph": True}]
    keys = [_key(_step(compile_as=way)) for way in ways]
    assert len(set(keys)) == len(ways)
    assert keys == [_key(_step(compile_as=way)) for way in ways]  # built again: the same keys
    assert "compiled" not in step_components(_step())  # an eager model's components are as before


@pytest.mark.parametrize("switch", [
    lambda: setattr(torch.backends.cudnn, "enabled", False),
    lambda: setattr(torch.backends.cudnn, "deterministic", True),
    lambda: torch.use_deterministic_algorithms(True),
], ids=["cudnn-off", "cudnn-deterministic", "deterministic-algorithms"])
def test_cuda_kernel_switches_are_in_a_cuda_key(monkeypatch, switch):
    """cuDNN off (convolutions unfold their input into a buffer) or deterministic algorithms
    (other kernels, other scratch memory) change what fits on CUDA; off CUDA they change nothing."""
    monkeypatch.setattr(torch.backends.cudnn, "enabled", torch.backends.cudnn.enabled)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    deterministic = torch.are_deterministic_algorithms_enabled()
    step, cuda = _step(), "cuda:0 (NVIDIA H100 80GB HBM3)"
    before = _key(step, cuda), _key(step)
    try:
        switch()
        assert _key(step, cuda) != before[0] and _key(step) == before[1]
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_what_changes_the_memory_misses_and_what_does_not_hits():
    base = _key(_step())
    for other in (_step(width=33), _step(frozen=True), _step(amsgrad=True), _step(foreach=False)):
        assert _key(other) != base
    assert _key(_step(), device="cuda:0 (NVIDIA A100-SXM4-80GB)") != _key(_step(), device="cuda:0 (NVIDIA H100)")
    assert _key(_step(), capacity=2**26) != base
    assert _key(_step(momentum=0.0)) != _key(_step(momentum=0.9)) == _key(_step(momentum=0.99))
    assert _key(_step(amsgrad=True, foreach=False)) == _key(_step(foreach=False, amsgrad=True))
    trained = _step(seed=1)
    with torch.no_grad():
        for param in trained.model.parameters():
            param.mul_(3)
    assert _key(trained) == base
