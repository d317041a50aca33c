"""Review 21: autobatch's decorator around a function whose own retry catches the out-of-memory
errors (``Trainer.train()`` under ``TrainingArguments(auto_find_batch_size=True)``, Accelerate's
``find_executable_batch_size``). The call returned its first size after errors caught inside it,
and the warning said only to re-raise them, in code the user does not own; the inner retry had
trained at a smaller size, from its first step. It now names that case and says to keep one."""

from __future__ import annotations

import warnings

import pytest
import torch

accelerate_memory = pytest.importorskip("accelerate.utils.memory")

from autobatch import find_executable_batch_size, simulated_memory  # noqa: E402


def test_a_retry_inside_the_function_that_caught_the_errors_is_named():
    ran = []

    @find_executable_batch_size(starting_batch_size=16)
    def run(batch_size):
        @accelerate_memory.find_executable_batch_size(starting_batch_size=batch_size)
        def train(size):  # as Trainer.train() under auto_find_batch_size=True
            torch.ones(size, 16 * 1024)  # 64 KiB a sample
            ran.append(size)

        train()
        return batch_size

    with simulated_memory("960KiB"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run() == 16
    said = [str(w.message) for w in caught if "caught there" in str(w.message)]
    assert ran == [14] and len(said) == 1
    assert "TrainingArguments(auto_find_batch_size=True)" in said[0] and "keep one of the two" in said[0]
