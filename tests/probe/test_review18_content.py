"""A step whose memory depends on the batch's content (sequences padded to the longest in the batch,
data-dependent routing): the probe's answer holds for the batches its trials drew, and says so."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from autobatch import TrainStep, find_max_batch


def _tokens() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model, batch):
    return F.cross_entropy(model(batch).flatten(0, 1), batch.flatten())


def test_a_batch_padded_to_its_longest_sequence_says_which_lengths_it_measured():
    """Before, a make_batch padding to the batch's longest sequence (lengths 8-63, one in 500 of 512)
    answered 69 under 8 MiB with nothing said, where a batch holding the long one fits 9."""
    lengths = itertools.cycle([8, 24, 16])  # each call pads to another longest length

    def make_batch(n):
        return torch.randint(0, 50, (n, next(lengths)))

    model, optimizer = _tokens()
    step = TrainStep(model, optimizer, _loss, make_batch)
    result = find_max_batch(step, memory_limit="256KiB", max_batch=64, cache=False, estimate_first=False)
    note = next(n for n in result.notes if "depends on the batch's content" in n)
    assert "inputs shaped [" in note and f"The answer, {result.batch_size}," in note and "pad to the longest" in note
    assert step.make_batch is make_batch  # the probe's recorder is gone


def test_a_step_of_fixed_shapes_gets_no_such_note():
    model, optimizer = _tokens()
    step = TrainStep(model, optimizer, _loss, lambda n: torch.randint(0, 50, (n, 16)))
    result = find_max_batch(step, memory_limit="256KiB", max_batch=64, cache=False, estimate_first=False)
    assert not any("batch's content" in n for n in result.notes)


def test_a_plain_callable_whose_peak_depends_on_its_data_is_told_by_its_peaks():
    """A mixture-of-experts step routes by value: its batch's shape is fixed and its peak is not."""
    model, optimizer = _tokens()
    share = itertools.cycle([1.0, 0.25, 0.5])  # how much of the batch one expert gets

    def step(n):
        optimizer.zero_grad()
        tokens = torch.randint(0, 50, (n, 16))
        routed = tokens[: max(1, int(n * next(share)))]
        _loss(model, routed).backward()
        optimizer.step()

    result = find_max_batch(step, memory_limit="256KiB", max_batch=64, restore=(model, optimizer))
    assert any("batch's content" in n and "above their start" in n for n in result.notes)


def test_an_error_above_every_size_that_passed_names_max_batch():
    """A model asserting its batch is at most 512 was told only to pass multiple_of, which a rerun
    with it met again at the next size above 512."""
    model, optimizer = _tokens()

    def loss(model, batch):
        assert batch.shape[0] <= 40, "the kernel takes at most 40 rows"
        return _loss(model, batch)

    step = TrainStep(model, optimizer, loss, lambda n: torch.randint(0, 50, (n, 4)))
    with pytest.raises(AssertionError) as caught:
        find_max_batch(step, memory_limit="256KiB", multiple_of=8, cache=False, estimate_first=False)
    assert "pass max_batch" in "".join(caught.value.__notes__)
