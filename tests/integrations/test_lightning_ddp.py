"""The Lightning callback under DDP: one launch of two CPU ranks runs three fits in turn (a
launch costs ~10 s of CI, so the three cases share it)."""
import os
import textwrap

import pytest

from test_review12_lightning_schedules import FINAL_LR

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, {tests!r})
    import lightning.pytorch as pl
    from autobatch import simulated_memory
    from autobatch.integrations.lightning import AutoBatchSize
    import test_lightning_loop, test_lightning_probe, test_review12_lightning_schedules as schedules

    def write(name, rank, record):
        with open(os.path.join({out!r}, f"rank{{rank}}_{{name}}.json"), "w") as handle:
            json.dump(record, handle)

    # 1. rank 1 has less memory: the ranks must still agree (the minimum)
    class Report(pl.Callback):
        def on_train_start(self, trainer, module):
            write("agree", trainer.global_rank, {{"size": module.batch_size, "confirmation": finder.confirmation.skipped}})

    budget = os.environ.get("LOCAL_RANK", "0") == "1" and "10MiB" or "12MiB"
    finder = AutoBatchSize(strategy="binary", max_batch=32)
    with simulated_memory(budget):
        run = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[finder, Report()])
        run.fit(test_lightning_loop.KeepsLogits())

    # 2. each rank trains half of 300 samples: the batch is at most a rank's share
    finder = AutoBatchSize()
    run = test_lightning_probe.trainer(finder, accelerator="cpu", devices=2, strategy="ddp", max_steps=-1, max_epochs=2)
    with simulated_memory("64MiB"):
        run.fit(test_lightning_probe.Small(samples=300))
    write("share", run.global_rank, {{"size": finder.batch_size, "steps": run.global_step}})

    # 3. every rank sizes the learning-rate schedule again at the size set
    module, finder = schedules.Scheduled(), AutoBatchSize(max_batch=64)
    run = schedules.trainer(finder, devices=2, strategy="ddp")
    with simulated_memory("64MiB"):
        run.fit(module)
    write("schedules", run.global_rank, {{"size": finder.batch_size, "steps": run.global_step,
                                         "configured": module.configured,
                                         "total": run.lr_scheduler_configs[0].scheduler.total_steps,
                                         "last_lr": module.lrs[-1]}})
    """
)


@pytest.mark.slow  # three processes import Lightning
def test_three_fits_under_ddp(tmp_path):
    """(1) ranks with different budgets agree on one size (the smaller rank's), confirmed across
    ranks; (2) each of 2 ranks trains half of 300 samples (Lightning's DistributedSampler): the batch
    was capped at 300, and with ``drop_last`` fit trained no step at all; (3) 2 ranks of 160 samples
    each: the module's 4 sized the OneCycleLR schedule for 80 steps, fit runs 6 at 64 (3 batches an
    epoch): every rank configures again, alike, and ends the schedule."""
    import json

    from conftest import rank_reports

    _, stderr = rank_reports(tmp_path, "ddp_fits.py", _SCRIPT.format(tests=os.path.dirname(__file__), out=str(tmp_path)))
    reports = {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("rank*_*.json")}
    assert len(reports) == 6, stderr[-3000:]
    agree = [reports[f"rank{rank}_agree"] for rank in (0, 1)]
    assert agree[0]["size"] == agree[1]["size"] > 1, agree
    assert "ranks" in agree[0]["confirmation"]
    share = [reports[f"rank{rank}_share"] for rank in (0, 1)]
    assert all(r["size"] == 150 and r["steps"] == 2 for r in share), share
    for report in (reports[f"rank{rank}_schedules"] for rank in (0, 1)):
        assert report["size"] == 64 and report["steps"] == report["total"] == 6
        assert report["configured"] == [[4, 80], [64, 6]] and report["last_lr"] == pytest.approx(FINAL_LR)
