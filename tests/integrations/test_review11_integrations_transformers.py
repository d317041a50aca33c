"""Review 11: fit_batch_size as a Transformers user switching from ``auto_find_batch_size`` uses it."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def make_trainer(tmp_path, **args):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    data = [{"input_ids": [i % 64] * 8, "labels": [i % 64] * 8} for i in range(32)]
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, use_cpu=True,
                                               report_to=[], save_strategy="no", max_steps=1, **args)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data)


def test_global_batch_beside_auto_find_batch_size_is_one_error_naming_it(tmp_path):
    """A user switching from ``auto_find_batch_size=True`` who keeps it: on an OOM ``train()`` would
    lower the per-device batch at x0.9 and keep ``gradient_accumulation_steps`` (transformers#33281),
    so the global batch asked for would not hold. Refused before any trial, the arguments untouched."""
    trainer = make_trainer(tmp_path, auto_find_batch_size=True, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="auto_find_batch_size=False"):
        fit_batch_size(trainer, global_batch=16)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (8, 2)
