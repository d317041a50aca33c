"""Review 35: an answer whose trial flushed, just below sizes that failed at the allocator's wall
after steps that fit, gives way to a size just below it whose full trial never flushed
(:func:`autobatch.probe.searching.measured_wall.below_late_failures`). On an H200 a CLIP dual
encoder's ``TrainStep`` answered 126 (flushing in two of five steps, 127-130 failing at their
fourth step) and the Runner at 126 ran out of memory at step 4 and, in a new process, at step 2;
125's three steps never flushed, and 125 trained 200 steps in both. The trial logs here are that
probe's (MiB as bytes do not matter: only the outcome, steps and flush counts are read)."""

from types import SimpleNamespace

import pytest

from autobatch.probe.records import TrialRecord
from autobatch.probe.searching.measured_wall import below_late_failures


def _runner(rows):
    records = [TrialRecord(batch, ok, None, 0.1, steps=steps, flushes=flushes, over_bytes=over,
                           flushed_out=flushed_out) for batch, ok, steps, flushes, over, flushed_out in rows]

    def passed_record(size):
        return next((r for r in reversed(records) if r.batch_size == size and r.passed), None)
    return SimpleNamespace(records=records, steps=3, passed_record=passed_record)


CLIP = [(8, True, 3, 0, None, False), (109, True, 1, 0, None, False), (130, False, 4, 1, 116, False),
        (128, False, 6, 5, None, True), (127, False, 4, 1, 86, False), (125, True, 3, 0, None, False),
        (126, True, 5, 2, None, False)]


@pytest.mark.parametrize("rows, answer", [
    (CLIP, 125),  # the CLIP probe: 126 flushed, 127 failed at its fourth step: 125 never flushed
    ([row for row in CLIP if row[0] != 125], 126),  # no clean size within 1 % below: 126 stands
    ([(8, True, 3, 0, None, False), (136, True, 1, 0, None, False), (182, False, 1, 0, 30, False),
      (181, True, 6, 5, None, False), (180, True, 3, 0, None, False)], 181),  # ResNet-50: 182 failed at step 1
    ([row if row[0] != 126 else (126, True, 3, 0, None, False) for row in CLIP], 126),  # 126 never flushed
])
def test_review35_a_flushing_answer_below_late_failures_gives_way_to_a_clean_size(rows, answer):
    assert below_late_failures(_runner(rows), 126 if answer in (125, 126) else 181, 1) == answer


WHISPER = [(8, True, 3, 0, None, False), (22, True, 1, 0, None, False), (26, False, 1, 0, None, False),
           (25, False, 2, 0, 337, False), (24, True, 3, 1, None, False)]


@pytest.mark.parametrize("rows, top, answer", [
    (WHISPER, 24, 23),  # 25 failed at the wall at its second step; 24 flushed: 23 confirmed (a new trial)
    ([row for row in WHISPER if row[0] != 25], 24, 24),  # only 26, failed at its first step: 24 stands
    ([(2, True, 3, 0, None, False), (6, False, 2, 0, 40, False), (5, True, 3, 1, None, False)], 5, 5),  # 4 is 20 % below
])
def test_review37_below_a_hundred_units_the_next_size_down_is_confirmed(rows, top, answer):
    """Review 37, an H200: a Whisper encoder-decoder's ``TrainStep`` answered 24 (flushing once in its three
    steps) below 25, which failed at the allocator's wall at its second step; its ``Runner`` ran out of memory at
    step 3 in the probing process and a new one, where 23 trained 200 steps. One unit there is 4 %, so no size
    within the percent below could be known: the size one unit down is confirmed, within five percent."""
    confirmed = []
    assert below_late_failures(_runner(rows), top, 1, lambda units: confirmed.append(units) or units) == answer
    assert confirmed == ([answer] if answer != top else [])
