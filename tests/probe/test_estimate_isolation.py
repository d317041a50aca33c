"""The fake-tensor trace leaves no trace: whatever the step does to the model, its loss module,
what they reach and the random generators while tracing is undone, and what cannot be undone (a
fake tensor kept where the estimate cannot reach, a parameter it cannot swap) is an EstimateError, so
``auto`` probes with trials; gradient hooks, learnable losses and views of preloaded data are
counted as simulated_memory counts them."""

import queue
import random

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

import autobatch
from autobatch import find_max_batch, simulated_memory
from autobatch.probe.tracing.estimate import EstimateError, estimate_max_batch, estimate_memory

from workloads import make_mlp_step

#: As in test_estimate: the estimate and simulated_memory count allocations the same way.
TOLERANCE = 0.02


def measured_peak(step, batch_size: int, steps: int = 2) -> int:
    with simulated_memory("4GiB") as device:
        for _ in range(steps):
            step(batch_size)
        return device.peak_bytes


class RotaryCache(torch.nn.Module):
    """Caches a tensor it computes in forward (as rotary embeddings cache cos/sin)."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = torch.nn.Linear(32, 32), torch.nn.Linear(32, 10)
        self._cos = None

    def forward(self, x):
        if self._cos is None or self._cos.shape[0] < x.shape[1]:
            self._cos = torch.arange(x.shape[1], dtype=torch.float32)[:, None].cos().expand(-1, 32).contiguous()
        return self.head((self.proj(x) * self._cos[: x.shape[1]]).mean(1))


def _rotary_step():
    torch.manual_seed(0)
    model = RotaryCache()
    return autobatch.TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                               lambda n: (torch.randn(n, 8, 32), torch.randint(0, 10, (n,))))


def test_a_tensor_cached_in_forward_is_put_back():
    step = _rotary_step()
    estimate_memory(step, 4)
    assert step.model._cos is None
    assert type(step.loss_fn(step.model, step.make_batch(4))) is torch.Tensor
    auto = find_max_batch(_rotary_step(), memory_limit="1MiB", cache=False)
    exact = find_max_batch(_rotary_step(), memory_limit="1MiB", cache=False, estimate_first=False)
    assert auto.batch_size == exact.batch_size and auto.estimate is not None


class LazyState(torch.nn.Module):
    """Registers a buffer, a submodule and a list entry the first time forward runs."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)
        self.seen = []

    def forward(self, x):
        if "scale" not in self._buffers:
            self.register_buffer("scale", torch.ones(16), persistent=False)
            self.extra = torch.nn.Identity()
            self.calls = 0
        self.calls += 1
        out = self.layer(self.extra(x * self.scale))
        self.seen.append(out)
        return out


def test_buffers_modules_and_attributes_added_while_tracing_are_removed():
    torch.manual_seed(0)
    model = LazyState()
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 16))
    keys, attributes = list(model.state_dict()), set(vars(model))
    estimate_memory(step, 8)
    assert list(model.state_dict()) == keys and set(vars(model)) == attributes
    assert "scale" not in model._buffers and "extra" not in model._modules and not model._non_persistent_buffers_set
    assert model.seen == [] and not hasattr(model, "calls")
    step(4)  # trains for real afterwards: a real buffer, real outputs
    assert type(model.scale) is torch.Tensor and all(type(t) is torch.Tensor for t in model.seen)


def test_a_list_in_a_hooks_closure_is_put_back():
    outputs = [None]
    step = make_mlp_step(width=64)
    step.model[-1].register_forward_hook(lambda module, args, out: outputs.__setitem__(0, out.detach()))
    estimate_memory(step, 4)
    assert outputs == [None]


#: What a notebook's feature-extraction hooks fill: module-level, read by the hooks' code only.
FEATURES: dict = {}
GRAD_NORMS: list = []


def _keep_features(module, args, out):
    FEATURES["last"] = out.detach()


def _keep_grad_norm(grad):
    GRAD_NORMS.append(grad.norm())


def test_review36_globals_filled_by_hooks_are_put_back():
    """A forward hook filling a module-level dict and a gradient hook appending to a module-level list:
    their globals were not walked (only loss_fn's, make_batch's and the classes' code), so the trace
    left fake tensors in them, unchecked, for the user's code and the trials to read."""
    step = make_mlp_step(width=64)
    step.model[-1].register_forward_hook(_keep_features)
    step.model[0].weight.register_hook(_keep_grad_norm)
    estimate_memory(step, 4)
    assert FEATURES == {} and GRAD_NORMS == []


class CountedCalls(torch.nn.Module):
    """Counts its calls at class level and keeps its last output there."""

    calls = 0

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)

    def forward(self, x):
        type(self).calls += 1
        type(self).last = self.layer(x)
        return type(self).last


def test_review36_class_attributes_forward_rebinds_or_adds_are_put_back():
    """``type(self).calls += 1`` counted every traced forward, and an attribute added to the class kept a fake."""
    model = CountedCalls()
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).mean(),
                               lambda n: torch.randn(n, 16))
    estimate_memory(step, 4)
    assert CountedCalls.calls == 0 and "last" not in vars(CountedCalls)


