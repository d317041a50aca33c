"""The "samples per optimizer step changed" warning (review 19) named ``global_batch=<the old
samples a step>`` to keep them, also where that is more than the training set holds: 64 samples
with ``per_device_train_batch_size=16`` and ``gradient_accumulation_steps=8`` said "pass
global_batch=128", which ``fit_batch_size`` then refuses ("larger than the training set"). It now
names the largest global batch that is taken. The probe is stubbed to a fixed answer, as in
review 19's tests: the advice is under test."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")

from test_integration_transformers import LENGTHS, PadCollator, make_trainer  # noqa: E402

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch import ProbeResult  # noqa: E402
from autobatch.integrations.global_batch import changed_samples  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def _answer(size: int) -> ProbeResult:
    return ProbeResult(batch_size=size, strategy="auto", strategy_used="binary", trials=[], capacity_bytes=None,
                       elapsed_s=0.0, margin=0.0)


def test_the_warning_suggests_only_a_global_batch_that_is_taken(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **options: _answer(3))
    trainer = make_trainer(tmp_path, PadCollator(), gradient_accumulation_steps=8)
    trainer.args.per_device_train_batch_size = 16  # 128 samples a step, more than the set's
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer)
    [line] = [r.getMessage() for r in caplog.records if "samples per optimizer step" in r.getMessage()]
    total = len(LENGTHS)
    assert "pass global_batch=128" not in line
    assert f"global_batch=128 would be refused, as the training set holds {total} samples" in line
    assert f"pass global_batch={total} or less" in line
    fit_batch_size(trainer, global_batch=total)  # the advice is taken, not refused
    assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == total
    # per process and a multiple of multiple_of: 2 processes of 10 samples, multiples of 4: 16 is the largest taken
    assert "pass global_batch=16 or less" in changed_samples(16, 3, 4, 2, size_setting="batch_size", setting="acc",
                                                            where="the Trainer", samples=10, multiple_of=4)
