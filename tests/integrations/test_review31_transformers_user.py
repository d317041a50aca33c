"""Review 31, a Hugging Face user's next variations on ``fit_batch_size``.

``label_smoothing_factor``: the ``Trainer``'s ``LabelSmoother`` computes the loss from the logits
and divides it by ``num_items_in_batch``, so a T5 (whose own loss ignores that count) split 8 x 2
steps as at 16 x 1; ``fit_batch_size`` still warned that every step's gradient was twice the mean
and told the user to set ``model_accepts_loss_kwargs = False``."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from test_review19_samples_per_step import _answer  # noqa: E402
from test_review26_transformers_seq2seq import WARNED, _seq2seq_trainer  # noqa: E402

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def _moved(tmp_path, monkeypatch, answer: int) -> tuple[float, list[str]]:
    """How far one optimizer step of ``global_batch=16`` moves a T5's weights under label
    smoothing (SGD, no clipping), split by a probe answer of ``answer``; and the warnings given."""
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **options: _answer(answer))
    trainer = _seq2seq_trainer(tmp_path / str(answer), label_smoothing_factor=0.1, optim="sgd", learning_rate=0.1,
                               max_grad_norm=0, train_sampling_strategy="sequential")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("autobatch").addHandler(handler)
    try:
        fit_batch_size(trainer, global_batch=16)
    finally:
        logging.getLogger("autobatch").removeHandler(handler)
    trainer.train()
    moved = sum(float((v - before[k]).float().norm()) ** 2 for k, v in trainer.model.state_dict().items()) ** 0.5
    return moved, [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def test_review31_label_smoothing_averages_an_accumulated_split_and_is_not_warned(tmp_path, monkeypatch):
    whole, _ = _moved(tmp_path, monkeypatch, 16)
    split, warnings = _moved(tmp_path, monkeypatch, 8)
    assert split == pytest.approx(whole, rel=1e-3)  # the LabelSmoother averaged the window: 8 x 2 as 16 x 1
    assert not [w for w in warnings if WARNED in w], warnings



def _own_loss(summed: bool):
    """A ``Seq2SeqTrainer`` subclass whose ``compute_loss`` takes the token cross-entropy itself: a
    plain mean (``summed`` False), or the sum over ``num_items_in_batch``."""
    import transformers

    class OwnLoss(transformers.Seq2SeqTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs, labels=labels)
            losses = torch.nn.functional.cross_entropy(outputs.logits.flatten(0, 1), labels.flatten(), reduction="none")
            kept = losses[labels.flatten() != -100]
            loss = kept.sum() / num_items_in_batch if summed and num_items_in_batch is not None else kept.mean()
            return (loss, outputs) if return_outputs else loss

    return OwnLoss


def test_review37_a_compute_loss_override_is_judged_not_the_model(tmp_path, monkeypatch, caplog):
    """The check asked the model alone: a subclass whose ``compute_loss`` took a plain mean (over
    GPT-2, which honours the count: 8 x 2 stepped 2.02x the gradient of 16 x 1, the logged loss
    doubled) was not warned, and one that divides its sum by ``num_items_in_batch`` over a T5 was
    told to set ``model_accepts_loss_kwargs = False``, which would then divide it again."""
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **options: _answer(8))
    trainer, said = _seq2seq_trainer(tmp_path), {}
    for summed in (False, True):
        trainer.__class__ = _own_loss(summed)  # the same trainer, its compute_loss overridden
        trainer.args.gradient_accumulation_steps = 1
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="autobatch"):
            fit_batch_size(trainer, global_batch=16)
        assert trainer.args.gradient_accumulation_steps == 2
        said[summed] = [r.getMessage() for r in caplog.records if WARNED in r.getMessage()]
    assert not said[True], said[True]
    assert len(said[False]) == 1 and "OwnLoss.compute_loss (your override)" in said[False][0]
    assert "trainer.loss_is_scaled_for_ga = False" in said[False][0]
