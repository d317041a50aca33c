"""A failed confirmation steps down by what it measured, at most a percent that doubles, and
bisects back up to within a percent (issue 16: VGG-16 as a plain callable on an H200 answered 70
of 132 after a wall excess of 2.1 GiB was priced at a unit's bytes)."""

import pytest

from autobatch.probe.records import TrialRecord
from autobatch.probe.searching.search import _confirm

MiB = 2**20


class Runner:
    """A TrialRunner's confirmation interface over a rule: sizes up to ``passes_to`` pass; above,
    each fails at the allocator's wall, over by ``over_mib`` (its pieces, not its batch), or by an
    OOM (no figure)."""

    settle_final = True

    def __init__(self, passes_to: int, over_mib: float | None, per_unit_mib: float = 50.0):
        self.passes_to, self.over, self.per_unit = passes_to, over_mib, per_unit_mib
        self.records: list[TrialRecord] = []

    def confirmed(self, batch_size: int, *, after_last_oom: bool) -> bool:
        for record in reversed(self.records):
            if record.batch_size == batch_size and record.passed:
                return True
            if after_last_oom and not record.passed and record.over_bytes is None:  # an OOM
                return False
        return False

    def run(self, batch_size: int, purpose: str, *, settle: bool) -> TrialRecord:
        passed = batch_size <= self.passes_to
        peak = int((1000 + self.per_unit * batch_size) * MiB)
        over = None if passed or self.over is None else int(self.over * MiB)
        record = TrialRecord(batch_size, passed, peak, 0.1, purpose, None if passed else "failed", steps=3,
                             step_peak_bytes=peak, resident_bytes=1000 * MiB, over_bytes=over)
        self.records.append(record)
        return record

    @property
    def sizes(self) -> list[int]:
        return [r.batch_size for r in self.records]


def test_a_wall_excess_worth_many_units_steps_down_in_doubling_strides_then_bisects_back():
    runner = Runner(passes_to=115, over_mib=2100.0)  # ~40 units' bytes at 53 MiB a unit
    assert _confirm(runner, 124, 1, after_last_oom=True) == 115
    # strides of two percents (the measured 42 units, capped), then 4, 8: never the 42-unit leap
    assert runner.sizes[:5] == [124, 122, 120, 116, 108]
    assert all(size >= 108 for size in runner.sizes)


@pytest.mark.parametrize("over_mib", [None, 2100.0])
def test_the_answer_is_within_a_percent_of_the_largest_that_passes(over_mib):
    for passes_to in (30, 99, 250, 997):
        runner = Runner(passes_to=passes_to, over_mib=over_mib)
        found = _confirm(runner, passes_to + passes_to // 10 + 3, 1, after_last_oom=True)
        assert passes_to - max(1, passes_to // 100) <= found <= passes_to


def test_consecutive_one_unit_failures_stay_one_unit_apart_twice():
    runner = Runner(passes_to=13, over_mib=None, per_unit_mib=450.0)  # BERT-base's plain callable
    assert _confirm(runner, 15, 1, after_last_oom=True) == 13
    assert runner.sizes == [15, 14, 13]


def test_a_small_measured_excess_is_taken_whole_and_no_bisection_follows():
    runner = Runner(passes_to=178, over_mib=60.0, per_unit_mib=40.0)  # two units over at 180
    assert _confirm(runner, 180, 1, after_last_oom=True) == 178
    assert runner.sizes == [180, 178]  # the measurement's two units, within two percents


def test_a_pass_before_an_oom_in_the_bisection_is_confirmed_again():
    runner = Runner(passes_to=50, over_mib=None)
    assert _confirm(runner, 60, 1, after_last_oom=True) == 50
    last = runner.records[-1]
    assert last.batch_size == 50 and last.passed  # 50's full pass came after the last OOM trial


@pytest.mark.parametrize("multiple_of", [1, 8])
def test_a_gallop_cut_short_at_one_unit_bisects_back(multiple_of):
    """5, 4, 3 units fail; the third failure's gallop (4 units) is cut to 1 unit: 2 is tried."""
    runner = Runner(passes_to=2 * multiple_of, over_mib=None)
    assert _confirm(runner, 5, multiple_of, after_last_oom=True) == 2
    assert [size // multiple_of for size in runner.sizes] == [5, 4, 3, 1, 2]
