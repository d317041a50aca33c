"""``halving`` stops at its first pass: where its first trial (1024 by default, with no
``max_batch``) passed, no larger size was tried, and the answer came with no word of it (a model
where 5000 fits was answered 1024). A note now says so and what to pass, in the command line's
keys there (``autobatch.probe.searching.untried.halving_first_note``)."""

from __future__ import annotations

from autobatch import find_max_batch
from autobatch.cli.errors import cli_keys

from workloads import ThresholdStep


def _halving_notes(**kwargs) -> list[str]:
    result = find_max_batch(ThresholdStep(5000), strategy="halving", steps_per_trial=1, memory_limit="1GiB",
                            cache=False, **kwargs)
    return [note for note in result.notes if "halving's first trial" in note]


def test_review38_halving_first_pass_says_larger_sizes_were_not_tried():
    (note,) = _halving_notes()
    assert note.startswith("1024 was halving's first trial and passed, so no larger size was tried"), note
    assert "Pass strategy='auto' for the largest size that fits, or a larger start or max_batch" in note, note
    assert "Set probe.strategy=auto for the largest size that fits, or a larger probe.start or probe.max_batch" in (
        cli_keys(note))
    (bounded,) = _halving_notes(max_batch=8000, start=1024)  # a max_batch above the first pass bounds nothing
    assert "a larger start (at most max_batch, 8000)" in bounded, bounded
    assert _halving_notes(max_batch=2000) == []  # started at max_batch and passed: the answer is max_batch
    assert _halving_notes(start=8192) == []  # 8192 failed, 4096 passed: its next size up failed
