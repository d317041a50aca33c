"""A plain callable that ignores its batch size (a ``DataLoader`` built outside it) reaches the
search ceiling with every trial's step taking the same memory: the note says the function does
not seem to use the size, where it said only "pass max_batch to search higher", the wrong advice
(``autobatch.probe.searching.untried._flat_steps``)."""

from __future__ import annotations

import torch

from autobatch import find_max_batch


def _ceiling_note(step) -> str:
    result = find_max_batch(step, memory_limit="8MiB", cache=False)
    (note,) = [note for note in result.notes if "search ceiling" in note]
    return note


def test_a_function_that_ignores_its_batch_size_is_told_so_at_the_ceiling():
    weight = torch.randn(64, 64, requires_grad=True)

    def step(batch_size: int) -> None:  # always 32 samples, whatever it is given
        (torch.randn(32, 64) @ weight).sum().backward()

    note = _ceiling_note(step)
    assert "does not seem to use the batch size" in note and "batch_size=batch_size" in note, note
    assert "from 8 to 16777216" in note, note


def test_a_step_that_grows_keeps_the_plain_ceiling_advice():
    weight = torch.randn(64, 64, requires_grad=True)

    def step(batch_size: int) -> None:  # grows up to 2048 samples, then stays there
        (torch.randn(min(batch_size, 2048), 64) @ weight).sum().backward()

    note = _ceiling_note(step)
    assert note.endswith("pass max_batch to search higher") and "does not seem" not in note, note
