"""A step that keeps tensors alive from call to call: once every size down to the smallest runs
out of memory after a larger size passed, the error says memory held between trials grew, not
"try activation checkpointing" (review 13)."""

from __future__ import annotations

import pytest
import torch

import autobatch


def test_a_step_that_keeps_its_outputs_is_told_so_not_to_checkpoint():
    kept = []  # the outputs a step appends for its metrics, never cleared

    def step(batch_size: int) -> None:
        out = torch.ones(batch_size, 1024)  # 4 KiB a sample, each call
        kept.append(torch.ones(128 * 1024))  # 512 KiB kept every call
        del out

    with pytest.raises(autobatch.NoBatchFitsError) as caught:
        autobatch.find_max_batch(step, memory_limit="4MiB", strategy="binary", cache=False)
    message = str(caught.value)
    assert "passed earlier in this probe" in message and "keeps tensors alive" in message
    assert "memory held between trials grew from" in message
    assert "activation checkpointing" not in message


def test_a_model_too_large_for_batch_one_keeps_the_usual_advice():
    with pytest.raises(autobatch.NoBatchFitsError) as caught:
        autobatch.find_max_batch(lambda n: torch.ones(n, 2**20), memory_limit="2MiB", cache=False)
    assert "passed earlier" not in str(caught.value) and "activation checkpointing" in str(caught.value)
