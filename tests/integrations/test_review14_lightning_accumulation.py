"""Review 14: ``AutoBatchSize`` under ``Trainer(fast_dev_run=...)``, and beside a Trainer's own
``accumulate_grad_batches``.

* Under ``fast_dev_run`` the callback probed and ran its confirmation before the one smoke-test
  batch, where Lightning's ``BatchSizeFinder`` skips with "Skipping batch size scaler since
  `fast_dev_run` is enabled.". It now skips the same way, with one warning; with
  ``global_batch`` the accumulation is still set (batch x accumulation == global_batch).
* ``Trainer(accumulate_grad_batches=4)`` with ``global_batch`` was replaced by the callback's own
  split, with only an INFO line. It is now kept where it splits the global batch into
  micro-batches that fit, and replaced with a warning naming both values where it does not.
"""

from __future__ import annotations

import logging
import warnings

import pytest

pl = pytest.importorskip("lightning.pytorch")

from test_review13_lightning_tuners import Regression  # noqa: E402  (1,024 samples, batch from hparams)

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402


def _fit(sizer: AutoBatchSize, budget: str, **options) -> tuple[Regression, pl.Trainer, list[str]]:
    module = Regression()
    trainer = pl.Trainer(**{**dict(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                                   enable_progress_bar=False, enable_model_summary=False), **options},
                         callbacks=[sizer])
    with simulated_memory(budget), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    return module, trainer, [str(w.message) for w in caught if "AutoBatchSize" in str(w.message)]


@pytest.mark.parametrize("global_batch", [None, 64])
def test_fast_dev_run_skips_the_probe_with_one_warning_and_keeps_the_global_batch(global_batch):
    sizer = AutoBatchSize(global_batch=global_batch)
    module, trainer, lines = _fit(sizer, "1MiB", fast_dev_run=True, max_steps=-1)
    assert sizer.result is None and sizer.confirmation is None  # no probe, no confirmation run
    assert len(lines) == 1 and lines[0].startswith("Skipping AutoBatchSize's probe since `fast_dev_run` is enabled")
    assert module.seen == [4]  # the one smoke-test batch, at the module's own size
    if global_batch is None:
        assert sizer.accumulation is None and trainer.accumulate_grad_batches == 1
    else:  # the module's 4 taken as the largest: the real run's accumulation path
        assert (sizer.batch_size, sizer.accumulation, trainer.accumulate_grad_batches) == (4, 16, 16)
        assert "accumulate_grad_batches=16 for global_batch=64" in lines[0]
    assert sizer.state_dict() == {}  # an unprobed size is not saved for a resume


def test_the_trainers_accumulation_is_kept_where_it_splits_the_global_batch_into_batches_that_fit(caplog):
    sizer = AutoBatchSize(global_batch=1024)
    with caplog.at_level(logging.INFO, logger="autobatch"):
        module, trainer, lines = _fit(sizer, "1MiB", accumulate_grad_batches=4)
    assert sizer.result.batch_size >= 512  # 2 x 512 would fit: the callback alone chose that
    assert (sizer.batch_size, sizer.accumulation, trainer.accumulate_grad_batches) == (256, 4, 4)
    assert set(module.seen) == {256} and lines == []  # no small-split advice on the user's own split
    assert "kept the Trainer's accumulate_grad_batches=4 for global_batch=1024" in caplog.text


def test_a_trainers_accumulation_whose_batches_do_not_fit_is_replaced_with_a_warning_naming_both():
    sizer = AutoBatchSize(global_batch=1024)
    module, trainer, lines = _fit(sizer, "512KiB", accumulate_grad_batches=2)
    probed = sizer.result.batch_size
    assert probed < 512 and (sizer.batch_size, trainer.accumulate_grad_batches) == (256, 4)
    assert set(module.seen) == {256}
    assert lines == [
        f"AutoBatchSize: accumulate_grad_batches=2 (set on the Trainer) would train micro-batches of 512, more "
        f"than fit (the probe's largest: {probed}); global_batch=1024 is kept with accumulate_grad_batches=4 "
        "(micro-batches of 256) instead. Remove accumulate_grad_batches from the Trainer (global_batch sets it), or "
        "pass a global_batch that accumulate_grad_batches=2 splits into micro-batches of at most 256 (e.g. global_batch=512)"
    ]


def test_the_replaced_splits_advice_names_the_largest_micro_batch_that_fits_not_the_replacement():
    """A global batch of 32 kept by 4 micro-batches of 8 where 10 fit: the advice said "at most 8"."""
    from autobatch.integrations.global_batch import split_keeping

    split = split_keeping(32, 1, 10, 2, setting="gradient_accumulation_steps", where="TrainingArguments")
    assert (split.accumulation, split.size) == (4, 8)
    assert split.warning.endswith("micro-batches of at most 10 (e.g. global_batch=20)")
