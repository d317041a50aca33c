"""Review 23: ``starting_batch_size`` / ``multiple_of`` of another integer type, as Accelerate's
decorator takes them (``starting_batch_size=np.int64(64)``, a size computed with NumPy). The
decorator refused them with "starting_batch_size must be a positive integer, got np.int64(64)",
a message that contradicts itself, where the rest of autobatch (``checks.positive_int``) takes any
integer type and keeps a plain ``int``. A float is still refused, naming the argument."""

from __future__ import annotations

import numpy as np
import pytest

from autobatch import find_executable_batch_size


def test_a_numpy_integer_start_runs_and_the_sizes_are_plain_ints():
    @find_executable_batch_size(starting_batch_size=np.int64(64), multiple_of=np.int32(8))
    def train(batch_size):
        return batch_size

    assert train() == 64 and type(train()) is int and type(train.batch_size) is int


def test_a_float_start_is_still_one_error_naming_it():
    with pytest.raises(ValueError, match=r"starting_batch_size must be a positive integer, got 64\.5"):
        find_executable_batch_size(lambda batch_size: batch_size, starting_batch_size=64.5)
