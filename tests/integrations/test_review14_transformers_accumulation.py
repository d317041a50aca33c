"""Review 14: ``fit_batch_size(trainer, global_batch=...)`` beside the user's own
``TrainingArguments(gradient_accumulation_steps=k)``: it was replaced by the fewest micro-batches
that fit, with only an INFO line. It is now kept where it splits the global batch into per-device
batches that fit, and replaced with one warning naming both values where it does not. The probe
is stubbed to answer 28 (a real probe of this trainer takes seconds): the split is under test."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")

from test_integration_transformers import PadCollator, make_trainer  # noqa: E402

import autobatch.integrations.transformers as integration  # noqa: E402
from autobatch import ProbeResult  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402

PROBED = 28  # what the real probe answers for this trainer under BUDGET


@pytest.mark.parametrize("given, kept", [(4, True), (2, False), (7, False)])
def test_the_users_accumulation_is_kept_where_it_fits_else_replaced_with_a_warning(tmp_path, caplog, monkeypatch,
                                                                                 given, kept):
    answer = ProbeResult(batch_size=PROBED, strategy="auto", strategy_used="binary", trials=[], capacity_bytes=None,
                         elapsed_s=0.0, margin=0.0)
    monkeypatch.setattr(integration, "find_max_batch", lambda step, **options: answer)
    trainer = make_trainer(tmp_path, PadCollator(), gradient_accumulation_steps=given)
    with caplog.at_level(logging.INFO, logger="autobatch"):
        result = fit_batch_size(trainer, global_batch=60)
    size, accumulation = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    assert size * accumulation == 60 and size <= result.batch_size < 30  # 2 x 30 does not fit
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if kept:
        assert (size, accumulation) == (15, 4) and warnings == []
        assert "kept TrainingArguments(gradient_accumulation_steps=4) for global_batch=60" in caplog.text
    else:
        assert accumulation != given and len(warnings) == 1
        assert warnings[0].startswith(f"fit_batch_size: gradient_accumulation_steps={given} (set on TrainingArguments) ")
        assert f"is kept with gradient_accumulation_steps={accumulation} (micro-batches of {size})" in warnings[0]
        assert ("more than fit (the probe's largest: 28)" if given == 2 else "does not split the 60 samples") in warnings[0]
