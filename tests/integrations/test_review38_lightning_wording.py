"""Review 38: three lines of ``AutoBatchSize`` that said something untrue. A resume's one trial was
logged as a search (``probe found batch 512 with predict in 1 trials``); the fix for an epoch the
accumulation window does not divide suggested ``max_batch=511`` for 512 samples without
``drop_last`` (batches of 511 and 1); a loop that needed less than the probed step was summarised
as ``-267.95 KiB beyond the probed step``."""

from __future__ import annotations

import logging

import pytest

pl = pytest.importorskip("lightning.pytorch")

from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.integrations.lightning_epochs import _window_fix  # noqa: E402
from autobatch.integrations.lightning_loop import LoopConfirmation, LoopRun  # noqa: E402

from test_review34_lightning_resume import checkpoint, resumed  # noqa: E402,F401 (a fixture)


def test_review38_a_resumed_size_that_fits_is_logged_as_confirmed_not_found(checkpoint, caplog):  # noqa: F811
    callback = AutoBatchSize(memory_limit="4MiB", confirm=False)
    with caplog.at_level(logging.INFO, logger="autobatch"):
        resumed(checkpoint, callback, budget="4MiB")
    lines = [record.getMessage() for record in caplog.records]
    assert callback.batch_size == 64
    assert any(line.startswith("AutoBatchSize: confirmed the checkpoint's batch_size=64 in 1 trial (") for line in lines)
    assert not any(line.startswith("probe found batch") for line in lines)  # no search ran


def test_review38_the_window_fix_suggests_full_batches_in_whole_windows():
    # 512 samples, no drop_last, windows of 2: 256 x 2 (was 511, batches of 511 and 1)
    assert _window_fix(512, 512, 2, False, 1) == ", max_batch=256 (2 batches an epoch, a multiple of 2)"
    assert _window_fix(512, 300, 2, True, 1) == ", max_batch=256 (2 batches an epoch, a multiple of 2)"  # as before


def test_review38_a_loop_below_the_probed_step_is_said_so():
    runs = [LoopRun(batch_size=512, passed=True, steps=2, peak_bytes=2 << 20, probe_bytes=2 << 20, extra_bytes=-2017,
                    seconds=0.1),
            LoopRun(batch_size=600, passed=False, steps=0, peak_bytes=2 << 20, probe_bytes=2 << 20, extra_bytes=-2017,
                    seconds=0.1)]
    said = LoopConfirmation(batch_size=512, probed=600, limit_bytes=None, runs=runs).summary()
    assert "passed at 512 (2 steps, loop peak 2.00 MiB, 1.97 KiB below the probed step, 0.10s)" in said
    assert "OOM at 600 (0 steps, loop peak 2.00 MiB, at most 1.97 KiB below the probed step" in said
    assert "-1.97" not in said
