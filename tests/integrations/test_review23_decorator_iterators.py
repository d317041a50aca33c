"""Review 23: a one-shot iterator passed to the decorated function (``train(iter(samples))``, a
generator of batches). Each retry runs the function from its top, but the iterator goes on from
where the failed attempt stopped: what the failed attempts drew was never trained, silently
(Accelerate's decorator does the same). Measured: 40 samples, attempts at 8 and 7 that ran out of
memory after drawing a batch each, the call returned 6 having trained 25 of the 40. Now one
``RuntimeWarning`` names the argument and what to pass instead; something iterable again (a list)
is no warning."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from autobatch import find_executable_batch_size


def _train():
    trained = []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, samples, *, scale=1):
        batches = iter(samples)  # a list is read again from its start by each attempt; an iterator goes on
        while chunk := list(itertools.islice(batches, batch_size)):
            if batch_size > 6:  # the device holds 6
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            trained.extend(chunk)
        return batch_size

    return train, trained


def _samples():
    yield from range(40)


@pytest.mark.parametrize("make", [lambda: iter(range(40)), _samples], ids=["list_iterator", "generator"])
def test_an_iterator_the_failed_attempts_drew_from_is_one_warning(make):
    train, trained = _train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train(make()) == 6
    assert len(trained) == 25  # 8 + 7 samples drawn by the failed attempts, gone
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "argument 1 of `train`" in said[0]
    assert "never trained" in said[0] and "make the iterator inside `train`" in said[0]


def test_a_list_is_read_again_by_each_attempt_and_is_no_warning():
    train, trained = _train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert train(list(range(40)), scale=2) == 6
    assert trained == list(range(40))


_stream = None  # a module global the decorated function reads (review 33)


class _Fit:
    def __init__(self, stream):
        self.stream, self.trained = stream, []

    @find_executable_batch_size(starting_batch_size=8)
    def fit(self, batch_size):
        while chunk := list(itertools.islice(self.stream, batch_size)):
            if batch_size > 6:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            self.trained.extend(chunk)
        return batch_size


@pytest.mark.parametrize("where", ["global", "closure", "self"])
def test_review33_an_iterator_read_from_outside_not_passed_in_is_one_warning(where):
    """Review 33: an iterator made outside and read (not passed) by the function, as a global, a
    variable of the enclosing function or ``self.stream``, lost what the failed attempts drew (25 of
    40 trained) with no warning: only the call's arguments were looked at."""
    global _stream
    stream = iter(range(40))
    _stream, trained = stream, []

    @find_executable_batch_size(starting_batch_size=8)
    def from_global(batch_size):
        while chunk := list(itertools.islice(_stream, batch_size)):
            if batch_size > 6:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            trained.extend(chunk)
        return batch_size

    @find_executable_batch_size(starting_batch_size=8)
    def from_closure(batch_size):
        while chunk := list(itertools.islice(stream, batch_size)):
            if batch_size > 6:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            trained.extend(chunk)
        return batch_size

    fit = _Fit(stream)
    call, says = {"global": (from_global, "global `_stream` that `from_global` reads"),
                  "closure": (from_closure, "`stream` that `from_closure` reads from its enclosing function"),
                  "self": (fit.fit, "`self.stream` of `fit`")}[where]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert call() == 6
    finally:
        _stream = None
    assert len(trained or fit.trained) == 25
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and says in said[0] and "never trained" in said[0], said


def test_review33_a_data_loader_iterator_the_failed_attempt_drew_from_is_one_warning():
    """Review 33: ``iter(DataLoader(...))`` passed in: its length hint is the loader's length,
    which never falls as it is drawn from, so it was not seen (16 batches of 4, 2 drawn by the
    attempt at 16 and lost, silently); its count of batches yielded shows it."""
    from torch.utils.data import DataLoader, TensorDataset

    batches = iter(DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4))
    drawn = []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size, loader_iterator):
        for (batch,) in loader_iterator:
            drawn.append(batch)
            if batch_size > 12 and len(drawn) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return batch_size

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train(batches) == 14
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "argument 1 of `train` (_SingleProcessDataLoaderIter)" in said[0], said
