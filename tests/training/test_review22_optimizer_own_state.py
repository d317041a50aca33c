"""Review 22: an optimizer state value that belongs to no parameter.

A custom optimizer that keeps its own tensor at the top of its state (``self.state["count"] =
torch.tensor(...)``) saved fine, but its resume failed "'Tensor' object has no attribute
'items'" after the weights were already loaded (refused as "written for another model"); and an
OOM inside its ``step()`` after it changed that value was replayed on top of the change. One
that keeps a parameter's state as a bare tensor (``self.state[p] = buffer``, not a dict) failed
its second step in the step guard's capture ("'Tensor' object has no attribute 'items'").
"""

from __future__ import annotations

import torch
from torch import nn

from autobatch import Runner

G = 8


class Counting(torch.optim.SGD):
    """SGD that counts its steps in a tensor of its own, keyed by a string; the first ``fail``
    calls raise an OOM after the count moved (part-way through, as a real OOM can)."""

    def __init__(self, params, fail: int = 0):
        super().__init__(params, lr=0.1, momentum=0.9)
        self.fail = fail

    def step(self, closure=None):
        self.state["count"] = self.state.get("count", torch.tensor(0)) + 1
        if self.fail:
            self.fail -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (test: inside optimizer.step)")
        return super().step(closure)


class BareMomentum(torch.optim.Optimizer):
    """Momentum SGD whose state per parameter is the buffer itself; its ``fail_at``-th step
    raises an OOM after it updated the first buffer in place."""

    def __init__(self, params, fail_at: int | None = None):
        super().__init__(params, {"lr": 0.1})
        self.calls, self.fail_at = 0, fail_at

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        for group in self.param_groups:
            for param in group["params"]:
                buffer = self.state.get(param)
                buffer = param.grad.clone() if not isinstance(buffer, torch.Tensor) else buffer.mul_(0.9).add_(param.grad)
                self.state[param] = buffer
                if self.calls == self.fail_at:
                    raise torch.OutOfMemoryError("CUDA out of memory (test: inside optimizer.step)")
                param.add_(buffer, alpha=-group["lr"])


def _data():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(G, 4, generator=generator), torch.randn(G, 1, generator=generator)) for _ in range(3)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _loss(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def test_a_top_level_state_tensor_round_trips_through_a_resume(tmp_path):
    first = _model()
    Runner(first, Counting(first.parameters()), _loss, global_batch=G, micro_batch=4, progress=False,
           checkpoint_dir=tmp_path).fit(_data(), epochs=1)
    model = _model()
    optimizer = Counting(model.parameters())
    Runner(model, optimizer, _loss, global_batch=G, micro_batch=4, progress=False).fit(_data(), epochs=2, resume=tmp_path)
    reference = _model()
    straight = Counting(reference.parameters())
    Runner(reference, straight, _loss, global_batch=G, micro_batch=4, progress=False).fit(_data(), epochs=2)
    assert int(optimizer.state["count"]) == int(straight.state["count"]) == 2 * len(_data())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_an_oom_inside_step_puts_back_the_optimizers_own_state():
    model = _model()
    optimizer = Counting(model.parameters(), fail=1)
    result = Runner(model, optimizer, _loss, global_batch=G, micro_batch=4, progress=False, grow_after=None).fit(_data(), epochs=1)
    assert len(result.oom_recoveries) == 1
    assert int(optimizer.state["count"]) == len(_data())  # the failed attempt's count undone, not one ahead


def test_a_bare_tensor_state_per_parameter_survives_a_replay_and_a_resume(tmp_path):
    model = _model()
    optimizer = BareMomentum(model.parameters(), fail_at=2)  # the second step: its buffers exist
    runner = Runner(model, optimizer, _loss, global_batch=G, micro_batch=4, progress=False, grow_after=None,
                    checkpoint_dir=tmp_path)
    assert len(runner.fit(_data(), epochs=1).oom_recoveries) == 1
    resumed = _model()
    Runner(resumed, BareMomentum(resumed.parameters()), _loss, global_batch=G, micro_batch=4, progress=False).fit(
        _data(), epochs=2, resume=tmp_path)
    reference = _model()
    Runner(reference, BareMomentum(reference.parameters()), _loss, global_batch=G, micro_batch=4, progress=False).fit(
        _data(), epochs=2)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(resumed.parameters(), reference.parameters()))
