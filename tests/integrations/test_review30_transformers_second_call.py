"""A second ``fit_batch_size(trainer)`` called the accumulation the first call set (from its
``global_batch``) one "set on TrainingArguments", as if the user had set it, and a second call with
a new ``global_batch`` held it as the user's to keep, telling them to "remove" it from their
arguments. The first call's record (:func:`~autobatch.integrations.transformers_resume.record_split`)
now says who set it. The probe is stubbed (a real probe of this trainer takes seconds): the
messages are under test."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")

from test_integration_transformers import PadCollator, make_trainer  # noqa: E402

import autobatch.integrations.transformers as integration  # noqa: E402
from autobatch import ProbeResult  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def _answer(monkeypatch, size: int) -> None:
    result = ProbeResult(batch_size=size, strategy="auto", strategy_used="binary", trials=[], capacity_bytes=None,
                         elapsed_s=0.0, margin=0.0)
    monkeypatch.setattr(integration, "find_max_batch", lambda step, **options: result)


def _warnings(caplog, call) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        call()
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("first_call", [True, False])
def test_the_changed_samples_warning_names_who_set_the_accumulation(tmp_path, caplog, monkeypatch, first_call):
    trainer = make_trainer(tmp_path, PadCollator(), **({} if first_call else {"gradient_accumulation_steps": 3}))
    if first_call:
        _answer(monkeypatch, 28)
        fit_batch_size(trainer, global_batch=60)  # 2 x 30 does not fit: 3 x 20
    else:
        trainer.args.per_device_train_batch_size = 20
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (20, 3)
    _answer(monkeypatch, 12)
    warnings = _warnings(caplog, lambda: fit_batch_size(trainer))
    origin = ("set on TrainingArguments by an earlier fit_batch_size(global_batch=60) call" if first_call
              else "set on TrainingArguments)")
    assert len(warnings) == 1 and f"gradient_accumulation_steps=3 ({origin}" in warnings[0], warnings


def test_a_new_global_batch_does_not_keep_the_first_call_s_accumulation_as_the_user_s(tmp_path, caplog, monkeypatch):
    trainer = make_trainer(tmp_path, PadCollator())
    _answer(monkeypatch, 28)
    fit_batch_size(trainer, global_batch=60)
    assert trainer.args.gradient_accumulation_steps == 3
    warnings = _warnings(caplog, lambda: fit_batch_size(trainer, global_batch=56))  # 3 does not split 56
    assert not any("gradient_accumulation_steps=3" in w for w in warnings), warnings
    assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == 56
    assert trainer.args.per_device_train_batch_size <= 28
