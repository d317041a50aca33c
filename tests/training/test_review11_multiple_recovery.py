"""``Runner(multiple_of=N)``: every micro-batch it trains is a multiple of N, through an OOM recovery
(halved, measured, the checkpointing fallback at N itself), a grow-back and a short last batch, and
the run still trains every sample once and ends with the uninjected run's weights (float64; the
splits differ, so up to summation order: ``rtol=1e-10``)."""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch import FaultInjector, Runner, StepOutOfMemoryError
from autobatch.training.multiples import multiple_sizes
from runner_workloads import SampleTracker, assert_weights_close, make_data, make_model, weights

GLOBAL, SAMPLES, EPOCHS = 24, 96, 2
STEPS = SAMPLES // GLOBAL * EPOCHS


class SizeTracker(SampleTracker):
    """A :class:`SampleTracker` that also records the size of every micro-batch run, failed attempts too."""

    def __init__(self, optimizer: torch.optim.Optimizer, global_batch: int) -> None:
        super().__init__(optimizer, global_batch)
        self.sizes: list[int] = []

    def loss_fn(self, model, batch):
        self.sizes.append(int(batch[0].shape[0]))
        return super().loss_fn(model, batch)


def _run(faults=None, *, micro_batch=GLOBAL, samples=SAMPLES, **options):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tracker = SizeTracker(optimizer, GLOBAL)
    runner = Runner(model, optimizer, tracker.loss_fn, global_batch=GLOBAL, micro_batch=micro_batch, multiple_of=4,
                    progress=False, log_every=None, faults=faults, **options)
    result = runner.fit(make_data(samples, GLOBAL), epochs=EPOCHS)
    return runner, result, tracker


@pytest.fixture(scope="module")
def reference():
    runner, result, tracker = _run()
    assert result.oom_recoveries == [] and set(tracker.sizes) == {GLOBAL}
    return weights(runner.model)


def _every_sample_once(tracker: SampleTracker, samples: int = SAMPLES) -> None:
    trained = [i for step in tracker.applied for i in step]
    assert sorted(trained) == sorted(list(range(samples)) * EPOCHS)


@pytest.mark.parametrize("schedule, times", [
    ([(1, "backward")], 1),  # 24 -> 12: 12, 12
    ([(1, "forward")], 2),  # 24 -> 12 -> 6, rounded down to 4 (not 6 -> 3,3,...)
    ([(0, "optimizer"), (3, "transfer")], 1),  # 24 again in the optimizer step, 24 -> 12 in a later step
])
def test_an_oom_recovers_to_multiples_and_ends_as_the_uninjected_run(reference, schedule, times):
    runner, result, tracker = _run(FaultInjector(schedule, times=times), grow_after=None)
    assert result.steps == STEPS and len(result.oom_recoveries) >= len(schedule)
    assert all(size % 4 == 0 for size in tracker.sizes), tracker.sizes  # failed attempts included
    assert all(r["micro_batch"] % 4 == 0 for r in result.oom_recoveries), result.oom_recoveries
    assert all(r["action"] == ("same" if r["phase"] == "optimizer" else "halve") for r in result.oom_recoveries)
    _every_sample_once(tracker)
    assert_weights_close(weights(runner.model), reference)


def test_halving_rounds_down_to_a_multiple_not_to_the_half():
    _, result, tracker = _run(FaultInjector([(1, "forward")], times=2), grow_after=None)
    assert [(r["micro_batch_before"], r["micro_batch"]) for r in result.oom_recoveries] == [(24, 12), (12, 4)]
    assert 3 not in tracker.sizes and 6 not in tracker.sizes


def test_grow_back_stays_on_multiples_under_a_ceiling_that_is_none(reference):
    # max_micro_batch=22 is a ceiling: grow-back stops at 20, the largest multiple of 4 under it
    runner, result, tracker = _run(FaultInjector([(0, "forward")], times=2), micro_batch=20, grow_after=1,
                                   max_micro_batch=22)
    assert runner.growth.ceiling == 20
    assert result.grow_attempts and all(a["to"] % 4 == 0 and a["to"] <= 20 for a in result.grow_attempts)
    assert all(size % 4 == 0 for size in tracker.sizes), tracker.sizes
    assert result.micro_batch == 20  # grown back to the ceiling
    _every_sample_once(tracker)
    assert_weights_close(weights(runner.model), reference)


