"""``train.checkpoint_every`` at an epoch's last step, in the command line's training run.

The command line saved from its own step hook (``runner.save()`` when ``step % every == 0``),
with the runner's ``checkpoint_every`` off, so it missed what the runner's own checkpoints do: at
an epoch's last step the epoch's iterator is run to its end first, so the checkpoint is of the
next epoch's start (a resume replayed the whole finished epoch, reading every batch of it
again, to skip it), and ``fit()``'s last checkpoint is not written again where the last step's
holds it (``checkpoints_saved`` counted the last step twice). The runner now writes them, after
the hook's metrics line, with the signals held as the hook's save was
(:meth:`autobatch.cli.interrupt.Interrupts.holding`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from hydra import compose, initialize_config_module

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli import interrupt
from autobatch.cli.build import build_workload, validate
from autobatch.cli.training import FINAL_MODEL, METRICS, run_training
from autobatch.training.checkpoints import resume
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint
from autobatch.training.runner import Runner

#: a shuffled ``_target_`` dataset of 3 global batches an epoch; a checkpoint at every epoch's end
RUN = ["model=mlp", "data=dataset", "data.dataset.size=24", "data.shape=[4]", "model.width=8", "device=cpu",
       "train.shuffle=true", "train.epochs=2", "train.checkpoint_every=3", "train.progress=false",
       "train.grow_after=0", "probe.memory_limit=null", "device.simulated_budget=null"]  # fmt: skip


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / METRICS).read_text().splitlines()]


def test_review38_an_epoch_end_checkpoint_is_the_next_epochs_start_and_resumes_exactly(tmp_path, monkeypatch):
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        cfg = compose("train", overrides=RUN)
    validate(cfg)
    kept, save = tmp_path / "step3.pt", Runner.save

    def keeping(self, path=None):  # the checkpoint of step 3 (epoch 0's last), kept as the run goes on
        written = save(self, path)
        if self.step == 3 and not kept.exists():
            shutil.copy(written, kept)
        return written

    monkeypatch.setattr(Runner, "save", keeping)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir(), resumed.mkdir()
    result, _ = run_training(cfg, build_workload(cfg), global_batch=8, micro_batch=8, out_dir=whole)
    assert result.steps == 6 and result.checkpoints_saved == 2  # steps 3 and 6; the end's is step 6's, not again
    state = load_checkpoint(kept)
    assert (state["step"], state["epoch"], state["position"]) == (3, 1, 0)  # epoch 1's start, not epoch 0's batch 3

    run_training(cfg, build_workload(cfg), global_batch=8, micro_batch=None, out_dir=resumed, resume=kept, resumed_step=3)
    assert _losses(resumed) == _losses(whole)[3:]
    final = torch.load(resumed / FINAL_MODEL, weights_only=True)
    expected = torch.load(whole / FINAL_MODEL, weights_only=True)
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)


def test_review38_a_signal_while_a_checkpoint_is_written_waits_for_it(tmp_path, monkeypatch, capsys):
    """A Ctrl-C as the runner's ``checkpoint_every`` write of step 2 ends: the write is whole and
    the run's own, then the run stops there, saved, exit 130. Not held, it landed between the file's
    ``os.replace`` and the runner noting that file as its own: the stop's save took this run's
    ``last.pt`` for another run's and wrote elsewhere."""
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        cfg = compose("train", overrides=[*RUN[:6], "train.steps=4", "train.checkpoint_every=1", *RUN[9:]])
    validate(cfg)
    monkeypatch.setattr(interrupt, "continue_command", lambda out_dir: "CONTINUE")  # no Hydra run here to name
    real = resume.save_checkpoint

    def signalled(state, path):  # the checkpoint of step 2 written, then the signal
        written = real(state, path)
        if state["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return written

    stopped = _stopped_by(signalled, cfg, tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert stopped.code == 130 and "interrupted (SIGINT) at step 2" in err, err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.pt"]
    assert load_checkpoint(tmp_path / "checkpoints")["step"] == 2 and len(_losses(tmp_path)) == 2


def test_review39_a_signal_held_during_a_step_checkpoint_is_not_written_again(tmp_path, monkeypatch, capsys):
    """A Ctrl-C held while the ``checkpoint_every`` write of step 2 ran is raised once it is written:
    the stop names that file, not written a second time (before: step 2 written twice, seconds of a
    large model; the runner's ``_holds_step_save``, as ``fit()``'s end uses it)."""
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        cfg = compose("train", overrides=[*RUN[:6], "train.steps=3", "train.checkpoint_every=2", *RUN[9:]])
    validate(cfg)
    monkeypatch.setattr(interrupt, "continue_command", lambda out_dir: "CONTINUE")
    real, writes = resume.save_checkpoint, []

    def signalled(state, path):  # counts the writes; the signal as step 2's ends
        written = real(state, path)
        writes.append(state["step"])
        if len(writes) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return written

    stopped = _stopped_by(signalled, cfg, tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert stopped.code == 130 and f"interrupted (SIGINT) at step 2; checkpoint {tmp_path / 'checkpoints' / 'last.pt'};" in err, err
    assert writes == [2] and load_checkpoint(tmp_path / "checkpoints")["step"] == 2 and len(_losses(tmp_path)) == 2


def _stopped_by(signalled, cfg, tmp_path, monkeypatch) -> SystemExit:
    """The ``SystemExit`` of a training run whose checkpoint writes go through ``signalled``
    (which sends SIGINT when it chooses), with SIGINT's default handler for the run."""
    monkeypatch.setattr(resume, "save_checkpoint", signalled)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a run in the background ignores it
    try:
        with pytest.raises(SystemExit) as stopped:
            run_training(cfg, build_workload(cfg), global_batch=8, micro_batch=8, out_dir=tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    return stopped.value
