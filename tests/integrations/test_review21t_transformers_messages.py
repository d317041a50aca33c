"""Review 21: two things ``fit_batch_size`` left unsaid or said wrong.

* It sizes training only, and the evaluations ``train()`` runs (``eval_strategy="steps"``) at a
  ``per_device_eval_batch_size`` above the answer were said only in the docs: measured (a tiny
  GPT-2, simulated 6 MiB), the probe's 15 trained and the first evaluation at 32 ran out of memory
  mid-run. One warning now names both sizes and what to set.
* Under ``auto_find_batch_size=True`` with an accumulation above 1, its warning advised
  ``global_batch=``, which beside ``auto_find_batch_size`` is one ``ValueError``: it now says to
  switch that off too.

The probe is stubbed to a fixed answer, 28 (the probes have their own tests)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import logging  # noqa: E402

from test_integration_transformers import PadCollator, make_trainer  # noqa: E402
from test_review19_samples_per_step import _answer  # noqa: E402

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


@pytest.mark.parametrize("strategy, eval_size, warned", [("steps", 64, True), ("steps", 28, False), ("no", 28, False)])
def test_evaluations_during_train_above_the_answer_are_one_warning(tmp_path, caplog, monkeypatch, strategy,
                                                                   eval_size, warned):
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **options: _answer(28))
    trainer = make_trainer(tmp_path, PadCollator())
    trainer.args.eval_strategy, trainer.args.per_device_eval_batch_size = strategy, eval_size
    trainer.eval_dataset = trainer.train_dataset
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer)
    assert trainer.args.per_device_eval_batch_size == eval_size  # left alone
    said = [r.getMessage() for r in caplog.records if "evaluation is not probed" in r.getMessage()]
    assert len(said) == int(warned)
    if warned:
        assert ("eval_strategy='steps') use per_device_eval_batch_size=64, above the 28 the training step fits"
                in said[0] and "set per_device_eval_batch_size=28 or less" in said[0])


@pytest.mark.parametrize("eval_dataset", [True, False])
def test_review35_an_eval_dataset_for_evaluate_is_warned_of_too(tmp_path, caplog, monkeypatch, eval_dataset):
    """Under ``eval_strategy="no"`` an ``eval_dataset`` is there for ``trainer.evaluate()`` (the example
    scripts' ``--do_eval``): it was not warned of, and ``evaluate()`` after ``train()`` at 64 ran out of
    memory where the probe answered 5 (a tiny GPT-2, simulated 24 MiB). Without one, nothing to say."""
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **options: _answer(28))
    trainer = make_trainer(tmp_path, PadCollator())
    trainer.args.eval_strategy, trainer.args.per_device_eval_batch_size = "no", 64
    trainer.eval_dataset = trainer.train_dataset if eval_dataset else None
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer)
    assert trainer.args.per_device_eval_batch_size == 64  # left alone
    said = [r.getMessage() for r in caplog.records if "evaluation is not probed" in r.getMessage()]
    assert len(said) == int(eval_dataset)
    if eval_dataset:
        assert ("trainer.evaluate() (given the Trainer's eval_dataset) use per_device_eval_batch_size=64, above the 28"
                in said[0] and "set per_device_eval_batch_size=28 or less" in said[0])


def test_the_accumulation_warning_under_auto_find_batch_size_says_to_switch_it_off_with_global_batch(
        tmp_path, caplog, monkeypatch):
    """Its advice, ``global_batch=``, beside ``auto_find_batch_size=True`` is one ValueError."""
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **options: _answer(28))
    trainer = make_trainer(tmp_path, PadCollator())
    trainer.args.auto_find_batch_size, trainer.args.gradient_accumulation_steps = True, 4
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer)
    said = [r.getMessage() for r in caplog.records if "pass global_batch=8" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("; with global_batch= set auto_find_batch_size=False too (beside it, "
                                               "it is refused: on an out-of-memory error train() would lower the "
                                               "batch without raising the accumulation)")
    with pytest.raises(ValueError, match="auto_find_batch_size=False"):
        fit_batch_size(trainer, global_batch=8)
