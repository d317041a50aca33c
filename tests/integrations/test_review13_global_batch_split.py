"""Review 13: a global batch with no divisor near the largest micro-batch that fits.

Both integrations split a rank's share of ``global_batch`` exactly (batch × accumulation ==
share), so a share with no divisor near the probed maximum took the next divisor down, silently:
``global_batch=998`` where 403 fit trained 499 micro-batches of 2 a step (3 would do), a prime one
micro-batches of 1. It still trains that split (the global batch asked for is kept), with one
warning naming the nearest global batches that keep the micro-batches large.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autobatch.integrations.global_batch import accumulation_for, small_split


def test_a_split_under_half_the_largest_names_the_nearest_global_batches_that_split_well():
    assert accumulation_for(998, 403) == (499, 2)
    message = small_split(998, 1, 403, 2)
    assert "499 micro-batches of 2" in message and "where 3 would do" in message
    assert "996 (3 x 332) or 999 (3 x 333)" in message
    # over 2 ranks the suggestions are global batches; a multiple_of keeps every split a multiple
    assert "1992 (3 x 332) or 1998 (3 x 333)" in small_split(1996, 2, 403, 2)
    assert "4080 (15 x 272) or 4096 (16 x 256)" in small_split(4088, 1, 403, accumulation_for(4088, 403, multiple_of=8)[1], multiple_of=8)
    assert small_split(1000, 1, 403, accumulation_for(1000, 403)[1]) is None  # 4 x 250: at least half
    assert small_split(256, 1, 403, 256) is None


def test_lightning_warns_where_the_split_is_small(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from autobatch.integrations.lightning import AutoBatchSize

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size, self.seen = 4, []
            self.net = nn.Linear(4, 1)
            self.data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))

        def training_step(self, batch, index):
            self.seen.append(batch[0].shape[0])
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)

    module = Regression()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[AutoBatchSize(global_batch=22, max_batch=10, confirm=False)])
    with pytest.warns(UserWarning, match=r"global_batch=22 splits into 11 micro-batches of 2 .* 21 \(3 x 7\) or "
                                         r"24 \(3 x 8\)"):
        trainer.fit(module)
    assert module.seen == [2] * 11 and trainer.accumulate_grad_batches == 11  # the global batch asked for is kept


def test_transformers_warns_where_the_split_is_small(tmp_path, caplog):
    transformers = pytest.importorskip("transformers")
    from autobatch.integrations.transformers import fit_batch_size

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    data = [{"input_ids": [i % 64] * 8, "labels": [i % 64] * 8} for i in range(64)]
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                               save_strategy="no", max_steps=1)
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer, global_batch=22, max_batch=10, cache=False, estimate_first=False)
    assert (arguments.per_device_train_batch_size, arguments.gradient_accumulation_steps) == (2, 11)
    assert "global_batch=22 splits into 11 micro-batches of 2 per process" in caplog.text
    assert "21 (3 x 7) or 24 (3 x 8)" in caplog.text
