"""Review 19: with no ``global_batch``, the user's own accumulation is kept and their batch
replaced, so the samples per optimizer step changed with only an INFO line, which a script does
not show: ``Trainer(per_device_train_batch_size=16, gradient_accumulation_steps=4)`` (64 a step)
trained ``3 x 4`` = 12 a step after ``fit_batch_size``, and ``Trainer(accumulate_grad_batches=4)``
over a module batch of 4 (16 a step) trained ``147 x 4`` = 588 after ``AutoBatchSize``, silently,
as Transformers' own ``auto_find_batch_size`` does (transformers#33281). Each is now one warning
naming ``global_batch=`` (the step's old samples) to keep them; an accumulation of 1 (the batch
is the step, and finding it was asked) stays silent. The probes are stubbed to a fixed answer:
the warning is under test, the probes have their own tests."""

from __future__ import annotations

import logging
import warnings

import pytest

pytest.importorskip("transformers")
pl = pytest.importorskip("lightning.pytorch")

from test_integration_transformers import PadCollator, make_trainer  # noqa: E402
from test_review13_lightning_tuners import Regression  # noqa: E402  (1,024 samples, batch from hparams)

import autobatch.integrations.lightning_trials as lightning_integration  # noqa: E402 (where the callback calls find_max_batch)
import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch import ProbeResult  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def _answer(size: int) -> ProbeResult:
    return ProbeResult(batch_size=size, strategy="auto", strategy_used="binary", trials=[], capacity_bytes=None,
                       elapsed_s=0.0, margin=0.0)


@pytest.mark.parametrize("accumulation, warned", [(1, False), (4, True)])
def test_transformers_a_changed_global_batch_is_one_warning_naming_global_batch(tmp_path, caplog, monkeypatch,
                                                                                 accumulation, warned):
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **options: _answer(3))
    trainer = make_trainer(tmp_path, PadCollator(), gradient_accumulation_steps=accumulation)
    trainer.args.per_device_train_batch_size = 16  # the user's: 64 samples a step with 4
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (3, accumulation)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == ([
        "fit_batch_size: per_device_train_batch_size=3 with gradient_accumulation_steps=4 (set on TrainingArguments) "
        "trains 12 samples per optimizer step where per_device_train_batch_size=16 trained 64, so the learning rate "
        "and schedule tuned for 64 no longer match; pass global_batch=64 to keep 64 samples a step (the accumulation "
        "is then set so its micro-batches fit), or set gradient_accumulation_steps=1 to train the probe's batch alone"
    ] if warned else [])


@pytest.mark.parametrize("global_batch", [None, 16])
def test_lightning_a_changed_global_batch_is_one_warning_naming_global_batch(monkeypatch, global_batch):
    monkeypatch.setattr(lightning_integration, "find_max_batch", lambda step, **options: _answer(147))
    sizer = AutoBatchSize(global_batch=global_batch, confirm=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=4,
                         callbacks=[sizer])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regression())  # the module's own batch: 4, so 16 samples a step
    lines = [str(w.message) for w in caught if "samples per optimizer step" in str(w.message)]
    if global_batch is None:
        assert (sizer.batch_size, trainer.accumulate_grad_batches) == (147, 4)
        assert len(lines) == 1 and lines[0].startswith(
            "AutoBatchSize: batch_size=147 with accumulate_grad_batches=4 (set on the Trainer) trains 588 samples per "
            "optimizer step where batch_size=4 trained 16")
        assert "pass global_batch=16 to keep 16 samples a step" in lines[0]
    else:  # the advice taken: 16 samples a step kept (the user's accumulation splits it into 4 x 4), no warning
        assert (sizer.batch_size, trainer.accumulate_grad_batches, lines) == (4, 4, [])
