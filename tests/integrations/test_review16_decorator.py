"""Review 16: ``find_executable_batch_size`` as users migrating from Accelerate write it.

* A call in which no size ran (``NoBatchFitsError``: memory held elsewhere) left
  ``wrapped.batch_size`` at 1, so the next call, with the memory freed, trained at batch 1
  silently where 15 fit (a start of 64). It now starts where the failed call started.
* The batch size passed by position to a function with keyword-only parameters or ``**kwargs``
  (``def train(batch_size, model, *, lr)`` called ``train(64, model)``) got Python's "takes 2
  positional arguments but 3 were given": those parameters were counted as positional.
* ``@find_executable_batch_size`` over ``@staticmethod`` made the wrapper an instance method:
  ``S().fit()`` was told the batch size was passed; over ``@classmethod``, "decorates a
  function; got classmethod". Both now decorate what the descriptor holds."""

from __future__ import annotations

import pytest
import torch

from autobatch import NoBatchFitsError, find_executable_batch_size, simulated_memory

SAMPLE = 64 * 1024  # floats: 256 KiB a sample, 15 fit under 4 MiB


def test_a_call_where_nothing_fit_leaves_the_next_call_its_search():
    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size):
        torch.zeros(batch_size, SAMPLE)
        return batch_size

    with simulated_memory("4MiB"):
        held = torch.zeros(1024 * 1024)  # the whole budget, held by something else
        with pytest.raises(NoBatchFitsError):
            train()
        assert train.batch_size == 4
        del held
        assert train() == 4


def test_the_batch_size_passed_beside_keyword_only_parameters_is_the_decorators_error():
    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, model, *, lr=0.1, **options):
        return batch_size

    class Loop:
        @find_executable_batch_size(starting_batch_size=8)
        def fit(self, batch_size, model, *, lr=0.1):
            return batch_size

    with pytest.raises(TypeError, match=r"Batch size was passed into `train` .* `train\(model\)`"):
        train(32, "model")
    with pytest.raises(TypeError, match=r"Batch size was passed into `fit` .* `fit\(model\)`"):
        Loop().fit(32, "model")
    assert train("model", lr=0.5) == 8 and Loop().fit("model") == 8


def test_static_and_class_methods_under_the_decorator():
    class Loop:
        scale = 2

        @find_executable_batch_size(starting_batch_size=64)
        @staticmethod
        def plain(batch_size, extra=0):
            torch.zeros(batch_size, SAMPLE)
            return batch_size + extra

        @find_executable_batch_size(starting_batch_size=64)
        @classmethod
        def scaled(cls, batch_size):
            torch.zeros(batch_size * cls.scale, SAMPLE)
            return batch_size

    with simulated_memory("4MiB"):
        assert (Loop().plain(), Loop.plain(1)) == (15, 16)
        assert (Loop.scaled(), Loop().scaled()) == (7, 7)
    assert Loop.plain.batch_size == 15 and [a.ok for a in Loop.scaled.attempts] == [False, True, True]
