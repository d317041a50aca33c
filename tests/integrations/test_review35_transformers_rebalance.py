"""Review 35, a Hugging Face user with ``train_sampling_strategy="batch_rebalance"`` (transformers 5).

Its ``BatchRebalanceSampler`` splits each optimizer step's samples into micro-batches of balanced
padded-token cost, moving samples between them: one may hold more samples than
``per_device_train_batch_size``, padded to its longest. Measured (CPU, a tiny GPT-2, samples of 40 and
1 token, ``gradient_accumulation_steps=4``, simulated 12 MiB): the probe answered 28, the sampler
formed micro-batches of 38, and ``train()`` ran out of memory. Such a run is refused before any trial,
or, where ``global_batch``'s split decides it, before anything is set; one micro-batch a step is not."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402

from test_integration_transformers import PadCollator, make_trainer  # noqa: E402
from test_review19_samples_per_step import _answer  # noqa: E402


def test_review35_batch_rebalance_with_several_micro_batches_a_step_is_refused(tmp_path, monkeypatch):
    trials = []
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **_: trials.append(1) or _answer(3))
    trainer = make_trainer(tmp_path, PadCollator(), train_sampling_strategy="batch_rebalance",
                           gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match=r"batch_rebalance.*4 micro-batches.*group_by_length"):
        fit_batch_size(trainer)
    assert trials == []  # before any trial
    trainer.args.gradient_accumulation_steps = 1
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4 for global_batch=12"):
        fit_batch_size(trainer, global_batch=12)  # 3 fit: a split of 4 micro-batches
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 1)
    fit_batch_size(trainer)  # one micro-batch a step: the sampler's one group is the probed batch
    assert trainer.args.per_device_train_batch_size == 3