def test_a_fake_kept_out_of_reach_is_an_estimate_error_and_auto_probes_with_trials():
    outputs = queue.Queue()  # the standard library's machinery is never rolled back: out of reach

    def keep(module, args, out):
        outputs.queue.clear()
        outputs.put(out.detach())

    step = make_mlp_step(width=64)
    step.model[-1].register_forward_hook(keep)
    with pytest.raises(EstimateError, match=r"model\.4\._forward_hooks.*outputs"):
        estimate_memory(step, 4)
    auto = find_max_batch(step, memory_limit="4MiB", cache=False, steps_per_trial=2)
    assert auto.estimate is None and any("no estimate for the first trial" in note for note in auto.notes)
    binary = find_max_batch(step, memory_limit="4MiB", cache=False, strategy="binary", steps_per_trial=2)
    assert auto.batch_size == binary.batch_size


class TensorAttribute(torch.nn.Module):
    """Trains a plain tensor attribute: not a parameter, so not swapped for a fake."""

    def __init__(self):
        super().__init__()
        self.layer, self.scale = torch.nn.Linear(16, 4), torch.ones(16, requires_grad=True)

    def forward(self, x):
        return self.layer(x * self.scale)


def test_a_fake_gradient_on_a_real_tensor_is_dropped_and_refused():
    model = TensorAttribute()
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 16))
    with pytest.raises(EstimateError, match=r"fake tensor \(dropped\) in model\.scale\.grad"):
        estimate_memory(step, 4)
    assert model.scale.grad is None


def _hooked_step(width=512):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 10))
    for param in model.parameters():
        param.register_hook(lambda grad: grad.clamp(-1, 1))
    return autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                               lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,))))


def test_gradient_hooks_on_parameters_are_traced():
    step = _hooked_step()
    estimate = estimate_memory(step, 16)
    assert estimate.step_peak_bytes == pytest.approx(measured_peak(step, 16), rel=TOLERANCE)
    assert all(p._backward_hooks for p in step.model.parameters())


def test_a_post_accumulate_grad_hook_is_refused_by_name():
    step = make_mlp_step(width=32)
    step.model[2].bias.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(EstimateError, match=r"2\.bias"):
        estimate_memory(step, 4)


class ArcHead(torch.nn.Module):
    """A loss that owns a learnable class-weight matrix the optimizer trains."""

    def __init__(self, dim=128, classes=4000):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(classes, dim) * 0.01)

    def forward(self, model, batch):
        emb = F.normalize(model(batch[0]), dim=-1)
        return F.cross_entropy(30 * emb @ F.normalize(self.weight, dim=-1).t(), batch[1])


def _arc_step(loss=None):
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    criterion = ArcHead()
    opt = torch.optim.AdamW(list(backbone.parameters()) + list(criterion.parameters()))
    step = autobatch.TrainStep(backbone, opt, loss or criterion,
                               lambda n: (torch.randn(n, 64), torch.randint(0, 4000, (n,))))
    return step, criterion


def test_a_loss_modules_parameters_are_estimated_and_left_real():
    step, criterion = _arc_step()
    estimate = estimate_memory(step, 32)
    assert criterion.weight.grad is None and not step.optimizer.state
    params = sum(p.numel() * p.element_size() for p in [*step.model.parameters(), criterion.weight])
    assert estimate.resident_bytes == params
    assert estimate.step_peak_bytes == pytest.approx(measured_peak(step, 32), rel=TOLERANCE)


def test_optimizer_parameters_outside_model_and_loss_module_are_refused_by_name():
    criterion_holder = {}
    step, criterion = _arc_step(loss=lambda m, b: criterion_holder["loss"](m, b))
    criterion_holder["loss"] = criterion
    with pytest.raises(EstimateError, match=r"param_groups\[0\]\['params'\]\[4\].*4000, 128"):
        estimate_memory(step, 8)
    assert criterion.weight.grad is None


def test_estimating_leaves_every_generator_as_it_was():
    step = make_mlp_step(width=32)
    step.make_batch = lambda n: (torch.from_numpy(numpy.random.randn(n, 64).astype("float32")),
                                 torch.tensor([random.randrange(10) for _ in range(n)]))
    numpy.random.seed(0), random.seed(0), torch.manual_seed(0)
    expected = numpy.random.rand(), random.random(), torch.rand(1).item()
    for estimate in (lambda: estimate_memory(step, 8), lambda: estimate_max_batch(step, "1MiB")):
        numpy.random.seed(0), random.seed(0), torch.manual_seed(0)
        estimate()
        assert (numpy.random.rand(), random.random(), torch.rand(1).item()) == expected


def test_a_view_of_a_preloaded_dataset_is_not_an_allocation():
    """simulated_memory counts only storages the step allocates; slicing a dataset that is
    already in memory allocates nothing. The dataset is resident, as the model is."""
    torch.manual_seed(0)
    inputs, targets = torch.randn(20000, 64), torch.randint(0, 10, (20000,))
    step = make_mlp_step(width=256, depth=1)
    step.make_batch = lambda n: (inputs[:n], targets[:n])
    estimate = estimate_memory(step, 100)
    assert estimate.step_peak_bytes == pytest.approx(measured_peak(step, 100), rel=TOLERANCE)
    params = sum(p.numel() * p.element_size() for p in step.model.parameters())
    data = inputs.untyped_storage().nbytes() + targets.untyped_storage().nbytes()
    assert estimate.resident_bytes == params + data
    assert all(type(p) is torch.nn.Parameter and not isinstance(p.grad, FakeTensor) for p in step.model.parameters())
