"""The cap the integrations put on the batch from the training set (no batch larger than a
process's share of it, as Lightning's ``BatchSizeFinder``) or from ``global_batch``, against the
user's ``multiple_of`` and ``start``.

Before, the cap was passed on as ``max_batch``, so ``find_max_batch`` refused it naming an
option the user never set: a 6-sample set with ``multiple_of=8`` said "max_batch=6 is smaller
than multiple_of=8 ... raise max_batch", and ``start=64`` over it "lower start or raise
max_batch". Now a set smaller than ``multiple_of`` is one error naming the training set, and a
``start`` above the cap starts at the cap (no batch above it can train).
"""

from __future__ import annotations

import pytest
import torch

from autobatch import simulated_memory


def test_the_cap_keeps_max_batch_and_start_within_the_samples():
    from autobatch.integrations.global_batch import cap_at_samples

    assert cap_at_samples(None, None, None, 8, where="x") == (None, None)
    assert cap_at_samples(100, None, None, 1, where="x") == (100, None)
    assert cap_at_samples(100, 40, 64, 8, where="x") == (40, 64)  # a conflict of the user's own is find_max_batch's to refuse
    assert cap_at_samples(30, None, 64, 1, where="x") == (30, 30)
    assert cap_at_samples(30, None, 16, 1, where="x") == (30, 16)
    with pytest.raises(ValueError, match=r"the train dataset has 6 samples, fewer than multiple_of=8") as error:
        cap_at_samples(6, None, None, 8, where="the train dataset")
    assert "max_batch" not in str(error.value)


pl = pytest.importorskip("lightning.pytorch")

from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from test_lightning_checks import Small as ChecksSmall  # noqa: E402


class Small(ChecksSmall):
    """test_lightning_checks' module over ``samples`` samples."""

    def __init__(self, samples: int) -> None:
        super().__init__()
        self.data = torch.utils.data.TensorDataset(torch.randn(samples, 8), torch.randn(samples, 1))


def fit(module, callback):
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    with simulated_memory("2MiB"):
        trainer.fit(module)


def test_lightning_a_dataset_smaller_than_multiple_of_is_one_error_naming_it():
    with pytest.raises(ValueError, match=r"6 samples, fewer than multiple_of=8") as error:
        fit(Small(6), AutoBatchSize(multiple_of=8))
    assert "raise max_batch" not in str(error.value)


def test_lightning_a_start_above_the_dataset_starts_at_it():
    callback = AutoBatchSize(probe_options={"start": 64}, confirm=False)
    fit(Small(24), callback)
    assert callback.batch_size == 24 and callback.result.trials[0].batch_size <= 24


def test_lightning_a_start_above_the_global_batch_share_starts_at_it():
    callback = AutoBatchSize(global_batch=16, probe_options={"start": 64}, confirm=False)
    fit(Small(64), callback)
    assert callback.batch_size == 16 and callback.accumulation == 1


transformers = pytest.importorskip("transformers")

from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def pad(samples):
    ids = torch.tensor([s["input_ids"] for s in samples])
    return {"input_ids": ids, "labels": ids}


def make_trainer(tmp_path, samples):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    data = [{"input_ids": [(i * 7 + j) % 64 for j in range(8)]} for i in range(samples)]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data,
                                data_collator=pad)


def test_transformers_a_training_set_smaller_than_multiple_of_is_one_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"6 samples, fewer than multiple_of=8") as error:
        fit_batch_size(make_trainer(tmp_path, 6), multiple_of=8)
    assert "raise max_batch" not in str(error.value)


@pytest.mark.parametrize("global_batch, expected", [(None, 24), (16, 16)])
def test_transformers_a_start_above_the_cap_starts_at_it(tmp_path, global_batch, expected):
    trainer = make_trainer(tmp_path, 24)
    with simulated_memory("64MiB"):
        result = fit_batch_size(trainer, global_batch=global_batch, start=64, strategy="binary")
    assert result.batch_size == expected and trainer.args.per_device_train_batch_size == expected
