"""``Runner.request_stop()``: the run ends early after a whole step, saved, and resumes exactly.

Early stopping from an ``on_step_end`` hook (or a watchdog thread, or a signal handler) ends
``fit`` after the step in progress: nothing is undone, the checkpoint holds that step, and
``result.stopped`` says so. A stop at an epoch's last batch counts the epoch. A resume ends with
the weights of the run that was never stopped, with a shuffling ``DataLoader`` too. A request
is forgotten once the run it ended returns. A request in the run's last step ends nothing early
(``result.stopped`` False: the run is complete), and a second ``fit()`` does not report the
first one's stop. (Two ranks: ``tests/distributed/test_stop_ranks.py``.)
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from autobatch import Runner
from runner_workloads import FEATURES, assert_weights_close, make_model, mse, weights

QUIET = dict(progress=False, log_every=None)


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(96, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randn(96, 1, generator=generator, dtype=torch.float64)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(3))


def _runner(**options) -> Runner:
    model = make_model(width=12)
    return Runner(model, torch.optim.AdamW(model.parameters(), lr=1e-2), mse, global_batch=16, micro_batch=4,
                  **QUIET, **options)


def _stopped_then_resumed(tmp_path, at: int):
    reference = _runner()
    reference.fit(_loader(), epochs=2)
    stopping = _runner(checkpoint_dir=tmp_path)
    result = stopping.fit(_loader(), epochs=2,
                          on_step_end=lambda info: stopping.request_stop() if info["step"] == at else None)
    resumed = _runner()
    finished = resumed.fit(_loader(), epochs=2, resume=tmp_path)
    return reference, result, stopping, finished, resumed


def test_a_stop_asked_in_the_step_hook_ends_the_run_after_that_step_and_a_resume_finishes_it(tmp_path):
    reference, result, stopping, finished, resumed = _stopped_then_resumed(tmp_path, at=4)
    assert result.stopped and result.steps == 4 and result.epochs == 0 and result.steps_this_run == 4
    state = torch.load(result.checkpoint_path, map_location="cpu", weights_only=True)
    assert state["step"] == 4
    assert finished.steps == 12 and not finished.stopped
    assert_weights_close(weights(resumed.model), weights(reference.model))


def test_a_stop_at_an_epochs_last_batch_counts_the_epoch(tmp_path):
    reference, result, stopping, finished, resumed = _stopped_then_resumed(tmp_path, at=6)
    assert result.stopped and result.steps == 6 and result.epochs == 1 and stopping.position == 0
    assert finished.steps == 12 and finished.epochs == 2
    assert_weights_close(weights(resumed.model), weights(reference.model))


def test_a_request_made_before_fit_ends_it_after_one_step_and_is_then_forgotten():
    runner = _runner()
    runner.request_stop()
    first = runner.fit(_loader(), epochs=1)
    assert first.stopped and first.steps == 1
    second = runner.fit(_loader(), epochs=1)  # goes on with the epoch: the request was used up
    assert not second.stopped and second.steps == 6 and second.epochs == 1


def test_a_request_from_another_thread_ends_the_run_after_a_whole_step():
    runner = _runner()
    started = threading.Event()

    def on_step_end(info):
        if info["step"] == 2:
            started.set()
            watcher.join()  # the other thread asks while this step's hook runs

    watcher = threading.Thread(target=lambda: (started.wait(), runner.request_stop()))
    watcher.start()
    result = runner.fit(_loader(), epochs=2, on_step_end=on_step_end)
    assert result.stopped and result.steps == 2


def _asking_at(runner, step: int):
    return lambda info: runner.request_stop() if info["step"] == step else None


@pytest.mark.parametrize("until", [{"steps": 4}, {"epochs": 1}, {"epochs": 2}])
def test_a_request_in_the_runs_last_step_is_no_early_stop(tmp_path, until):
    last = until.get("steps") or 6 * until["epochs"]  # 6 batches an epoch
    runner = _runner(checkpoint_dir=tmp_path)
    result = runner.fit(_loader(), **until, on_step_end=_asking_at(runner, last))
    assert result.steps == last and not result.stopped
    saved = torch.load(result.checkpoint_path, map_location="cpu", weights_only=True)
    assert saved["step"] == last and saved["result"]["stopped"] is False


def test_a_request_before_the_last_step_still_stops_the_run(tmp_path):
    runner = _runner(checkpoint_dir=tmp_path)
    result = runner.fit(_loader(), steps=4, on_step_end=_asking_at(runner, 3))
    assert result.steps == 3 and result.stopped


def test_a_fit_after_a_stopped_one_starts_not_stopped(tmp_path):
    runner = _runner(checkpoint_dir=tmp_path, checkpoint_every=1)
    assert runner.fit(_loader(), epochs=1, on_step_end=_asking_at(runner, 2)).stopped
    seen = []

    def on_step_end(info):
        saved = torch.load(tmp_path / "last.pt", map_location="cpu", weights_only=True)  # the step before's checkpoint
        seen.append((runner.result.stopped, saved["result"]["stopped"]))

    second = runner.fit(_loader(), epochs=1, on_step_end=on_step_end)
    assert not second.stopped and second.steps == 6
    assert seen == [(False, True)] + [(False, False)] * 3  # the first is the stopped run's own last checkpoint
