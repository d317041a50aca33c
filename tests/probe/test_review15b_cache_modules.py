"""Review 15b of the probe cache's key: a module the loss reads that is not the model.

A frozen teacher or a criterion the loss reads from a global or a closure was keyed by its class
name only, and a loss that is a module by its plain settings only: a teacher four times as wide,
``label_smoothing`` switched on or a learnable head of another width returned the answer cached
for the other one (a distillation step that fits 60 was answered 1135 from the cache)."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import autobatch
from autobatch.probe.caching.cache_key import key_of, step_components

TEACHER = nn.Linear(32, 64)
CRITERION = nn.CrossEntropyLoss()


def _distill(model, batch):
    with torch.no_grad():
        target = TEACHER(batch[0])
    return F.cross_entropy(model(batch[0]), batch[1]) + target.mean() * 0


def _criterion(model, batch):
    return CRITERION(model(batch[0]), batch[1])


class HeadLoss(nn.Module):
    """A loss that is a module with a learnable head."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.head = nn.Linear(10, width)

    def forward(self, model, batch):
        return self.head(model(batch[0])).logsumexp(1).mean()


def _key(loss) -> str:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss,
                               lambda n: (torch.randn(n, 32), torch.randint(0, 10, (n,))))
    return key_of(step_components(step))


def test_a_global_teacher_of_another_width_is_another_key(monkeypatch):
    before = _key(_distill)
    assert _key(_distill) == before  # a re-created identical step keys the same
    monkeypatch.setattr(sys.modules[__name__], "TEACHER", nn.Linear(32, 4096))
    assert _key(_distill) != before


def test_a_criterion_with_other_settings_is_another_key(monkeypatch):
    before = _key(_criterion)
    monkeypatch.setattr(sys.modules[__name__], "CRITERION", nn.CrossEntropyLoss())
    assert _key(_criterion) == before  # another instance, the same settings
    monkeypatch.setattr(sys.modules[__name__], "CRITERION", nn.CrossEntropyLoss(label_smoothing=0.1))
    assert _key(_criterion) != before


def test_a_teacher_in_a_closure_and_a_loss_module_are_keyed_by_their_parameters():
    def closure(width):
        teacher = nn.Linear(32, width)
        return lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]) + teacher(batch[0]).mean() * 0

    assert _key(closure(64)) == _key(closure(64))
    assert _key(closure(64)) != _key(closure(4096))
    assert _key(HeadLoss(16)) == _key(HeadLoss(16))
    assert _key(HeadLoss(16)) != _key(HeadLoss(4096))


def test_a_loss_that_is_a_module_method_is_keyed_by_the_module():
    assert _key(HeadLoss(16).forward) == _key(HeadLoss(16).forward)
    assert _key(HeadLoss(16).forward) != _key(HeadLoss(4096).forward)


def test_a_compiled_model_keys_the_same_when_built_again():
    # torch.compile's wrapper keeps an address in a private int (_torchdynamo_wrapper_id): keyed as
    # a setting, every process (every compile) missed the cache
    def step():
        model = torch.compile(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)))
        return autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _criterion,
                                   lambda n: (torch.randn(n, 32), torch.randint(0, 10, (n,))))

    first, second = step(), step()
    assert key_of(step_components(first)) == key_of(step_components(second))


class SharedGate(nn.Module):
    """A module whose code reads a module-level instance of its own class (as library code does)."""

    def forward(self, x):
        return x if self is SHARED_GATE else SHARED_GATE(x) * x


SHARED_GATE = SharedGate()


def test_a_module_whose_code_reads_an_instance_of_its_class_is_keyed():
    # a module keyed by its classes' code, whose code reads the module again: bounded, not a RecursionError
    def key():
        model = nn.Sequential(nn.Linear(32, 10), SharedGate())
        step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _criterion,
                                   lambda n: (torch.randn(n, 32), torch.randint(0, 10, (n,))))
        return key_of(step_components(step))

    assert key() == key()
