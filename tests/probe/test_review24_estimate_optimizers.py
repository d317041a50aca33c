"""Review 24: the estimate of a step whose optimizer keeps state of its own, outside
``optimizer.state`` (a custom optimizer's attribute), and its step hooks."""

import pytest
import torch

from autobatch import TrainStep, estimate_memory, simulated_memory


def _measured(step: TrainStep, batch_size: int) -> int:
    with simulated_memory("1GiB") as simulation:
        for _ in range(3):
            step(batch_size)
    return simulation.peak_bytes


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


class OwnBuffers(torch.optim.Optimizer):
    """Momentum kept in its own dict, made on the first step (torch's ``__getstate__`` keeps only
    ``defaults``, ``state`` and ``param_groups``, so a ``copy.copy`` of it has no ``buffers``)."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})
        self.buffers: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for i, param in enumerate(group["params"]):
                buffer = self.buffers.get(i)
                if buffer is None:
                    buffer = self.buffers[i] = torch.zeros_like(param)
                buffer.mul_(0.9).add_(param.grad)
                param.add_(buffer, alpha=-group["lr"])


def test_an_optimizers_own_attribute_is_traced_and_put_back():
    """The trace's optimizer had lost the attribute: ``AttributeError: 'OwnBuffers' object has no
    attribute 'buffers'``, raised as the step's own error, for a step that trains."""
    model = _model()
    optimizer = OwnBuffers(model.parameters())
    step = TrainStep(model, optimizer, lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 16))
    estimated = estimate_memory(step, 8).step_peak_bytes
    assert optimizer.buffers == {}  # the trace's fake buffers are not left in the real dict
    assert estimated == pytest.approx(_measured(step, 8), rel=0.005)
    assert all(type(buffer) is torch.Tensor for buffer in optimizer.buffers.values())


def test_an_optimizer_step_hook_is_traced():
    """A post-step hook that allocates (here a copy of each parameter, as an EMA kept beside the
    step would be made) runs in the real step, so the estimate counts it."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: list[torch.Tensor] = []

    def keep_copies(opt, args, kwargs):
        kept[:] = [p.detach().clone() for group in opt.param_groups for p in group["params"]]

    optimizer.register_step_post_hook(keep_copies)
    step = TrainStep(model, optimizer, lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 16))
    estimated = estimate_memory(step, 8).step_peak_bytes
    assert kept == []  # put back as the trace found it
    assert estimated == pytest.approx(_measured(step, 8), rel=0.005)


class Lookahead(torch.optim.Optimizer):
    """Steps the optimizer it wraps, sharing its param groups, then moves slow weights of its own."""

    def __init__(self, base: torch.optim.Optimizer, alpha: float = 0.5) -> None:
        super().__init__(base.param_groups, base.defaults)
        self.base, self.alpha = base, alpha
        self.param_groups = base.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        self.base.step()
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                if "slow" not in state:
                    state["slow"] = param.clone()
                state["slow"].lerp_(param, self.alpha)


def test_an_optimizer_a_wrapper_steps_is_traced_over_the_fake_parameters():
    """The trace's copy had lost ``base`` (``AttributeError``, raised as the step's own error); kept
    as the real AdamW, it would step the real parameters, which get no gradient in a trace, leaving
    its moments out (0.44 of the peak, with no error): the wrapped optimizer is faked too."""
    model = _model()
    base = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = TrainStep(model, Lookahead(base), lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 16))
    estimated = estimate_memory(step, 8).step_peak_bytes
    assert not base.state and all(type(p) is torch.nn.Parameter for p in base.param_groups[0]["params"])
    assert estimated == pytest.approx(_measured(step, 8), rel=0.005)


class GlobalState(torch.optim.SGD):
    """SGD with momentum keeping a step count and a scale under ``state["global"]``, not a parameter."""

    def step(self, closure=None):
        shared = self.state["global"]
        shared["t"] = shared.get("t", 0) + 1
        shared.setdefault("scale", torch.ones(4))
        return super().step()


def test_optimizer_state_keyed_by_a_string_is_traced():
    """Once the optimizer had stepped, the trace made a fake of each key of ``optimizer.state`` and
    crashed on ``"global"`` with a bare ``TypeError: cannot create weak reference to 'str' object``."""
    model = _model()
    optimizer = GlobalState(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(model, optimizer, lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 16))
    step(8)  # the state exists before the estimate, as after a few steps of training
    estimated = estimate_memory(step, 8).step_peak_bytes
    assert optimizer.state["global"]["t"] == 1 and type(optimizer.state["global"]["scale"]) is torch.Tensor
    assert estimated == pytest.approx(_measured(step, 8), rel=0.005)


class BareState(torch.optim.Optimizer):
    """Momentum kept as a bare tensor per parameter (``self.state[p] = buffer``), not a dict: the
    runner and the cache key take such state; the trace's copy raised ``AttributeError: 'Tensor'
    object has no attribute 'items'`` once the real optimizer had stepped."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param not in self.state:
                    self.state[param] = torch.zeros_like(param)
                self.state[param].mul_(0.9).add_(param.grad)
                param.add_(self.state[param], alpha=-group["lr"])


def test_bare_tensor_optimizer_state_is_traced():
    model = _model()
    optimizer = BareState(model.parameters())
    step = TrainStep(model, optimizer, lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 16))
    _measured(step, 8)  # the real optimizer has its state now: the trace copies it
    kept = {param: buffer.clone() for param, buffer in optimizer.state.items()}
    estimated = estimate_memory(step, 8).step_peak_bytes
    assert estimated == pytest.approx(_measured(step, 8), rel=0.005)
    assert all(type(optimizer.state[param]) is torch.Tensor for param in kept)  # the real state is no fake
