"""Review 18: ``fit_batch_size`` on an eval-only ``Trainer`` (no ``train_dataset``, for
``trainer.evaluate()``). The error said "needs trainer.train_dataset (or pass sample=)", and a
``sample=`` then probed a training step and set ``per_device_train_batch_size``, which
``evaluate()`` never reads. It now says that only training is sized, and what to set for
evaluation."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def test_an_eval_only_trainer_is_one_error_saying_evaluation_is_not_sized(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments,
                                   eval_dataset=[{"input_ids": [1] * 8, "labels": [1] * 8}] * 4)
    with pytest.raises(ValueError, match=r"sizes training and trainer\.train_dataset is None.*"
                                         r"trainer\.evaluate\(\) alone, set per_device_eval_batch_size"):
        fit_batch_size(trainer, memory_limit="2MiB")
    assert trainer.args.per_device_train_batch_size == 8  # untouched
