"""Counts in messages take their noun's number: an FSDP2 checkpoint written by one rank said
"sharded over 1 ranks", a run of one step "the run has done 1 steps and 1 full epochs", a resume
"it stopped 1 batches of 16 ... (16 samples)", the runner's last log line "1 steps, 0 OOM
recoveries" (:func:`autobatch.memory.units.counted`)."""

from __future__ import annotations

import logging

import pytest
import torch

from autobatch import Runner
from autobatch.errors import CheckpointError
from autobatch.memory.units import counted
from autobatch.training.checkpoints.resume_checks import position_for
from autobatch.training.checkpoints.sharded_files import check_sharded_resume
from runner_workloads import make_data, make_model, mse


def test_a_one_rank_sharded_checkpoint_and_a_one_batch_position_read_in_the_singular(tmp_path):
    assert [counted(n, "rank") for n in (0, 1, 2)] == ["0 ranks", "1 rank", "2 ranks"]
    assert [counted(n, "OOM recovery", "OOM recoveries") for n in (1, 3)] == ["1 OOM recovery", "3 OOM recoveries"]
    (tmp_path / "last.rank0-of-1.pt").write_bytes(b"x")  # fully_shard in a job of one process
    with pytest.raises(CheckpointError, match=r"sharded over 1 rank \(last\.rank<r>-of-1\.pt\)"):
        check_sharded_resume(tmp_path / "last.pt", sharded=False)
    with pytest.raises(CheckpointError, match=r"it stopped 1 batch of 16 into its epoch \(16 samples\)"):
        position_for(tmp_path / "last.pt", {"position": 1, "global_batch": 16, "epoch_samples": 16}, 12)


def test_a_run_of_one_step_says_one_step(caplog):
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=16,
                    progress=False)
    with caplog.at_level(logging.INFO, logger="autobatch"):
        runner.fit(make_data(16, 16), steps=1)
        runner.fit(make_data(16, 16), steps=1)
    messages = [r.getMessage() for r in caplog.records]
    done = [m for m in messages if m.startswith("training done")]
    assert done and "training done: 1 step (1 this run), 16 samples" in done[0] and "0 OOM recoveries" in done[0]
    warned = [m for m in messages if "trained no step" in m]
    assert len(warned) == 1 and "the run has done 1 step and 1 full epoch already" in warned[0], warned


def test_the_give_up_message_with_checkpointing_on_reads_as_a_sentence():
    """With checkpointing already on, the advice began mid-sentence: "... left to try. lower precision"."""
    from autobatch.errors import StepOutOfMemoryError

    assert "left to try. Try lower precision" in str(StepOutOfMemoryError(3, "forward", checkpointing=True))
    assert "left to try. Enable checkpointing_fallback=True" in str(StepOutOfMemoryError(3, "forward", checkpointing=False))
