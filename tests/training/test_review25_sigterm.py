"""A preempted library run (SIGTERM, as SLURM or Kubernetes send before they kill a job) saves
its progress before the process ends: without it, a Runner with a checkpoint_dir lost every step
since the last checkpoint_every."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

import autobatch
from autobatch.training import stop_request


def _runner(tmp_path, **options):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch=4,
                            progress=False, log_every=None, grow_after=None, **options)


DATA = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(6)]


@pytest.fixture
def raised(monkeypatch):
    """The signal the runner raises again once it saved (recorded instead of ending pytest)."""
    signals = []
    monkeypatch.setattr(stop_request.signal, "raise_signal", signals.append)
    return signals


def _terminate_at(step):
    def hook(info):
        if info["step"] == step:
            os.kill(os.getpid(), signal.SIGTERM)
    return hook


def test_sigterm_stops_after_the_step_saves_and_ends_the_process_as_asked(tmp_path, raised):
    runner = _runner(tmp_path, checkpoint_dir=tmp_path / "ckpt")
    result = runner.fit(DATA, on_step_end=_terminate_at(2))
    assert result.stopped and result.steps == 2 and raised == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back before it is raised again
    resumed = _runner(tmp_path, checkpoint_dir=tmp_path / "ckpt").fit(DATA, resume="latest")
    assert resumed.resumed_from["step"] == 2 and resumed.steps == 6


def test_a_users_own_handler_or_no_checkpoint_dir_is_left_alone(tmp_path, raised):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        result = _runner(tmp_path, checkpoint_dir=tmp_path / "ckpt").fit(DATA, on_step_end=_terminate_at(2))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM] and not result.stopped and result.steps == 6 and raised == []
    runner = _runner(tmp_path)  # no checkpoint_dir: nowhere to save, SIGTERM keeps its default
    runner.fit(DATA[:1])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and raised == []


def test_review31_an_error_out_of_a_stopping_fit_is_logged_before_the_signal_ends_the_process(
        tmp_path, raised, monkeypatch, caplog):
    """SIGTERM, then the stop's checkpoint could not be written (a full disk): the signal, raised
    again, ended the process before Python printed the error, so the user was told nothing and
    believed the run saved. The error is logged, with its traceback, before the signal."""
    from autobatch.training.checkpoints import resume

    def full_disk(state, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(resume, "save_checkpoint", full_disk)
    with caplog.at_level("ERROR", logger="autobatch.runner"), pytest.raises(OSError, match="No space"):
        _runner(tmp_path, checkpoint_dir=tmp_path / "ckpt").fit(DATA, on_step_end=_terminate_at(2))
    assert raised == [signal.SIGTERM]
    failed = [record for record in caplog.records if record.levelname == "ERROR" and "SIGTERM" in record.getMessage()]
    assert failed and failed[0].exc_info is not None and "No space left" in str(failed[0].exc_info[1])
