"""Activation checkpointing: which blocks are wrapped, that it saves memory, that undo restores."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autobatch.planning.checkpointing import enable_checkpointing, find_blocks, is_checkpointed
from autobatch.memory.simulated import simulated_memory


def block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU())


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x, *, scale=1.0):
        return torch.tanh(self.fc(x)) * scale


class Net(nn.Module):
    """Embedding-like head, a ModuleList of repeated layers, a tail."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))
        self.out = nn.Linear(width, 2)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x, scale=0.5)
        return self.out(x)


def test_finds_repeated_blocks_outermost_only():
    seq = nn.Sequential(block(4), block(4), nn.Linear(4, 2))
    assert find_blocks(seq) == ["0", "1"]  # the lone Linear does not repeat; no nesting
    assert find_blocks(Net()) == ["layers.0", "layers.1", "layers.2"]
    assert find_blocks(Net(), targets=["Layer"]) == ["layers.0", "layers.1", "layers.2"]
    assert find_blocks(Net(), targets=[nn.Linear]) == ["inp", "layers.0.fc", "layers.1.fc", "layers.2.fc", "out"]
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def test_same_results_and_gradients_and_undo_restores_modules():
    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    before_keys = list(model.state_dict())
    before_modules = dict(model.named_modules())
    before_params = {name: p for name, p in model.named_parameters()}
    reference = model(x)
    reference.sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    handle = enable_checkpointing(model)
    assert handle.modules == ["layers.0", "layers.1", "layers.2"]
    assert all(is_checkpointed(model.get_submodule(name)) for name in handle.modules)
    assert list(model.state_dict()) == before_keys  # keys unchanged while wrapped
    out = model(x)  # kwargs (scale=) pass through the checkpoint
    assert out.grad_fn is not None
    torch.testing.assert_close(out, reference, atol=0, rtol=0)
    out.sum().backward()
    for grad, ref in zip((p.grad for p in model.parameters()), ref_grads):
        torch.testing.assert_close(grad, ref, atol=1e-12, rtol=1e-12)
    assert enable_checkpointing(model).modules == []  # already wrapped: nothing new

    clone = copy.deepcopy(model)  # the copy is wrapped and calls its own layers
    with torch.no_grad():
        clone.layers[0].fc.weight.add_(1.0)
    assert is_checkpointed(clone.layers[0]) and not torch.equal(clone(x), model(x))

    handle.undo()
    handle.undo()  # idempotent
    assert not any(is_checkpointed(m) for m in model.modules())
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert dict(model.named_modules()) == before_modules  # the same objects
    assert all(before_params[name] is p for name, p in model.named_parameters())
    assert list(model.state_dict()) == before_keys
    torch.testing.assert_close(model(x), reference, atol=0, rtol=0)


def test_modules_by_name_and_context_manager():
    model = Net()
    with enable_checkpointing(model, modules=["layers.1"]) as handle:
        assert handle.modules == ["layers.1"] and is_checkpointed(model.layers[1])
        assert not is_checkpointed(model.layers[0])
    assert not is_checkpointed(model.layers[1])


def test_checkpointing_lowers_the_simulated_peak():
    torch.manual_seed(0)
    model = nn.Sequential(*(block(32) for _ in range(6)))
    x = torch.randn(1, 256, 32)

    def peak() -> int:
        with simulated_memory("1GiB") as device:
            model(x).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        return device.peak_bytes

    plain = peak()
    with enable_checkpointing(model):
        wrapped = peak()
    assert wrapped < plain / 2


def test_targets_that_match_no_module_are_one_clear_error():
    """A misspelt block class wrapped nothing; the plan then failed blaming something else."""
    import autobatch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"\['Linearr'\] match no module of the model; its module classes: Linear, ReLU"):
        enable_checkpointing(model, ["Linearr"])
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).sum(), torch.randn)
    with pytest.raises(ValueError, match="match no module"):
        autobatch.plan(step, global_batch=4, checkpoint_targets=["Linearr"], memory_limit="1MiB")
    with pytest.raises(ValueError, match="match no module"):
        autobatch.Runner(model, step.optimizer, step.loss_fn, global_batch=4, checkpoint_targets=["Linearr"])


class ConvBlock(nn.Module):
    def __init__(self, channels: int = 4, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels, momentum=momentum)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))) + x


def test_batchnorm_statistics_count_each_micro_batch_once_when_checkpointed():
    """The recompute in backward ran BatchNorm's training forward again: num_batches_tracked
    went up by 2 per forward and running_mean/var took the batch in twice."""
    for momentum in (0.1, None):  # None: the cumulative average reads num_batches_tracked
        torch.manual_seed(0)
        plain = nn.Sequential(*(ConvBlock(momentum=momentum) for _ in range(3))).double()
        wrapped = copy.deepcopy(plain)
        assert enable_checkpointing(wrapped).modules == ["0", "1", "2"]
        for _ in range(3):  # three micro-batches
            x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
            out_plain, out_wrapped = plain(x), wrapped(x)
            torch.testing.assert_close(out_wrapped, out_plain, atol=0, rtol=0)
            out_plain.square().mean().backward()
            out_wrapped.square().mean().backward()
        for (name, a), b in zip(plain.named_buffers(), wrapped.buffers()):
            torch.testing.assert_close(b, a, atol=0, rtol=0, msg=name)
        assert wrapped[0].bn.num_batches_tracked.item() == 3
        for a, b in zip(plain.parameters(), wrapped.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-12, rtol=1e-12)


def test_single_torch_layers_are_not_blocks():
    """Checkpointing one Linear, Conv2d or BatchNorm2d keeps its input, which is what it saves: a
    flat VGG-style Sequential had each Conv2d and BatchNorm2d wrapped alone, for nothing."""
    vgg = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                        nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    assert find_blocks(vgg) == []
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) == []
    assert find_blocks(vgg, targets=[nn.Conv2d]) == ["0", "3"]  # named, they are wrapped
    assert find_blocks(nn.ModuleList([nn.GRU(4, 4), nn.GRU(4, 4)])) == ["0", "1"]  # a recurrent layer saves a lot

    class Leaf(nn.Module):  # a block of the user's own without children still counts
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return torch.tanh(x * self.weight)

    assert find_blocks(nn.Sequential(Leaf(), Leaf())) == ["0", "1"]


def test_a_checkpointed_model_pickles_and_stays_wrapped():
    """torch.save(model) failed: the installed bound method pickled as
    getattr(block, '_checkpointed_forward')."""
    import io

    torch.manual_seed(0)
    model = Net().double()
    handle = enable_checkpointing(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [name for name, m in loaded.named_modules() if is_checkpointed(m)] == handle.modules
    assert loaded.layers[0].forward.module is loaded.layers[0]  # calls its own block
    torch.testing.assert_close(loaded(x), model(x), atol=0, rtol=0)
    with torch.no_grad():
        loaded.layers[0].fc.weight.add_(1.0)
    assert not torch.equal(loaded(x), model(x))
    clone = copy.deepcopy(model)
    assert clone.layers[1].forward.module is clone.layers[1] and is_checkpointed(clone.layers[1])
