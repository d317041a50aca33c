"""Review 29: a ``Trainer`` subclass whose ``compute_loss`` reads the batch size from its
arguments (per-example weights, contrastive labels: ``torch.ones(self.args.per_device_train_batch_size)``)
got the user's own size in every probe trial, where ``train()`` runs it at the size set: the
probe failed with "The size of tensor a (8) must match the size of tensor b (2)". Each trial now
runs with ``per_device_train_batch_size`` (and ``_train_batch_size``) at its size, put back after it."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402

from test_integration_transformers import BUDGET, PadCollator, make_trainer  # noqa: E402


class Weighted(transformers.Trainer):
    """Weights each example's loss by a vector sized from the configured per-device batch."""

    read: list[tuple[int, int, int]] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rows = inputs["input_ids"].shape[0]
        self.read.append((self.args.per_device_train_batch_size, self._train_batch_size, rows))
        out = model(**inputs)
        weights = torch.ones(self.args.per_device_train_batch_size, device=out.logits.device) / rows
        loss = out.loss + 0 * (out.logits.mean(dim=(1, 2)) * weights).sum()
        return (loss, out) if return_outputs else loss


def test_a_compute_loss_that_reads_the_batch_size_is_probed_at_each_trials_size(tmp_path):
    trainer = make_trainer(tmp_path, PadCollator())
    trainer.__class__ = Weighted  # the subclass's compute_loss, without building a second Trainer
    Weighted.read.clear()
    with simulated_memory(BUDGET):
        # RuntimeError "The size of tensor a (4) must match the size of tensor b (2)" before
        result = fit_batch_size(trainer, max_batch=4, cache=False, estimate_first=False, strategy="binary")
    size = trainer.args.per_device_train_batch_size
    assert size == result.batch_size > 2 and trainer._train_batch_size == size
    assert len(Weighted.read) > 2 and all(args == own == rows for args, own, rows in Weighted.read)
