"""An answer whose own trial flushed must clear the wall a larger size measured (issue 16), and a
margin's size passes a full trial.

The allocator's wall exists only on an accelerator; here the trial records that the search
reads are written out as an H200 measured them (MobileNetV3-Large, 8 GiB cap), so the rule runs
exactly as it does there."""

import torch

from autobatch import TrainStep, find_max_batch
from autobatch.probe.searching.measured_wall import below_measured_wall, measured_wall, measured_wall_note
from autobatch.probe.records import TrialRecord

MiB = 2**20
CAP = 8192 * MiB


class Records:
    """The part of a TrialRunner the rule reads: its records, the latest pass of a size."""

    def __init__(self, records):
        self.records = list(records)

    def passed_record(self, batch_size):
        return next((r for r in reversed(self.records) if r.batch_size == batch_size and r.passed), None)


def passed(size, peak_mib, flushes, resident_mib=300.0):
    return TrialRecord(size, True, int(peak_mib * MiB), 0.1, "wall", steps=4, step_peak_bytes=int(peak_mib * MiB),
                       resident_bytes=int(resident_mib * MiB), flushes=flushes)


def failed(size, wall_mib):
    return TrialRecord(size, False, None, 0.1, "wall", error="CUDA out of memory", steps=3,
                       wall_bytes=None if wall_mib is None else int(wall_mib * MiB))


def mobilenet(flushes=2):
    """The H200's records: 362 ran out of memory with 304.7 MiB in pieces; 359-361 passed flushing."""
    return Records([passed(311, 6900.0, 0), failed(366, 249.2), passed(359, 7920.2, flushes),
                    passed(360, 7943.9, flushes), failed(362, 304.7), passed(361, 7962.9, flushes)])


def test_a_flushing_answer_above_the_wall_the_next_size_measured_steps_down_by_the_excess():
    runner = mobilenet()
    assert measured_wall(runner, 361, CAP) == (362, CAP - int(304.7 * MiB))
    asked = []

    def confirm(units):  # the lower size's full trial: it passes, below the wall
        asked.append(units)
        runner.records.append(passed(units, 7962.9 - 21.4 * (361 - units), 2))
        return units

    # 361 peaks 75.6 MiB above 8192 - 304.7 MiB; at ~21.5 MiB a unit (359 to 361) that is 4 units
    assert below_measured_wall(runner, 361, 1, CAP, confirm) == 357
    assert asked == [357]
    note = measured_wall_note(runner, 361, 357, CAP)
    assert "357, below 361" in note and "362 ran out of memory" in note


def test_each_lower_size_is_checked_again_until_one_clears_the_wall():
    runner = mobilenet()
    asked = []

    def confirm(units):  # the first step down still peaks too high: measured again
        asked.append(units)
        peak = 7900.0 if len(asked) == 1 else 7880.0
        runner.records.append(passed(units, peak, 2))
        return units

    assert below_measured_wall(runner, 361, 1, CAP, confirm) == 356
    assert asked == [357, 356]


def test_no_step_down_without_a_flush_a_wall_figure_or_an_excess():
    never = lambda units: (_ for _ in ()).throw(AssertionError("no trial expected"))  # noqa: E731
    assert below_measured_wall(mobilenet(flushes=0), 361, 1, CAP, never) == 361  # its own trial never met the wall
    no_figure = Records([passed(311, 6900.0, 0), failed(362, None), passed(361, 7962.9, 2)])
    assert below_measured_wall(no_figure, 361, 1, CAP, never) == 361  # the failure above measured no wall
    clear = Records([passed(90, 7000.0, 0), failed(101, 324.8), passed(100, 7835.4, 2)])  # ViT-B/16's TrainStep
    assert below_measured_wall(clear, 100, 1, CAP, never) == 100
    assert below_measured_wall(mobilenet(), 361, 1, None, never) == 361  # no capacity known (CPU)


def test_nothing_left_when_no_lower_size_passes():
    assert below_measured_wall(mobilenet(), 361, 1, CAP, lambda units: None) is None


def test_a_margins_size_tried_by_a_shorter_search_trial_passes_a_full_trial():
    """Binary's doubling tried 1024 for one step; a margin landing on 1024 runs it in full."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    step = TrainStep(model, torch.optim.AdamW(model.parameters()),
                     lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                     make_batch=lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,))))
    boundary = find_max_batch(step, strategy="binary", memory_limit="8MiB", cache=False).batch_size
    margin = 1 - 1024.5 / boundary  # floor(boundary * (1 - margin)) == 1024
    result = find_max_batch(step, strategy="binary", margin=margin, memory_limit="8MiB", cache=False,
                            steps_per_trial=3)
    assert result.batch_size == 1024
    assert any(t.batch_size == 1024 and t.passed and t.steps == 3 for t in result.trials)