def test_the_smallest_size_is_the_multiple_then_checkpointing_then_an_error_naming_it(reference):
    runner, result, tracker = _run(FaultInjector([(1, "forward")], times=2), micro_batch=8, grow_after=None,
                                   checkpointing_fallback=True)
    assert [(r["action"], r["micro_batch"]) for r in result.oom_recoveries] == [("halve", 4), ("checkpointing", 4)]
    assert runner.checkpoint_handle is not None and min(tracker.sizes) == 4
    _every_sample_once(tracker)
    assert_weights_close(weights(runner.model), reference)

    with pytest.raises(StepOutOfMemoryError) as info:
        _run(FaultInjector([(1, "backward")], times=None), micro_batch=8, grow_after=None)
    message = str(info.value)
    assert "micro-batch 4" in message and "multiple_of=4" in message and "micro-batch 1 " not in message


def test_a_short_last_batch_that_is_no_multiple_trains_once_with_one_piece_that_is_not(caplog):
    samples = SAMPLES + 10  # each epoch ends with a batch of 10: 8 and 2 would be a piece of 2; 10 <= 12 merges
    with caplog.at_level("WARNING", logger="autobatch"):
        runner, result, tracker = _run(micro_batch=12, samples=samples, grow_after=None)
    assert "multiple_of=4" in caplog.text and "drop_last=True" in caplog.text
    assert [size for size in tracker.sizes if size % 4] == [10, 10]  # one piece an epoch, the short batch's
    _every_sample_once(tracker, samples)


def test_the_split_is_full_pieces_and_a_smaller_last_one_in_steps_of_the_multiple():
    assert multiple_sizes(24, 8, 4, 4) == [8, 8, 8]
    assert multiple_sizes(24, 16, 4, 4) == [16, 8]
    assert multiple_sizes(20, 16, 4, 8) == [12, 8]  # 16 + 4 leaves a piece below the floor 8: balanced in 4s
    assert multiple_sizes(23, 8, 4, 4) == [8, 8, 7]  # no multiple: the remainder joins the last piece
    assert multiple_sizes(19, 8, 4, 4) == [8, 8, 3]  # ... or is its own piece where it would not fit
    assert multiple_sizes(3, 8, 4, 4) == [3]


def test_a_measured_recovery_rounds_down_to_a_multiple_and_trains_every_sample_once():
    """A squeeze of 5 % between steps under the simulated device: the recovery is sized from measured
    memory (not halved), rounded down to a multiple of 4."""
    from test_promise import numbered, tracked, SEEN
    from autobatch.workloads.models import MLP

    torch.manual_seed(0)
    model = MLP((16,), 4, width=32, layers=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    answer = autobatch.find_max_batch(autobatch.TrainStep(model, optimizer, tracked, numbered), memory_limit="2MiB",
                                      cache=False, multiple_of=4).batch_size
    assert answer % 4 == 0
    steps, trained, squeeze = 6, [], []
    batches = [numbered(answer, answer * i) for i in range(steps)]
    SEEN.clear()
    with autobatch.simulated_memory("2MiB") as device:

        def on_step_end(info):
            trained.extend(SEEN[-info["accumulation"]:])
            SEEN.clear()
            if info["step"] == 2:
                squeeze.append(torch.empty(device.limit_bytes // 20, dtype=torch.uint8))

        runner = Runner(model, optimizer, tracked, global_batch=answer, micro_batch=answer, multiple_of=4,
                        progress=False)
        result = runner.fit(batches, on_step_end=on_step_end)
    recoveries = result.oom_recoveries
    assert recoveries and recoveries[0]["action"] == "measured", recoveries
    assert all(r["micro_batch"] % 4 == 0 for r in recoveries) and result.micro_batch % 4 == 0
    assert recoveries[0]["micro_batch"] >= 0.75 * answer, (recoveries, answer)  # a few percent, not half
    assert all((last - first + 1) % 4 == 0 for first, last in trained)
    ids = torch.cat([torch.arange(first, last + 1) for first, last in trained]).sort().values
    assert torch.equal(ids, torch.arange(answer * steps))
