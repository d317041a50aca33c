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
