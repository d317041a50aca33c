"""``fit_batch_size(trainer)`` without ``global_batch``, with the user's own
``gradient_accumulation_steps=4``, capped the batch at the training set alone: on a 12-sample set
a batch of 12 made one batch an epoch, so each optimizer step trained 12 samples, not the 48 the
warning said, and the probe sized a window of 4 batches that never ran. The cap is now the set
over the accumulation. The probe is stubbed where its answer is the cap under test."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch import ProbeResult  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def _trainer(tmp_path, samples: int, accumulation: int):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    data = [{"input_ids": [(i * 7 + j) % 64 for j in range(8)]} for i in range(samples)]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
        max_steps=1, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    collate = lambda rows: {"input_ids": torch.tensor([r["input_ids"] for r in rows]),  # noqa: E731
                            "labels": torch.tensor([r["input_ids"] for r in rows])}
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data,
                                data_collator=collate)


def _largest_allowed(step, **options) -> ProbeResult:  # everything fits: the answer is the cap
    return ProbeResult(batch_size=options["max_batch"], strategy="auto", strategy_used="binary", trials=[],
                       capacity_bytes=None, elapsed_s=0.0, margin=0.0)


def test_the_users_accumulation_caps_the_batch_at_the_set_over_it_and_the_warning_holds(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(transformers_integration, "find_max_batch", _largest_allowed)
    trainer = _trainer(tmp_path, 12, 4)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer)
    size, accumulation = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    assert accumulation == 4 and size * accumulation <= len(trainer.train_dataset) and size == 12 // 4
    said = [r.getMessage() for r in caplog.records if "samples per optimizer step" in r.getMessage()]
    assert len(said) == 1 and f"trains {size * accumulation} samples per optimizer step" in said[0]


def test_a_set_smaller_than_the_accumulations_batches_is_one_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(transformers_integration, "find_max_batch", _largest_allowed)
    with pytest.raises(ValueError, match=r"3 samples, fewer than gradient_accumulation_steps=4 batches") as caught:
        fit_batch_size(_trainer(tmp_path, 3, 4))
    assert "lower gradient_accumulation_steps" in str(caught.value)
