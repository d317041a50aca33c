"""A ``make_batch`` that returns an iterator (a generator function that ``yield``s its batch, or
``iter([...])``) is one clear ``ValueError`` saying to return the batch, not the misleading
"make_batch ignores its batch size" that it got before (its iterators all read as one shape); the
fake-tensor estimate says the same, where its trace fed the iterator to the model and torch said
only ``must be Tensor, not generator``."""

import pytest
import torch

import autobatch
from autobatch.probe.tracing.estimate import estimate_max_batch, estimate_peak


def _step(make_batch):
    model = torch.nn.Linear(8, 2)
    return autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: m(b).pow(2).mean(), make_batch=make_batch)


def _yields(n):
    yield torch.randn(n, 8)


@pytest.mark.parametrize("make_batch", [_yields, lambda n: iter([torch.randn(n, 8)])])
def test_iterator_make_batch_is_named(make_batch):
    with autobatch.simulated_memory("1MiB"), pytest.raises(ValueError) as info:
        autobatch.find_max_batch(_step(make_batch), max_batch=16)
    text = str(info.value)
    assert "returned" in text and "iterator" in text and "ignores its batch size" not in text


def _message(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    assert not getattr(info.value, "__notes__", None)  # one message, no "the step's own error" note
    return str(info.value)


@pytest.mark.parametrize("make_batch", [_yields, lambda n: iter([torch.randn(n, 8)])])
def test_estimate_names_an_iterator_make_batch_as_the_probe_does(make_batch):
    estimated = _message(lambda: estimate_max_batch(_step(make_batch), "1MiB"))
    assert "returned an iterator" in estimated and "not generator" not in estimated
    assert _message(lambda: estimate_peak(_step(make_batch), 4)) == estimated
    with autobatch.simulated_memory("1MiB"):
        probed = _message(lambda: autobatch.find_max_batch(_step(make_batch), max_batch=16))
    assert probed == estimated
